"""FP8 GEMMs with row-wise scaling: the norm before a GEMM emits its e4m3 input, the GEMM adds a
2-D residual in its epilogue (ULTRA-HSTU's FP8 stack, ``../shared/seeds/ultra-hstu-notes-zh.txt``).

    quantize_fp8(v [..., K]) -> (q e4m3 [..., K], scale f32 [..., 1])          v ≈ q · scale
    norm_quant_fp8(x, u | None, *, kind, eps) -> (q, scale)      = quantize_fp8(gated_norm(x, u))
    scaled_linear_fp8(q, scale, weight [N, K], bias | None, residual | None, *, out_dtype, gemm_dtype=None) -> [..., N]
    fp8_linear(x, u | None, weight, bias | None, residual | None, *, norm, eps, out_dtype, gemm_dtype=None)

Row-wise quantisation (one scale per row; the weight: one per output channel), the recipe the
field uses for FP8 training GEMMs (torchao's ``Float8LinearRecipeName.ROWWISE``; ``_scaled_mm``'s
row-wise scales on sm_90):

    amax = max |v| over the row (float32; a zero row uses AMAX_FLOOR), scale = amax / 448,
    q = e4m3(clamp(v · (448 / amax), ±448))        (round to nearest even, as the hardware converts)

GEMM: ``acc = q @ q_wᵀ`` accumulated in float32, ``g = acc · (scale · scale_wᵀ) + bias`` in
float32; with a residual, ``y = round(g, gemm_dtype) + residual`` in float32 — ``gemm_dtype`` is the
dtype the user's own linear returns, so ``r + linear(...)`` rounds where theirs does (under bf16
autocast: the linear's bf16 result added to a float32 residual stream); None: no rounding there —;
``y`` rounded to ``out_dtype``. The residual is a full ``[..., N]`` tensor (HSTU's
``x + output(...)``): ``_scaled_mm`` takes a 1-D bias only, hence the Triton kernel.

``fp8_linear`` is what the ``fp8_linear`` pass emits: ``norm`` = ``"layer"`` | ``"rms"`` quantises
``gated_norm(x, u)`` in one pass (the fused kernel), ``"none"`` quantises ``x`` itself. Its backward
keeps gradients in the high precision (no FP8 in the backward): with ``n`` the GEMM's input
before quantisation,

    dn = dy @ weight,   dweight = dyᵀ @ n,   dbias = Σ_rows dy,   dresidual = dy,
    (dx, du) = gated_norm's backward of dn          (norm "none": dx = dn)

i.e. the quantisation is a straight-through estimator, and both backward GEMMs run on the
high-precision operands — torchao's ``rowwise_with_gw_hp`` recipe (the weight gradient from the
unquantised input): here it costs nothing, since nothing FP8 is saved and the backward recomputes
``n`` from ``x`` and ``u``, which the norm's backward keeps anyway.

CPU runs everything emulated with torch's float8 dtypes (the e4m3 values are exact in float32, so
the emulated GEMM differs from a tensor-core one only in float32 summation order).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import lookup, register_op
from ..norm import KINDS, _check as _check_norm, _gated_norm_reference, gated_norm_backward

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
AMAX_FLOOR = 1e-12  # a zero row quantises to zeros with a finite scale
NORMS = ("none",) + KINDS
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"grcompile::{op}: {msg}")


def _check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in _DTYPES:
        _fail(op, f"{name} must be float32 / bfloat16 / float16, got {t.dtype}")


def quantize_rowwise(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``v`` per row (last dim), see the module docstring."""
    vf = v.float()
    amax = vf.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR) if v.shape[-1] else \
        vf.new_full((*v.shape[:-1], 1), AMAX_FLOOR)
    # Both divisions tensor by tensor, so IEEE-rounded on every device: with a Python 448 torch
    # computes ``448 / amax`` as ``reciprocal(amax) · 448`` and, on CUDA, ``amax / 448`` as
    # ``amax · (1/448)`` (two roundings each, different per device; a kernel could match neither).
    fmax = torch.full_like(amax, FP8_MAX)
    q = (vf * (fmax / amax)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, amax / fmax


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


# ---- quantize_fp8 / norm_quant_fp8 ------------------------------------------------------------

def _quantize_reference(v: torch.Tensor) -> list[torch.Tensor]:
    return list(quantize_rowwise(v))


def _norm_quant_reference(x: torch.Tensor, u: Optional[torch.Tensor], *, kind: str, eps: float) -> list[torch.Tensor]:
    return list(quantize_rowwise(_gated_norm_reference(x, u, kind=kind, eps=eps)))


register_op("norm_quant_fp8", reference=_norm_quant_reference,
            triton="grcompile.lowering.fp8.triton:norm_quant_fp8_triton")


@torch.library.custom_op("grcompile::quantize_fp8", mutates_args=())
def quantize_fp8(v: torch.Tensor) -> list[torch.Tensor]:
    """``[q, scale]``: row-wise e4m3 values and float32 scales of ``v`` (plain torch everywhere:
    one elementwise pass any backend's compiler fuses)."""
    _check_quantizable(v)
    return [t.contiguous() for t in _quantize_reference(v)]


def _check_quantizable(v: torch.Tensor) -> None:
    _check_float("quantize_fp8", "v", v)
    if v.dim() < 1:
        _fail("quantize_fp8", "v must have at least one dimension (its rows are scaled along the last), got a 0-d tensor")


@quantize_fp8.register_fake
def _(v):
    _check_quantizable(v)
    return [v.new_empty(v.shape, dtype=FP8_DTYPE), v.new_empty((*v.shape[:-1], 1), dtype=torch.float32)]


@torch.library.custom_op("grcompile::norm_quant_fp8", mutates_args=())
def norm_quant_fp8(x: torch.Tensor, u: Optional[torch.Tensor], *, kind: str, eps: float) -> list[torch.Tensor]:
    """``[q, scale]`` of ``gated_norm(x, u)`` in one pass over the rows (no normed tensor written)."""
    _check_norm(x, u, kind, eps)
    _check_float("norm_quant_fp8", "x", x)
    return [t.contiguous() for t in lookup("norm_quant_fp8", x.device.type)(x, u, kind=kind, eps=eps)]


@norm_quant_fp8.register_fake
def _(x, u, *, kind, eps):
    _check_norm(x, u, kind, eps)
    _check_float("norm_quant_fp8", "x", x)
    return [x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)]


