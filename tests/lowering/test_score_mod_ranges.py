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
    metas = _evaluate(gm, {n.name: torch.zeros(3, dtype=dtypes[n.name]) for n in gm.graph.nodes
                           if n.op == "placeholder"})
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
    # floor(log2(1)) may be -1 for a log2 a few ulps low, sqrt(1) truncate to 0: no exact points assumed
    assert _output_range(ranges, gm) == (-1, 63 + 9)


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
    assert _output_range(ranges, gm) == (0, 4)  # torch's integer % takes the divisor's sign


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
    assert -1e-30 < lo < 0 and 10 < hi < 10.01  # relative errors, and the smallest normal for underflow


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


K = {"k_side_0": torch.int64}


def _rounding_cases():
    """Score_mod pieces whose float32 / bf16 / fp16 rounding leaves the exact-math interval (a
    review's counterexamples): each (function, input values, a value torch computes that the
    interval must hold)."""
    def where_float_constant(k_side_0):
        y = k_side_0.clamp(0, 30).float() / 10.0
        return torch.where(y > 2.99999999, 0.0, y).long()  # 2.99999999 is 3.0 in float32

    def int_compared_with_float(k_side_0):
        x = k_side_0.clamp(16777210, 16777230)
        return torch.where(x < 16777219.5, 16777220, x) - 16777220  # compared in float32

    def clamp_promotes_beyond_2_24(k_side_0):
        return torch.clamp(k_side_0.clamp(2**25 - 3, 2**25 - 1), min=0.5).long() - (2**25 - 3)

    def float_constant_bound(k_side_0):
        return k_side_0.clamp(0, 10).float().clamp(0.0, 2.99999999).long()

    def int_minus_float_constant(k_side_0):
        return (k_side_0.clamp(2**30, 2**30 + 100) - 1073741824.0).long()

    def bf16_cast(k_side_0):
        return k_side_0.clamp(0, 259).to(torch.bfloat16).long()

    def half_cast(k_side_0):
        return (k_side_0.clamp(0, 29999).float() / 1e4).half().long()

    def where_promotes_to_float32(k_side_0):
        return torch.where(k_side_0 > 0, k_side_0.clamp(0, 2**31 - 1), 0.5).long()

    stamps = torch.tensor([0, 3, 29, 30, 259, 2**24 + 3, 2**25 - 1, 2**30 + 100, 29999, 2**31 - 1, 16777219])[None, :]
    return [(where_float_constant, 3), (int_compared_with_float, -1), (clamp_promotes_beyond_2_24, 3),
            (float_constant_bound, 3), (int_minus_float_constant, 128), (bf16_cast, 260), (half_cast, 3),
            (where_promotes_to_float32, 2**31)], stamps


@pytest.mark.parametrize("case", range(8))
def test_intervals_hold_the_value_the_dtype_rounds_to(case):
    cases, stamps = _rounding_cases()
    fn, reached = cases[case]
    gm, ranges = _ranges(fn, {}, K)
    lo, hi = _output_range(ranges, gm)
    assert lo <= reached <= hi, (fn.__name__, (lo, hi))
    _assert_within(gm, ranges, {"k_side_0": stamps})


