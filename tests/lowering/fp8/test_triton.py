"""The Triton kernels of the FP8 ops (grcompile.lowering.fp8.triton), run on CPU tensors by Triton's
interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py before Triton is imported), through
the custom ops with ``use_backend("triton")``:

- ``norm_quant_fp8`` equals ``quantize_rowwise(gated_norm)`` (gated_norm's Triton kernel) bit for
  bit, on random shapes (no rows, one row, D = 1, odd D), layouts, dtypes, kinds, zero rows;
- the kernel's integer e4m3 rounding equals torch's cast on every tie and its neighbours;
- ``scaled_linear_fp8`` equals the reference up to float32 summation order (bound below), and
  stays within the propagated e4m3 rounding of a bf16 ``linear(x, w)``;
- both kernels' AOT configs compile for sm_90 without spills, the GEMM with e4m3 ``wgmma``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from grcompile.lowering import OPS, use_backend
from grcompile.lowering.fp8 import FP8_DTYPE, _scaled_linear_reference, quantize_rowwise
from grcompile.lowering.fp8 import triton as fp8_triton
from grcompile.lowering.norm.triton import MAX_D

from tests.lowering import PROFILE
from tests.lowering.norm.test_triton import LAYOUTS

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1 set before Triton is imported")

SETTINGS = settings(parent=settings.get_profile(PROFILE))
SLOW = settings(parent=settings.get_profile("lowering-slow"))
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


# ---- norm_quant_fp8 ---------------------------------------------------------------------------


def norm_quant_both(x: torch.Tensor, u, kind: str, eps: float):
    """``(kernel [q, scale], quantize_rowwise(gated_norm))``, both ops under the Triton backend."""
    with use_backend("triton"):
        got = torch.ops.grcompile.norm_quant_fp8(x, u, kind=kind, eps=eps)
        want = quantize_rowwise(torch.ops.grcompile.gated_norm(x, u, kind=kind, eps=eps))
    return got, want


def check_norm_quant(shape, D, dtype, kind, gated, x_layout, u_layout, zero_row, eps, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    full = (*shape, D)
    x = (torch.randn(full, generator=g) * 3 + 1).to(dtype)
    if zero_row and x.numel():
        x.view(-1, D)[0] = 0.0  # a zero row: norm 0, amax floored
    x = LAYOUTS[x_layout](x)
    u = LAYOUTS[u_layout](torch.randn(full, generator=g).to(dtype)) if gated else None
    (q, scale), (q_ref, scale_ref) = norm_quant_both(x, u, kind, eps)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (*shape, 1) and scale.is_contiguous()
    assert torch.equal(bits(q), bits(q_ref))
    assert torch.equal(scale, scale_ref)


norm_cases = dict(shape=st.lists(st.sampled_from([0, 1, 2, 3, 5]), min_size=0, max_size=3),
                  D=st.sampled_from([1, 3, 37, 64, 100]), dtype=st.sampled_from(DTYPES),
                  kind=st.sampled_from(["layer", "rms"]), gated=st.booleans(),
                  x_layout=st.sampled_from(list(LAYOUTS)), u_layout=st.sampled_from(list(LAYOUTS)),
                  zero_row=st.booleans(), eps=st.sampled_from([1e-5, 1e-6, 0.1]), seed=st.integers(0, 2**16))


@given(**norm_cases)
@SETTINGS
def test_norm_quant_is_quantize_of_the_triton_norm_bit_for_bit(**kw) -> None:
    check_norm_quant(**kw)


@pytest.mark.slow
@given(**norm_cases)
@SLOW
def test_norm_quant_is_quantize_of_the_triton_norm_bit_for_bit_slow(**kw) -> None:
    check_norm_quant(**kw)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_quant_bit_for_bit_on_many_rows(dtype, kind, gated) -> None:
    """Every dtype / kind / gate on 54 rows of 100: enough values on e4m3 rounding boundaries that
    a one-ulp difference in the norm (a rounding left out) changes codes; the random cases above
    are small and rarely do."""
    check_norm_quant((6, 9), 100, dtype, kind, gated, "transposed", "contiguous", True, 1e-5, 1)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (2, 0, 4), (0,), (1, 7)])
def test_norm_quant_empty_and_one_row(shape) -> None:
    """No rows or D = 0 launch nothing (D = 0: the floor scale); a single row runs the kernel."""
    x = torch.randn(shape)
    (q, scale), (q_ref, scale_ref) = norm_quant_both(x, x, "layer", 1e-5)
    assert torch.equal(bits(q), bits(q_ref)) and torch.equal(scale, scale_ref)


def test_norm_quant_nan_row_stays_nan() -> None:
    """A NaN in a row makes its amax, scale and codes NaN (torch.amax's rule), other rows unchanged."""
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    x[1, 5] = float("nan")
    (q, scale), (q_ref, scale_ref) = norm_quant_both(x, None, "rms", 1e-6)
    assert bool(scale[1].isnan().all()) and bool(q[1].float().isnan().all()) and bool(scale_ref[1].isnan().all())
    keep = torch.tensor([True, False, True])
    assert torch.equal(bits(q[keep]), bits(q_ref[keep])) and torch.equal(scale[keep], scale_ref[keep])


def test_norm_quant_wide_rows_fall_back() -> None:
    """D > MAX_D runs the reference, counted as such and warned once."""
    x = torch.randn(2, MAX_D + 1, generator=torch.Generator().manual_seed(0))
    calls = OPS["norm_quant_fp8"].calls
    before = calls["triton"], calls["reference"]
    with pytest.warns(UserWarning, match="does not run this call"):
        OPS["norm_quant_fp8"].fallbacks.pop(f"D={MAX_D + 1}", None)
        (q, scale), (q_ref, scale_ref) = norm_quant_both(x, None, "layer", 1e-5)
    assert (calls["triton"], calls["reference"]) == (before[0], before[1] + 1)
    assert torch.equal(bits(q), bits(q_ref)) and torch.equal(scale, scale_ref)


def test_triton_backend_runs_the_kernels() -> None:
    calls = OPS["norm_quant_fp8"].calls, OPS["scaled_linear_fp8"].calls
    before = [c["triton"] for c in calls]
    x, w = torch.randn(4, 32), torch.randn(8, 32)
    with use_backend("triton"):
        q, scale = torch.ops.grcompile.norm_quant_fp8(x, None, kind="rms", eps=1e-6)
        torch.ops.grcompile.scaled_linear_fp8(q, scale, w, None, None, out_dtype=torch.float32)
    assert [c["triton"] for c in calls] == [b + 1 for b in before]


# ---- the integer e4m3 rounding (the interpreter's and sm_80's path) ----------------------------

@triton.jit
def _convert(V, Q, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(V + i, mask=i < n)
    tl.store(Q + i, fp8_triton._e4m3_bits(v, False), mask=i < n)


def test_integer_e4m3_rounding_matches_torch() -> None:
    """Every finite e4m3 value, every midpoint between neighbours (ties: to even) and the float32
    next to each, both signs, plus random values over 2**-30 ... 2**9 clamped to ±448."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, grid, torch.tensor([2.0 ** -10, 2.0 ** -11, 1e-30, 1e-40, 447.9, 448.0])])
    near = torch.cat([near, torch.nextafter(near, torch.tensor(0.0)), torch.nextafter(near, torch.tensor(1e3))])
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(20000, generator=g) * 2.0 ** torch.randint(-30, 10, (20000,), generator=g).float()
    v = torch.cat([near, -near, rand]).clamp(-448, 448)
    q = torch.empty(v.shape, dtype=torch.uint8)
    _convert[(triton.cdiv(v.numel(), 4096),)](v, q, v.numel(), BLOCK=4096)
    want = bits(v.to(FP8_DTYPE))
    assert torch.equal(q, want), v[q != want][:8]


# ---- scaled_linear_fp8 ------------------------------------------------------------------------


def summation_bound(q, scale, weight, bias, residual, out_dtype) -> torch.Tensor:
    """|kernel − reference| allowed when only float32 summation order differs: two orders of a
    K-term sum of exact products differ by ≤ 2(K−1)·2⁻²⁴·Σ|terms|; the epilogue (scale, + bias,
    + residual) adds ≤ 2⁻²⁴ of each intermediate per rounding (4 more terms of the magnitude bound
    ``mag``); a bf16 output may round the two float32 values to neighbouring bf16s (≤ 2⁻⁷ relative;
    the interpreter truncates where the GPU rounds to nearest)."""
    wq, wscale = quantize_rowwise(weight)
    K = q.shape[-1]
    mag = (q.double().abs() @ wq.double().abs().t()) * (scale.double() * wscale.double().t())
    if bias is not None:
        mag = mag + bias.double().abs()
    if residual is not None:
        mag = mag + residual.double().abs()
    tol = mag * (2 * K + 4) * 2.0 ** -24
    if out_dtype == torch.bfloat16:
        tol = tol + (mag + tol) * 2.0 ** -7
    return tol


def check_linear(lead, K, N, has_bias, res_layout, out_dtype, w_dtype, q_layout, seed, fp8_dot=True) -> None:
    """The op under the Triton backend (the e4m3 dot), or with ``fp8_dot=False`` the launch of the
    sm_80 path (codes decoded to fp16 before the dot), against the reference."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=g) * 4
    q, scale = quantize_rowwise(x)
    if q_layout == "transposed" and q.dim() >= 3:  # same values, non-contiguous leading dims
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
    weight = torch.randn(N, K, generator=g).to(w_dtype)
    bias = torch.randn(N, generator=g).to(w_dtype) if has_bias else None
    residual = None if res_layout is None else LAYOUTS[res_layout](torch.randn(*lead, N, generator=g).to(out_dtype))
    if fp8_dot:
        with use_backend("triton"):
            y = torch.ops.grcompile.scaled_linear_fp8(q, scale, weight, bias, residual, out_dtype=out_dtype)
    else:
        y = fp8_triton.scaled_linear_fp8_launch(q, scale, weight, bias, residual, out_dtype=out_dtype, fp8_dot=False,
                                                interpreted=True)
    want = _scaled_linear_reference(q, scale, weight, bias, residual, out_dtype=out_dtype)
    assert y.shape == want.shape and y.dtype == out_dtype and y.is_contiguous()
    err = (y.double() - want.double()).abs()
    assert bool((err <= summation_bound(q, scale, weight, bias, residual, out_dtype)).all()), err.max()


linear_cases = dict(lead=st.lists(st.sampled_from([0, 1, 2, 3, 5]), min_size=1, max_size=3),
                    K=st.sampled_from([1, 5, 32, 33, 100]), N=st.sampled_from([1, 7, 16, 33, 70]),
                    has_bias=st.booleans(), res_layout=st.sampled_from([None, *LAYOUTS]),
                    out_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
                    w_dtype=st.sampled_from(DTYPES), q_layout=st.sampled_from(["contiguous", "transposed"]),
                    seed=st.integers(0, 2**16), fp8_dot=st.booleans())


@given(**linear_cases)
@SETTINGS
def test_scaled_linear_matches_reference_up_to_summation_order(**kw) -> None:
    check_linear(**kw)


@pytest.mark.slow
@given(**linear_cases)
@SLOW
def test_scaled_linear_matches_reference_up_to_summation_order_slow(**kw) -> None:
    check_linear(**kw)


@pytest.mark.parametrize("lead, K, N", [((0,), 16, 8), ((3,), 16, 0), ((4,), 0, 5), ((2, 0), 8, 3)])
def test_scaled_linear_zero_size(lead, K, N) -> None:
    """No rows / no outputs launch nothing; K = 0 gives bias + residual."""
    check_linear(list(lead), K, N, True, "contiguous", torch.float32, torch.float32, "contiguous", 0)


@triton.jit
def _decode(C, H):
    i = tl.arange(0, 256)
    tl.store(H + i, fp8_triton._e4m3_to_fp16(tl.load(C + i)))


def test_e4m3_decode_to_fp16_is_exact() -> None:
    """The sm_80 path's decoding of all 256 codes: torch's value, NaN for NaN, -0 for 0x80."""
    codes = torch.arange(256, dtype=torch.uint8)
    h = torch.empty(256, dtype=torch.float16)
    _decode[(1,)](codes, h)
    want = codes.view(FP8_DTYPE).to(torch.float16)
    assert torch.equal(h.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(h[keep].view(torch.int16), want[keep].view(torch.int16))


def test_scaled_linear_fp8_gemm_within_e4m3_rounding_of_bf16_linear() -> None:
    """y = scaled_linear_fp8(quantize_fp8(x), w) against ``F.linear(x, w)`` in bf16.

    Bound: x̃ = q·s with |x − x̃| ≤ e_x = max(2⁻⁴|x|, 2⁻¹⁰·s) per element (half an e4m3 ulp:
    3 mantissa bits for normals, a fixed 2⁻⁹·s step below 2⁻⁶·s) plus 2⁻²²|x| (float32 scaling);
    the same for w. Then |x·w − x̃·w̃| ≤ Σ_k e_x|w| + |x̃|e_w, plus float32 summation
    (K·2⁻²²·Σ|x||w|) and the bf16 reference's own rounding (half a bf16 ulp: 2⁻⁸|ref|)."""
    g = torch.Generator().manual_seed(3)
    M, K, N = 37, 200, 45
    x = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 10).bfloat16()
    w = (torch.randn(N, K, generator=g) / K ** 0.5).bfloat16()
    x[3] = 0  # a zero row
    with use_backend("triton"):
        q, scale = torch.ops.grcompile.quantize_fp8(x)
        y = torch.ops.grcompile.scaled_linear_fp8(q, scale, w, None, None, out_dtype=torch.float32)
    ref = F.linear(x, w).double()

    def e(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        a = v.double().abs()
        return torch.maximum(a * 2.0 ** -4, s.double().expand_as(a) * 2.0 ** -10) + a * 2.0 ** -22

    ws = quantize_rowwise(w)[1]
    xq = (q.double() * scale.double()).abs()
    x64, w64 = x.double().abs(), w.double().abs()
    bound = (e(x, scale) @ w64.t() + xq @ e(w, ws).t() + (x64 @ w64.t()) * K * 2.0 ** -22
             + ref.abs() * 2.0 ** -8)
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), (err - bound).max()
    assert bool((err[3] == 0).all())
    # negative control: the rows of another input (each row is scaled differently) break the bound
    assert not bool(((y.roll(1, 0).double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, D, transposed", [(48, 32, False), (7, 33, True), (1, 1, False), (130, 100, True),
                                                 (0, 16, False)])
def test_weight_quantisation_kernel_is_quantize_rowwise_bit_for_bit(dtype, rows, D, transposed) -> None:
    """The GEMM's per-call weight quantisation (``quantize_rows_fwd``) equals ``quantize_rowwise``
    bit for bit: odd widths, one element, a transposed weight, a zero row and a NaN row."""
    g = torch.Generator().manual_seed(rows * 131 + D)
    w = torch.randn(D, rows, generator=g).t() if transposed else torch.randn(rows, D, generator=g)
    w = (w * torch.logspace(-3, 3, w.shape[1]).to(w.dtype)).to(dtype)
    if rows > 3:
        w[1] = 0
        w[2, 0] = float("nan")
    got_q, got_s = fp8_triton.quantize_rows_triton(w)
    want_q, want_s = quantize_rowwise(w)
    finite = ~want_s.isnan().squeeze(-1)
    assert torch.equal(bits(got_q)[finite], bits(want_q)[finite])
    assert torch.equal(got_s.isnan(), want_s.isnan()) and torch.equal(got_s[finite], want_s[finite])
    assert bool(got_q[~finite].float().isnan().all())


def test_cublas_route_rules(monkeypatch) -> None:
    """Where ``scaled_linear_fp8`` hands its GEMM to ``torch._scaled_mm`` (sm_90 only; its single
    bf16 rounding must be the reference's) and where the Triton kernel keeps it."""
    q = torch.zeros(4, 32, dtype=FP8_DTYPE)
    w, r, bias = torch.zeros(16, 32), torch.zeros(4, 16), torch.zeros(16)
    bf16, f32 = torch.bfloat16, torch.float32
    route = fp8_triton._cublas_route
    assert route(q, w, None, None, bf16, None, (9, 0))
    assert route(q, w, None, r, f32, bf16, (9, 0))  # autocast: the linear rounds to bf16, then the add
    assert not route(q, w, bias, None, bf16, None, (9, 0))  # bias: the Triton epilogue
    assert not route(q, w, None, None, f32, None, (9, 0))  # float32 output: no bf16 rounding
    assert not route(q, w, None, r, f32, None, (9, 0))  # unrounded linear before the residual
    assert not route(q, w, None, None, bf16, None, (8, 9))  # Ada: no row-wise _scaled_mm
    assert not route(q, w, None, None, bf16, None, (10, 0))  # measured on sm_90 only
    assert not route(torch.zeros(4, 24, dtype=FP8_DTYPE), torch.zeros(16, 24), None, None, bf16, None, (9, 0))
    monkeypatch.setenv("GRCOMPILE_FP8_GEMM", "triton")
    assert not route(q, w, None, None, bf16, None, (9, 0))


@pytest.mark.parametrize("residual_dtype, out_dtype", [(None, torch.bfloat16), (torch.float32, torch.float32),
                                                       (torch.bfloat16, torch.bfloat16),
                                                       (torch.bfloat16, torch.float32)])
def test_cublas_route_equals_the_reference(monkeypatch, residual_dtype, out_dtype) -> None:
    """``scaled_linear_fp8_cublas`` (``torch._scaled_mm`` runs on CPU too) rounds where the reference
    does: the GEMM to bf16, the residual added in float32, the sum to ``out_dtype``."""
    monkeypatch.setattr(fp8_triton, "quantize_rows_triton", quantize_rowwise)  # its kernel needs a GPU or the interpreter
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 9, 64, generator=g), torch.randn(48, 64, generator=g)
    r = None if residual_dtype is None else torch.randn(2, 9, 48, generator=g).to(residual_dtype)
    q, scale = quantize_rowwise(x)
    got = fp8_triton.scaled_linear_fp8_cublas(q, scale, w, r, out_dtype=out_dtype)
    want = _scaled_linear_reference(q, scale, w, None, r, out_dtype=out_dtype, gemm_dtype=torch.bfloat16)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    # negative control: without the bf16 rounding of the GEMM the sums differ
    if r is not None and out_dtype == torch.float32:
        unrounded = _scaled_linear_reference(q, scale, w, None, r, out_dtype=out_dtype)
        assert not torch.equal(got, unrounded)


@pytest.mark.parametrize("op", ["norm_quant", "scaled_linear"])
def test_opcheck_with_the_kernels(op: str) -> None:
    """Fake vs real shapes and strides, and AOTAutograd, with the kernels running."""
    g = torch.Generator().manual_seed(0)
    x, u = LAYOUTS["transposed"](torch.randn(3, 4, 16, generator=g)), torch.randn(3, 4, 16, generator=g)
    with use_backend("triton"):
        if op == "norm_quant":
            torch.library.opcheck(torch.ops.grcompile.norm_quant_fp8.default, (x, u), dict(kind="layer", eps=1e-6),
                                  test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
        else:
            q, scale = quantize_rowwise(x)
            residual = LAYOUTS["expanded"](torch.randn(3, 4, 8, generator=g))
            torch.library.opcheck(torch.ops.grcompile.scaled_linear_fp8.default,
                                  (q, scale, torch.randn(8, 16, generator=g), torch.randn(8, generator=g), residual),
                                  dict(out_dtype=torch.bfloat16),
                                  test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


# ---- ahead of time: sm_90 ---------------------------------------------------------------------

_AOT = """
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from grcompile.lowering.aot import build_report
from grcompile.lowering.fp8.triton import aot_configs
report = build_report(["grcompile.lowering.fp8.triton:aot_configs"], ["sm_90"], with_roofline=False, progress=False)
c = next(c for c in aot_configs() if c["kernel"] == "scaled_fp8_gemm" and c["arch"] == "sm_90")
attrs = {(c["fn"].arg_names.index(a),): [["tt.divisibility", 16]] for a in c["divisible_by_16"]}
k = triton.compile(ASTSource(fn=c["fn"], signature=c["signature"], constexprs=c["constexprs"], attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=c["num_warps"], num_stages=c["num_stages"]))
print(json.dumps(dict(records=[dict(kernel=r["kernel"], failures=r["failures"], spill=r["spill_bytes"],
                                    tensor_cores=r["tensor_cores"]) for r in report["records"]],
                      wgmma=sorted(set(re.findall(r"wgmma\\.mma_async\\S*", k.asm["ptx"]))))))
"""


def test_aot_configs_compile_for_sm90() -> None:
    """Every sm_90 config compiles without spills (the AOT report's judgement), the GEMM's with
    tensor cores, and its PTX multiplies e4m3 by e4m3 with wgmma (a fresh process: under
    TRITON_INTERPRET=1 ``@triton.jit`` builds interpreter functions that cannot compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    kernels = {r["kernel"] for r in res["records"]}
    assert kernels == {"norm_quant_fwd", "quantize_rows_fwd", "scaled_fp8_gemm"}
    assert all(not r["failures"] and r["spill"] == 0 for r in res["records"]), res["records"]
    assert all(r["tensor_cores"] for r in res["records"] if r["kernel"] == "scaled_fp8_gemm")
    assert res["wgmma"] and all(".e4m3.e4m3" in w for w in res["wgmma"]), res["wgmma"]


def test_a_library_handoff_is_reported_under_the_library() -> None:
    """report()'s kernel line names who ran the call: a GEMM handed to cuBLAS counts there."""
    from grcompile.lowering import OPS, kernel_usage, lookup, note_library

    entry = OPS["scaled_linear_fp8"]
    saved, triton = entry.calls.copy(), entry.triton
    try:
        entry.calls.clear()
        entry.triton = lambda: None
        lookup("scaled_linear_fp8", "cuda")()
        entry.triton = lambda: note_library("scaled_linear_fp8", "cublas")
        lookup("scaled_linear_fp8", "cuda")()
        assert kernel_usage()["scaled_linear_fp8"] == {"triton": 1, "cublas": 1}
        note_library("scaled_linear_fp8", "cublas")  # outside a dispatched call: the Triton call stays counted
        assert kernel_usage()["scaled_linear_fp8"] == {"triton": 1, "cublas": 2}
    finally:
        entry.calls.clear()
        entry.calls.update(saved)
        entry.triton = triton
