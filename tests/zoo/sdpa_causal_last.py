"""A decoder-only next-item model on ``F.scaled_dot_product_attention(is_causal=True, scale=...)``
with no mask at all: right padding plus causality keeps padded keys away from real queries, as
its author relied on. The next-item representation is read at the last real position with
``h[torch.arange(B), lengths - 1]`` (an empty row reads position -1, i.e. N - 1: padding, not
compared)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

# Fusing is legal (a causal attention over the padded rows, every position computed) but gains
# nothing here: SDPA is already one fused kernel and there is no bias to compute in-kernel, so the
# calls stay as written (a written-out causal attention with no padding mask does fuse:
# tests/passes/test_unpadded_attention.py). Packing is not provable: nothing in the graph says that
# the padding is a suffix of each row; only the data convention does.
EXPECT = {"fused_attention": 0, "jagged": False,
          "dense_reason": "no key mask: padded keys are excluded only by right padding, a property of the data"}


class CausalLM(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, dropout=0.1):
        super().__init__()
        self.h, self.p = heads, dropout
        self.wte = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.wpe = nn.Embedding(max_len, d)
        self.ln = nn.ModuleList(nn.LayerNorm(d) for _ in range(2 * layers))
        self.attn = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"),
                                               nn.Linear(4 * d, d)) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx, lengths):
        B, T = idx.size()
        x = self.wte(idx) + self.wpe(torch.arange(0, T, dtype=torch.long, device=idx.device))
        for i in range(len(self.attn)):
            q, k, v = self.attn[i](self.ln[2 * i](x)).split(x.size(-1), dim=2)
            q = q.view(B, T, self.h, -1).transpose(1, 2)
            k = k.view(B, T, self.h, -1).transpose(1, 2)
            v = v.view(B, T, self.h, -1).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0,
                                               is_causal=True, scale=1.0 / q.size(-1))
            x = x + self.proj[i](y.transpose(1, 2).contiguous().view(B, T, -1))
            x = x + self.mlp[i](self.ln[2 * i + 1](x))
        h = self.ln_f(x)
        last = h[torch.arange(B, device=idx.device), lengths - 1]  # [B, D]
        return last @ self.wte.weight.t()


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = CausalLM(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed),
                     valid=lambda idx, lengths: lengths > 0, name="sdpa_causal_last")