def test_a_floored_quotient_is_floored_after_the_divisions_rounding():
    """The kernel floors float32(a / b): 3.2999999523 / 1.1000000238 rounds to 3.0, so 3 must be
    in the interval (eager torch's fmod-based floor gives 2)."""
    def floored(k_side_0):
        y = k_side_0.clamp(0, 10).float().clamp(0.0, 3.299999952316284)
        return (y // 1.100000023841858).long()
    gm, ranges = _ranges(floored, {}, K)
    lo, hi = _output_range(ranges, gm)
    assert lo <= 0 and hi >= 3


def test_underflow_to_zero_proves_no_logarithm():
    def tiny_square(k_side_0):
        x = k_side_0.clamp(1, 10).float() * 1e-23
        return torch.log(x * x)  # x * x rounds to 0: log is -inf
    gm, ranges = _ranges(tiny_square, {}, K)
    assert _output_range(ranges, gm) is None


_OPS = ["{a}.abs()", "-{a}", "{a}.long()", "{a}.int()", "{a}.float()", "{a}.to(torch.int16)", "torch.log({a})",
        "torch.log2({a})", "torch.log1p({a})", "torch.exp({a})", "torch.sqrt({a})", "torch.floor({a})",
        "{a}.clamp({c}, {d})", "{a}.clamp(min={c})", "{a}.clamp_max({d})", "torch.where({a} < {c}, {d}, {a})",
        "{a}.masked_fill({a} > {c}, {d})", "{a} // {c}", "{a} % {c}", "torch.remainder({a}, {b})",
        "torch.div({a}, {c}, rounding_mode='trunc')", "{a} / {c}",
        "{a} * {c}", "{a} + {c}", "{c} - {a}", "{a} + {b}", "{a} - {b}", "{a} * {b}", "torch.minimum({a}, {b})",
        "torch.where({a} > {b}, {a}, {b})", "{a}.half()", "{a}.bfloat16()", "torch.sigmoid({a})"]
_CONSTANTS = [0, 1, -1, 3, 0.5, 2.5, 100, 255, 2**24 + 1, 2**31, 0.301, 2.99999999, 16777217.0, 1e-3]
_STAMPS = [0, 1, -1, 2, 3, 100, 2**24 - 1, 2**24 + 1, 2**25 - 1, 2**31 - 1, -(2**31), 2**53 + 1, INT64[0], INT64[1],
           1_700_000_000_000, 255, 256]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_programs_hold_their_intervals(data):
    """Random chains of the ops above over clamped and raw timestamps and positions: every value
    torch computes lies in its node's interval."""
    n = data.draw(st.integers(2, 6))
    names, lines = ["q_pos", "k_pos", "q_side_0", "k_side_0", "s0", "s1"], [
        f"    s0 = q_side_0.clamp({data.draw(st.integers(-50, 0))}, {data.draw(st.integers(1, 300))})",
        f"    s1 = k_side_0.clamp(-40, 40).float() * {data.draw(st.sampled_from([0.1, 0.7, 1.5, 3.0]))!r}"]
    for i in range(n):
        a = data.draw(st.sampled_from(names[-2:] + names))
        b = data.draw(st.sampled_from(names))
        c, d = data.draw(st.sampled_from(_CONSTANTS)), data.draw(st.sampled_from(_CONSTANTS))
        lines.append(f"    v{i} = " + data.draw(st.sampled_from(_OPS)).format(a=a, b=b, c=repr(c), d=repr(d)))
        names.append(f"v{i}")
    scope = {"torch": torch}
    exec("def program(q_pos, k_pos, q_side_0, k_side_0):\n" + "\n".join(lines) + f"\n    return v{n - 1}\n", scope)
    max_len = data.draw(st.sampled_from([1, 5, 64, 2**24]))
    dtypes = {"q_pos": torch.int64, "k_pos": torch.int64, "q_side_0": torch.int64, "k_side_0": torch.int64}
    try:
        gm, ranges = _ranges(scope["program"], {"q_pos": (0, max_len - 1), "k_pos": (0, max_len - 1)}, dtypes)
    except (RuntimeError, TypeError):
        return  # a program torch itself rejects (e.g. an op the dtype lacks)
    positions = st.lists(st.integers(0, max_len - 1), min_size=3, max_size=3)
    stamps = st.lists(st.one_of(st.sampled_from(_STAMPS), st.integers(-1000, 1000)), min_size=3, max_size=3)
    inputs = {"q_pos": torch.tensor(data.draw(positions))[:, None], "k_pos": torch.tensor(data.draw(positions))[None, :],
              "q_side_0": torch.tensor(data.draw(stamps))[:, None], "k_side_0": torch.tensor(data.draw(stamps))[None, :]}
    try:
        _evaluate(gm, inputs)
    except (RuntimeError, TypeError):
        return
    _assert_within(gm, ranges, inputs)
