"""HSTU as community ports write it: one ``uvqk`` projection through SiLU then ``torch.split``,
heads as ``view(B, N, H, d)`` and ``einsum("bnhd,bmhd->bhnm")``, a per-head time bias gathered by
a *one-hot matmul* (``F.one_hot(bucket, nb).float() @ ts_w``, ``ts_w: [nb, H]``, log-bucketed
|dt|), a position bias shared by the heads (``pos_w[j - i + N - 1]``), SiLU attention divided by N
and multiplied by a float causal x key mask, ``layer_norm(attn @ v) * u`` and a residual."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids, timestamps

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


class HSTULayer(nn.Module):
    def __init__(self, d, heads, max_len, num_buckets, dropout):
        super().__init__()
        self.h, self.dh, self.nb = heads, d // heads, num_buckets
        self.uvqk = nn.Linear(d, 4 * d)
        self.o = nn.Linear(d, d)
        self.ts_w = nn.Parameter(torch.randn(num_buckets, heads) * 0.1)
        self.pos_w = nn.Parameter(torch.randn(2 * max_len - 1) * 0.1)
        self.max_len = max_len
        self.drop = nn.Dropout(dropout)

    def forward(self, x, ts, mask):
        B, N, D = x.shape
        u, v, q, k = torch.split(F.silu(self.uvqk(x)), [D, D, D, D], dim=-1)
        q, k, v = (t.view(B, N, self.h, self.dh) for t in (q, k, v))
        qk = torch.einsum("bnhd,bmhd->bhnm", q, k)
        dt = (ts[:, None, :] - ts[:, :, None]).abs().float()
        bucket = torch.clamp(torch.log1p(dt).div(0.7).long(), 0, self.nb - 1)
        time_bias = (F.one_hot(bucket, self.nb).to(x.dtype) @ self.ts_w).permute(0, 3, 1, 2)  # [B, H, N, N]
        idx = torch.arange(N, device=x.device)
        pos_bias = self.pos_w[idx[None, :] - idx[:, None] + self.max_len - 1]  # [N, N], shared by heads
        attn = F.silu(qk + time_bias + pos_bias) / N
        attn = attn * mask[:, None]
        out = torch.einsum("bhnm,bmhd->bnhd", attn, v).reshape(B, N, D)
        return x + self.o(self.drop(F.layer_norm(out, [D]) * u))


class HSTU(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, num_buckets=16, dropout=0.1):
        super().__init__()
        self.emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.norm = nn.LayerNorm(d)
        self.layers = nn.ModuleList(HSTULayer(d, heads, max_len, num_buckets, dropout) for _ in range(layers))

    def forward(self, ids, ts):
        N = ids.shape[1]
        x = self.emb(ids)
        valid = (ids != 0).float()
        mask = torch.tril(torch.ones(N, N, device=ids.device)) * valid[:, None, :]
        for layer in self.layers:
            x = layer(self.norm(x), ts, mask)
        return x * valid[..., None]


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = HSTU(num_items, max_len, dropout=dropout, **kw)

    def make_batch(batch_size, max_len, seed):
        ids, _ = padded_ids(batch_size, max_len, num_items, seed)
        return ids, timestamps(ids, seed)

    return UserModel(model, make_batch, valid=lambda ids, ts: ids != 0, name="hstu_onehot_einsum")
