"""A light SASRec variant whose feed-forward is a ``Conv1d(k=1)`` stack applied to ``x.transpose(1,
2)`` and whose norms are *non-affine* ``F.layer_norm`` calls on the transposed (non-contiguous)
conv output, ``F.layer_norm(y.transpose(1, 2), (D,))``; attention through
``nn.MultiheadAttention(batch_first=True, need_weights=False)`` with a bool ``key_padding_mask``
and a bool causal mask, per-position outputs multiplied by the validity."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 1, "jagged": True, "dense_reason": ""}


class ConvFFNRec(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, dropout=0.1):
        super().__init__()
        self.emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.conv1 = nn.Conv1d(d, 2 * d, kernel_size=1)
        self.conv2 = nn.Conv1d(2 * d, d, kernel_size=1)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids):
        B, N = ids.shape
        pad = ids == 0
        x = self.emb(ids) + self.pos(torch.arange(N, device=ids.device))
        x = F.layer_norm(x, (x.shape[-1],))
        causal = ~torch.ones(N, N, dtype=torch.bool, device=ids.device).tril()
        a, _ = self.attn(x, x, x, key_padding_mask=pad, attn_mask=causal, need_weights=False)
        y = (x + self.drop(a)).transpose(1, 2)                # [B, D, N]
        y = y + self.conv2(self.drop(F.relu(self.conv1(y))))
        out = F.layer_norm(y.transpose(1, 2), (y.shape[1],))  # non-contiguous input, no affine
        return out * (~pad).unsqueeze(-1)


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = ConvFFNRec(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed)[0],
                     valid=lambda ids: ids != 0, name="conv_ffn_nonaffine")
