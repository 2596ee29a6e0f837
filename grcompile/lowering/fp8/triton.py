"""Triton kernels of the FP8 ops (:mod:`grcompile.lowering.fp8`): the norm that emits its GEMM's
e4m3 input, and the row-wise scaled FP8 GEMM with a 2-D residual in its epilogue.

    norm_quant_fp8_triton(x, u, *, kind, eps) -> [q, scale]          (the ``norm_quant_fp8`` slot)
    scaled_linear_fp8_triton(q, scale, weight, bias, residual, *, out_dtype, gemm_dtype=None) -> y
    aot_configs() -> list[dict]                                        (configs the AOT report compiles)

**norm_quant_fp8**: one program takes a block of rows (every leading dim flattened) whole in
registers, computes ``gated_norm`` with the gated_norm kernel's own helpers and launch meta
(:mod:`..norm.triton`: same loads, statistics, tile and warps, hence the same reduction order),
rounds it to the input dtype where ``gated_norm`` stores it (and the norm before the gate, as
that kernel does), then quantises the row: ``amax`` (float32, NaN-propagating, floor
``AMAX_FLOOR``), ``q = e4m3(clamp(v · (448 / amax), ±448))``, ``scale = amax / 448``, both
divisions IEEE-rounded (``div_rn``) as the reference's are. So ``norm_quant_fp8_triton(x, u)`` is
``quantize_rowwise(gated_norm_triton(x, u))`` bit for bit (the tests check it in the interpreter).
The e4m3 conversion is the hardware's ``cvt.rn.satfinite.e4m3x2.f32`` on sm_89+ (``HW_CVT``) and
otherwise an integer round-to-nearest-even on the float32 bits (:func:`_e4m3_bits`), used on older
GPUs (sm_80 has no e4m3 conversion) and in Triton's interpreter, whose fp32→fp8 cast is wrong
(Triton 3.9 rounds half up on one cut bit and drops the mantissa carry: 31.6 becomes 16); both
round to nearest even, the values are already clamped to ±448 and finite codes agree (a NaN row
gives NaN codes, their sign bit may differ). ``D > MAX_D`` runs the reference (noted in the
registry, warned once); empty inputs launch nothing.

**scaled_linear_fp8**: the weight is quantised per output channel by the reference's own
:func:`quantize_rowwise` (plain torch: one elementwise pass per call), then a tiled GEMM
(:func:`scaled_fp8_gemm`): ``tl.dot`` of e4m3 tiles into a float32 accumulator (``wgmma`` with
e4m3 operands on sm_90), masked edges (any M, N, K), grouped tile order for L2 reuse, and the
epilogue ``y = round(acc · (scale_row · wscale_col) + bias, gemm_dtype) + residual`` in float32 (the
reference's order; the rounding only where ``gemm_dtype`` is given and narrower than float32, as the
user's linear rounds before their residual add) with the 2-D residual tile loaded there, rounded to
``out_dtype``. It agrees with the
reference up to float32 summation order. ``torch._scaled_mm`` (row-wise scales) is not used even
where it could run (residual None, sm_90, dims multiples of 16): its row-wise path's constraints
(output and bias dtypes) vary across torch versions and no GPU was at hand to verify it, and this
kernel covers every case, notably the 2-D residual ``_scaled_mm`` cannot take (1-D bias only).

Architectures: FP8 tensor cores exist from sm_89 (Ada's ``mma.sync`` e4m3, Hopper's ``wgmma``).
On sm_80 .. sm_88 Triton has no e4m3 type at all: the same kernel (``FP8_DOT`` off) reads the
codes as bytes and decodes them in registers to fp16, exactly (:func:`_e4m3_to_fp16`: e4m3 values
are exact in fp16), for fp16 ``mma.sync``: FP8's halved operand traffic, bf16-class tensor-core
rate. Older GPUs and non-CUDA devices run the reference (noted, warned once). The AOT configs cover
both kernels on both archs (norm: ``HW_CVT`` on sm_90, off on sm_80; GEMM: e4m3 on sm_90, decoded
on sm_80). In the interpreter (CPU tests) ``tl.dot`` takes the e4m3 tiles as they are and decodes
them exactly, so the tested GEMM is the sm_89+ one; the tests launch the decoded path too, with
small tiles so that the K loop and its masked tail run. Note the interpreter also truncates
float32→bfloat16 casts (the GPU rounds to nearest even): a bf16 GEMM output may differ from the
reference by one bf16 ulp there, and the bf16 norm matches ``gated_norm_triton`` (same cast) but
not torch's norm bit for bit. None of this ran on a GPU here (none was lent): the sm_90 / sm_80
code is checked by compiling it (PTX, registers, spills), not by running it.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import triton_interpreting
from ..norm import _check as _check_norm
from ..norm.triton import (AOT_ROWS, MAX_D, _meta as _norm_meta, _note_fallback, _strides, _too_wide, _view3,
                           aot_int_args, gated_norm_rows)
from . import AMAX_FLOOR, FP8_DTYPE, _norm_quant_reference, _scaled_linear_reference, quantize_rowwise

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_TL_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_FLOOR = tl.constexpr(AMAX_FLOOR)  # a jit function reads module globals only as constexprs


# --------------------------------------------------------------------------------------------
# norm + quantisation


@triton.jit
def _max_nan(a, b):
    """``max`` that keeps NaN (``torch.amax``'s rule; the hardware max drops it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _e4m3_bits(v, HW_CVT: tl.constexpr):
    """The e4m3fn code (uint8) of float32 ``v``, ``|v| <= 448`` or NaN, rounded to nearest even."""
    if HW_CVT:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    b = v.to(tl.int32, bitcast=True)
    sign = ((b >> 31) & 1) << 7
    a = b & 0x7FFFFFFF
    e = a >> 23  # biased float32 exponent; e4m3's normals start at 2**-6, i.e. e = 121
    # normal: keep 3 of 23 mantissa bits, round half to even; a carry moves into the exponent
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: k · 2**-9, k = |v| · 2**9 rounded half to even (k = 8 is 2**-6, code 8: right too)
    m = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - e, 31)
    sub = (m + ((1 << (shift - 1)) - 1) + ((m >> shift) & 1)) >> shift
    code = tl.where(e >= 121, normal, sub)
    code = tl.where(a > 0x7F800000, 0x7F, code)  # NaN
    return (code | sign).to(tl.uint8)


