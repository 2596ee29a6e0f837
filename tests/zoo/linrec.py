"""Low-rank / linear attention for long sequences (LinRec-style): queries normalised by a softmax
over the feature axis, keys by a softmax over the *sequence* axis (``dim=-2``), ``K^T V`` first
(``[B, H, d, d]``), then ``Q (K^T V)``; plus an item-to-interest read-out where each of K learned
interests spreads a softmax over the *items* (``softmax(q @ interests^T, dim=-2) @ v_int``, the
shape of inductor's attention pattern with the softmax on the wrong axis). No padding mask
anywhere: padded positions enter every normaliser, so the outputs at valid positions depend on them."""
import torch
import torch.nn as nn

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 0, "jagged": False,
          "dense_reason": "softmax over the sequence axis without a mask: padded positions enter the normaliser"}


class LinearAttention(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.h = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        B, N, D = x.shape
        heads = lambda t: t.view(B, N, self.h, D // self.h).permute(0, 2, 1, 3)
        q = torch.softmax(heads(self.q(x)), dim=-1)
        k = torch.softmax(heads(self.k(x)), dim=-2)
        v = heads(self.v(x))
        y = (q @ (k.transpose(-1, -2) @ v)).permute(0, 2, 1, 3).reshape(B, N, D)
        return self.norm(x + self.drop(self.o(y)))


class LinRec(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, interests=4, dropout=0.1):
        super().__init__()
        self.emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList(LinearAttention(d, heads, dropout) for _ in range(layers))
        self.h = heads
        self.interests = nn.Parameter(torch.randn(interests, d) * 0.1)
        self.to_q, self.to_v = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, ids):
        B, N = ids.shape
        x = self.emb(ids) + self.pos.weight[:N]
        for layer in self.layers:
            x = layer(x)
        heads = lambda t: t.view(B, t.shape[1], self.h, -1).permute(0, 2, 1, 3)
        q = heads(self.to_q(x))                                    # [B, H, N, d]
        k = heads(self.interests.expand(B, -1, -1))                # [B, H, K, d]
        v = heads(self.to_v(self.interests).expand(B, -1, -1))     # [B, H, K, d]
        a = torch.softmax(q @ k.transpose(-1, -2), dim=-2)         # [B, H, N, K]: over the items
        return x + (a @ v).permute(0, 2, 1, 3).reshape(B, N, -1)


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = LinRec(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed)[0],
                     valid=lambda ids: ids != 0, name="linrec")
