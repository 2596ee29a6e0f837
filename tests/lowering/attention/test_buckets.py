"""The bucket planner of the attention reference (grcompile/lowering/attention/buckets.py)."""
from __future__ import annotations

import contextlib

from hypothesis import given, settings
from hypothesis import strategies as st

import torch

from grcompile.lowering.attention import buckets
from grcompile.lowering.attention.buckets import _chunks, plan_buckets

from .. import PROFILE

SETTINGS = settings(parent=settings.get_profile(PROFILE))


@given(st.lists(st.integers(0, 300), min_size=0, max_size=40), st.sampled_from([0.0, 0.125, 0.5]),
       st.sampled_from([0, 100, 8192]))
@SETTINGS
def test_plan_buckets_waste_bound(lengths, waste, slack) -> None:
    buckets = plan_buckets(lengths, waste, slack)
    rows = sorted(r for bucket in buckets for r in bucket)
    assert rows == [i for i, n in enumerate(lengths) if n > 0]
    for bucket in buckets:
        M = lengths[bucket[0]]
        assert all(lengths[r] <= M for r in bucket)
        area = len(bucket) * M * M
        padded = area - sum(lengths[r] ** 2 for r in bucket)
        assert padded <= max(waste * area, slack)


def _pairs(offs: list[int], heads: int, causal: bool) -> tuple[dict, int]:
    """How often each (query token, key token) pair is a valid slot pair of some chunk, and the
    scores the chunks compute (Σ n·Lq·Lk)."""
    seen: dict[tuple[int, int], int] = {}
    area = 0
    for qi, qv, ki, kv in _chunks(offs, heads, causal, torch.device("cpu")):
        n, Lq = qi.shape
        assert n >= 2 and Lq >= 2 and ki.shape[1] >= 2  # no size-1 specialisation of the compiled chunk
        area += n * Lq * ki.shape[1]
        for r in range(n):
            for q in qi[r][qv[r]].tolist():
                for k in ki[r][kv[r]].tolist():
                    seen[(q, k)] = seen.get((q, k), 0) + 1
    return seen, area


@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.booleans(),
       st.sampled_from([{}, {"CAUSAL_Q_BLOCK": 3}, {"CHUNK_ELEMENTS": 50, "MIN_Q_BLOCK": 3}]))
@SETTINGS
def test_chunks_cover_each_allowed_pair_once(lengths, causal, knobs) -> None:
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    with _knobs(knobs):
        seen, _ = _pairs(offs, 2, causal)
    want = {(a + i, a + j) for a, b in zip(offs[:-1], offs[1:]) for i in range(b - a) for j in range(b - a)
            if j <= i or not causal}
    assert set(seen) >= want  # every allowed pair is computed (a causal block may also see later keys: masked)
    assert all(count == 1 for count in seen.values())  # ... once: a key's gradient is summed over its chunks
    rows = {t: r for r, (a, b) in enumerate(zip(offs[:-1], offs[1:])) for t in range(a, b)}
    assert all(rows[q] == rows[k] for q, k in seen)


def test_a_lone_row_is_computed_once() -> None:
    """A row alone in its bucket costs its own scores, not twice as many (it was paired with an
    all-padding copy of itself until 2026-11-29)."""
    for L, causal in ((64, False), (64, True), (1000, True), (7, False)):
        _, area = _pairs([0, L], 8, causal)
        full = L * max(L, 2)
        assert area <= full + 2 * L, (L, causal, area)


@contextlib.contextmanager
def _knobs(values: dict):
    old = {k: getattr(buckets, k) for k in values}
    for k, v in values.items():
        setattr(buckets, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(buckets, k, v)
