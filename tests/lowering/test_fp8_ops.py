"""The FP8 ops' reference numerics (grcompile.lowering.fp8): row-wise e4m3 quantisation within its
rounding bound, the fused norm + quantisation equal to its two steps, the GEMM within the
propagated e4m3 bound of the exact product, and the backward equal to its formula."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from grcompile.lowering.fp8 import FP8_MAX, dequantize, quantize_rowwise
from grcompile.lowering.norm import _gated_norm_reference

from tests.lowering import PROFILE

SETTINGS = settings(parent=settings.get_profile(PROFILE))


def rounding_bound(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest |dequantize(quantize(v)) − v| e4m3 round-to-nearest allows per element: half an ulp,
    2⁻⁴·|z| for normals (z = v / scale), 2⁻¹⁰ in the subnormal range (|z| < 2⁻⁶), plus the float32
    rounding of z."""
    z = v.double().abs() / scale.double()
    return (torch.maximum(z * 2.0 ** -4, torch.full_like(z, 2.0 ** -10)) + z * 2.0 ** -22) * scale.double()


def e4m3_round(z: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e4m3 grid (3 mantissa bits, min normal 2⁻⁶, saturating at
    448), in float64: an oracle independent of torch's float8 conversion."""
    z = z.double().clamp(-FP8_MAX, FP8_MAX)
    exponent = torch.floor(torch.log2(z.abs().clamp_min(2.0 ** -6)))
    ulp = 2.0 ** (exponent - 3)
    return torch.round(z / ulp) * ulp  # torch.round: half to even


@SETTINGS
@given(rows=st.integers(0, 5), cols=st.integers(1, 40), exponent=st.integers(-20, 20), seed=st.integers(0, 2**16))
def test_quantize_within_half_an_ulp(rows: int, cols: int, exponent: int, seed: int) -> None:
    v = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 2.0 ** exponent
    v[::3, 0] = 0.0  # some exact zeros
    q, scale = quantize_rowwise(v)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (rows, 1) and scale.dtype == torch.float32
    err = (dequantize(q, scale).double() - v.double()).abs()
    assert bool((err <= rounding_bound(v, scale)).all())
    nonzero = v.abs().amax(dim=-1) > 0
    assert bool((q.float().abs().amax(dim=-1)[nonzero] == FP8_MAX).all())  # the row's amax uses the full range
    assert torch.equal(scale, v.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / torch.tensor(FP8_MAX))
    amax = v.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    assert torch.equal(q.double(), e4m3_round(v.float() * (torch.full_like(amax, FP8_MAX) / amax)))


def test_quantize_zero_rows_nan_and_half_inputs() -> None:
    v = torch.tensor([[0.0, 0.0, 0.0], [1.0, float("nan"), 2.0], [3.0, -1.5, 0.25]])
    q, scale = quantize_rowwise(v)
    assert bool((q[0].float() == 0).all()) and bool(torch.isfinite(scale[0]).all()) and scale[0].item() > 0
    assert bool(torch.isnan(dequantize(q, scale)[1]).all())  # a NaN is not hidden
    assert bool(torch.isfinite(dequantize(q, scale)[2]).all())
    qb, sb = quantize_rowwise(v[2:].bfloat16())
    assert torch.equal(qb.float(), q[2:].float()) and torch.equal(sb, scale[2:])  # exact bf16 values, same codes


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
def test_norm_quant_is_quantize_of_the_norm_bit_for_bit(kind: str, dtype: torch.dtype, gated: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 48, generator=g).to(dtype)
    u = torch.randn(7, 3, 48, generator=g).to(dtype) if gated else None
    q, scale = torch.ops.grcompile.norm_quant_fp8(x, u, kind=kind, eps=1e-6)
    q_ref, scale_ref = quantize_rowwise(_gated_norm_reference(x, u, kind=kind, eps=1e-6))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)


def _gemm_bound(n: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|fp8 GEMM − exact GEMM| ≤ Σ_k |δn||w| + |n||δw| + |δn||δw| (+ float32 summation slack)."""
    qn, sn = quantize_rowwise(n)
    qw, sw = quantize_rowwise(w)
    dn, dw = rounding_bound(n, sn), rounding_bound(w, sw)
    n64, w64 = n.double().abs(), w.double().abs()
    slack = (n64 @ w64.t()) * n.shape[-1] * 2.0 ** -23
    return dn @ w64.t() + n64 @ dw.t() + dn @ dw.t() + slack


@SETTINGS
@given(m=st.integers(0, 9), k=st.integers(1, 50), n=st.integers(1, 20), residual=st.booleans(),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_fp8_linear_within_e4m3_rounding_of_the_exact_gemm(m, k, n, residual, bias, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    r = torch.randn(m, n, generator=g) if residual else None
    y = torch.ops.grcompile.fp8_linear(x, None, w, b, r, norm="none", eps=0.0, out_dtype=torch.float32)
    exact = x.double() @ w.double().t() + (b.double() if bias else 0) + (r.double() if residual else 0)
    assert bool(((y.double() - exact).abs() <= _gemm_bound(x, w) + exact.abs() * 2.0 ** -23).all())


def test_fp8_linear_backward_is_its_formula() -> None:
    """dx, du: the unquantised function's gradient (straight through); dweight: dyᵀ @ the unquantised
    input; dbias: Σ dy; dresidual: dy — against float64 autograd."""
    g = torch.Generator().manual_seed(1)
    x, u = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g)
    w, b, r = torch.randn(16, 32, generator=g), torch.randn(16, generator=g), torch.randn(6, 16, generator=g)
    dy = torch.randn(6, 16, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, u, w, b, r)]
    y = torch.ops.grcompile.fp8_linear(*leaves, norm="rms", eps=1e-6, out_dtype=torch.float32)
    y.backward(dy)
    got = [t.grad for t in leaves]

    x64, u64, w64 = (t.double().requires_grad_() for t in (x, u, w))
    n64 = u64 * F.rms_norm(x64, (32,), eps=1e-6)
    (n64 @ w64.t().detach()).backward(dy.double())
    n = (u * F.rms_norm(x, (32,), eps=1e-6)).double()  # unquantised: torchao's rowwise_with_gw_hp
    want = [x64.grad, u64.grad, dy.double().t() @ n, dy.double().sum(0), dy.double()]
    for name, a, e in zip(("x", "u", "weight", "bias", "residual"), got, want):
        torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-5, msg=name)


def test_bad_inputs_name_the_argument() -> None:
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="weight must be \\[N, K=16\\]"):
        torch.ops.grcompile.fp8_linear(x, None, w.t(), None, None, norm="none", eps=0.0, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="residual must be a float \\(4, 8\\)"):
        torch.ops.grcompile.fp8_linear(x, None, w, None, torch.randn(4, 1), norm="none", eps=0.0,
                                       out_dtype=torch.float32)
    with pytest.raises(ValueError, match="norm must be one of"):
        torch.ops.grcompile.fp8_linear(x, None, w, None, None, norm="batch", eps=0.0, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="x must be float32 / bfloat16 / float16"):
        torch.ops.grcompile.fp8_linear(x.double(), None, w, None, None, norm="none", eps=0.0, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="quantize_fp8: v must have at least one dimension"):
        torch.ops.grcompile.quantize_fp8(torch.tensor(1.0))
