"""A user-tower encoder on ``F.scaled_dot_product_attention`` with a bool ``attn_mask``
(``[B, 1, N, N]``, causal and key-valid), ``dropout_p`` only while training, one fused qkv
projection split by ``chunk``, heads by ``view(...).transpose(1, 2)``, pre-RMSNorm blocks with a
SwiGLU feed-forward, and a masked-mean pooled user vector ``[B, D]`` as the output."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

# pooled output: the jagged exit is a segment mean over each row's tokens
EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


class Block(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.w12 = nn.Linear(d, 4 * d, bias=False)
        self.w3 = nn.Linear(2 * d, d, bias=False)

    def forward(self, x, mask):
        B, N, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(B, N, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(a.transpose(1, 2).reshape(B, N, D))
        g, u = self.w12(self.norm2(x)).chunk(2, dim=-1)
        return x + self.w3(F.silu(g) * u)


class MeanPoolTower(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, dropout=0.1):
        super().__init__()
        self.emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))

    def forward(self, ids):
        B, N = ids.shape
        keep = ids > 0
        mask = torch.tril(torch.ones(N, N, dtype=torch.bool, device=ids.device)) & keep[:, None, None, :]
        x = self.emb(ids) + self.pos.weight[:N]
        for blk in self.blocks:
            x = blk(x, mask)
        m = keep.unsqueeze(-1).float()
        return (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = MeanPoolTower(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed)[0], valid=None,
                     name="sdpa_bool_meanpool")
