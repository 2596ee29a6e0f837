"""The ``grcompile::jagged_attention`` op: its schema, fake implementation and autograd formula,
the registration of its reference and kernel slots and the record of the variants it ran (see
the package docstring for the math)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import lookup, register_op
from .reference import _attention_backward_reference, _attention_reference, _grad_placeholder
from .side_ranges import measured_sides
from .validation import _check_dropout, _check_meta

register_op("jagged_attention", reference=_attention_reference,
            triton="grcompile.lowering.attention.triton:attention_triton",
            ascend="grcompile.lowering.attention.ascend:attention_ascend")
register_op("jagged_attention_backward", reference=_attention_backward_reference,
            triton="grcompile.lowering.attention.triton:attention_backward_triton",
            ascend="grcompile.lowering.attention.ascend:attention_backward_ascend")


# --------------------------------------------------------------------------------------------
# the custom ops


def jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                     positions: torch.Tensor, q_side: list[torch.Tensor], k_side: list[torch.Tensor],
                     tables: list[torch.Tensor], seed: Optional[torch.Tensor], *, score_mod: str,
                     use_qk: bool, activation: str, scale: float, out_scale: float, causal: bool, max_len: int,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """See the package docstring. ``seed`` is required (``None`` without dropout): an argument left
    to its default would change the structure autograd expects back from the backward.

    A composite of :func:`jagged_attention_fwd` (its output; AOTAutograd traces through it): the
    passes emit this one-output op, and the backward still gets the softmax's log-sum-exp the
    forward computed."""
    return torch.ops.grcompile.jagged_attention_fwd(
        q, k, v, offsets, positions, q_side, k_side, tables, seed, score_mod=score_mod, use_qk=use_qk,
        activation=activation, scale=scale, out_scale=out_scale, causal=causal, max_len=max_len,
        dropout_p=dropout_p)[0]


torch.library.define("grcompile::jagged_attention", torch.library.infer_schema(jagged_attention, mutates_args=()))
torch.library.impl("grcompile::jagged_attention", "CompositeImplicitAutograd")(jagged_attention)


@torch.library.custom_op("grcompile::jagged_attention_fwd", mutates_args=())
def jagged_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                         positions: torch.Tensor, q_side: list[torch.Tensor], k_side: list[torch.Tensor],
                         tables: list[torch.Tensor], seed: Optional[torch.Tensor], *, score_mod: str,
                         use_qk: bool, activation: str, scale: float, out_scale: float, causal: bool, max_len: int,
                         dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: ``jagged_attention``'s output and, for the softmax, the log-sum-exp of each
    (token, head)'s allowed scores before dropout (``[T, H]``, float32 — float64 for float64
    inputs; ``+inf`` on a query with no allowed key), which the backward reads instead of
    recomputing the forward; ``[0]`` for SiLU / identity, whose backward needs none."""
    impl = lookup("jagged_attention", q.device.type)
    with measured_sides(q_side, k_side, enabled=bool(score_mod)) as side_ranges:  # once, for the kernel too
        out, lse = impl(q, k, v, offsets, positions, list(q_side), list(k_side), list(tables), seed,
                        score_mod=score_mod, use_qk=use_qk, activation=activation, scale=scale,
                        out_scale=out_scale, causal=causal, max_len=max_len, dropout_p=dropout_p, with_lse=True)
    # after the call, whose checks reject malformed arguments with a ValueError (recording first
    # read q.shape[2] of a rank-2 q: an IndexError instead)
    note_variant(q, v, q_side, k_side, tables, score_mod=score_mod, activation=activation, causal=causal,
                 use_qk=use_qk, dropout_p=dropout_p, max_len=max_len, side_ranges=side_ranges)
    return out, lse


def lse_like(q: torch.Tensor, activation: str) -> torch.Tensor:
    """An empty ``lse`` of the shape and dtype :func:`jagged_attention_fwd` returns for ``q``."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((q.shape[0], q.shape[1]) if activation == "softmax" else (0,), dtype=dtype)


# (score_mod, activation, causal, use_qk, dropout, dtype, dqk, dv, q_side dtypes, k_side dtypes,
# table (shape, dtype)s, (max_len, heads), side ranges) -> calls: the attention variants this process
# ran, whatever the kernel (the bench compiles their Triton kernels ahead of time from this)
SEEN_VARIANTS: dict[tuple, int] = {}


def note_variant(q, v, q_side, k_side, tables, *, score_mod: str, activation: str, causal: bool, use_qk: bool,
                 dropout_p: float, max_len: int, side_ranges: tuple) -> None:
    """Count one call of this variant; ``side_ranges``: :func:`.side_ranges.measured_sides`'."""
    key = (score_mod, activation, causal, use_qk, dropout_p > 0, q.dtype, int(q.shape[2]), int(v.shape[2]),
           tuple(t.dtype for t in q_side), tuple(t.dtype for t in k_side),
           tuple((tuple(int(n) for n in t.shape), t.dtype) for t in tables), (int(max_len), int(q.shape[1])),
           tuple(side_ranges) if score_mod else ())
    SEEN_VARIANTS[key] = SEEN_VARIANTS.get(key, 0) + 1


@jagged_attention_fwd.register_fake
def _(q, k, v, offsets, positions, q_side, k_side, tables, seed, *, score_mod, use_qk, activation, scale,
      out_scale, causal, max_len, dropout_p=0.0):
    _check_meta(q, k, v, offsets, positions, q_side, k_side, tables, score_mod, activation, max_len)
    _check_dropout(seed, dropout_p, q.device)
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), lse_like(q, activation)