@triton.jit
def norm_quant_fwd(X, U, Q, S, n_rows, inner, D, sx0, sx1, sx2, su0, su1, su2, eps,
                   BLOCK_D: tl.constexpr, ROWS: tl.constexpr, IS_RMS: tl.constexpr, HAS_U: tl.constexpr,
                   CDT: tl.constexpr, NORM_DT: tl.constexpr, HW_CVT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    # gated_norm_fwd's own rows (its output, rounded to the input dtype as it stores it)
    y = gated_norm_rows(X, U, rows, cols, mask, inner, D, sx0, sx1, sx2, su0, su1, su2, eps,
                        IS_RMS, HAS_U, CDT, NORM_DT)
    y = y.to(NORM_DT).to(tl.float32)
    _quantize_rows(y, rows, cols, mask, n_rows, D, Q, S, HW_CVT)


@triton.jit
def _quantize_rows(y, rows, cols, mask, n_rows, D, Q, S, HW_CVT: tl.constexpr):
    """:func:`quantize_rowwise` of the float32 rows ``y`` (same IEEE divisions): codes to ``Q``
    (contiguous rows of ``D``), scales to ``S``."""
    amax = tl.reduce(tl.where(mask, tl.abs(y), 0.0), 1, _max_nan)
    amax = tl.maximum(amax, _FLOOR, propagate_nan=tl.PropagateNan.ALL)
    fmax = tl.full(amax.shape, 448.0, tl.float32)
    v = y * tl.math.div_rn(fmax, amax)[:, None]
    v = tl.minimum(tl.maximum(v, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                   propagate_nan=tl.PropagateNan.ALL)
    tl.store(Q + rows[:, None] * D + cols[None, :], _e4m3_bits(v, HW_CVT), mask=mask)
    tl.store(S + rows, tl.math.div_rn(amax, fmax), mask=rows < n_rows)


@triton.jit
def quantize_rows_fwd(X, Q, S, n_rows, D, sx0, sx1, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                      HW_CVT: tl.constexpr):
    """``quantize_rowwise`` of a 2-D ``X`` (any strides): the GEMM's weight, once per call."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    y = tl.load(X + rows[:, None] * sx0 + cols[None, :] * sx1, mask=mask, other=0.0).to(tl.float32)
    _quantize_rows(y, rows, cols, mask, n_rows, D, Q, S, HW_CVT)


def quantize_rows_triton(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rowwise(w)`` of a 2-D ``w`` by :func:`quantize_rows_fwd`, bit for bit (rows wider than
    ``MAX_D`` and empty inputs: torch's own)."""
    n_rows, D = w.shape
    if D > MAX_D or n_rows == 0 or D == 0:
        return quantize_rowwise(w)
    q = torch.empty((n_rows, D), dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty((n_rows, 1), dtype=torch.float32, device=w.device)
    block_d = triton.next_power_of_2(D)
    rows = max(1, min(16, 4096 // block_d))
    quantize_rows_fwd[(triton.cdiv(n_rows, rows),)](w, q.view(torch.uint8), scale, n_rows, D, w.stride(0), w.stride(1),
                                                    BLOCK_D=block_d, ROWS=rows, HW_CVT=_hw_e4m3(w.device),
                                                    num_warps=4 if block_d <= 1024 else 8)
    return q, scale


def _hw_e4m3(device: torch.device) -> bool:
    """Whether compiled code on ``device`` has FP8 (e4m3) conversions and tensor cores: sm_89+."""
    return (device.type == "cuda" and not triton_interpreting()
            and torch.cuda.get_device_capability(device) >= (8, 9))


def _norm_quant_meta(D: int, n_rows: int, kind: str, dtype: torch.dtype, has_u: bool, hw_cvt: bool) -> dict:
    """gated_norm's launch meta for this call (same tile, rows and warps) plus the quantiser's."""
    meta = _norm_meta(D, n_rows, kind, dtype, has_u)
    meta["constexprs"].update(NORM_DT=_TL[dtype], HW_CVT=hw_cvt)
    return meta


def norm_quant_fp8_triton(x: torch.Tensor, u: Optional[torch.Tensor], *, kind: str,
                          eps: float) -> list[torch.Tensor]:
    """``[q, scale]`` of ``gated_norm(x, u)`` by :func:`norm_quant_fwd`; contiguous outputs."""
    _check_norm(x, u, kind, eps)
    D = x.shape[-1]
    if _too_wide("norm_quant_fp8", D):
        return [t.contiguous() for t in _norm_quant_reference(x, u, kind=kind, eps=eps)]
    n_rows = x.numel() // D if D else 0
    if n_rows == 0:  # nothing to launch (D = 0 still has rows: quantize_rowwise gives them its floor scale)
        return [t.contiguous() for t in quantize_rowwise(torch.empty(x.shape, dtype=x.dtype, device=x.device))]
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    x3 = _view3(x)
    u3 = x3 if u is None else _view3(u)
    meta = _norm_quant_meta(D, n_rows, kind, x.dtype, u is not None, _hw_e4m3(x.device))
    grid = (triton.cdiv(n_rows, meta["constexprs"]["ROWS"]),)
    norm_quant_fwd[grid](x3, u3, q.view(torch.uint8), scale, n_rows, x3.shape[1], D, *_strides(x3), *_strides(u3),
                         float(eps), **meta["constexprs"], num_warps=meta["num_warps"])
    return [q, scale]


# --------------------------------------------------------------------------------------------
# scaled FP8 GEMM


@triton.jit
def _e4m3_to_fp16(c):
    """The fp16 values of e4m3fn codes ``c`` (uint8), exactly: the code's exponent and mantissa
    bits placed in fp16's (bias 15 against 7, subnormals included) times 2**8; NaN stays NaN."""
    c = c.to(tl.int16)
    h = ((c & 0x7F) << 7) | ((c & 0x80) << 8)
    h = tl.where((c & 0x7F) == 0x7F, 0x7E00, h)
    return h.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def scaled_fp8_gemm(A, B, SA, SB, BIAS, R, Y, M, N, K, sam, sbn, srm,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, FP8_DOT: tl.constexpr,
                    GEMM_DT: tl.constexpr = tl.float32):
    """``Y [M, N] = (A [M, K] @ B [N, K]ᵀ) · (SA ⊗ SB) + BIAS + R``: A, B e4m3 codes with unit K
    stride (``FP8_DOT``: e4m3 pointers multiplied as they are; else uint8 pointers decoded to fp16
    in registers), R with unit column stride, Y contiguous."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n  # GROUP_M row tiles walk the column tiles together (L2 reuse of B)
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    in_m, in_n = rm < M, rn < N
    a_ptrs = A + rm.to(tl.int64)[:, None] * sam + rk[None, :]
    b_ptrs = B + rn.to(tl.int64)[None, :] * sbn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        in_k = k * BLOCK_K + rk < K
        a = tl.load(a_ptrs, mask=in_m[:, None] & in_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=in_k[:, None] & in_n[None, :], other=0.0)
        if not FP8_DOT:
            a = _e4m3_to_fp16(a)
            b = _e4m3_to_fp16(b)
        if FP8_DOT:  # sm_90's FP8 wgmma accumulates with ~14 bits unless promoted: once per K tile
            acc = tl.dot(a, b, acc, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.float32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    sa = tl.load(SA + rm, mask=in_m, other=0.0)
    sb = tl.load(SB + rn, mask=in_n, other=0.0)
    y = acc * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        y = y + tl.load(BIAS + rn, mask=in_n, other=0.0).to(tl.float32)[None, :]
    mask = in_m[:, None] & in_n[None, :]
    if HAS_RES:
        if GEMM_DT != tl.float32:
            y = y.to(GEMM_DT).to(tl.float32)
        y = y + tl.load(R + rm.to(tl.int64)[:, None] * srm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + rm.to(tl.int64)[:, None] * N + rn[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _gemm_meta(M: int, fp8_dot: bool, interpreted: bool) -> dict:
    """Tiles and launch options. sm_89+ (``fp8_dot``): 128 x 128 x 128 e4m3 tiles, 8 warps (two
    warpgroups of wgmma on sm_90), 3 stages (96 KiB of shared memory); sm_80: 128 x 128 x 64 code
    tiles decoded to fp16 for ``mma.sync``; 64-row tiles (4 warps) for short inputs. Interpreter:
    tiles of at most 32 (K: 32), so several programs, the group order and the K tail all run."""
    if interpreted:
        block_m = max(16, min(32, triton.next_power_of_2(max(M, 1))))
        return dict(constexprs=dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, FP8_DOT=fp8_dot),
                    num_warps=4, num_stages=1)
    block_m = 64 if M <= 64 else 128
    return dict(constexprs=dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128 if fp8_dot else 64, GROUP_M=8,
                                FP8_DOT=fp8_dot),
                num_warps=4 if block_m == 64 else 8, num_stages=3)


def scaled_linear_fp8_triton(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             residual: Optional[torch.Tensor], *, out_dtype: torch.dtype,
                             gemm_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``round((q · scale) @ e4m3(weight)ᵀ + bias, gemm_dtype) + residual`` as ``out_dtype`` by :func:`scaled_fp8_gemm`:
    the e4m3 dot on sm_89+ and in the interpreter, the fp16-decoded one on sm_80 .. sm_88, the
    reference elsewhere (older GPUs, other devices; noted and warned once)."""
    interpreted = triton_interpreting()
    cc = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" and not interpreted else None
    if not interpreted and (cc is None or cc < (8, 0)):
        where = f"{q.device.type}" + (f" sm_{cc[0]}{cc[1]}" if cc else "")
        _note_fallback("scaled_linear_fp8", where, f"no kernel for {where} (needs CUDA sm_80+)")
        return _scaled_linear_reference(q, scale, weight, bias, residual, out_dtype=out_dtype, gemm_dtype=gemm_dtype)
    if not interpreted and _cublas_route(q, weight, bias, residual, out_dtype, gemm_dtype, cc):
        from .. import note_library
        note_library("scaled_linear_fp8", "cublas")  # report() says which library ran the GEMM
        return scaled_linear_fp8_cublas(q, scale, weight, residual, out_dtype=out_dtype)
    return scaled_linear_fp8_launch(q, scale, weight, bias, residual, out_dtype=out_dtype, gemm_dtype=gemm_dtype,
                                    fp8_dot=interpreted or cc >= (8, 9), interpreted=interpreted)


def _cublas_route(q: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  residual: Optional[torch.Tensor], out_dtype: torch.dtype, gemm_dtype: Optional[torch.dtype],
                  cc: tuple[int, int]) -> bool:
    """Whether this call goes to cuBLAS's row-wise FP8 GEMM (``torch._scaled_mm``) rather than the
    Triton kernel. ``GRCOMPILE_FP8_GEMM=triton|cublas|auto`` (default auto: cuBLAS where it computes
    the same thing). It does where its row-wise path runs (sm_90, widths multiples of 16) and its one
    rounding — a bf16 output — is the reference's: no bias (its bias would be added before that
    rounding in its own dtype rules), and either no residual with a bf16 output, or a residual with
    the linear's result rounded to bf16 first (``gemm_dtype`` bf16: autocast), the residual then
    added in float32 after the GEMM."""
    choice = os.environ.get("GRCOMPILE_FP8_GEMM", "auto")
    if choice == "triton" or cc[0] != 9 or bias is not None or q.dtype != FP8_DTYPE:  # measured on sm_90 only
        return False
    K, N = q.shape[-1], weight.shape[0]
    if K % 16 or N % 16 or K == 0 or N == 0 or q.numel() == 0 or weight.dim() != 2:
        return False
    rounds_like_reference = (out_dtype == torch.bfloat16 and gemm_dtype in (None, torch.bfloat16)) \
        if residual is None else gemm_dtype == torch.bfloat16
    return rounds_like_reference and choice in ("auto", "cublas")


def scaled_linear_fp8_cublas(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                             residual: Optional[torch.Tensor], *, out_dtype: torch.dtype) -> torch.Tensor:
    """``round(acc · (scale ⊗ wscale), bf16) (+ residual in float32)`` with ``torch._scaled_mm``
    (cuBLAS / CUTLASS row-wise FP8 GEMM, float32 accumulation); the weight quantised by
    :func:`quantize_rows_triton`. See :func:`_cublas_route` for when it runs."""
    K, N = q.shape[-1], weight.shape[0]
    M = int(torch.Size(q.shape[:-1]).numel())
    wq, wscale = quantize_rows_triton(weight)
    y = torch._scaled_mm(q.reshape(M, K).contiguous(), wq.t(), scale_a=scale.reshape(M, 1).contiguous(),
                         scale_b=wscale.reshape(1, N), out_dtype=torch.bfloat16)
    if residual is not None:
        r = residual.reshape(M, N)
        # one elementwise pass where torch's own promotion lands on out_dtype (it adds in float32)
        y = y + r if torch.result_type(y, r) == out_dtype else (y.float() + r.float()).to(out_dtype)
    elif out_dtype != torch.bfloat16:
        y = y.to(out_dtype)
    return y.reshape(*q.shape[:-1], N)


def scaled_linear_fp8_launch(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             residual: Optional[torch.Tensor], *, out_dtype: torch.dtype, fp8_dot: bool,
                             interpreted: bool, gemm_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """One launch of :func:`scaled_fp8_gemm` (``fp8_dot``: e4m3 operands, else decoded to fp16;
    the tests run both paths in the interpreter)."""
    K, N = q.shape[-1], weight.shape[0]
    M = int(torch.Size(q.shape[:-1]).numel())
    y = torch.empty((*q.shape[:-1], N), dtype=out_dtype, device=q.device)
    if M == 0 or N == 0:
        return y
    wq, wscale = quantize_rowwise(weight) if interpreted or weight.dim() != 2 else quantize_rows_triton(weight)
    a, b = q.reshape(M, K).contiguous(), wq.contiguous()
    if not fp8_dot:  # the codes, as bytes: Triton has no e4m3 type before sm_89
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    r = None if residual is None else residual.reshape(M, N)
    if r is not None and N > 1 and r.stride(1) != 1:
        r = r.contiguous()
    meta = _gemm_meta(M, fp8_dot, interpreted)
    c = meta["constexprs"]
    grid = (triton.cdiv(M, c["BLOCK_M"]) * triton.cdiv(N, c["BLOCK_N"]),)
    sb = wscale.reshape(N)
    scaled_fp8_gemm[grid](a, b, scale.reshape(M).contiguous(), sb, sb if bias is None else bias.contiguous(),
                          y if r is None else r, y, M, N, K, max(K, 1), max(K, 1), 0 if r is None else r.stride(0),
                          **c, HAS_BIAS=bias is not None, HAS_RES=r is not None,
                          GEMM_DT=_TL_DTYPE[gemm_dtype] if r is not None and gemm_dtype is not None else tl.float32,
                          num_warps=meta["num_warps"],
                          num_stages=meta["num_stages"])
    return y


# --------------------------------------------------------------------------------------------
# ahead-of-time configs (CUDA targets; compiled by the AOT report, two of them by the tests)


def aot_configs() -> list[dict]:
    """Representative compile configs of both kernels (dict format: :mod:`grcompile.lowering.aot`),
    each for one arch (the ``arch`` key, repeated in ``config``).

    ``norm_quant_fwd``: fp32 / bf16, D in {256, 1024}, layer / rms, gated or not, rows sized as for
    4096 rows; sm_90 with the hardware e4m3 conversion, sm_80 with the integer one.
    ``scaled_fp8_gemm``: both tile shapes of :func:`_gemm_meta`, bf16 / fp32 outputs, with and
    without bias and residual; sm_90 multiplies e4m3 tiles (wgmma), sm_80 decodes them to fp16
    (mma.sync). K, N and the row strides are declared divisible by 16 (model widths are), as
    Triton specialises them at launch."""
    configs = []
    for arch, hw_cvt in (("sm_90", True), ("sm_80", False)):
        for dtype, D, kind, gated in ((torch.float32, 256, "rms", False), (torch.bfloat16, 1024, "layer", True),
                                      (torch.bfloat16, 256, "rms", True)):
            meta = _norm_quant_meta(D, 4096, kind, dtype, gated, hw_cvt)
            signature = {"X": "*" + _TL_NAME[dtype], "U": "*" + _TL_NAME[dtype], "Q": "*u8", "S": "*fp32"}
            signature.update({a: "i32" for a in ("n_rows", "inner", "D")})
            signature.update({f"{s}{i}": "i32" for s in ("sx", "su") for i in range(3)})
            signature["eps"] = "fp32"
            signature.update({c: "constexpr" for c in meta["constexprs"]})
            configs.append(dict(kernel="norm_quant_fwd", fn=norm_quant_fwd, signature=signature,
                                int_args=aot_int_args(D, ("sx", "su")),
                                constexprs=meta["constexprs"], num_warps=meta["num_warps"], num_stages=1,
                                uses_dot=False, arch=arch,
                                config=dict(dtype=_TL_NAME[dtype], D=D, kind=kind, gated=gated,
                                            rows_per_program=meta["constexprs"]["ROWS"], arch=arch)))
        for dtype, D in ((torch.bfloat16, 1024), (torch.float32, 256)):
            block_d = triton.next_power_of_2(D)
            constexprs = dict(BLOCK_D=block_d, ROWS=max(1, min(16, 4096 // block_d)), HW_CVT=hw_cvt)
            signature = {"X": "*" + _TL_NAME[dtype], "Q": "*u8", "S": "*fp32", "n_rows": "i32", "D": "i32",
                         "sx0": "i32", "sx1": "i32", **{c: "constexpr" for c in constexprs}}
            configs.append(dict(kernel="quantize_rows_fwd", fn=quantize_rows_fwd, signature=signature,
                                int_args=dict(n_rows=AOT_ROWS, D=D, sx0=D, sx1=1),
                                constexprs=constexprs, num_warps=4, num_stages=1, uses_dot=False, arch=arch,
                                config=dict(dtype=_TL_NAME[dtype], D=D, rows_per_program=constexprs["ROWS"],
                                            arch=arch)))
    for arch, fp8_dot in (("sm_90", True), ("sm_80", False)):
        for M, out_dtype, has_bias, has_res in ((4096, torch.bfloat16, True, True),
                                                (4096, torch.float32, False, False), (64, torch.bfloat16, False, True)):
            meta = _gemm_meta(M, fp8_dot, interpreted=False)
            out, codes = "*" + _TL_NAME[out_dtype], "*fp8e4nv" if fp8_dot else "*u8"
            signature = {"A": codes, "B": codes, "SA": "*fp32", "SB": "*fp32", "BIAS": "*bf16", "R": out, "Y": out}
            signature.update({a: "i32" for a in ("M", "N", "K", "sam", "sbn", "srm")})
            # with a residual, the autocast case: the linear's result rounded to bf16 before the add
            constexprs = dict(meta["constexprs"], HAS_BIAS=has_bias, HAS_RES=has_res,
                              GEMM_DT=tl.bfloat16 if has_res else tl.float32)
            signature.update({c: "constexpr" for c in constexprs})
            tile = "x".join(str(constexprs[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
            configs.append(dict(kernel="scaled_fp8_gemm", fn=scaled_fp8_gemm, signature=signature, int_args=dict(M=M),
                                constexprs=constexprs, num_warps=meta["num_warps"], num_stages=meta["num_stages"],
                                uses_dot=True, arch=arch,
                                divisible_by_16=[a for a, t in signature.items() if t.startswith("*")]
                                + ["N", "K", "sam", "sbn", "srm"],
                                config=dict(tile=tile, out=_TL_NAME[out_dtype], bias=has_bias, residual=has_res,
                                            dot="e4m3" if fp8_dot else "fp16", arch=arch)))
    return configs


__all__ = ["norm_quant_fp8_triton", "scaled_linear_fp8_triton", "scaled_linear_fp8_launch", "scaled_linear_fp8_cublas",
           "quantize_rows_triton", "aot_configs", "norm_quant_fwd", "quantize_rows_fwd", "scaled_fp8_gemm"]
