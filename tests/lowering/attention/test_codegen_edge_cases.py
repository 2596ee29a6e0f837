"""Edge cases of the score_mod -> Triton generator a fuzzing review found (float floor division,
gradients of 0-d fill values, results along one role only, non-finite constants, bool / unsigned
operands, NaN / inf semantics, constant tables captured from the enclosing scope): the kernels
equal the reference in values and every gradient, and run them (no handoff), unless a case says
the generator hands it to the reference with a reason."""
from __future__ import annotations

import warnings

import pytest
import torch

from grcompile.lowering import OPS
from grcompile.lowering import score_mod as S

from .test_triton import DEVICE, _assert_match, _case, at  # noqa: F401 - the interpreter set-up

LENGTHS = [7, 1, 0, 4]  # 12 tokens
FLOATS = torch.tensor([1.0, 0.3, -1.0, 0.7, 2.0, -0.2, 0.5, 1.5, -3.0, 0.05, 0.6, 0.0])


def _check(fn, q_side=(), k_side=(), tables=(), activation="silu", causal=True, use_qk=True, fallback=None):
    """Kernel vs reference for ``fn`` on these sides / tables; ``fallback``: a text the handoff's
    reason must contain (else the kernels must run it, with no fallback warning)."""
    key = S.register_score_mod(fn)
    args, kwargs = _case(LENGTHS, 2, 8, 8, activation, causal, 0.0, "none", 3, use_qk=use_qk)
    args = (*args[:5], [t.to(DEVICE) for t in q_side], [t.to(DEVICE) for t in k_side],
            [t.to(DEVICE) for t in tables], args[8])
    kwargs["score_mod"] = key
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if fallback else "error")
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's, in the interpreter, on NaN / inf lanes
        _assert_match(args, kwargs, fallback=bool(fallback))
    if fallback:
        assert fallback in OPS["jagged_attention"].fallbacks[key]
    else:
        assert key not in OPS["jagged_attention"].fallbacks


# -- 1. float floor division: torch floors like Python, through fmod (1.0 // 0.1 == 9) ----------------


