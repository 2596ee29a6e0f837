"""Which int64 side tensors of a call hold int32-sized values, so their arithmetic in a generated
score_mod can run in int32; and the exact bounds of every integer side, from which the CPU
reference learns whether a score_mod's integer arithmetic may overflow (:mod:`.overflow`).

A timestamp side is int64 in the user's model, and the time gap ``|q_ts − k_ts|`` a relative time
bias buckets is int64 arithmetic: a 64-bit subtract, absolute value and int64 → float conversion
per (query, key) pair, several machine instructions each on a GPU. Epoch seconds (until 2038),
relative times and small ids are non-negative and below 2³¹, and then every difference of two of
them fits int32. Which it is depends on the data, so every call measures it: each int64 side gets
the interval :data:`INT32_CLASSES` names that holds its values (or None), and the kernel variant
for those intervals lets the value-range analysis prove the gap fits int32.

One reduction per integer side and one device synchronisation per call (the op's argument checks
synchronise already). Nothing is kept across calls: a tensor's values can change without its
version counter moving (``t.data = ...``, a write through a numpy alias), and a stale interval
would make the kernel truncate. Within one call the op measures once (:func:`measured_sides`
around its kernel) and the kernel reuses that for the very same tensors. During a CUDA graph
capture nothing is measured (a sync would break the capture): the sides get None, the variant
that holds every int64.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional, Sequence

import torch

Interval = tuple[int, int]

# the intervals a side may be given, narrowest first; both keep any difference of two values in int32
INT32_CLASSES: tuple[Interval, ...] = ((0, (1 << 31) - 1), (-(1 << 30), (1 << 30) - 1))

# (the sides, their exact bounds) measured by the op for the call in progress (this thread / context)
_IN_CALL: contextvars.ContextVar[Optional[tuple[tuple, tuple]]] = contextvars.ContextVar(
    "grcompile_side_ranges", default=None)
INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _class_of(lo: int, hi: int) -> Optional[Interval]:
    return next((c for c in INT32_CLASSES if c[0] <= lo and hi <= c[1]), None)


def value_bounds(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """``[min, max]`` of each (non-empty, integer, same-device) tensor, with one synchronisation."""
    return torch.stack([torch.stack([t.min().long(), t.max().long()]) for t in tensors]).tolist()


def _measure(sides: list[torch.Tensor]) -> tuple:
    """Each side's exact ``(min, max)``: integer sides only, else None (floats, bools, empty sides,
    sides on several devices — the op's checks reject those by name — and during a CUDA graph
    capture)."""
    bounds: list[Optional[Interval]] = [None] * len(sides)
    slots: dict[int, list[int]] = {}  # id of a side to measure -> its slots (one tensor may be several sides)
    for i, t in enumerate(sides):
        if t.dtype in INTEGER_DTYPES and t.numel() > 0:
            slots.setdefault(id(t), []).append(i)
    if not slots:
        return tuple(bounds)
    tensors = [sides[s[0]] for s in slots.values()]
    if len({t.device for t in tensors}) > 1:
        return tuple(bounds)
    if tensors[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return tuple(bounds)
    for same, (lo, hi) in zip(slots.values(), value_bounds(tensors)):
        for i in same:
            bounds[i] = (lo, hi)
    return tuple(bounds)


def _classes(sides: Sequence[torch.Tensor], bounds: tuple) -> tuple:
    return tuple(_class_of(*b) if b is not None and t.dtype == torch.int64 else None for t, b in zip(sides, bounds))


def integer_side_bounds(q_side: Sequence[torch.Tensor], k_side: Sequence[torch.Tensor]) -> tuple:
    """Per side, query sides first: the exact ``(min, max)`` of an integer side, else None (see
    :func:`_measure`). Inside :func:`measured_sides` for these very tensors, what it measured."""
    sides = [*q_side, *k_side]
    scoped = _IN_CALL.get()
    if scoped is not None and len(scoped[0]) == len(sides) and all(a is b for a, b in zip(scoped[0], sides)):
        return scoped[1]
    return _measure(sides)


def int64_side_ranges(q_side: Sequence[torch.Tensor], k_side: Sequence[torch.Tensor]) -> tuple:
    """Per side, query sides first: the :data:`INT32_CLASSES` interval holding every value of an
    int64 side, else None (other dtypes, an empty side: None). Inside :func:`measured_sides` for
    these very tensors, from what it measured."""
    return _classes([*q_side, *k_side], integer_side_bounds(q_side, k_side))


@contextlib.contextmanager
def measured_sides(q_side: Sequence[torch.Tensor], k_side: Sequence[torch.Tensor],
                   enabled: bool = True) -> Iterator[tuple]:
    """Measure the sides once for the call inside the block (``enabled=False``: nothing to
    measure, every side None); yields their :func:`int64_side_ranges`."""
    sides = (*q_side, *k_side)
    bounds = _measure(list(sides)) if enabled else (None,) * len(sides)
    token = _IN_CALL.set((sides, bounds))
    try:
        yield _classes(sides, bounds)
    finally:
        _IN_CALL.reset(token)


__all__ = ["INT32_CLASSES", "INTEGER_DTYPES", "int64_side_ranges", "integer_side_bounds", "measured_sides", "value_bounds"]
