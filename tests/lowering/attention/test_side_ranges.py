"""int64 side tensors measured per call (``side_ranges.int64_side_ranges``) and the int32 kernel
variant they select: the kernel equals the reference on timestamps at the edges of each int32
class and just beyond them (where the variant that holds every int64 must run), and a side
written in place between calls is measured again."""
from __future__ import annotations

import pytest
import torch

from grcompile.lowering import score_mod as S
from grcompile.lowering.attention.side_ranges import INT32_CLASSES, int64_side_ranges, measured_sides

from .test_triton import DEVICE, _assert_match, _case, at  # noqa: F401 - the interpreter set-up

NON_NEGATIVE, CENTRED = INT32_CLASSES
I32_MAX = (1 << 31) - 1


def test_each_int64_side_gets_the_narrowest_class_holding_its_values():
    small = torch.tensor([5, 0, I32_MAX])
    centred = torch.tensor([-(1 << 30), (1 << 30) - 1])
    ms = torch.tensor([1_700_000_000_000, 1_700_000_000_001])
    assert int64_side_ranges([small, centred], [ms, torch.tensor([-(1 << 30) - 1, 0])]) == \
        (NON_NEGATIVE, CENTRED, None, None)
    assert int64_side_ranges([torch.tensor([0, I32_MAX + 1])], []) == (None,)
    # other dtypes and empty sides are not measured
    assert int64_side_ranges([torch.tensor([1, 2], dtype=torch.int32), torch.zeros(0, dtype=torch.int64)],
                             [torch.ones(3)]) == (None, None, None)


def test_every_call_measures_its_sides_and_the_op_measures_once_per_call():
    """Nothing is kept across calls (values can change without the version counter moving:
    ``t.data = ...``); inside :func:`measured_sides` the kernel reuses the op's measurement of the
    very same tensors, and measures other tensors itself."""
    stamps = torch.tensor([1, 2, 3])
    assert int64_side_ranges([stamps], [stamps]) == (NON_NEGATIVE, NON_NEGATIVE)
    stamps.data = torch.tensor([1 << 40, 1, 2])  # no version bump
    assert stamps._version == 0 and int64_side_ranges([stamps], [stamps]) == (None, None)
    other = torch.tensor([5, 6, 7])
    with measured_sides([stamps], [other]) as ranges:
        assert ranges == (None, NON_NEGATIVE)
        stamps.data = torch.tensor([1, 2, 3])  # inside one call the op's measurement stands
        assert int64_side_ranges([stamps], [other]) == (None, NON_NEGATIVE)
        assert int64_side_ranges([other], [stamps]) == (NON_NEGATIVE, NON_NEGATIVE)  # other tensors: measured
    with measured_sides([stamps], [], enabled=False) as ranges:
        assert ranges == (None,)
    # sides on two devices are not measured (the op's checks reject the call by name)
    assert int64_side_ranges([other], [other.to("meta")]) == (None, None)


def test_inference_mode_and_threads():
    """Inference tensors (no version counter) and concurrent calls: nothing is shared to race on."""
    import threading
    with torch.inference_mode():
        stamps = torch.arange(5)
        assert int64_side_ranges([stamps], [stamps]) == (NON_NEGATIVE, NON_NEGATIVE)
    errors = []

    def work(seed):
        try:
            for i in range(200):
                t = torch.arange(seed, seed + 4) * (1 if i % 2 else 1 << 33)
                assert int64_side_ranges([t], []) == ((NON_NEGATIVE,) if i % 2 else (None,))
        except Exception as error:  # noqa: BLE001
            errors.append(error)
    threads = [threading.Thread(target=work, args=(s,)) for s in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def signed_gap(score, q_pos, k_pos, q_side_0, k_side_0):
    """Wrapping anywhere in the gap's arithmetic flips these: the sign, the floored quotient."""
    gap = k_side_0 - q_side_0
    return score + (gap > 0).float() + (gap // 1_000_000_000).float() + (gap.abs() % 7).float() * 0.1


STAMP_SETS = {
    "non_negative_edges": ([0, I32_MAX], NON_NEGATIVE),
    "centred_edges": ([-(1 << 30), (1 << 30) - 1], CENTRED),
    "one_past_int32": ([0, I32_MAX + 1], None),
    "milliseconds": ([1_700_000_000_000, 1_700_000_000_000 + (1 << 33)], None),
    "negative_past_centred": ([-(1 << 30) - 1, 3], None),
}


@pytest.mark.parametrize("name", sorted(STAMP_SETS))
@pytest.mark.parametrize("bias", ["signed_gap", "hstu"])
def test_kernel_equals_reference_at_and_beyond_each_class_edge(name, bias):
    values, expected = STAMP_SETS[name]
    (q, k, v, offsets, positions, q_side, k_side, tables, seed), kwargs = _case([7, 0, 1, 9], 2, 8, 8, "silu",
                                                                                 True, 0.0, "hstu", 3)
    T = q.shape[0]
    gen = torch.Generator().manual_seed(11)
    lo, hi = values
    near = torch.randint(0, 3, (T,), generator=gen)
    # each row mixes both extremes: gaps of the whole span, both signs
    stamps = torch.where(torch.randint(0, 2, (T,), generator=gen) == 1, hi - near, lo + near)
    stamps[0], stamps[-1] = lo, hi
    stamps = stamps.to(DEVICE)
    if bias == "signed_gap":
        kwargs["score_mod"], tables = S.register_score_mod(signed_gap), []
    args = (q, k, v, offsets, positions, [stamps], [stamps.flip(0).contiguous()], tables, seed)
    assert int64_side_ranges(args[5], args[6]) == (expected, expected)
    variant = at._variant(args[5], args[6], tables, kwargs["score_mod"], "silu", True, True, False)
    _, code = at.kernels_for(variant, args[5], args[6], tables)
    assert code.int32_sides == ([] if expected is None else ["ks0", "qs0"])
    _assert_match(args, kwargs)


def test_values_replaced_without_a_version_bump_run_the_int64_variant():
    """A call in seconds, then the same tensor objects refilled with milliseconds through
    ``.data`` (no version bump): the second call measures again and equals the reference; and the
    op itself runs under ``torch.inference_mode``."""
    args, kwargs = _case([6, 1, 8], 2, 8, 8, "silu", True, 0.0, "hstu", 5)
    q, k, v, offsets, positions, q_side, k_side, tables, seed = args
    _assert_match(args, kwargs)
    for side in (*q_side, *k_side):
        side.data = side.data * 1000 + 1_700_000_000_000
    assert int64_side_ranges(q_side, k_side) == (None, None)
    _assert_match(args, kwargs)
    from grcompile.lowering import use_backend
    with torch.inference_mode(), use_backend("triton"):
        out = torch.ops.grcompile.jagged_attention(*args, **kwargs)
    from grcompile.lowering.attention import reference as ref
    torch.testing.assert_close(out, ref._attention_reference(*args, **kwargs), rtol=1e-4, atol=1e-5)
