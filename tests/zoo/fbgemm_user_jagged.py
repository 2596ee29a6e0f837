"""A model that already goes jagged by hand with fbgemm inside ``forward``: lengths -> offsets
(``asynchronous_complete_cumsum``), ``dense_to_jagged`` to run the input MLP on the ``[T, D]``
values only, ``jagged_to_padded_dense`` back to ``[B, N, D]`` (zeros at padding), then an SDPA
causal x key-valid attention block on the padded tensor. ``T`` is data dependent: a new length
mix must not recompile."""
import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 1, "jagged": False,
          "dense_reason": "the embedding feeds the user's own fbgemm dense_to_jagged and stays as written; the "
                          "block after jagged_to_padded_dense goes jagged"}


class FbgemmJaggedRec(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, dropout=0.1):
        super().__init__()
        self.h, self.p = heads, dropout
        self.emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, ids):
        B, N = ids.shape
        valid = ids != 0
        lengths = valid.sum(dim=1)
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        values = torch.ops.fbgemm.dense_to_jagged(self.emb(ids), [offsets])[0]      # [T, D]
        values = values + self.mlp(values)
        x = torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [N], 0.0)   # [B, N, D]
        q, k, v = self.qkv(self.norm(x)).view(B, N, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        mask = torch.tril(torch.ones(N, N, dtype=torch.bool, device=ids.device)) & valid[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.p if self.training else 0.0)
        return x + self.o(a.transpose(1, 2).reshape(B, N, -1))


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = FbgemmJaggedRec(num_items, max_len, dropout=dropout, **kw)
    # dense_to_jagged keeps the first lengths[b] positions of a row: right padding, no holes
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed)[0],
                     valid=lambda ids: ids != 0, name="fbgemm_user_jagged")
