"""The bucket planner of the attention reference (grcompile/lowering/attention/buckets.py)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from grcompile.lowering.attention.buckets import plan_buckets

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