# ---- scaled_linear_fp8 ------------------------------------------------------------------------

def _check_gemm(op: str, x: torch.Tensor, weight, bias, residual, out_dtype, gemm_dtype=None) -> None:
    """Shapes, dtypes and devices of a GEMM of ``x [..., K]`` (its input, quantised or not)."""
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        _fail(op, f"weight must be [N, K={x.shape[-1] if x.dim() else '?'}], got {tuple(weight.shape)}")
    _check_float(op, "weight", weight)
    out_shape = (*x.shape[:-1], weight.shape[0])
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype not in _DTYPES):
        _fail(op, f"bias must be a float [{weight.shape[0]}], got {bias.dtype} {tuple(bias.shape)}")
    if residual is not None and (residual.shape != out_shape or residual.dtype not in _DTYPES):
        _fail(op, f"residual must be a float {out_shape}, got {residual.dtype} {tuple(residual.shape)}")
    for name, dtype in (("out_dtype", out_dtype), ("gemm_dtype", gemm_dtype)):
        if dtype is not None and dtype not in _DTYPES or name == "out_dtype" and dtype is None:
            _fail(op, f"{name} must be float32 / bfloat16 / float16, got {dtype}")
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None and t.device != x.device:
            _fail(op, f"{name} is on {t.device} but the input is on {x.device}")


def _check_linear(q, scale, weight, bias, residual, out_dtype, gemm_dtype=None) -> None:
    op = "scaled_linear_fp8"
    if q.dtype != FP8_DTYPE or q.dim() < 1:
        _fail(op, f"q must be a {FP8_DTYPE} tensor [..., K], got {q.dtype} of {q.dim()} dims")
    if scale.dtype != torch.float32 or scale.shape != (*q.shape[:-1], 1) or scale.device != q.device:
        _fail(op, f"scale must be float32 {(*q.shape[:-1], 1)} on {q.device}, "
                  f"got {scale.dtype} {tuple(scale.shape)} on {scale.device}")
    _check_gemm(op, q, weight, bias, residual, out_dtype, gemm_dtype)


def _scaled_linear_reference(q, scale, weight, bias, residual, *, out_dtype, gemm_dtype=None) -> torch.Tensor:
    with torch.autocast(q.device.type, enabled=False):
        wq, wscale = quantize_rowwise(weight)
        acc = torch.matmul(q.float(), wq.float().t())
        y = acc * (scale * wscale.squeeze(-1))  # [..., 1] x [N]: a 1-D input's output stays [N]
        if bias is not None:
            y = y + bias.float()
        if residual is not None:  # the user's linear result, rounded as theirs is, then their add
            y = (y if gemm_dtype is None else y.to(gemm_dtype).float()) + residual.float()
    return y.to(out_dtype)


register_op("scaled_linear_fp8", reference=_scaled_linear_reference,
            triton="grcompile.lowering.fp8.triton:scaled_linear_fp8_triton")


