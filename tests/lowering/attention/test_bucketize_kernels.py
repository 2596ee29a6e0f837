"""``torch.bucketize`` generated into the Triton attention kernels (``score_mod_codegen._bucketize``):
the kernels count the boundaries ``b`` with ``not (b >= x)`` (``right=True``: ``not (b > x)``), one
by one up to ``LINEAR_BUCKETS`` boundaries and by binary lifting above, in the dtype torch compares
in. Each case: values and every gradient (the bias table's, gathered at the buckets) equal the
reference, which calls torch.bucketize, and the kernels ran them (no handoff) — on gaps that fall on
boundaries (ties), between and beyond them, NaN gaps (torch: bucket K), repeated boundaries, empty
and one-element boundaries, int64 gaps beyond float32's exact integers. Unsorted boundaries (torch
defines nothing for them) hand the call to the reference with the reason.
Run by Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, as test_triton.py)."""
from __future__ import annotations

import math

import pytest
import torch

from grcompile.lowering import OPS, score_mod_codegen as codegen
from grcompile.lowering import score_mod as S
from grcompile.lowering.score_mod_ranges import propagate

from .test_codegen_edge_cases import _check
from .test_triton import DEVICE, at  # noqa: F401 - the interpreter set-up

H = 2
# 12 tokens (test_codegen_edge_cases.LENGTHS = [7, 1, 0, 4]): gaps on, between and beyond the boundaries
STAMPS = torch.tensor([0.0, 1.0, 3.0, 3.0, 4.0, 10.0, 40.0, 41.0, 2.0, 5.0, 30.0, 100.0], dtype=torch.float64)


def time_bucket(right: bool, out_int32: bool = False):
    def bucketed_gap(score, q_pos, k_pos, head, q_side_0, k_side_0, table_0, table_1):
        dt = (q_side_0 - k_side_0).abs()
        return score + table_1[(torch.bucketize(dt, table_0, right=right, out_int32=out_int32), head)]
    bucketed_gap.__name__ = f"bucketed_gap_{int(right)}{int(out_int32)}"
    return bucketed_gap


def shared_bucket(score, q_pos, k_pos, q_side_0, k_side_0, table_0, table_1):
    """An integer gap against boundaries of another dtype, a shared table."""
    return torch.nn.functional.silu(score + table_1[torch.bucketize((k_side_0 - q_side_0).abs(), table_0)])


def t5_position_bucket(score, q_pos, k_pos, head, table_0, table_1):
    """T5-style: the relative position k - q through bucketize, one bias per head."""
    return score + table_1[(torch.bucketize(k_pos - q_pos, table_0), head)]


def bucket_as_number(score, q_pos, k_pos, q_side_0, k_side_0, table_0):
    """The bucket used as a number (a slope per bucket), no table lookup."""
    return score - 0.25 * torch.bucketize(q_side_0 - k_side_0, table_0, right=True).float()


def _table(rows: int, heads: int = H, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, generator=g) if heads else torch.randn(rows, generator=g)


@pytest.mark.parametrize("K", [0, 1, 5, 16, 17, 40])
@pytest.mark.parametrize("right", [False, True])
def test_time_gap_buckets_match_torch(K, right):
    """K <= 16: one compare per boundary; 17 and 40: binary lifting (5 / 6 halvings)."""
    g = torch.Generator().manual_seed(K)
    bounds = torch.sort(torch.randint(0, 50, (K,), generator=g).float()).values  # repeats: ties between boundaries
    if K >= 5:
        bounds[:5] = torch.tensor([1.0, 3.0, 3.0, 10.0, 30.0])  # gaps equal to boundaries: the side of a tie
        bounds = torch.sort(bounds).values
    stamps = STAMPS.float()
    _check(time_bucket(right), q_side=[stamps], k_side=[stamps], tables=[bounds, _table(K + 1)],
           activation="softmax", causal=False)


def test_nan_gaps_fall_in_the_last_bucket_as_in_torch():
    stamps = STAMPS.float().clone()
    stamps[[2, 9]] = math.nan  # NaN gaps: torch.bucketize gives K, whatever right is
    for right in (False, True):
        for K in (5, 20):
            bounds = torch.linspace(0.0, 60.0, K)
            _check(time_bucket(right, out_int32=True), q_side=[stamps], k_side=[stamps],
                   tables=[bounds, _table(K + 1)], activation="softmax", causal=False)


