"""Value ranges of score_mod graphs (``grcompile.lowering.score_mod_ranges``): what they prove is
what the kernel generator drops (int64 → int32, a table lookup's wrap and bounds check), so every
proven interval must hold for every input in the inputs' ranges — checked here by evaluating the
graphs in float32 on random and extreme inputs — and the proofs must be strong enough for the
bucketings people write."""
from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings, strategies as st

from grcompile.lowering import score_mod as S
from grcompile.lowering.score_mod_codegen import Guard, generate
from grcompile.lowering.score_mod_ranges import dtype_range, propagate

INT64 = dtype_range(torch.int64)


def hstu_time_bucket(q_side_0, k_side_0):
    gap = (q_side_0 - k_side_0).abs()
    return torch.clamp((torch.log(torch.where(gap < 1, 1, gap).float()) / 0.301).long(), 0, 128)


def log1p_bucket(q_side_0, k_side_0):
    return torch.clamp(torch.log1p((k_side_0 - q_side_0).abs().float()).div(0.7).long(), 0, 127)


def max_spelled_bucket(q_side_0, k_side_0):
    """max(gap, 1) spelled with masked_fill, then a floor-rounded log2 and a sqrt."""
    gap = (k_side_0 - q_side_0).abs()
    gap = gap.masked_fill(gap < 1, 1).float()
    return torch.floor(torch.log2(gap)).long() + torch.sqrt(gap).clamp(max=9.0).long()


def relative_position(q_pos, k_pos):
    return k_pos - q_pos + 63


def position_floor_div(q_pos, k_pos):
    return torch.div(k_pos - q_pos, 3, rounding_mode="floor") % 5


def float_side_bucket(q_side_0, k_side_0):
    """A float side may be NaN: its log is unproven, and so is the cast (not the clamp after it)."""
    return (torch.log(k_side_0) * 2).long()


def _ranges(fn, inputs: dict[str, tuple], dtypes: dict[str, torch.dtype]):
    gm = fx.symbolic_trace(fn)
    args = {n.name: torch.zeros(3, dtype=dtypes[n.name]) for n in gm.graph.nodes if n.op == "placeholder"}
    metas = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            metas[n] = super().run_node(n)
            return metas[n]
    Recorder(gm).run(*args.values())
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    ranges = propagate(gm, metas, {placeholders[k]: v for k, v in inputs.items()})
    return gm, ranges


def _output_range(ranges, gm):
    return ranges[next(n for n in gm.graph.nodes if n.op == "output").args[0]]


SIDES = {"q_side_0": torch.int64, "k_side_0": torch.int64}
POSITIONS = {"q_pos": torch.int64, "k_pos": torch.int64}


def _cast(gm, ranges):
    return ranges[next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "long")]


def test_log_bucketed_time_gaps_are_proven_inside_their_clamp_whatever_the_timestamps():
    for fn, want in ((hstu_time_bucket, (0, 128)), (log1p_bucket, (0, 127))):
        gm, ranges = _ranges(fn, {}, SIDES)
        assert _output_range(ranges, gm) == want
    # HSTU's max(|gap|, 1) keeps the log's argument >= 1: the cast before the clamp is proven
    # small (int32 in the kernel)
    lo, hi = _cast(*_ranges(hstu_time_bucket, {}, SIDES))
    assert lo == 0 and hi <= 145
    # log1p(|gap|) is NaN at a gap of -2**63 (|x| wraps): the cast is unproven, only the clamp
    assert _cast(*_ranges(log1p_bucket, {}, SIDES)) == INT64


def test_max_spelled_with_masked_fill_refines_the_kept_branch():
    gm, ranges = _ranges(max_spelled_bucket, {}, SIDES)
    assert _output_range(ranges, gm) == (1, 63 + 9)  # sqrt(1) = 1 exactly


def test_unknown_integers_wrap_so_abs_of_int64_min_stays_negative():
    def gap(q_side_0, k_side_0):
        return (k_side_0 - q_side_0).abs()
    gm, ranges = _ranges(gap, {}, SIDES)
    assert _output_range(ranges, gm) == INT64
    assert torch.tensor([INT64[0]]).abs().item() < 0  # torch's own wrap, which the whole range covers


def test_positions_bound_the_relative_index_only_when_the_launch_knows_them():
    gm, ranges = _ranges(relative_position, {"q_pos": (0, 63), "k_pos": (0, 63)}, POSITIONS)
    assert _output_range(ranges, gm) == (0, 126)
    gm, ranges = _ranges(relative_position, {"q_pos": (0, 99), "k_pos": (0, 99)}, POSITIONS)
    assert _output_range(ranges, gm) == (-36, 162)
    gm, ranges = _ranges(position_floor_div, {"q_pos": (0, 99), "k_pos": (0, 99)}, POSITIONS)
    assert _output_range(ranges, gm) == INT64  # % is not modelled: unproven, never wrong


def test_a_float_side_that_may_be_nan_proves_nothing():
    gm, ranges = _ranges(float_side_bucket, {}, {"q_side_0": torch.float32, "k_side_0": torch.float32})
    assert _output_range(ranges, gm) == INT64


def _evaluate(gm: fx.GraphModule, inputs: dict[str, torch.Tensor]) -> dict[fx.Node, torch.Tensor]:
    values = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            values[n] = super().run_node(n)
            return values[n]
    Recorder(gm).run(*inputs.values())
    return values


