"""``grcompile::gated_norm``: ``u ⊙ norm(x)`` over the last dim, ``norm`` = LayerNorm or RMSNorm
without affine parameters (HSTU's ``u * layer_norm(out)``, FuXi-α's ``rms_norm(out) * u``);
``u=None`` gives the plain norm (the blocks' input norms).

    gated_norm(x [..., D], u [..., D] | None, *, kind: "layer" | "rms", eps: float) -> [..., D]

Reference forward: ``F.layer_norm`` / ``F.rms_norm`` then ``u *`` — the user's own ops in the
input's dtype, so a half-precision model computes exactly what it did unfused (the norm rounded
to bf16 / fp16 before the gate, the product rounded again; torch's half norms keep float32
statistics). Backward: analytic, in float32 for half inputs, rounding where the user's multiply
rounds (``g ⊙ u`` and the norm ``du`` multiplies by), from the saved inputs only:

    n = (x − μ)·r (layer) or x·r (rms),  r = 1/sqrt(var + eps) or 1/sqrt(mean(x²) + eps)
    du = g ⊙ n,   g_n = g ⊙ u
    dx = r·(g_n − mean(g_n) − n·mean(g_n ⊙ n))   (layer; rms drops the mean(g_n) term)

Triton (:mod:`.triton`, imported on first use): one pass per block of rows, fused with the
gate, and a backward kernel writing ``dx`` and ``du`` together. The backward runs as its own op
``grcompile::gated_norm_backward`` (``[dx]`` or ``[dx, du]``) only where the chosen backend for
``x``'s device is Triton; elsewhere the autograd formula stays the plain-torch one above, so the
graphs AOTAutograd traces on CPU are unchanged.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import OPS, lookup, register_op

KINDS = ("layer", "rms")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what torch's norms compute
_OP = "grcompile::gated_norm"


def _check(x: torch.Tensor, u: Optional[torch.Tensor], kind: str, eps: float) -> None:
    if kind not in KINDS:
        raise ValueError(f"{_OP}: kind must be one of {KINDS}, got {kind!r}")
    if x.dim() < 1:
        raise ValueError(f"{_OP}: x must have at least one dim [..., D], got a scalar")
    if x.dtype not in DTYPES:
        raise ValueError(f"{_OP}: x must be float16, bfloat16, float32 or float64, got dtype {x.dtype}")
    if u is not None:
        if u.shape != x.shape:
            raise ValueError(f"{_OP}: u must have the shape of x {tuple(x.shape)}, got {tuple(u.shape)}")
        if u.dtype != x.dtype:
            raise ValueError(f"{_OP}: u must have the dtype of x ({x.dtype}), got {u.dtype}")
        if u.device != x.device:
            raise ValueError(f"{_OP}: u is on {u.device} but x is on {x.device}")
    if not eps >= 0.0:
        raise ValueError(f"{_OP}: eps must be >= 0, got {eps}")


def _cdtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _gated_norm_reference(x: torch.Tensor, u: Optional[torch.Tensor], *, kind: str, eps: float) -> torch.Tensor:
    _check(x, u, kind, eps)
    D = x.shape[-1]
    n = F.layer_norm(x, (D,), eps=eps) if kind == "layer" else F.rms_norm(x, (D,), eps=eps)
    return n if u is None else u * n


def gated_norm_backward(grad: torch.Tensor, x: torch.Tensor, u: Optional[torch.Tensor], kind: str,
                        eps: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Analytic ``(dx, du)`` of ``gated_norm`` (plain torch; usable under tracing)."""
    cd = _cdtype(x.dtype)
    xc, g = x.to(cd), grad.to(cd)
    if kind == "layer":
        xm = xc - xc.mean(dim=-1, keepdim=True)
        r = torch.rsqrt(xm.pow(2).mean(dim=-1, keepdim=True) + eps)
    else:
        xm = xc
        r = torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)
    n = xm * r
    # the multiply's gradients as the user's half-precision multiply rounds them (no-ops in fp32)
    gn = g if u is None else (g * u.to(cd)).to(x.dtype).to(cd)
    inner = gn - n * (gn * n).mean(dim=-1, keepdim=True)
    if kind == "layer":
        inner = inner - gn.mean(dim=-1, keepdim=True)
    dx = (r * inner).to(x.dtype)
    du = None if u is None else (g * n.to(x.dtype).to(cd)).to(u.dtype)
    return dx, du


