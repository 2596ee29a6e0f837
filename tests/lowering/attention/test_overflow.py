"""Integer overflow in a score_mod and the CPU reference's compiled chunks
(``grcompile.lowering.attention.overflow``): eager PyTorch wraps, inductor's C++ need not, so a
call whose score_mod may overflow runs the eager chunk — and one that provably does not (HSTU's
time buckets on second or millisecond timestamps) keeps the compiled chunk."""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

from grcompile.lowering import score_mod as S
from grcompile.lowering.attention import chunks, overflow
from grcompile.lowering.attention.overflow import _rounded_out, overflow_reason
from grcompile.lowering.attention.reference import _attention_backward_reference, _attention_reference
from grcompile.lowering.score_mod_codegen import graph_with_metas
from grcompile.lowering.score_mod_ranges import may_wrap, propagate

I32_MAX, I64_MAX = (1 << 31) - 1, (1 << 63) - 1


def int32_step(score, q_pos, k_pos, q_side_0, k_side_0):
    """``ts.int() + 1`` wraps to −2³¹ at 2³¹ − 1 in eager: the comparison is then false."""
    return score + ((q_side_0.int() + 1) > 0).float() * 2.0 - (k_side_0 > 5).float()


def int64_step(score, q_pos, k_pos, q_side_0, k_side_0):
    return score + ((k_side_0 + 1) > 0).float() + ((q_side_0 + 1) > 0).float()


def hstu_buckets(score, q_pos, k_pos, q_side_0, k_side_0, table_0):
    gap = (q_side_0 - k_side_0).abs().clamp(min=1)
    return score + table_0[(torch.log(gap.float()) / 0.301).long().clamp(0, 128)]


def _call(fn, q_side, k_side, tables=(), activation="silu"):
    lengths = [37, 0, 1, 40]
    T = sum(lengths)
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    positions = torch.cat([torch.arange(n) for n in lengths])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, 2, 8, generator=g) for _ in range(3))
    kwargs = dict(score_mod=S.register_score_mod(fn), use_qk=True, activation=activation, scale=0.5, out_scale=1.0,
                  causal=True, max_len=40, dropout_p=0.0)
    return (q, k, v, offsets, positions, [q_side(T, g)], [k_side(T, g)], list(tables), None), kwargs


def _run(args, kwargs, compiled: bool):
    old, chunks.COMPILE_CHUNKS = chunks.COMPILE_CHUNKS, compiled
    try:
        out = _attention_reference(*args, **kwargs)
        grad = torch.ones_like(out)
        return out, _attention_backward_reference(grad, *args, **kwargs)[:3]
    finally:
        chunks.COMPILE_CHUNKS = old


@pytest.mark.parametrize("fn, dtype, big", [(int32_step, torch.int64, I32_MAX), (int64_step, torch.int64, I64_MAX),
                                            (int64_step, torch.int32, I32_MAX)])
def test_overflowing_score_mod_runs_uncompiled_with_eagers_wrapped_values(fn, dtype, big, monkeypatch):
    """Compiled, these differed from eager by up to 17 (inductor computed the unwrapped sum)."""
    monkeypatch.setattr(overflow, "_WARNED", set())  # warned once per score_mod
    def side(T, g):
        return torch.where(torch.rand(T, generator=g) < 0.5, torch.tensor(big), torch.randint(0, 9, (T,), generator=g)
                           ).to(dtype)
    args, kwargs = _call(fn, side, side)
    assert "may overflow" in overflow_reason(kwargs["score_mod"], args[5], args[6], [], max_len=40, heads=2)
    with pytest.warns(UserWarning, match="runs it uncompiled"):
        got = _run(args, kwargs, compiled=True)
    want = _run(args, kwargs, compiled=False)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_score_mods_that_cannot_overflow_keep_the_compiled_chunk():
    """HSTU's bucketed gap on epoch seconds and milliseconds, and the wrapping score_mods on small
    values: proven, no warning."""
    table = torch.randn(129)
    for scale in (1, 1000):
        def stamps(T, g, scale=scale):
            return 1_700_000_000 * scale + torch.randint(0, 10 ** 6, (T,), generator=g)
        args, kwargs = _call(hstu_buckets, stamps, stamps, [table])
        assert overflow_reason(kwargs["score_mod"], args[5], args[6], args[7], max_len=40, heads=2) is None
    for fn in (int32_step, int64_step):
        args, kwargs = _call(fn, lambda T, g: torch.arange(T), lambda T, g: -torch.arange(T))
        assert overflow_reason(kwargs["score_mod"], args[5], args[6], [], max_len=40, heads=2) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _attention_reference(*args, **kwargs)


def test_may_wrap_lists_unproven_integer_arithmetic_only():
    def fn(score, q_pos, k_pos, q_side_0, k_side_0):
        widened = q_side_0.long()  # int32 -> int64: exact
        same = k_side_0.int()  # int32 -> int32: exact
        return score + ((widened * 3 + same) > 0).float() + (k_pos - q_pos).float()
    i32 = torch.zeros(3, dtype=torch.int32)
    gm, metas = graph_with_metas(S.get_score_mod(S.register_score_mod(fn)), [i32], [i32], [])
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # whole int32 sides: int64 arithmetic on them cannot overflow, positions below 2^24 neither
    assert may_wrap(gm, metas, propagate(gm, metas, {ph[1]: (0, 1 << 24), ph[2]: (0, 1 << 24)})) == []
    # nothing proven about positions: their difference may
    assert [n.name for n in may_wrap(gm, metas, propagate(gm, metas, {}))] == ["sub"]


@settings(max_examples=200, deadline=None)
@given(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-(1 << 63), (1 << 63) - 1))
def test_rounded_bounds_contain_the_values_and_stay_in_the_dtype(a, b):
    lo, hi = min(a, b), max(a, b)
    r_lo, r_hi = _rounded_out(lo, hi)
    assert -(1 << 63) <= r_lo <= lo <= hi <= r_hi <= (1 << 63) - 1
    if -(1 << 31) <= lo and hi < (1 << 31):
        assert -(1 << 31) <= r_lo and r_hi < (1 << 31)
