"""Causal attention with a T5 relative-position bias: distances bucketed T5 style (exact below
``num_buckets // 2``, logarithmic up to ``max_distance``, ``bidirectional=False``), one bias per
head from ``nn.Embedding(num_buckets, num_heads)`` permuted to ``[1, H, N, N]``, unscaled einsum
scores, ``masked_fill(~mask, finfo.min)``, T5's RMS LayerNorm written out, a gated-GELU
feed-forward, per-position outputs."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


class T5LayerNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def relative_position_bucket(relative_position, num_buckets=8, max_distance=16):
    relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return torch.where(is_small, relative_position, large)


class T5Block(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.h = heads
        self.ln_attn, self.ln_ff = T5LayerNorm(d), T5LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.wi_0, self.wi_1 = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.wo = nn.Linear(2 * d, d, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, position_bias, mask):
        b, n, d = x.shape
        h = self.ln_attn(x)
        shape = lambda t: t.view(b, n, self.h, d // self.h).transpose(1, 2)
        q, k, v = shape(self.q(h)), shape(self.k(h)), shape(self.v(h))
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) + position_bias
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        attn = self.dropout(F.softmax(scores.float(), dim=-1).type_as(scores))
        x = x + self.dropout(self.o(torch.einsum("bhqk,bhkd->bhqd", attn, v).transpose(1, 2).reshape(b, n, d)))
        h = self.ln_ff(x)
        return x + self.dropout(self.wo(self.dropout(F.gelu(self.wi_0(h), approximate="tanh") * self.wi_1(h))))


class T5Rec(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, num_buckets=8, dropout=0.1):
        super().__init__()
        self.num_buckets = num_buckets
        self.embed = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)
        self.blocks = nn.ModuleList(T5Block(d, heads, dropout) for _ in range(layers))
        self.final_layer_norm = T5LayerNorm(d)

    def compute_bias(self, n, device):
        context_position = torch.arange(n, dtype=torch.long, device=device)[:, None]
        memory_position = torch.arange(n, dtype=torch.long, device=device)[None, :]
        buckets = relative_position_bucket(memory_position - context_position, self.num_buckets)
        values = self.relative_attention_bias(buckets)  # [N, N, H]
        return values.permute([2, 0, 1]).unsqueeze(0)   # [1, H, N, N]

    def forward(self, ids):
        n = ids.shape[1]
        valid = ids != 0
        causal = torch.arange(n, device=ids.device)[None, :] <= torch.arange(n, device=ids.device)[:, None]
        mask = causal[None, None] & valid[:, None, None, :]
        bias = self.compute_bias(n, ids.device)
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, bias, mask)
        return self.final_layer_norm(x)


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = T5Rec(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed)[0],
                     valid=lambda ids: ids != 0, name="t5_bucket_bias")