def test_integer_gaps_compare_in_the_promoted_dtype():
    """int64 gaps beyond 2**24 against float32 boundaries compare in float32 (torch promotes):
    16777217 equals the boundary 16777216 there; against int64 boundaries exactly."""
    base = 1_700_000_000
    stamps = torch.tensor([0, 1, 16_777_216, 16_777_217, 16_777_215, 5, 2, 3, 16_777_218, 7, 9, 1 << 33]) + base
    for bounds in (torch.tensor([1.0, 16_777_216.0]), torch.tensor([1, 16_777_216, 1 << 33]),
                   torch.tensor([1, 16_777_217], dtype=torch.int32)):
        _check(shared_bucket, q_side=[stamps], k_side=[stamps], tables=[bounds, _table(bounds.numel() + 1, 0)],
               causal=False)
    # an int32 gap against float64 boundaries, computed in float64
    small = (stamps - base).clamp(max=1 << 30).int()
    _check(shared_bucket, q_side=[small], k_side=[small], tables=[torch.tensor([0.5, 16_777_216.5], dtype=torch.float64),
                                                                  _table(3, 0)], causal=False)


def test_relative_position_buckets_per_head():
    _check(t5_position_bucket, tables=[torch.tensor([-4, -2, -1, 0, 1]), _table(6)], activation="softmax",
           causal=False)


def test_bucket_used_as_a_number():
    stamps = STAMPS.float()
    _check(bucket_as_number, q_side=[stamps], k_side=[stamps], tables=[torch.tensor([-10.0, -3.0, 0.0, 3.0, 10.0])])


def test_unsorted_boundaries_run_the_reference_with_the_reason():
    """torch requires sorted boundaries (its binary search's answer on others is no definition):
    the launcher checks each call's and hands unsorted ones — or NaN among them — to the reference."""
    stamps = STAMPS.float()
    for bounds in (torch.tensor([1.0, 30.0, 3.0, 10.0]), torch.tensor([1.0, math.nan, 10.0, 30.0])):
        fn = time_bucket(False)
        _check(fn, q_side=[stamps], k_side=[stamps], tables=[bounds, _table(5)], activation="softmax",
               causal=False, fallback="torch.bucketize (tables[0]) are not sorted")
        OPS["jagged_attention"].fallbacks.pop(S.register_score_mod(fn), None)
        OPS["jagged_attention_backward"].fallbacks.pop(S.register_score_mod(fn), None)


def test_the_generated_code_counts_with_scalar_loads_or_halvings():
    """The forward lines: K compares of scalar loads up to LINEAR_BUCKETS, else one masked gather
    per halving; the boundaries receive no gradient buffer (torch.bucketize passes none)."""
    key = S.register_score_mod(time_bucket(True))
    stamps = STAMPS.float()
    for K, loads in ((16, 16), (17, 5), (40, 6)):
        code = codegen.generate(S.get_score_mod(key), [stamps], [stamps], [torch.zeros(K), _table(K + 1)],
                                backward=True)
        text = "\n".join(code.forward)
        assert text.count("tl.load(tab0") == loads, text
        assert " >= bx" not in text and text.count(" > bx") == loads, text  # right=True: not (b > x)
        assert code.sorted_tables == [0] and code.float_tables == [1], (code.sorted_tables, code.float_tables)


def test_bucket_range_is_zero_to_k():
    """score_mod_ranges proves a bucket lies in [0, K] whatever the gap: the lookup of a [K+1, H]
    table needs no bounds check and the bucket is computed in int32."""
    key = S.register_score_mod(time_bucket(False))
    gm, metas = codegen.graph_with_metas(S.get_score_mod(key), [STAMPS], [STAMPS], [torch.zeros(7), _table(8)])
    ranges = propagate(gm, metas, {})
    (node,) = [n for n in gm.graph.nodes if n.target is torch.bucketize]
    assert ranges[node] == (0, 7)
    code = codegen.generate(S.get_score_mod(key), [STAMPS], [STAMPS], [torch.zeros(7), _table(8)], backward=False)
    assert code.guards and code.guard_bits(max_len=12, heads=H) == 0  # (the head index: proven at the launch)
