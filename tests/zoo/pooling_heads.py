"""A retrieval user tower with two pooling heads over its single attention layer: a masked mean
(``(x * m).sum(1) / m.sum(1)``) and an attention (softmax) pooling over the positions
(``masked_fill(~valid, -inf)``, ``softmax(dim=1)``, ``nan_to_num`` for the empty rows), concatenated
into a ``[B, 2D]`` user vector. The encoder masks with ``masked_fill(~mask, float('-inf'))`` and
its empty rows get a self-loop (``| eye``) so that no query row is fully masked."""
import math

import torch
import torch.nn as nn

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

# pooled output: the jagged exits are a segment mean and a segment softmax-weighted sum
EXPECT = {"fused_attention": 1, "jagged": True, "dense_reason": ""}


class PoolingTower(nn.Module):
    def __init__(self, num_items, max_len, d=16, dropout=0.1):
        super().__init__()
        self.emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.wq, self.wk, self.wv = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
        self.pool_score = nn.Linear(d, 1)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids):
        B, N = ids.shape
        valid = ids.ne(0)
        x = self.emb(ids) + self.pos(torch.arange(N, device=ids.device))
        eye = torch.eye(N, dtype=torch.bool, device=ids.device)
        mask = torch.ones(N, N, dtype=torch.bool, device=ids.device).tril() & (valid.unsqueeze(1) | eye)
        s = self.wq(x) @ self.wk(x).transpose(1, 2) / math.sqrt(x.shape[-1])
        p = self.drop(torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1))
        x = self.norm(x + p @ self.wv(x))
        x = x + self.ff(x)

        m = valid.unsqueeze(-1).to(x.dtype)
        mean = (x * m).sum(1) / m.sum(1).clamp(min=1)
        w = self.pool_score(x).squeeze(-1).masked_fill(~valid, float("-inf"))
        w = torch.nan_to_num(torch.softmax(w, dim=1), nan=0.0)
        attn_pool = (w.unsqueeze(-1) * x).sum(1)
        return torch.cat([mean, attn_pool], dim=-1)


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = PoolingTower(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed)[0], valid=None,
                     name="pooling_heads")