@torch.library.custom_op("grcompile::scaled_linear_fp8", mutates_args=())
def scaled_linear_fp8(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      residual: Optional[torch.Tensor], *, out_dtype: torch.dtype,
                      gemm_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``round((q · scale) @ e4m3(weight)ᵀ + bias, gemm_dtype) + residual`` as ``out_dtype``; see the
    module docstring."""
    _check_linear(q, scale, weight, bias, residual, out_dtype, gemm_dtype)
    fn = lookup("scaled_linear_fp8", q.device.type)
    return fn(q, scale, weight, bias, residual, out_dtype=out_dtype, gemm_dtype=gemm_dtype).contiguous()


@scaled_linear_fp8.register_fake
def _(q, scale, weight, bias, residual, *, out_dtype, gemm_dtype=None):
    _check_linear(q, scale, weight, bias, residual, out_dtype, gemm_dtype)
    return q.new_empty((*q.shape[:-1], weight.shape[0]), dtype=out_dtype)


# ---- fp8_linear: the differentiable composite the pass emits ------------------------------------

def _check_fp8_linear(x, u, weight, bias, residual, norm, eps, out_dtype, gemm_dtype=None) -> None:
    if norm not in NORMS:
        _fail("fp8_linear", f"norm must be one of {NORMS}, got {norm!r}")
    _check_float("fp8_linear", "x", x)
    if norm == "none":
        if u is not None:
            _fail("fp8_linear", "u (the gate) needs a norm")
    else:
        _check_norm(x, u, norm, eps)
    _check_gemm("fp8_linear", x, weight, bias, residual, out_dtype, gemm_dtype)


def _quantized_input(x: torch.Tensor, u: Optional[torch.Tensor], norm: str, eps: float) -> list[torch.Tensor]:
    if norm == "none":
        return torch.ops.grcompile.quantize_fp8(x)
    return torch.ops.grcompile.norm_quant_fp8(x, u, kind=norm, eps=eps)


@torch.library.custom_op("grcompile::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, u: Optional[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor],
               residual: Optional[torch.Tensor], *, norm: str, eps: float, out_dtype: torch.dtype,
               gemm_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``residual + linear(N(x, u), weight, bias)`` with the GEMM in FP8 (row-wise scales);
    ``N`` = ``gated_norm`` (``norm`` "layer" / "rms") or the identity ("none")."""
    _check_fp8_linear(x, u, weight, bias, residual, norm, eps, out_dtype, gemm_dtype)
    with torch.autocast(x.device.type, enabled=False):
        q, scale = _quantized_input(x, u, norm, eps)
        return torch.ops.grcompile.scaled_linear_fp8(q, scale, weight, bias, residual, out_dtype=out_dtype,
                                                     gemm_dtype=gemm_dtype)


@fp8_linear.register_fake
def _(x, u, weight, bias, residual, *, norm, eps, out_dtype, gemm_dtype=None):
    _check_fp8_linear(x, u, weight, bias, residual, norm, eps, out_dtype, gemm_dtype)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


def fp8_linear_backward(grad: torch.Tensor, x: torch.Tensor, u: Optional[torch.Tensor], weight: torch.Tensor,
                        has_bias: bool, residual_dtype: Optional[torch.dtype], norm: str, eps: float):
    """``(dx, du, dweight, dbias, dresidual)`` of ``fp8_linear`` (see the module docstring)."""
    with torch.autocast(x.device.type, enabled=False):
        n = x if norm == "none" else torch.ops.grcompile.gated_norm(x, u, kind=norm, eps=eps)
        g = grad.float()
        rows = g.reshape(-1, g.shape[-1])
        dweight = (rows.t() @ n.float().reshape(rows.shape[0], weight.shape[1])).to(weight.dtype)
        dbias = rows.sum(dim=0) if has_bias else None  # float32; the caller casts to the bias dtype
        dresidual = grad.to(residual_dtype) if residual_dtype is not None else None
        n_dtype = x.dtype  # the norm's output dtype: the dtype its backward takes the gradient in
        dn = (g @ weight.float()).to(n_dtype)
        if norm == "none":
            dx, du = dn, None
        else:
            dx, du = gated_norm_backward(dn, x, u, norm, eps)
    return dx, du, dweight, dbias, dresidual


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    x, u, weight, bias, residual = inputs
    ctx.has_u, ctx.has_bias = u is not None, bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.save_for_backward(x, u, weight)
    ctx.norm, ctx.eps = keyword_only_inputs["norm"], keyword_only_inputs["eps"]


def _backward(ctx, grad):
    x, u, weight = ctx.saved_tensors
    dx, du, dweight, dbias, dresidual = fp8_linear_backward(grad, x, u, weight, ctx.has_bias, ctx.residual_dtype,
                                                            ctx.norm, ctx.eps)
    if dbias is not None:
        dbias = dbias.to(ctx.bias_dtype)
    return dx, du, dweight, dbias, dresidual


fp8_linear.register_autograd(_backward, setup_context=_setup_context)

FP8_LINEAR = torch.ops.grcompile.fp8_linear.default  # what the fp8_linear pass emits

__all__ = ["FP8_DTYPE", "FP8_MAX", "AMAX_FLOOR", "NORMS", "FP8_LINEAR", "quantize_rowwise", "dequantize",
           "quantize_fp8", "norm_quant_fp8", "scaled_linear_fp8", "fp8_linear", "fp8_linear_backward"]
