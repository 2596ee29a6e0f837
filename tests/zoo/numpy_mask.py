"""An additive-mask transformer whose causal mask is built once with numpy at construction time
(``np.triu(np.full(..., -1e4), k=1)``) and sliced into a tensor constant in ``forward``, with a
Hugging Face style key mask ``(1.0 - valid[:, None, None, :]) * -1e4`` added on top, scores by
``einsum``, and per-position outputs."""
import numpy as np
import torch
import torch.nn as nn

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


class Layer(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.h = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, additive):
        b, n, d = x.shape
        split = lambda t: t.reshape(b, n, self.h, d // self.h)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (d // self.h) ** -0.5 + additive
        att = self.drop(scores.softmax(-1))
        y = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, n, d)
        x = self.ln1(x + self.o(y))
        return self.ln2(x + self.drop(self.ff(x)))


class NumpyMaskRec(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, dropout=0.1):
        super().__init__()
        self.causal_np = np.triu(np.full((max_len, max_len), -1e4, dtype=np.float32), k=1)
        self.emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList(Layer(d, heads, dropout) for _ in range(layers))

    def forward(self, ids):
        n = ids.shape[1]
        x = self.emb(ids) + self.pos(torch.arange(n, device=ids.device))
        valid = (ids != 0).float()
        causal = torch.from_numpy(self.causal_np[:n, :n]).to(ids.device)
        additive = causal[None, None] + (1.0 - valid[:, None, None, :]) * -1e4
        for layer in self.layers:
            x = layer(x, additive)
        return x


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = NumpyMaskRec(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed)[0],
                     valid=lambda ids: ids != 0, name="numpy_mask")
