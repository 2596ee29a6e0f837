"""A pre-norm transformer on ``F.scaled_dot_product_attention`` with an *additive float*
``attn_mask``: causal ``torch.full((N, N), finfo.min).triu(1)`` plus the key padding as
``(1 - valid[:, None, None, :]) * finfo.min`` (their sum is -inf where both apply: SDPA's softmax
copes), an explicit ``scale`` (a temperature, not 1/sqrt(d)), ``dropout_p`` while training, heads
by ``rearrange``-like ``reshape + permute``, per-position outputs."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 2, "jagged": True, "dense_reason": ""}


class Block(nn.Module):
    def __init__(self, d, heads, dropout, temperature):
        super().__init__()
        self.h, self.p, self.scale = heads, dropout, 1.0 / temperature
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.to_q, self.to_kv = nn.Linear(d, d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.to_out = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * d, d))

    def forward(self, x, attn_mask):
        b, n, d = x.shape
        h = self.ln1(x)
        k, v = self.to_kv(h).chunk(2, dim=-1)
        q, k, v = (t.reshape(b, n, self.h, -1).permute(0, 2, 1, 3) for t in (self.to_q(h), k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale,
                                           dropout_p=self.p if self.training else 0.0)
        x = x + self.to_out(o.permute(0, 2, 1, 3).reshape(b, n, d))
        return x + self.ff(self.ln2(x))


class FloatMaskRec(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, layers=2, dropout=0.1, temperature=8.0):
        super().__init__()
        self.emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout, temperature) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, ids):
        n = ids.shape[1]
        x = self.emb(ids) + self.pos(torch.arange(n, device=ids.device)).unsqueeze(0)
        neg = torch.finfo(x.dtype).min
        valid = (ids != 0).to(x.dtype)
        attn_mask = torch.full((n, n), neg, device=ids.device).triu(1) + (1.0 - valid[:, None, None, :]) * neg
        for blk in self.blocks:
            x = blk(x, attn_mask)
        return self.ln_f(x)


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = FloatMaskRec(num_items, max_len, dropout=dropout, **kw)
    return UserModel(model, lambda b, n, seed: padded_ids(b, n, num_items, seed)[0],
                     valid=lambda ids: ids != 0, name="sdpa_float_mask")
