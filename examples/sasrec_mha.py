"""A SASRec written the way most current code writes it: ``nn.MultiheadAttention`` under a
``key_padding_mask`` and a causal ``attn_mask``, right padding with pad id 0.

Try the tools on it (from the repository root)::

    python -m grcompile.explain --model examples/sasrec_mha.py:factory
    python -m grcompile.bench --model examples/sasrec_mha.py:factory --max-len 200 --batch-size 128

``factory`` returns a ``grcompile.user_model.UserModel``: the module, a seeded batch maker and the
valid positions. The module returns ``[B, N, D]`` sequence embeddings; a training step uses the
default loss (mean of squares at the valid positions), enough to time forward + backward.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from grcompile.user_model import UserModel


class SASRecMHA(nn.Module):
    def __init__(self, num_items: int, max_len: int, embedding_dim: int, num_blocks: int, num_heads: int,
                 dropout: float) -> None:
        super().__init__()
        self.max_len = max_len
        self.item_emb = nn.Embedding(num_items + 1, embedding_dim, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, embedding_dim)
        self.emb_dropout = nn.Dropout(dropout)
        self.attn_norms = nn.ModuleList(nn.LayerNorm(embedding_dim, eps=1e-8) for _ in range(num_blocks))
        self.attns = nn.ModuleList(nn.MultiheadAttention(embedding_dim, num_heads, dropout=dropout, batch_first=True)
                                   for _ in range(num_blocks))
        self.ffn_norms = nn.ModuleList(nn.LayerNorm(embedding_dim, eps=1e-8) for _ in range(num_blocks))
        self.ffns = nn.ModuleList(
            nn.Sequential(nn.Linear(embedding_dim, embedding_dim), nn.ReLU(), nn.Dropout(dropout),
                          nn.Linear(embedding_dim, embedding_dim), nn.Dropout(dropout))
            for _ in range(num_blocks))
        self.final_norm = nn.LayerNorm(embedding_dim, eps=1e-8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        N = ids.shape[1]
        padding = ids == 0
        positions = torch.arange(N, device=ids.device)
        x = self.item_emb(ids) * self.item_emb.embedding_dim ** 0.5 + self.pos_emb(positions)
        x = self.emb_dropout(x).masked_fill(padding.unsqueeze(-1), 0.0)
        causal = torch.triu(torch.ones(N, N, dtype=torch.bool, device=ids.device), diagonal=1)
        for attn_norm, attn, ffn_norm, ffn in zip(self.attn_norms, self.attns, self.ffn_norms, self.ffns):
            h = attn_norm(x)
            a, _ = attn(h, h, h, key_padding_mask=padding, attn_mask=causal, need_weights=False)
            x = x + a
            x = x + ffn(ffn_norm(x))
            # masked_fill rather than a product: an all-padding row has no key to attend to, and
            # eval-mode MultiheadAttention returns NaN there (0 * NaN would stay NaN)
            x = x.masked_fill(padding.unsqueeze(-1), 0.0)
        return self.final_norm(x)


def factory(max_len: int = 50, num_items: int = 1000, embedding_dim: int = 64, num_blocks: int = 2,
            num_heads: int = 2, dropout: float = 0.0) -> UserModel:
    model = SASRecMHA(num_items, max_len, embedding_dim, num_blocks, num_heads, dropout)

    def make_batch(batch_size: int, max_len: int, seed: int) -> tuple[torch.Tensor]:
        """Right-padded ids [B, N]: lengths uniform in 0..N (about half padding), the first rows
        empty, length 1 and full."""
        if max_len > model.max_len:
            raise ValueError(f"batch max_len {max_len} > the model's max_len {model.max_len}")
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(0, max_len + 1, (batch_size,), generator=g)
        lengths[:3] = torch.tensor([0, 1, max_len])[:batch_size]
        ids = torch.randint(1, num_items + 1, (batch_size, max_len), generator=g)
        return (ids.masked_fill(torch.arange(max_len) >= lengths.unsqueeze(1), 0),)

    return UserModel(model, make_batch, valid=lambda ids: ids != 0, name="sasrec_mha")
