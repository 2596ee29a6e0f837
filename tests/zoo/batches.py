"""Padded id batches for the zoo models: random length mixes that always hold an empty
(all-padding) row, a length-1 row and a full row when the batch has room for them."""
from __future__ import annotations

import torch


def lengths_mix(batch_size: int, max_len: int, g: torch.Generator) -> torch.Tensor:
    """``[B]`` lengths: 0, 1 and ``max_len`` first (as many as fit), the rest uniform in [0, max_len]."""
    fixed = [0, 1, max_len][:batch_size]
    rest = torch.randint(0, max_len + 1, (batch_size - len(fixed),), generator=g).tolist()
    order = torch.randperm(batch_size, generator=g).tolist()  # the special rows not always first
    mix = fixed + rest
    return torch.tensor([mix[i] for i in order], dtype=torch.long)


def padded_ids(batch_size: int, max_len: int, num_items: int, seed: int, *, left: bool = False,
               pad: int = 0, holes: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [B, N], lengths [B])``: ids in [1, num_items] (``pad`` elsewhere), right padded or
    ``left`` padded; ``holes`` turns that fraction of the tokens inside rows into padding too
    (deduplicated or filtered events), so a row's last valid position may precede its length."""
    g = torch.Generator().manual_seed(seed)
    lengths = lengths_mix(batch_size, max_len, g)
    ids = torch.randint(1, num_items + 1, (batch_size, max_len), generator=g)
    pos = torch.arange(max_len)[None, :]
    inside = pos >= (max_len - lengths)[:, None] if left else pos < lengths[:, None]
    if holes:
        hole = torch.rand(batch_size, max_len, generator=g) < holes
        # keep each row's last token valid so that lengths - 1 still names a valid position
        last = (max_len - 1) if left else (lengths - 1).clamp(min=0)
        hole[torch.arange(batch_size), last] = False
        inside = inside & ~hole
    ids = torch.where(inside, ids, torch.full_like(ids, pad))
    return ids, lengths


def timestamps(ids: torch.Tensor, seed: int, pad_value: int = 0) -> torch.Tensor:
    """Non-decreasing unix-like seconds per row, ``pad_value`` at padding."""
    g = torch.Generator().manual_seed(seed + 7919)
    gaps = torch.randint(0, 3 * 86400, ids.shape, generator=g)
    ts = 1_600_000_000 + torch.cumsum(gaps, dim=1)
    return torch.where(ids != 0, ts, torch.full_like(ts, pad_value))
