"""Globally unique ids for merged tables (MTGRBoost §4.2, eq. 8): the high bits of an int64 tag
the feature table, so several features share one lookup without their id spaces colliding.

With ``m`` tables, ``k = ceil(log2(m + 1))`` tag bits sit below the (always 0) sign bit; table
``i`` (0-based) owns ``[i·2^(63−k), (i+1)·2^(63−k))`` and its ids must be ``< 2^(63−k)``:

    global = (i << (63 − k)) | id          id = global & (2^(63−k) − 1),   i = global >> (63 − k)

Bad ids (negative, too large, not an integer tensor) raise a ``ValueError`` naming the feature, on
the caller's rank, before any collective runs (so no other rank waits for it).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


def require_int_ids(label: str, ids) -> None:
    """The dtype check every id consumer makes first; ``label`` names the feature or table."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{label}: ids must be an int64 (or int32) tensor, got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)}")


def tag_bits(num_tables: int) -> int:
    if num_tables < 1:
        raise ValueError(f"num_tables must be >= 1, got {num_tables}")
    return max(1, math.ceil(math.log2(num_tables + 1)))


class TableTags:
    """Tag / untag ids of ``features`` (table order = list order)."""

    def __init__(self, features: Sequence[str]) -> None:
        if len(set(features)) != len(features):
            raise ValueError(f"feature names repeat: {list(features)}")
        self.features = list(features)
        self.bits = tag_bits(len(self.features))
        self.shift = 63 - self.bits
        self.max_id = (1 << self.shift) - 1

    def check(self, feature: str, ids: torch.Tensor) -> None:
        if feature not in self.features:
            raise ValueError(f"unknown feature {feature!r}; known: {self.features}")
        require_int_ids(f"feature {feature!r}", ids)
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0:
                raise ValueError(f"feature {feature!r}: negative id {lo}")
            if hi > self.max_id:
                raise ValueError(f"feature {feature!r}: id {hi} exceeds the {self.shift}-bit id space of "
                                 f"{len(self.features)} merged tables (max {self.max_id})")

    def tag(self, feature: str, ids: torch.Tensor) -> torch.Tensor:
        self.check(feature, ids)
        return ids.long() | (self.features.index(feature) << self.shift)

    def untag(self, global_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(table index, local id)`` of tagged ids."""
        return global_ids >> self.shift, global_ids & self.max_id


__all__ = ["TableTags", "require_int_ids", "tag_bits"]
