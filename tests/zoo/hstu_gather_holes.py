"""A compact HSTU written from the paper: validity from the ids up front, ``uvqk`` split by
``chunk``, SiLU attention with a 1-D relative-position table (``rab[j - i + N - 1]``, shared by the
heads) and a float causal x key mask, ``u * layer_norm(attn @ v)``, holes inside the rows (dropped
events), and the user state gathered at ``lengths - 1`` with ``torch.gather`` (the loader keeps
each row's last event)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


class HSTUBlock(nn.Module):
    def __init__(self, d, heads, max_len, dropout):
        super().__init__()
        self.h = heads
        self.norm = nn.LayerNorm(d)
        self.uvqk = nn.Linear(d, 4 * d, bias=False)
        self.rab = nn.Parameter(torch.randn(2 * max_len - 1) * 0.1)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, valid):
        B, N, D = x.shape
        u, v, q, k = F.silu(self.uvqk(self.norm(x))).chunk(4, dim=-1)
        q, k, v = (t.view(B, N, self.h, -1).transpose(1, 2) for t in (q, k, v))
        i = torch.arange(N, device=x.device)
        rel = i[None, :] - i[:, None] + N - 1
        mask = torch.tril(torch.ones(N, N, device=x.device)) * valid[:, None, :].float()
        attn = F.silu(q @ k.transpose(-1, -2) + self.rab[rel]) / N * mask[:, None]
        y = (attn @ v).transpose(1, 2).reshape(B, N, D)
        return (x + self.drop(self.proj(u * F.layer_norm(y, (D,))))) * valid[..., None]


class HSTUGather(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, dropout=0.1):
        super().__init__()
        self.items = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.blocks = nn.ModuleList(HSTUBlock(d, heads, max_len, dropout) for _ in range(layers))

    def forward(self, ids, lengths):
        valid = ids != 0
        x = self.items(ids)
        for block in self.blocks:
            x = block(x, valid)
        index = (lengths - 1).clamp(min=0)[:, None, None].expand(-1, 1, x.shape[-1])
        return torch.gather(x, 1, index).squeeze(1)


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = HSTUGather(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed, holes=0.25),
                     valid=lambda ids, lengths: lengths > 0, name="hstu_gather_holes")
