"""A hand-written SASRec for left-padded histories (the original TF SASRec convention: the newest
item at position N-1), validity taken from the ids before anything else and multiplied in after
every block, masked scores set to ``-2**32 + 1``, ``x.view(B, N, H, d).transpose(1, 2)`` heads,
the user vector read at ``h[:, -1, :]`` and scored against the whole item table."""
import math

import torch
import torch.nn as nn

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


class Block(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.h = heads
        self.ln_attn, self.ln_ffn = nn.LayerNorm(d, eps=1e-8), nn.LayerNorm(d, eps=1e-8)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d) for _ in range(4))
        self.ffn = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Dropout(dropout), nn.Linear(d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, valid):
        B, N, D = x.shape
        h = self.ln_attn(x)
        q, k, v = (w(h).view(B, N, self.h, D // self.h).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.h)
        allowed = torch.tril(torch.ones(N, N, dtype=torch.bool, device=x.device)) & valid[:, None, :]
        scores = scores.masked_fill(~allowed[:, None], -2.0 ** 32 + 1)
        out = (self.drop(torch.softmax(scores, dim=-1)) @ v).transpose(1, 2).reshape(B, N, D)
        x = x + self.drop(self.wo(out))
        x = x + self.drop(self.ffn(self.ln_ffn(x)))
        return x * valid[..., None]


class LeftPadSASRec(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, dropout=0.2):
        super().__init__()
        self.items = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.positions = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.final = nn.LayerNorm(d, eps=1e-8)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids):
        valid = ids != 0
        n = ids.shape[1]
        x = self.items(ids) * math.sqrt(self.items.embedding_dim) + self.positions(torch.arange(n, device=ids.device))
        x = self.drop(x) * valid[..., None]
        for block in self.blocks:
            x = block(x, valid)
        user = self.final(x)[:, -1, :]
        return user @ self.items.weight.t()


def factory(max_len=12, num_items=40, dropout=0.2, **kw):
    model = LeftPadSASRec(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed, left=True, holes=0.2)[0],
                     valid=lambda ids: ids[:, -1] != 0, name="sasrec_left_last")