def _assert_within(gm, ranges, inputs):
    for node, value in _evaluate(gm, inputs).items():
        iv = ranges.get(node)
        if iv is None or not isinstance(value, torch.Tensor) or node.op == "placeholder":
            continue
        assert not torch.isnan(value.double()).any(), node
        lo, hi = iv
        v = value.double() if value.is_floating_point() else value
        assert bool((v >= lo).all()) and bool((v <= hi).all()), (node.format_node(), iv, value)


EXTREMES = [0, 1, -1, 2**31 - 1, -(2**31), 2**53 + 1, INT64[0], INT64[1], 1_700_000_000_000]


@settings(max_examples=40, deadline=None)
@given(q=st.lists(st.one_of(st.integers(INT64[0], INT64[1]), st.sampled_from(EXTREMES)), min_size=4, max_size=4),
       k=st.lists(st.one_of(st.integers(-10**12, 10**12), st.sampled_from(EXTREMES)), min_size=4, max_size=4))
def test_proven_ranges_hold_on_extreme_timestamps(q, k):
    inputs = {"q_side_0": torch.tensor(q)[:, None], "k_side_0": torch.tensor(k)[None, :]}
    for fn in (hstu_time_bucket, log1p_bucket, max_spelled_bucket):
        gm, ranges = _ranges(fn, {}, SIDES)
        _assert_within(gm, ranges, inputs)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), data=st.data())
def test_proven_ranges_hold_for_positions_below_max_len(n, data):
    pos = data.draw(st.lists(st.integers(0, n - 1), min_size=3, max_size=3))
    inputs = {"q_pos": torch.tensor(pos)[:, None], "k_pos": torch.tensor(pos[::-1])[None, :]}
    for fn in (relative_position, position_floor_div):
        gm, ranges = _ranges(fn, {"q_pos": (0, n - 1), "k_pos": (0, n - 1)}, POSITIONS)
        _assert_within(gm, ranges, inputs)


def test_float_results_are_widened_past_rounding():
    def scaled(q_pos, k_pos):
        return (k_pos.float() / 3.0) * 3.0
    gm, ranges = _ranges(scaled, {"q_pos": (0, 10), "k_pos": (0, 10)}, POSITIONS)
    lo, hi = _output_range(ranges, gm)
    assert lo == 0 and 10 < hi < 10.01  # a zero stays exact: rounding errors are relative


def _hstu_code(N: int, buckets: int = 16):
    stamps = torch.zeros(4, dtype=torch.int64)
    return generate(S.get_score_mod(S.hstu_rab_key(N, buckets)), [stamps], [stamps],
                    [torch.zeros(2 * N - 1), torch.zeros(buckets + 1)], backward=True)


def test_hstu_time_lookup_is_generated_without_guards_and_positions_guarded_by_the_launch():
    code = _hstu_code(64)
    forward = "\n".join(code.forward)
    # one guarded lookup (positions), whose wrap and check are GUARDS bits; the time table's
    # lookup is proven in range: no wrap, no check, no out-of-range flag
    assert [g.kind for g in code.guards] == ["wrap", "check"]
    assert forward.count("oob = oob |") == 1 and forward.count("tl.where(ix") == 1
    assert forward.count("if (GUARDS >> ") == 2
    assert "tl.int64" not in forward.split("tl.log")[1]  # the cast after the log is int32
    assert code.guard_bits(64, 4) == 0  # positions < 64: k - q + 63 lies in [0, 126]
    assert code.guard_bits(65, 4) == 0b11  # a longer row could index -1 or 127
    assert code.guard_bits(1, 4) == 0


def test_a_per_head_table_is_guarded_unless_the_launch_has_no_more_heads_than_it():
    def per_head(score, q_pos, k_pos, head, table_0):
        return score + table_0[(k_pos - q_pos + 7, head)]
    code = generate(S.get_score_mod(S.register_score_mod(per_head)), [], [], [torch.zeros(15, 3)], backward=True)
    assert code.guard_bits(8, 3) == 0
    bits = code.guard_bits(8, 4)
    check = next(g for g in code.guards if g.kind == "check")
    assert bits == 1 << check.bit  # the head axis may overflow; no index is negative: no wrap
    assert code.guard_bits(9, 3) & (1 << check.bit)


def test_guard_kinds():
    nodes = fx.Graph()
    i = nodes.placeholder("i")
    assert Guard(0, "wrap", (i,), (5,)).proven({i: (0, 9)})
    assert not Guard(0, "wrap", (i,), (5,)).proven({i: (-1, 3)})
    assert Guard(0, "check", (i,), (5,)).proven({i: (-5, 4)})  # after the wrap
    assert not Guard(0, "check", (i,), (5,)).proven({i: (0, 5)})
    assert not Guard(0, "check", (i,), (5,)).proven({})
    assert math.isfinite(INT64[1])


@pytest.mark.parametrize("fn", [hstu_time_bucket, log1p_bucket])
def test_nan_free_float_intervals_survive_int_to_float_of_the_whole_int64_range(fn):
    gm, ranges = _ranges(fn, {}, SIDES)
    floats = [ranges[n] for n in gm.graph.nodes if n.op != "placeholder" and ranges.get(n) is not None
              and isinstance(ranges[n][0], float)]
    assert floats and all(math.isfinite(lo) and math.isfinite(hi) for lo, hi in floats)
