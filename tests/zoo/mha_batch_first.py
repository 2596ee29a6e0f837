"""SASRec on ``nn.MultiheadAttention(batch_first=True)``, the way most recent forks write it:
bool ``key_padding_mask`` (True = padding), bool causal ``attn_mask`` from ``triu(diagonal=1)``,
``need_weights=False``, post-norm residual blocks with a Linear/GELU feed-forward, right padding,
a per-position output (logits against the item table)."""
import torch
import torch.nn as nn

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


class Block(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.ln1 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * d, d))
        self.ln2 = nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, causal, pad):
        a, _ = self.attn(x, x, x, key_padding_mask=pad, attn_mask=causal, need_weights=False)
        x = self.ln1(x + self.drop(a))
        return self.ln2(x + self.drop(self.ff(x)))


class SASRecMHA(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, dropout=0.1):
        super().__init__()
        self.item_emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))

    def forward(self, seq):
        n = seq.size(1)
        pad = seq == 0
        x = self.drop(self.item_emb(seq) + self.pos_emb(torch.arange(n, device=seq.device)))
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=seq.device), diagonal=1)
        for block in self.blocks:
            x = block(x, causal, pad)
        return x @ self.item_emb.weight[1:].t()  # [B, N, num_items]


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = SASRecMHA(num_items, max_len, dropout=dropout, **kw)

    def make_batch(batch_size, max_len, seed):
        return padded_ids(batch_size, max_len, num_items, seed)[0]

    return UserModel(model, make_batch, valid=lambda seq: seq != 0, name="mha_batch_first")
