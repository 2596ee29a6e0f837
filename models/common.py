"""Pieces every naive padded model shares: the item/position input, the relative biases, the
L2-normalised output. Written the plain padded way on purpose: these are the compiler's inputs."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig


class SequentialEncoder(nn.Module):
    """Base class: ``forward(ids [B, N], timestamps [B, N]) -> [B, N, D]`` L2-normalised,
    zero at padding. Subclasses implement ``encode(x, valid, timestamps)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        D = config.embedding_dim
        self.item_embedding = nn.Embedding(config.num_items + 1, D, padding_idx=config.pad_id)
        self.position_embedding = nn.Embedding(config.max_len, D)
        nn.init.trunc_normal_(self.item_embedding.weight, std=0.02)
        nn.init.trunc_normal_(self.position_embedding.weight, std=math.sqrt(1.0 / D))
        with torch.no_grad():
            self.item_embedding.weight[config.pad_id].zero_()
        self.input_dropout = nn.Dropout(config.dropout)
        if config.num_categories:
            # Side information as many catalogues have it: each item's category (a fixed hash here),
            # its own padded embedding, added to the item's.
            C = config.num_categories
            self.category_embedding = nn.Embedding(C + 1, D, padding_idx=config.pad_id)
            nn.init.trunc_normal_(self.category_embedding.weight, std=0.02)
            with torch.no_grad():
                self.category_embedding.weight[config.pad_id].zero_()
            items = torch.arange(config.num_items + 1)
            category = 1 + (items * 2654435761) % C
            self.register_buffer("item_category", torch.where(items == config.pad_id, config.pad_id, category),
                                 persistent=False)

    def run_block(self, block: nn.Module, *args: torch.Tensor) -> torch.Tensor:
        """``block(*args)``; in training with ``config.checkpoint_blocks``, under
        ``torch.utils.checkpoint`` (the block's activations are recomputed in the backward, as
        users fit long sequences)."""
        if self.config.checkpoint_blocks and self.training and torch.is_grad_enabled():
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def forward(self, ids: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        B, N = ids.shape
        valid = ids != self.config.pad_id
        positions = torch.arange(N, device=ids.device)
        x = self.item_embedding(ids)
        if self.config.num_categories:
            x = x + self.category_embedding(self.item_category[ids])
        x = x * math.sqrt(self.config.embedding_dim)
        x = x + self.position_embedding(positions).unsqueeze(0)
        x = self.input_dropout(x) * valid.unsqueeze(-1)
        x = self.encode(x, valid, timestamps)
        return F.normalize(x, dim=-1) * valid.unsqueeze(-1)

    def encode(self, x: torch.Tensor, valid: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def item_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.item_embedding(ids), dim=-1)

    def all_item_embeddings(self) -> torch.Tensor:
        return F.normalize(self.item_embedding.weight, dim=-1)


def causal_padding_mask(valid: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool: query i may see key j iff j <= i and both are real items."""
    N = valid.shape[1]
    causal = torch.tril(torch.ones(N, N, dtype=torch.bool, device=valid.device))
    return causal.unsqueeze(0) & valid.unsqueeze(1) & valid.unsqueeze(2)


class RelativePositionBias(nn.Module):
    """Toeplitz bias β[j − i] over 2·max_len − 1 learned weights."""

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.weight = nn.Parameter(torch.empty(2 * max_len - 1).normal_(0, 0.02))

    def forward(self, N: int, device: torch.device) -> torch.Tensor:
        positions = torch.arange(N, device=device)
        relative = positions.unsqueeze(0) - positions.unsqueeze(1)  # [i, j] -> j - i
        return self.weight[relative + self.max_len - 1]  # [N, N]


class RelativeTimeBias(nn.Module):
    """α[bucket(|t_next(i) − t_j|)], bucket = clamp(floor(ln(max(Δ, 1)) / 0.301), 0, num_buckets).

    The query side uses the timestamp of the item that follows position i (the one being
    predicted); at the last real position, which has no successor, it uses its own timestamp,
    so no output ever reads a padded timestamp.
    """

    def __init__(self, num_buckets: int) -> None:
        super().__init__()
        self.num_buckets = num_buckets
        self.weight = nn.Parameter(torch.empty(num_buckets + 1).normal_(0, 0.02))

    def forward(self, timestamps: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        next_ts = torch.cat([timestamps[:, 1:], timestamps[:, -1:]], dim=1)
        next_valid = torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)
        query_ts = torch.where(next_valid, next_ts, timestamps)
        delta = (query_ts.unsqueeze(2) - timestamps.unsqueeze(1)).abs().clamp(min=1)
        buckets = (torch.log(delta.float()) / 0.301).long().clamp(0, self.num_buckets)
        return self.weight[buckets]  # [B, N, N]
