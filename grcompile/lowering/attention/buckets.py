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

    ``n``, ``Lq`` and ``Lk`` are at least 2 (a lone row is paired with a copy of itself whose slots
    are all padding, a one-token block gets a padding slot): the compiled chunk kernel is dynamic
    in them, and a size of 1 would be a specialisation, hence a recompile, in the middle of
    training."""
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
            live = [True] * len(rows) + [False] * (len(rows) < 2)
            rows = rows + rows[:1] * (len(rows) < 2)
            starts = torch.tensor([offs[r] for r in rows], dtype=torch.int64, device=device)
            lens = torch.tensor([lengths[r] for r in rows], dtype=torch.int64, device=device)
            live_t = torch.tensor(live, dtype=torch.bool, device=device)
            for q0 in range(0, L, q_block):
                q1 = min(L, q0 + q_block)
                k1 = q1 if causal else L  # positions increase within a row: later keys are masked
                yield _slots(starts, lens, live_t, q0, q1, device) + _slots(starts, lens, live_t, 0, k1, device)


def _slots(starts, lens, live, lo: int, hi: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots ``lo .. max(hi, lo + 2)`` of each row; those at or past ``hi`` are padding."""
    ar = torch.arange(lo, max(hi, lo + 2), dtype=torch.int64, device=device).unsqueeze(0)
    valid = (ar < lens.unsqueeze(1)) & (ar < hi) & live.unsqueeze(1)
    index = starts.unsqueeze(1) + torch.minimum(ar, lens.unsqueeze(1) - 1)
    return index, valid
