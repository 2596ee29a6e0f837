"""An interpretable next-item model that returns its attention map: ``nn.MultiheadAttention``
(batch_first) with ``need_weights=True`` and the head-averaged weights returned to the caller, a
3-D bool ``attn_mask`` of shape ``[B * heads, N, N]`` built with ``repeat_interleave`` over heads,
and the diagonal always allowed (``| eye``) so that an all-padding row has no fully masked query
(``need_weights=True`` takes the plain softmax path, which would give NaN there)."""
import torch
import torch.nn as nn

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

# The weights are an output: the fused op does not produce them, so that attention stays dense.
EXPECT = {"fused_attention": 0, "jagged": False,
          "dense_reason": "the attention weights are returned (need_weights=True): the [B, N, N] map is an output"}


class AttnMapRec(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)
        self.mha = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, d)

    def forward(self, ids):
        B, N = ids.shape
        x = self.emb(ids) + self.pos[:N]
        valid = ids != 0
        eye = torch.eye(N, dtype=torch.bool, device=ids.device)
        allowed = torch.ones(N, N, dtype=torch.bool, device=ids.device).tril() & (valid[:, None, :] | eye)
        blocked = (~allowed).repeat_interleave(self.heads, dim=0)  # [B * heads, N, N], True = blocked
        h, weights = self.mha(x, x, x, attn_mask=blocked, need_weights=True)
        return self.out(self.norm(x + h)), weights


def loss(out, ids):
    h, weights = out
    valid = (ids != 0)[..., None]
    return torch.where(valid, h, 0).square().mean() + torch.where(valid, weights, 0).square().sum()


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = AttnMapRec(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed)[0],
                     valid=lambda ids: ids != 0, loss=loss, name="mha_need_weights")