@torch.library.custom_op("grcompile::jagged_attention_backward", mutates_args=())
def jagged_attention_backward(
        grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
        positions: torch.Tensor, q_side: list[torch.Tensor], k_side: list[torch.Tensor],
        tables: list[torch.Tensor], seed: Optional[torch.Tensor] = None, fwd_out: Optional[torch.Tensor] = None,
        fwd_lse: Optional[torch.Tensor] = None, *, score_mod: str, use_qk: bool,
        activation: str, scale: float, out_scale: float, causal: bool, max_len: int, dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Gradients of ``jagged_attention`` by recomputation (the dropout mask is recomputed from
    ``seed``); integer side tensors / tables get an empty float placeholder (the autograd wrapper
    turns it into ``None``). ``fwd_lse`` / ``fwd_out``: the forward's log-sum-exp and output
    (softmax; :func:`jagged_attention_fwd`): given, the softmax weights are ``exp(s − lse)`` and the
    row sum of the backward is ``Σ dO∘out``; None (or an empty ``fwd_lse``), they are recomputed
    (a kernel that needs both reruns the forward when ``fwd_out`` is None). ``positions`` must
    increase strictly within each row, as the forward checked (not checked again here)."""
    impl = lookup("jagged_attention_backward", q.device.type)
    stats = {} if fwd_lse is None or not fwd_lse.numel() else dict(fwd_out=fwd_out, fwd_lse=fwd_lse)
    return impl(grad_out, q, k, v, offsets, positions, list(q_side), list(k_side), list(tables), seed,
                score_mod=score_mod, use_qk=use_qk, activation=activation, scale=scale, out_scale=out_scale,
                causal=causal, max_len=max_len, dropout_p=dropout_p, **stats)


@jagged_attention_backward.register_fake
def _(grad_out, q, k, v, offsets, positions, q_side, k_side, tables, seed=None, fwd_out=None, fwd_lse=None, *,
      score_mod, use_qk, activation, scale, out_scale, causal, max_len, dropout_p=0.0):
    def like(ts):
        return [torch.empty_like(t) if t.is_floating_point() else _grad_placeholder(t) for t in ts]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), like(q_side), like(k_side), like(tables)


_KWARGS = ("score_mod", "use_qk", "activation", "scale", "out_scale", "causal", "max_len", "dropout_p")


def _traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake (or functional) tensor of a trace, whose in-place writes become
    out-of-place ops: AOTAutograd's joint graph (torch.compile), not eager execution."""
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, offsets, positions, q_side, k_side, tables, seed = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.n_q_side, ctx.n_k_side = len(q_side), len(k_side)
    ctx.has_seed = seed is not None
    # the softmax's backward reads the forward's log-sum-exp and output (usually saved anyway: the
    # projection after the attention reads it). Where AOTAutograd traces the op, in-place writes
    # become out-of-place ops and the output is saved. Run eagerly (lowering="eager", a direct
    # call), a saved output would make an in-place write that eager allows (`out += residual`)
    # fail the backward: there it is kept unsaved with its version, and used only if unchanged.
    ctx.has_lse = keyword_only_inputs["activation"] == "softmax"  # not lse.numel(): T may be unbacked
    ctx.has_out = ctx.has_lse and _traced(out)
    ctx.eager_out = out.detach() if ctx.has_lse and not ctx.has_out else None  # no grad_fn: no reference cycle
    ctx.eager_out_version = out._version if ctx.eager_out is not None else None
    ctx.save_for_backward(q, k, v, offsets, positions, *q_side, *k_side, *tables, *([seed] if ctx.has_seed else []),
                          *([out] if ctx.has_out else []), *([lse] if ctx.has_lse else []))
    ctx.kwargs = {name: keyword_only_inputs[name] for name in _KWARGS}
    ctx.floating = [t.is_floating_point() for t in (*q_side, *k_side, *tables)]


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, offsets, positions, *rest = ctx.saved_tensors
    fwd_lse = rest.pop() if ctx.has_lse else None
    fwd_out = rest.pop() if ctx.has_out else None
    if ctx.eager_out is not None and ctx.eager_out._version == ctx.eager_out_version:
        fwd_out = ctx.eager_out  # written in place since (a shared version counter): summed in the backward
    seed = rest.pop() if ctx.has_seed else None
    q_side, k_side = rest[:ctx.n_q_side], rest[ctx.n_q_side:ctx.n_q_side + ctx.n_k_side]
    tables = rest[ctx.n_q_side + ctx.n_k_side:]
    dq, dk, dv, d_qs, d_ks, d_tables = torch.ops.grcompile.jagged_attention_backward(
        grad_out.contiguous(), q, k, v, offsets, positions, list(q_side), list(k_side), list(tables), seed, fwd_out,
        fwd_lse, **ctx.kwargs)
    flags = iter(ctx.floating)
    d_qs = [g if next(flags) else None for g in d_qs]
    d_ks = [g if next(flags) else None for g in d_ks]
    d_tables = [g if next(flags) else None for g in d_tables]
    return dq, dk, dv, None, None, d_qs, d_ks, d_tables, None


jagged_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
JAGGED_ATTENTION = torch.ops.grcompile.jagged_attention.default  # what the jagged rewrite emits


__all__ = ["jagged_attention", "jagged_attention_fwd", "jagged_attention_backward", "lse_like", "note_variant", "SEEN_VARIANTS", "JAGGED_ATTENTION"]
