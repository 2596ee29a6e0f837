"""Pass ``fuse_norm_gate``: ``u ⊙ Norm(x)`` and bare input norms → ``grcompile::gated_norm``.

Matches: ``layer_norm(x, (D,))`` / ``rms_norm(x, (D,))`` over the last dim of ``x``, without affine
weight or bias, with a constant eps, on float32 / float64 / bfloat16 / float16 (half dtypes: the op
rounds the norm to the input dtype before the gate and the product after it, as the user's two
ops do; statistics in float32).
When the norm's only user is ``mul(norm, u)`` (either order) with ``u`` of the same shape and
dtype, the product is fused too — HSTU's ``u * layer_norm(attn_out)``, FuXi-α's
``rms_norm(out) * u``; otherwise the norm alone becomes ``gated_norm(x, None)`` (input norms).
Emits: ``torch.ops.grcompile.gated_norm(x, u | None, kind="layer" | "rms", eps=eps)``, one op the
Triton / Ascend kernels replace (one pass per row instead of norm, then gate, then their
backwards); the CPU reference is the same torch ops, so values do not change.
Skips (counted, not reported as fallbacks: nothing is lost): affine norms (SASRec's LayerNorm
modules), norms over more than the last dim, non-constant eps.
Invariant: values and gradients equal the unfused graph's (same reference ops; analytic backward).
Runs anywhere in the pipeline: it is row-wise, so dense ``[B, N, D]`` and jagged ``[T, D]`` alike.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .effects import WriteOrder
from .pass_manager import GraphPass, PassContext, substitute
from ..lowering.norm import GATED_NORM
from .op_semantics import arg, canonical, example, example_tensor, refresh_example_values
from .symbolic import known_eq

_KINDS = {"layer_norm": "layer", "rms_norm": "rms"}
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _match_norm(node: fx.Node) -> tuple[str, float] | str:
    """``(kind, eps)`` for a fusable norm, else the reason it is skipped."""
    op = canonical(node)
    x = node.args[0]
    xv = example_tensor(x)
    if xv is None:
        return "no_shape"
    if xv.dtype not in _DTYPES:
        return "dtype"
    shape = arg(node, 1, "normalized_shape")
    shape = [shape] if isinstance(shape, int) else list(shape or [])
    if len(shape) != 1 or not known_eq(example(shape[0]), xv.shape[-1]):
        return "not_last_dim"
    if op == "layer_norm":
        weight, bias, eps = arg(node, 2, "weight"), arg(node, 3, "bias"), arg(node, 4, "eps", 1e-5)
    else:
        weight, bias, eps = arg(node, 2, "weight"), None, arg(node, 3, "eps")
        if eps is None:  # F.rms_norm's default: the epsilon of its compute dtype (float32 for half inputs)
            eps = torch.finfo(torch.promote_types(xv.dtype, torch.float32)).eps
    if weight is not None or bias is not None:
        return "affine"
    if not isinstance(eps, (int, float)):
        return "eps_not_constant"
    return _KINDS[op], float(eps)


def _gate_of(norm: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(mul node, u)`` when the norm's only user multiplies it by a same-shape, same-dtype ``u``."""
    if len(norm.users) != 1:
        return None
    mul = next(iter(norm.users))
    if canonical(mul) != "mul" or len(mul.args) != 2 or mul.kwargs:
        return None
    a, b = mul.args
    u = b if a is norm else a if b is norm else None
    nv, uv = example_tensor(norm), example_tensor(u)
    if u is None or u is norm or nv is None or uv is None:
        return None
    if uv.dim() != nv.dim() or not all(known_eq(a, b) for a, b in zip(uv.shape, nv.shape)) or uv.dtype != nv.dtype:
        return None
    return mul, u


class FuseNormGate(GraphPass):
    name = "fuse_norm_gate"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        refresh_example_values(gm, strict=False)  # nodes an earlier pass inserted (the jagged block)
        g = gm.graph
        write_order = WriteOrder(g)  # the fused op reads the norm's input where the gate was
        for node in list(g.nodes):
            if node.op != "call_function" or canonical(node) not in _KINDS:
                continue
            match = _match_norm(node)
            if isinstance(match, str):
                ctx.count(f"skipped_{match}")
                continue
            kind, eps = match
            gate = _gate_of(node)
            if gate is not None and (write_order.between(node.args[0], gate[0]) is not None
                                     or write_order.between(node, gate[0]) is not None):
                ctx.count("skipped_gate_written_in_place")  # a write between the norm and its gate
                gate = None
            replaced, u = gate if gate is not None else (node, None)
            with g.inserting_before(replaced):
                fused = g.call_function(GATED_NORM, (node.args[0], u),
                                        {"kind": kind, "eps": eps})
            substitute(g, fused, replaced, node)  # reports name the user's norm line
            ctx.rewrite("gated_norm" if u is not None else "norm", fused, kind=kind, eps=eps)


__all__ = ["FuseNormGate"]
