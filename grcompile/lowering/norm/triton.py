"""Triton kernels of ``grcompile::gated_norm`` (``u ⊙ norm(x)`` over the last dim) and of its
backward ``grcompile::gated_norm_backward``; the math is :mod:`.norm`'s reference, line for line.

    gated_norm_triton(x, u, *, kind, eps) -> y              (the ``gated_norm`` triton slot)
    gated_norm_backward_triton(grad, x, u, *, kind, eps) -> [dx] or [dx, du]
    aot_configs() -> list[dict]                              (representative configs to compile ahead of time)

One program normalises a block of ``ROWS`` rows (rows = every leading dim flattened) held whole in
registers (``BLOCK_D = next_power_of_2(D)``, masked), with float32 statistics for fp16 / bf16 / fp32
and float64 for fp64 inputs. Nothing is saved for the backward beyond the inputs: its kernel
recomputes mean and rstd from ``x`` and writes ``dx`` and ``du`` in the same pass.

Layouts: the inputs are *not* made contiguous. Each is viewed as ``[A, B, D]`` (1- and 2-d
inputs get leading dims of 1; more than 3 dims collapse the leading ones with ``reshape``, a copy
only when they do not collapse) and the kernel takes all three strides, so a transposed ``x``
(Conv1d layout), a strided slice or an expanded ``u`` (stride 0) is read in place. Outputs are
contiguous, as the op promises.

Limits: ``D > MAX_D`` (16384) runs the reference instead: a row must fit in registers (sm_90,
ptxas: no spills up to D = 8192 in either kernel; at 16384 with 32 warps the backward spills 32
bytes). Empty inputs (no rows or ``D == 0``) launch nothing. fp64 runs in the kernels too (float64
statistics). Importing this module imports Triton.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import triton
import triton.language as tl

from . import _cdtype, _check, gated_norm_backward, _gated_norm_reference

MAX_D = 16384
_ELEMS = 2048  # elements per program: rows are batched until a block holds about this many


@triton.jit
def _load_rows(P, rows, cols, mask, inner, s0, s1, s2, CDT: tl.constexpr):
    """Rows ``rows`` (int64) of a ``[A, B, D]`` view with strides ``(s0, s1, s2)``, as ``CDT``."""
    off = (rows // inner) * s0 + (rows % inner) * s1
    return tl.load(P + off[:, None] + cols[None, :].to(tl.int64) * s2, mask=mask, other=0.0).to(CDT)


@triton.jit
def _stats(x, mask, D, eps, IS_RMS: tl.constexpr):
    """``(x − μ, r)`` (layer) or ``(x, r)`` (rms), masked lanes 0; ``r = 1/sqrt(var + eps)``."""
    if IS_RMS:
        xm = x
    else:
        xm = tl.where(mask, x - (tl.sum(x, axis=1) / D)[:, None], 0.0)
    r = tl.rsqrt(tl.sum(xm * xm, axis=1) / D + eps)
    return xm, r


@triton.jit
def gated_norm_rows(X, U, rows, cols, mask, inner, D, sx0, sx1, sx2, su0, su1, su2, eps,
                    IS_RMS: tl.constexpr, HAS_U: tl.constexpr, CDT: tl.constexpr, OUT_DT: tl.constexpr):
    """``u ⊙ norm(x)`` of a block of rows in ``CDT``, not yet rounded to ``OUT_DT`` (the output
    dtype) — shared by every kernel that computes ``gated_norm`` (the FP8 norm + quantisation too),
    so they agree bit for bit."""
    x = _load_rows(X, rows, cols, mask, inner, sx0, sx1, sx2, CDT)
    xm, r = _stats(x, mask, D, eps, IS_RMS)
    y = xm * r[:, None]
    if HAS_U:  # the norm rounded to the input dtype first, as the user's norm-then-multiply rounds it
        y = _load_rows(U, rows, cols, mask, inner, su0, su1, su2, CDT) * y.to(OUT_DT).to(CDT)
    return y


@triton.jit
def gated_norm_fwd(X, U, Y, n_rows, inner, D, sx0, sx1, sx2, su0, su1, su2, eps,
                   BLOCK_D: tl.constexpr, ROWS: tl.constexpr, IS_RMS: tl.constexpr, HAS_U: tl.constexpr,
                   CDT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    y = gated_norm_rows(X, U, rows, cols, mask, inner, D, sx0, sx1, sx2, su0, su1, su2, eps,
                        IS_RMS, HAS_U, CDT, Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * D + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def gated_norm_bwd(G, X, U, DX, DU, n_rows, inner, D, sg0, sg1, sg2, sx0, sx1, sx2, su0, su1, su2, eps,
                   BLOCK_D: tl.constexpr, ROWS: tl.constexpr, IS_RMS: tl.constexpr, HAS_U: tl.constexpr,
                   CDT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    out = rows[:, None] * D + cols[None, :]
    x = _load_rows(X, rows, cols, mask, inner, sx0, sx1, sx2, CDT)
    g = _load_rows(G, rows, cols, mask, inner, sg0, sg1, sg2, CDT)
    xm, r = _stats(x, mask, D, eps, IS_RMS)
    n = xm * r[:, None]
    if HAS_U:  # the product's gradients rounded to the input dtype, as the user's multiply's are
        gn = (g * _load_rows(U, rows, cols, mask, inner, su0, su1, su2, CDT)).to(DX.dtype.element_ty).to(CDT)
        tl.store(DU + out, (g * n.to(DU.dtype.element_ty).to(CDT)).to(DU.dtype.element_ty), mask=mask)
    else:
        gn = g
    inner_ = gn - n * (tl.sum(gn * n, axis=1) / D)[:, None]
    if not IS_RMS:
        inner_ = inner_ - (tl.sum(gn, axis=1) / D)[:, None]
    tl.store(DX + out, (r[:, None] * inner_).to(DX.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# launch helpers


def _view3(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[A, B, D]`` keeping its strides (a copy only if > 3 dims do not collapse)."""
    while t.dim() < 3:
        t = t.unsqueeze(0)
    return t if t.dim() == 3 else t.reshape(-1, t.shape[-2], t.shape[-1])


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _meta(D: int, n_rows: int, kind: str, dtype: torch.dtype, has_u: bool) -> dict:
    """Constexprs and launch options of one call (also what :func:`aot_configs` uses)."""
    block_d = triton.next_power_of_2(D)
    rows = max(1, min(64, _ELEMS // block_d, triton.next_power_of_2(n_rows)))
    cdt = tl.float64 if _cdtype(dtype) == torch.float64 else tl.float32
    return dict(constexprs=dict(BLOCK_D=block_d, ROWS=rows, IS_RMS=kind == "rms", HAS_U=has_u, CDT=cdt),
                num_warps=min(max(rows * block_d // 256, 1), 16 if block_d <= 8192 else 32))


def _note_fallback(op: str, key: str, why: str, stacklevel: int = 3) -> None:
    """The reference runs this call; the registry keeps why, warned once per (op, key)."""
    from .. import note_fallback
    if note_fallback(op, key, why):
        warnings.warn(f"grcompile::{op}: the Triton kernel does not run this call ({why}); the reference runs "
                      "instead (same values, slower)", stacklevel=stacklevel)


def _too_wide(op: str, D: int) -> bool:
    if D > MAX_D:
        _note_fallback(op, f"D={D}", f"rows of D = {D} > {MAX_D} do not fit in registers", stacklevel=4)
    return D > MAX_D


def _empty(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def gated_norm_triton(x: torch.Tensor, u: Optional[torch.Tensor], *, kind: str, eps: float) -> torch.Tensor:
    """``u ⊙ norm(x)`` by :func:`gated_norm_fwd`; contiguous output."""
    _check(x, u, kind, eps)
    D = x.shape[-1]
    if _too_wide("gated_norm", D):
        return _gated_norm_reference(x, u, kind=kind, eps=eps).contiguous()
    y = _empty(x)
    n_rows = x.numel() // D if D else 0
    if n_rows == 0:
        return y
    x3 = _view3(x)
    u3 = x3 if u is None else _view3(u)
    meta = _meta(D, n_rows, kind, x.dtype, u is not None)
    grid = (triton.cdiv(n_rows, meta["constexprs"]["ROWS"]),)
    gated_norm_fwd[grid](x3, u3, y, n_rows, x3.shape[1], D, *_strides(x3), *_strides(u3), float(eps),
                         **meta["constexprs"], num_warps=meta["num_warps"])
    return y


def gated_norm_backward_triton(grad: torch.Tensor, x: torch.Tensor, u: Optional[torch.Tensor], *, kind: str,
                               eps: float) -> list[torch.Tensor]:
    """``[dx]`` (``u`` None) or ``[dx, du]`` by :func:`gated_norm_bwd`; contiguous outputs."""
    _check(x, u, kind, eps)
    D = x.shape[-1]
    if _too_wide("gated_norm_backward", D):
        return [g.contiguous() for g in gated_norm_backward(grad, x, u, kind, eps) if g is not None]
    dx, du = _empty(x), (None if u is None else _empty(u))
    outs = [dx] if du is None else [dx, du]
    n_rows = x.numel() // D if D else 0
    if n_rows == 0:
        return outs
    g3, x3 = _view3(grad), _view3(x)
    u3 = x3 if u is None else _view3(u)
    meta = _meta(D, n_rows, kind, x.dtype, u is not None)
    grid = (triton.cdiv(n_rows, meta["constexprs"]["ROWS"]),)
    gated_norm_bwd[grid](g3, x3, u3, dx, dx if du is None else du, n_rows, x3.shape[1], D, *_strides(g3),
                         *_strides(x3), *_strides(u3), float(eps), **meta["constexprs"],
                         num_warps=meta["num_warps"])
    return outs


# --------------------------------------------------------------------------------------------
# ahead-of-time configs (CUDA target; compiled by the AOT report, one of them by the tests)

_TL = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


AOT_ROWS = 4096  # the AOT report's launch: 4096 contiguous rows


def aot_int_args(D: int, strides: tuple[str, ...]) -> dict[str, int]:
    """The integer arguments a launch on contiguous ``[AOT_ROWS, D]`` tensors passes (``_view3``
    makes them ``[1, rows, D]``): the AOT report compiles that specialisation (unit last stride)."""
    return dict(n_rows=AOT_ROWS, inner=AOT_ROWS, D=D,
                **{f"{s}{i}": st for s in strides for i, st in enumerate((AOT_ROWS * D, D, 1))})


def aot_configs() -> list[dict]:
    """Representative compile configs of both kernels: fp32 / bf16, D in {64, 256, 1024}, layer /
    rms, gated or not. Each dict: ``kernel``, ``fn``, ``signature``, ``constexprs``, ``num_warps``,
    ``num_stages``, ``config`` (JSON-able summary) and ``uses_dot``. Rows are sized as for a batch
    of 4096 rows; integer arguments are the values such a launch passes (``int_args``)."""
    cases = [(torch.float32, 64, "layer", True), (torch.float32, 256, "rms", False),
             (torch.bfloat16, 1024, "layer", True), (torch.bfloat16, 256, "rms", True)]
    configs = []
    for kernel, fn, ptrs, strides in (
            ("gated_norm_fwd", gated_norm_fwd, ("X", "U", "Y"), ("sx", "su")),
            ("gated_norm_bwd", gated_norm_bwd, ("G", "X", "U", "DX", "DU"), ("sg", "sx", "su"))):
        for dtype, D, kind, gated in cases:
            meta = _meta(D, 4096, kind, dtype, gated)
            signature = {p: "*" + _TL[dtype] for p in ptrs}
            signature.update({a: "i32" for a in ("n_rows", "inner", "D")})
            signature.update({f"{s}{i}": "i32" for s in strides for i in range(3)})
            signature["eps"] = "fp32"
            signature.update({c: "constexpr" for c in meta["constexprs"]})
            configs.append(dict(kernel=kernel, fn=fn, signature=signature, constexprs=meta["constexprs"],
                                int_args=aot_int_args(D, strides),
                                num_warps=meta["num_warps"], num_stages=1, uses_dot=False,
                                config=dict(dtype=_TL[dtype], D=D, kind=kind, gated=gated,
                                            rows_per_program=meta["constexprs"]["ROWS"])))
    return configs


__all__ = ["gated_norm_triton", "gated_norm_backward_triton", "aot_configs", "gated_norm_fwd", "gated_norm_bwd",
           "MAX_D"]