# (a float side that requires a gradient is divided with rounding_mode="floor": eager torch has
# no derivative for floor_divide, so `side // 0.1` cannot be differentiated by the reference)
def float_floordiv_by_a_tenth(score, q_pos, k_pos, k_side_0):
    return (score + torch.div(k_side_0, 0.1, rounding_mode="floor") + torch.div(k_side_0, -0.3, rounding_mode="floor")
            + (k_pos * 0.1) // 0.1 + (q_pos - k_pos) * 0.7 // 0.7)


def int_floordiv_by_a_float(score, q_pos, k_pos, k_side_0):
    return score + k_side_0 // 1e-3 + torch.floor_divide(k_side_0, 0.3) + k_side_0.float() // -0.1


def half_floordiv(score, q_pos, k_pos, q_side_0, k_side_0):
    return (score + torch.div(k_side_0, q_side_0, rounding_mode="floor").float()
            + torch.div(k_side_0, 0.1, rounding_mode="floor").float())


def test_float_floor_division_floors_like_torch():
    _check(float_floordiv_by_a_tenth, k_side=[FLOATS.clone()])
    _check(int_floordiv_by_a_float, k_side=[torch.tensor([5, 1, -3, 7, 0, 9, 2, 3, -6, 1, 10, 4])])
    half = torch.tensor([1.0, 0.3, -1.0, 0.7, 2.0, -0.2, 0.5, 1.5, -3.0, 0.05, 0.6, 0.9], dtype=torch.float16)
    _check(half_floordiv, q_side=[(half * 0 + 0.1).flip(0)], k_side=[half])


# -- 2. a 0-d tensor fill value / where operand receives its gradient -----------------------------------


def learned_future_score(score, q_pos, k_pos, table_0):
    return score.masked_fill(k_pos > q_pos, table_0)


def learned_future_score_keyword(score, q_pos, k_pos, table_0):
    return score.masked_fill(k_pos > q_pos, value=table_0 * 2.0)


def where_with_tables(score, q_pos, k_pos, table_0, table_1):
    return torch.where(k_pos > q_pos, table_0, score) + torch.where(k_pos > q_pos + 1, score, table_1[k_pos])


@pytest.mark.parametrize("fn, tables", [
    (learned_future_score, [torch.tensor(0.7)]), (learned_future_score_keyword, [torch.tensor(-0.4)]),
    (where_with_tables, [torch.tensor(0.7), torch.randn(7, generator=torch.Generator().manual_seed(0))])])
def test_tensor_fill_values_and_where_operands_get_their_gradient(fn, tables):
    _check(fn, tables=tables, causal=False)


# -- 3. a result that varies along the keys only, the queries only or neither --------------------------


def item_logit(score, q_pos, k_pos, k_side_0):
    return k_side_0


def key_position_weight(score, q_pos, k_pos, table_0):
    return table_0[k_pos]


def query_side_only(score, q_pos, k_pos, q_side_0):
    return q_side_0 * 2.0


def head_weight(score, q_pos, k_pos, head, table_0):
    return table_0[head] * 0.5


def scalar_weight(score, q_pos, k_pos, table_0):
    return table_0 * 3.0


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_results_along_one_role_or_none_get_their_gradients(activation):
    _check(item_logit, k_side=[FLOATS.clone()], activation=activation, use_qk=False)
    _check(key_position_weight, tables=[FLOATS[:7].clone()], activation=activation, use_qk=False)
    _check(query_side_only, q_side=[FLOATS.flip(0)], activation=activation)
    _check(head_weight, tables=[torch.tensor([0.3, -1.2])], activation=activation, use_qk=False)
    _check(scalar_weight, tables=[torch.tensor(0.8)], activation=activation)


# -- 4. non-finite constants reach the kernel source as valid Triton ------------------------------------


NEG_INF = torch.tensor(float("-inf"))


def full_like_inf(score, q_pos, k_pos):
    return torch.where(k_pos <= q_pos, score, torch.full_like(score, float("-inf")))


def where_tensor_inf(score, q_pos, k_pos):
    return torch.where(k_pos <= q_pos, score, NEG_INF)


def masked_fill_tensor_inf(score, q_pos, k_pos):
    return score.masked_fill(k_pos > q_pos, NEG_INF)


@pytest.mark.parametrize("fn", [full_like_inf, where_tensor_inf, masked_fill_tensor_inf])
def test_non_finite_constants_run_in_the_kernel(fn):
    _check(fn, activation="softmax", causal=False)


# -- 5. bool operands of integer arithmetic; integer bounds given as keywords -----------------------------


def bool_mod(score, q_pos, k_pos, k_side_0):
    return score + ((k_pos > q_pos) % 2).float() + (k_side_0 // 2).float() + (k_side_0 * 3 - 1).float()


def uint8_clamp_wrapped(score, q_pos, k_pos, k_side_0):
    return score + torch.clamp(k_side_0, min=-5, max=5).float()  # torch wraps -5 into uint8: 251


def uint8_clamp_keywords(score, q_pos, k_pos, k_side_0):
    return score + torch.clamp(k_side_0, min=2, max=100).float() + k_side_0.clamp(max=7).float()


BOOLS = torch.tensor([True, False, True, True, False, False, True, False, True, True, False, True])
BYTES = torch.tensor([200, 3, 7, 0, 255, 1, 2, 99, 100, 101, 6, 8], dtype=torch.uint8)


def test_bool_operands_are_promoted_and_wrapped_keyword_constants_run_the_reference():
    _check(bool_mod, k_side=[BOOLS])
    _check(uint8_clamp_keywords, k_side=[BYTES])
    _check(uint8_clamp_wrapped, k_side=[BYTES], fallback="wraps")


# -- 6. NaN and inf as torch treats them ------------------------------------------------------------------


def _nan_to_three(x):
    return torch.where(x != x, 3.0, x)


def min_max_of_nan(score, q_pos, k_pos, k_side_0):
    a, zero = torch.log(k_side_0), torch.zeros_like(k_side_0)  # log(-1) is NaN
    return (score + _nan_to_three(torch.minimum(a, zero)) + _nan_to_three(torch.maximum(zero, a))
            + _nan_to_three(torch.max(a, zero * 0.5)))


def relu_of_nan(score, q_pos, k_pos, k_side_0):
    return score + _nan_to_three(torch.relu(torch.log(k_side_0))) + _nan_to_three(torch.log(k_side_0).relu())


def clamp_by_nan(score, q_pos, k_pos, k_side_0):
    return score + _nan_to_three(k_side_0.clamp(min=float("nan"))) + _nan_to_three(k_side_0.clamp(max=k_side_0.log()))


def log1p_of_inf(score, q_pos, k_pos, k_side_0):
    return score + torch.log1p(k_side_0 * 1e30 * 1e30).clamp(max=5.0)  # log1p(inf) is inf


WITH_NEGATIVES = FLOATS.masked_fill(FLOATS == 0, 0.25)  # their log is NaN (and no log(0) = -inf)


@pytest.mark.parametrize("fn, k_side", [(min_max_of_nan, WITH_NEGATIVES), (relu_of_nan, WITH_NEGATIVES),
                                        (clamp_by_nan, WITH_NEGATIVES),
                                        (log1p_of_inf, torch.tensor([0, 1, 2, 0, 3, 1, 0, 0, 5, 1, 1, 0]))])
def test_nan_and_inf_propagate_as_in_torch(fn, k_side):
    _check(fn, k_side=[k_side.clone()])


# -- 7. a constant table captured from the enclosing scope, indexed with a tensor -------------------------


BUCKET_OF_GAP = torch.tensor([0, 1, 2, 3, 4, 4, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7])


def fixed_buckets(score, q_pos, k_pos, table_0):
    return score + table_0[BUCKET_OF_GAP[(q_pos - k_pos).abs().clamp(max=15)]]


def test_a_captured_constant_table_runs_in_the_kernel():
    _check(fixed_buckets, tables=[torch.randn(8, generator=torch.Generator().manual_seed(1))])
