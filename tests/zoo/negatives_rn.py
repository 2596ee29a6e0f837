"""A SASRec trained with sampled softmax whose loader draws ``R`` negatives per user, shared by
the user's positions, as a ``[B, R]`` tensor — and here ``R == N`` (same shape as the ids, by
coincidence). Logits ``[B, N, 1 + R]`` (positive first), cross-entropy averaged over the valid
positions; the model returns the scalar loss. Attention by ``einsum`` with a causal mask from
``torch.ones(N, N).triu(1).bool()`` and a key mask, ``masked_fill(-inf)``."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.user_model import UserModel
from tests.zoo.batches import padded_ids

EXPECT = {"fused_attention": 1, "jagged": True, "dense_reason": ""}


class SampledSoftmaxSASRec(nn.Module):
    def __init__(self, num_items, max_len, d=16, heads=2, dropout=0.1):
        super().__init__()
        self.h = heads
        self.items = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.ln0, self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Dropout(dropout), nn.Linear(2 * d, d))
        self.drop = nn.Dropout(dropout)

    def encode(self, ids):
        B, N = ids.shape
        x = self.ln0(self.items(ids) + self.pos.weight[:N])
        q, k, v = self.qkv(x).reshape(B, N, 3, self.h, -1).unbind(2)
        s = torch.einsum("bihd,bjhd->bhij", q, k) / q.shape[-1] ** 0.5
        blocked = torch.ones(N, N, device=ids.device).triu(1).bool()[None, None] | (ids == 0)[:, None, None, :]
        a = self.drop(torch.softmax(s.masked_fill(blocked, float("-inf")), dim=-1))
        a = torch.nan_to_num(a)
        x = self.ln1(x + self.proj(torch.einsum("bhij,bjhd->bihd", a, v).reshape(B, N, -1)))
        return self.ln2(x + self.ff(x))

    def forward(self, ids, targets, negatives):
        h = self.encode(ids)                                            # [B, N, D]
        pos = (h * self.items(targets)).sum(-1, keepdim=True)           # [B, N, 1]
        neg = torch.einsum("bnd,brd->bnr", h, self.items(negatives))    # [B, N, R]
        logits = torch.cat([pos, neg], dim=-1)
        ce = F.cross_entropy(logits.flatten(0, 1), torch.zeros(logits.shape[0] * logits.shape[1], dtype=torch.long,
                                                                  device=ids.device), reduction="none")
        valid = (ids != 0).flatten().float()
        return (ce * valid).sum() / valid.sum().clamp(min=1)


def factory(max_len=12, num_items=40, dropout=0.1, **kw):
    model = SampledSoftmaxSASRec(num_items, max_len, dropout=dropout, **kw)

    def make_batch(batch_size, max_len, seed):
        ids, _ = padded_ids(batch_size, max_len, num_items, seed)
        g = torch.Generator().manual_seed(seed + 11)
        targets = torch.where(ids != 0, torch.randint(1, num_items + 1, ids.shape, generator=g), 0)
        negatives = torch.randint(1, num_items + 1, (batch_size, max_len), generator=g)  # R == N
        return ids, targets, negatives

    return UserModel(model, make_batch, valid=None, name="negatives_rn")