def _gated_norm_backward_reference(grad: torch.Tensor, x: torch.Tensor, u: Optional[torch.Tensor], *, kind: str,
                                   eps: float) -> list[torch.Tensor]:
    return [g for g in gated_norm_backward(grad, x, u, kind, eps) if g is not None]


register_op("gated_norm", reference=_gated_norm_reference, triton="grcompile.lowering.norm.triton:gated_norm_triton")
register_op("gated_norm_backward", reference=_gated_norm_backward_reference,
            triton="grcompile.lowering.norm.triton:gated_norm_backward_triton")


@torch.library.custom_op("grcompile::gated_norm", mutates_args=())
def gated_norm(x: torch.Tensor, u: Optional[torch.Tensor], *, kind: str, eps: float) -> torch.Tensor:
    """``u ⊙ norm(x)`` (``norm(x)`` if ``u`` is None); see the module docstring. The output is
    contiguous whatever the inputs' strides (a transposed ``x`` is the Conv1d feed-forward's
    usual layout): the fake kernel promises exactly that, so compiled code agrees with it."""
    return lookup("gated_norm", x.device.type)(x, u, kind=kind, eps=eps).contiguous()


@gated_norm.register_fake
def _(x, u, *, kind, eps):
    _check(x, u, kind, eps)
    return x.new_empty(x.shape)  # contiguous, like the real output


def _check_backward(grad: torch.Tensor, x: torch.Tensor, u: Optional[torch.Tensor], kind: str, eps: float) -> None:
    _check(x, u, kind, eps)
    if grad.shape != x.shape or grad.dtype != x.dtype:
        raise ValueError(f"{_OP}_backward: grad must have the shape and dtype of x {tuple(x.shape)} {x.dtype}, "
                         f"got {tuple(grad.shape)} {grad.dtype}")


@torch.library.custom_op("grcompile::gated_norm_backward", mutates_args=())
def gated_norm_backward_op(grad: torch.Tensor, x: torch.Tensor, u: Optional[torch.Tensor], *, kind: str,
                           eps: float) -> list[torch.Tensor]:
    """``[dx]`` (``u`` None) or ``[dx, du]`` of ``gated_norm``, contiguous (a list: a schema cannot
    return an optional tensor)."""
    _check_backward(grad, x, u, kind, eps)
    return [g.contiguous() for g in lookup("gated_norm_backward", x.device.type)(grad, x, u, kind=kind, eps=eps)]


@gated_norm_backward_op.register_fake
def _(grad, x, u, *, kind, eps):
    _check_backward(grad, x, u, kind, eps)
    return [x.new_empty(x.shape)] + ([] if u is None else [u.new_empty(u.shape)])


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    x, u = inputs
    ctx.has_u = u is not None
    if u is not None:
        ctx.save_for_backward(x, u)
    else:
        ctx.save_for_backward(x)
    ctx.kind, ctx.eps = keyword_only_inputs["kind"], keyword_only_inputs["eps"]


def _backward(ctx, grad):
    if ctx.has_u:
        x, u = ctx.saved_tensors
    else:
        (x,), u = ctx.saved_tensors, None
    # Decided when traced: a compiled graph keeps the choice it was traced with (also when the
    # AOTAutograd cache hands it to a later process running another backend; values agree).
    # A backward that is itself differentiated (create_graph) needs the plain-torch formula.
    if not torch.is_grad_enabled() and OPS["gated_norm"].kernel_for(x.device.type)[0] == "triton":
        dx, *du = torch.ops.grcompile.gated_norm_backward(grad, x, u, kind=ctx.kind, eps=ctx.eps)
        return dx, (du[0] if du else None)
    dx, du = gated_norm_backward(grad, x, u, ctx.kind, ctx.eps)
    return dx, du


gated_norm.register_autograd(_backward, setup_context=_setup_context)
GATED_NORM = torch.ops.grcompile.gated_norm.default  # what fuse_norm_gate emits

__all__ = ["gated_norm", "gated_norm_backward", "gated_norm_backward_op", "KINDS", "GATED_NORM"]
