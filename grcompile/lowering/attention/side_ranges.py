"""Which int64 side tensors of a call hold int32-sized values, so their arithmetic in a generated
score_mod can run in int32.

A timestamp side is int64 in the user's model, and the time gap ``|q_ts − k_ts|`` a relative time
bias buckets is int64 arithmetic: a 64-bit subtract, absolute value and int64 → float conversion
per (query, key) pair, several machine instructions each on a GPU. Epoch seconds (until 2038),
relative times and small ids are non-negative and below 2³¹, and then every difference of two of
them fits int32. Which it is depends on the data, so the launch measures it: each int64 side gets
the interval :data:`INT32_CLASSES` names that holds its values (or None), and the kernel variant
for those intervals lets the value-range analysis prove the gap fits int32.

One reduction per side and one device synchronisation per call, which the op's argument checks
already pay; the result is kept per tensor object and version, so the backward, which sees the
forward's saved tensors, pays none. During a CUDA graph capture nothing is measured (a sync
would break the capture): the sides get None, the variant that holds every int64.
"""
from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch

Interval = tuple[int, int]

# the intervals a side may be given, narrowest first; both keep any difference of two values in int32
INT32_CLASSES: tuple[Interval, ...] = ((0, (1 << 31) - 1), (-(1 << 30), (1 << 30) - 1))

_KNOWN: dict[int, tuple[weakref.ref, int, Optional[Interval]]] = {}  # id -> (tensor, version, interval)
_KNOWN_MAX = 64


def _class_of(lo: int, hi: int) -> Optional[Interval]:
    return next((c for c in INT32_CLASSES if c[0] <= lo and hi <= c[1]), None)


def _cached(t: torch.Tensor) -> tuple[bool, Optional[Interval]]:
    hit = _KNOWN.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return True, hit[2]
    return False, None


def _remember(t: torch.Tensor, interval: Optional[Interval]) -> None:
    if len(_KNOWN) >= _KNOWN_MAX:  # dead entries first, then the oldest
        for key in [k for k, (ref, _, _) in _KNOWN.items() if ref() is None] or list(_KNOWN)[:_KNOWN_MAX // 2]:
            del _KNOWN[key]
    _KNOWN[id(t)] = (weakref.ref(t), t._version, interval)


def int64_side_ranges(q_side: Sequence[torch.Tensor], k_side: Sequence[torch.Tensor]) -> tuple:
    """Per side, query sides first: the :data:`INT32_CLASSES` interval holding every value of an
    int64 side, else None (other dtypes, an empty side: None)."""
    sides = [*q_side, *k_side]
    ranges: list[Optional[Interval]] = [None] * len(sides)
    todo: dict[int, list[int]] = {}  # id of a side to measure -> its slots (one tensor may be several sides)
    for i, t in enumerate(sides):
        if t.dtype != torch.int64 or t.numel() == 0:
            continue
        hit, interval = _cached(t)
        if hit:
            ranges[i] = interval
        else:
            todo.setdefault(id(t), []).append(i)
    if not todo:
        return tuple(ranges)
    tensors = [sides[slots[0]] for slots in todo.values()]
    if tensors[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return tuple(ranges)
    bounds = torch.stack([torch.stack([t.min(), t.max()]) for t in tensors]).tolist()  # one sync
    for t, slots, (lo, hi) in zip(tensors, todo.values(), bounds):
        interval = _class_of(lo, hi)
        _remember(t, interval)
        for i in slots:
            ranges[i] = interval
    return tuple(ranges)


__all__ = ["INT32_CLASSES", "int64_side_ranges"]
