"""ALiBi attention (Press et al.; MPT's ``build_alibi_bias``): no position embeddings, per-head
slopes ``2 ** (-8 * (h + 1) / H)`` in a registered buffer, the bias ``slopes * -(i - j)`` built
per call from ``arange(N)`` and added to the scaled scores, causal and key-padding masks applied
with ``masked_fill(..., finfo.min)`` (MPT), heads by ``rearrange``-like ``unflatten`` +
``transpose``, a fused ``Wqkv`` projection, post-attention LayerNorm with a GELU MLP, and
per-position outputs."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


def get_slopes(n_heads):
    """The ALiBi paper's geometric slopes (for a power of two number of heads)."""
    start = 2 ** (-(2 ** -(math.log2(n_heads) - 3)))
    return [start * start ** i for i in range(n_heads)]


class AlibiAttention(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.n_heads, self.d = heads, d
        self.Wqkv = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)
        self.attn_drop = nn.Dropout(dropout)
        self.register_buffer("slopes", torch.tensor(get_slopes(heads)))

    def forward(self, x, key_padding_mask):
        b, s, _ = x.shape
        q, k, v = self.Wqkv(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.n_heads, -1)).transpose(1, 2) for t in (q, k, v))
        softmax_scale = 1 / math.sqrt(q.size(-1))
        attn_weight = q.matmul(k.transpose(-1, -2)) * softmax_scale
        pos = torch.arange(s, device=x.device)
        alibi = self.slopes.view(1, -1, 1, 1) * -(pos.view(1, 1, s, 1) - pos.view(1, 1, 1, s))
        attn_weight = attn_weight + alibi
        min_val = torch.finfo(q.dtype).min
        attn_weight = attn_weight.masked_fill(~key_padding_mask.view(b, 1, 1, s), min_val)
        causal_mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        attn_weight = attn_weight.masked_fill(~causal_mask.view(1, 1, s, s), min_val)
        attn_weight = self.attn_drop(torch.softmax(attn_weight, dim=-1))
        out = attn_weight.matmul(v).transpose(1, 2).flatten(2)
        return self.out_proj(out)


class AlibiBlock(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = AlibiAttention(d, heads, dropout)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x, key_padding_mask):
        x = x + self.resid_drop(self.attn(self.norm_1(x), key_padding_mask))
        return x + self.resid_drop(self.ffn(self.norm_2(x)))


class AlibiRec(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=4, layers=2, dropout=0.1):
        super().__init__()
        self.wte = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.emb_drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(AlibiBlock(d, heads, dropout) for _ in range(layers))
        self.norm_f = nn.LayerNorm(d)

    def forward(self, ids):
        key_padding_mask = ids.bool()
        x = self.emb_drop(self.wte(ids))
        for block in self.blocks:
            x = block(x, key_padding_mask)
        return F.linear(self.norm_f(x), self.wte.weight)


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = AlibiRec(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed)[0],
                     valid=lambda ids: ids != 0, name="alibi_bias")
