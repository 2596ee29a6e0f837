"""An HSTU variant for left-padded batches that come with a ``lengths`` tensor: validity from
``arange(N) >= N - lengths``, the projection split by feature-axis slices (``uvqk[..., :d]``,
``uvqk[..., d:2 * d]``, ...), a ``[2 * max_len - 1, H]`` parameter bias gathered by relative
position (per head), heads by ``permute`` and ``matmul``, ``torch.where(mask, attn, 0)``, and the
user vector read at the last position ``out[:, -1, :]`` (always a real item under left padding)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


class Layer(nn.Module):
    def __init__(self, d, heads, max_len, dropout):
        super().__init__()
        self.d, self.h, self.max_len = d, heads, max_len
        self.norm = nn.LayerNorm(d)
        self.uvqk = nn.Linear(d, 4 * d)
        self.rel_bias = nn.Parameter(torch.randn(2 * max_len - 1, heads) * 0.1)
        self.out = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        B, N, _ = x.shape
        d, h = self.d, self.h
        uvqk = F.silu(self.uvqk(self.norm(x)))
        u, v, q, k = uvqk[..., :d], uvqk[..., d:2 * d], uvqk[..., 2 * d:3 * d], uvqk[..., 3 * d:]
        q = q.reshape(B, N, h, d // h).permute(0, 2, 1, 3)
        k = k.reshape(B, N, h, d // h).permute(0, 2, 3, 1)
        v = v.reshape(B, N, h, d // h).permute(0, 2, 1, 3)
        pos = torch.arange(N, device=x.device)
        rel = pos[None, :] - pos[:, None] + self.max_len - 1
        bias = self.rel_bias[rel].permute(2, 0, 1)  # [H, N, N]
        attn = F.silu(q @ k + bias) / N
        attn = torch.where(mask[:, None], attn, torch.zeros_like(attn))
        y = (attn @ v).permute(0, 2, 1, 3).reshape(B, N, d)
        return x + self.drop(self.out(F.layer_norm(y, (d,)) * u))


class LeftPadHSTU(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, dropout=0.1):
        super().__init__()
        self.item = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.layers = nn.ModuleList(Layer(d, heads, max_len, dropout) for _ in range(layers))
        self.final = nn.LayerNorm(d)

    def forward(self, ids, lengths):
        B, N = ids.shape
        pos = torch.arange(N, device=ids.device)
        valid = pos[None, :] >= (N - lengths)[:, None]
        mask = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]
        x = self.item(ids)
        for layer in self.layers:
            x = layer(x, mask)
        return self.final(x)[:, -1, :]


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = LeftPadHSTU(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed, left=True),
                     valid=lambda ids, lengths: lengths > 0, name="hstu_slices_left")
