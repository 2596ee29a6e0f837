"""A time-aware SASRec whose relative bias buckets the time gap between two events with
``torch.bucketize`` over hand-picked boundaries (a minute, an hour, six hours, a day, three days, a
week; a registered buffer) and looks each bucket up in a per-head ``nn.Embedding(K + 1, heads)``
permuted to ``[B, H, N, N]``: the way industrial time-aware attention is commonly written instead of
TiSASRec's clipped intervals or HSTU's log buckets. Pre-LN blocks, ``masked_fill`` of the causal and
key-padding mask with -1e9, explicit softmax, per-position outputs."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids, timestamps

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}

HOUR, DAY = 3600, 86400


class TimeBucketAttention(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.register_buffer("time_boundaries", torch.tensor([60, HOUR, 6 * HOUR, DAY, 3 * DAY, 7 * DAY]))
        self.time_bias = nn.Embedding(len(self.time_boundaries) + 1, heads)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, ts, mask):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.h, d // self.h).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        gap = (ts[:, :, None] - ts[:, None, :]).abs()  # [B, N, N] seconds
        bucket = torch.bucketize(gap, self.time_boundaries)  # 0 .. K
        bias = self.time_bias(bucket).permute(0, 3, 1, 2)  # [B, H, N, N]
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.h) + bias
        scores = scores.masked_fill(~mask, -1e9)
        attn = self.dropout(F.softmax(scores, dim=-1))
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = TimeBucketAttention(d, heads, dropout)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(dropout), nn.Linear(2 * d, d))

    def forward(self, x, ts, mask):
        x = x + self.attn(self.ln1(x), ts, mask)
        return x + self.ff(self.ln2(x))


class TimeBucketSASRec(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, dropout=0.1):
        super().__init__()
        self.item = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids, ts):
        n = ids.shape[1]
        valid = ids != 0
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        mask = causal[None, None] & valid[:, None, None, :]
        x = self.dropout(self.item(ids) + self.pos(torch.arange(n, device=ids.device))[None])
        for block in self.blocks:
            x = block(x, ts, mask)
        return self.ln(x)


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = TimeBucketSASRec(num_items, max_len, dropout=dropout, **kw)

    def make_batch(batch_size, max_len, seed):
        ids, _ = padded_ids(batch_size, max_len, num_items, seed)
        return ids, timestamps(ids, seed)

    return UserModel(model, make_batch, valid=lambda ids, ts: ids != 0, name="time_bucketize_bias")
