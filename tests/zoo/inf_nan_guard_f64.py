"""A model whose author builds the mask in float64 (``torch.ones(..., dtype=torch.float64)``
times the key validity), masks with ``-inf`` through ``masked_fill(mask == 0, -inf)``, and guards
the NaN an all-padding row produces with ``torch.where(torch.isnan(p), 0, p)``; scores and
values stay float32. Single-head attention, GRU-free, per-position outputs with holes."""
import math

import torch
import torch.nn as nn

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


class GuardedAttention(nn.Module):
    def __init__(self, d, dropout):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask64):
        q, k, v = torch.split(self.qkv(self.norm(x)), x.shape[-1], dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(mask64 == 0, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        p = torch.where(torch.isnan(p), torch.zeros_like(p), p)  # empty rows: -inf everywhere
        return x + self.out(self.drop(p) @ v)


class F64MaskRec(nn.Module):
    def __init__(self, num_items, max_len, d=16, layers=2, dropout=0.1):
        super().__init__()
        self.emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d))
        self.layers = nn.ModuleList(GuardedAttention(d, dropout) for _ in range(layers))

    def forward(self, ids):
        n = ids.shape[1]
        x = self.emb(ids) + self.pos[:, :n]
        key_valid = (ids != 0).to(torch.float64)
        mask64 = torch.tril(torch.ones(n, n, dtype=torch.float64, device=ids.device))[None] * key_valid[:, None, :]
        for layer in self.layers:
            x = layer(x, mask64)
        return x


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = F64MaskRec(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed, holes=0.2)[0],
                     valid=lambda ids: ids != 0, name="inf_nan_guard_f64")
