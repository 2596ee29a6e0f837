"""The bucket planner of the CPU reference: rows grouped by length into buckets whose padded pair
area wastes at most ``BUCKET_WASTE`` (or ``BUCKET_SLACK_PAIRS`` pairs), each bucket split into
chunks of at most ``CHUNK_ELEMENTS`` score elements (query blocks for one long row); a causal chunk
is cut into query blocks of at most ``CAUSAL_Q_BLOCK`` (each reads the keys up to its end, so the
masked upper triangle is mostly not computed).

The knobs are module globals read at call time: set them on this module (tests do).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

BUCKET_WASTE = 0.125  # max fraction of a bucket's padded pair area that is padding
BUCKET_SLACK_PAIRS = 8192  # ... or this many padded pairs, whichever is larger
CHUNK_ELEMENTS = 1 << 22  # max elements of one chunk's [n, H, Lq, Lk] score tensor
MIN_Q_BLOCK = 16  # smallest query block when a single row exceeds CHUNK_ELEMENTS
CAUSAL_Q_BLOCK = 256  # causal chunks with longer rows are cut into query blocks of about this size


def plan_buckets(lengths: Sequence[int], waste: Optional[float] = None,
                 slack_pairs: Optional[int] = None) -> list[list[int]]:
    """Group the non-empty rows into buckets (lists of row ids, longest first).

    Rows sorted by decreasing length are added greedily to the current bucket while the padding
    of the bucket's pair area ``n·M² − Σ l²`` (``M``: its longest row) stays within ``waste`` of
    ``n·M²`` or within ``slack_pairs``. Attention cost is quadratic in the length, so the waste is
    measured on pairs, not tokens. Defaults: the module's ``BUCKET_WASTE`` / ``BUCKET_SLACK_PAIRS``."""
    waste = BUCKET_WASTE if waste is None else waste
    slack_pairs = BUCKET_SLACK_PAIRS if slack_pairs is None else slack_pairs
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    M = count = sum_sq = 0
    for row in order:
        n = lengths[row]
        if buckets:
            area = (count + 1) * M * M
            padded = area - (sum_sq + n * n)
            if padded <= waste * area or padded <= slack_pairs:
                buckets[-1].append(row)
                count, sum_sq = count + 1, sum_sq + n * n
                continue
        buckets.append([row])
        M, count, sum_sq = n, 1, n * n
    return buckets


def _chunks(offs: list[int], heads: int, causal: bool, device: torch.device, budget: Optional[int] = None):
    """Yield ``(q_index [n, Lq], q_valid, k_index [n, Lk], k_valid)`` per chunk: the token of each
    slot (a padded slot repeats its row's last real token) and whether the slot is real.

    ``n``, ``Lq`` and ``Lk`` are at least 2: the compiled chunk kernel is dynamic in them, and a
    size of 1 would be a specialisation, hence a recompile, in the middle of training. A lone row's
    query block becomes two slot rows, its two halves, that read the same keys (:func:`_halves`):
    the scores cover the block's pairs once. (Pairing the row with an all-padding copy of itself,
    as before 2026-11-29, computed every long row's scores twice: the HSTU attention at N = 1024
    was 1.3x slower than with no pairing at all.) A one-token block gets a padding slot."""
    budget = CHUNK_ELEMENTS if budget is None else budget
    lengths = [b - a for a, b in zip(offs[:-1], offs[1:])]
    for bucket in plan_buckets(lengths):
        M = lengths[bucket[0]]
        per_row = heads * M * M
        rows_per_chunk = max(1, budget // max(per_row, 1))
        for c in range(0, len(bucket), rows_per_chunk):
            rows = bucket[c:c + rows_per_chunk]
            L = lengths[rows[0]]  # longest of this chunk
            q_block = L if len(rows) > 1 or heads * L * L <= budget else max(MIN_Q_BLOCK, budget // (heads * L))
            if causal and q_block > CAUSAL_Q_BLOCK:
                # a causal block reads the keys up to its end only: 4 blocks compute 62.5 % of the square
                blocks = -(-q_block // CAUSAL_Q_BLOCK)
                q_block = -(-q_block // blocks)
            if len(rows) == 1:
                yield from _halves(offs[rows[0]], L, q_block, causal, device)
                continue
            starts = torch.tensor([offs[r] for r in rows], dtype=torch.int64, device=device)
            lens = torch.tensor([lengths[r] for r in rows], dtype=torch.int64, device=device)
            for q0 in range(0, L, q_block):
                q1 = min(L, q0 + q_block)
                k1 = q1 if causal else L  # positions increase within a row: later keys are masked
                yield _slots(starts, lens, q0, q1, device) + _slots(starts, lens, 0, k1, device)


def _halves(start: int, length: int, q_block: int, causal: bool, device: torch.device):
    """The chunks of one row: each query block as two slot rows, its first and second half (the
    second padded to the first's width), both reading the keys up to the block's end. A key slot
    read by both halves is one token: the backward's ``index_add_`` sums its two gradients."""
    starts = torch.full((2,), start, dtype=torch.int64, device=device)
    lens = torch.full((2,), length, dtype=torch.int64, device=device)
    for q0 in range(0, length, q_block):
        q1 = min(length, q0 + q_block)
        half = max(2, -(-(q1 - q0) // 2))
        firsts = torch.tensor([q0, q0 + half], dtype=torch.int64, device=device)
        k1 = q1 if causal else length
        yield _slots(starts, lens, firsts, q1, device, width=half) + _slots(starts, lens, 0, k1, device)


def _slots(starts, lens, lo, hi: int, device, width: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots ``lo .. lo + width`` of each row (``lo``: an int, or one per row; ``width``:
    ``max(hi - lo, 2)`` by default); those at or past ``hi`` are padding."""
    width = max(hi - lo, 2) if width is None else width
    first = torch.as_tensor(lo, dtype=torch.int64, device=device).reshape(-1, 1)
    ar = first + torch.arange(width, dtype=torch.int64, device=device).unsqueeze(0)
    valid = (ar < lens.unsqueeze(1)) & (ar < hi)
    index = starts.unsqueeze(1) + torch.minimum(ar, lens.unsqueeze(1) - 1)
    return index, valid
