"""``grcompile::score_mod_attention`` — the padded-interface face of ``jagged_attention``.

``fuse_attention`` emits it on the user's dense ``[B, N, H, d]`` q, k, v and ``[B, N]`` validity,
so the rewritten graph keeps static shapes; inside, the op packs the valid tokens (a data-
dependent count T, invisible to the compiler), runs ``grcompile::jagged_attention``'s kernel with
the captured score_mod (``kind="score"``), and scatters the result back (zeros at padding)::

    out[b, i] = Σ_j A(b, i, j) · v[b, j]   over the valid keys j of row b (j ≤ i when ``causal``)
    A = score_mod(q_i·k_j, pos_i, pos_j, *q_sides, *k_sides, *tables)    normalize="none"
    A = softmax_j(score_mod(...))                                       normalize="softmax"
    A ← A · keep / (1 − dropout_p)     (attention dropout; keep hashed from ``seed``, see jagged_attention)

Backward is its own op (recomputation inside the jagged kernel), so AOTAutograd never traces the
data-dependent packing. Once the jagged rewrite keeps whole blocks packed, it calls
``jagged_attention`` directly and this wrapper's pack/unpack disappears.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import lookup, register_op
from .attention import note_variant
from .attention.side_ranges import measured_sides
from .jagged import dense_to_jagged, jagged_index, jagged_to_dense, padded_positions, valid_to_offsets
from .score_mod import get_score_mod, register_score_mod  # noqa: F401 (re-exported for passes)
from .semantics import declare

_ACTIVATION = {"none": "identity", "softmax": "softmax"}


def _check(q, k, v, valid, q_sides, k_sides, normalize) -> None:
    if valid.dtype != torch.bool or valid.dim() != 2:
        raise ValueError(f"score_mod_attention: valid must be a bool [B, N] mask, got {valid.dtype} {tuple(valid.shape)}")
    B, N = valid.shape
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, N):
        raise ValueError(f"score_mod_attention: v must be [B, N, H, dv] with B, N = {B}, {N}; got {tuple(v.shape)}")
    if (q is None) != (k is None):
        raise ValueError("score_mod_attention: q and k are both given or both None")
    if q is not None and (q.dim() != 4 or tuple(q.shape[:2]) != (B, N) or q.shape != k.shape or q.shape[2] != v.shape[2]):
        raise ValueError(f"score_mod_attention: q, k must be [B, N, H, d] like v; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    for name, sides in (("q_sides", q_sides), ("k_sides", k_sides)):
        for i, s in enumerate(sides):
            if tuple(s.shape) != (B, N):
                raise ValueError(f"score_mod_attention: {name}[{i}] must be [B, N] = [{B}, {N}], got {tuple(s.shape)}")
    if normalize not in _ACTIVATION:
        raise ValueError(f"score_mod_attention: normalize must be 'none' or 'softmax', got {normalize!r}")


def _packed(q, k, v, valid, q_sides, k_sides):
    index = jagged_index(valid)
    N = valid.shape[1]
    if q is None:  # a bias-only channel (FuXi): the kernel ignores q·k when use_qk=False
        q = k = v.new_zeros(v.shape[0], N, v.shape[2], 1)
    return (index, dense_to_jagged(q, index), dense_to_jagged(k, index), dense_to_jagged(v, index),
            valid_to_offsets(valid), padded_positions(index, N),
            [dense_to_jagged(s, index) for s in q_sides], [dense_to_jagged(s, index) for s in k_sides])


def _kwargs(q, valid, score_mod, normalize, causal, dropout_p):
    # max_len >= 1 for the kernel's checks; with N == 0 there is no token, so the bound is moot
    return dict(score_mod=score_mod, use_qk=q is not None, activation=_ACTIVATION[normalize], scale=1.0,
                out_scale=1.0, causal=causal, max_len=max(1, valid.shape[1]), dropout_p=dropout_p)


def _score_mod_attention_dense(q, k, v, valid, q_sides, k_sides, tables, seed, score_mod, normalize, causal,
                               dropout_p):
    """Pack, run ``jagged_attention`` (whose kernel the device picks), scatter back: the op is a
    composite, so its only implementation is this one on every backend."""
    index, qj, kj, vj, offsets, positions, qs, ks = _packed(q, k, v, valid, q_sides, k_sides)
    kwargs = _kwargs(q, valid, score_mod, normalize, causal, dropout_p)
    with measured_sides(qs, ks, enabled=bool(score_mod)) as side_ranges:  # once, for the kernel too
        out = lookup("jagged_attention", v.device.type)(qj, kj, vj, offsets, positions, qs, ks, list(tables), seed,
                                                        **kwargs)
    note_variant(qj, vj, qs, ks, tables, score_mod=score_mod, activation=_ACTIVATION[normalize], causal=causal,
                 use_qk=q is not None, dropout_p=dropout_p, max_len=kwargs["max_len"], side_ranges=side_ranges)
    B, N = valid.shape
    return jagged_to_dense(out, index, B, N)


register_op("score_mod_attention", reference=_score_mod_attention_dense)


@torch.library.custom_op("grcompile::score_mod_attention", mutates_args=())
def score_mod_attention(q: Optional[torch.Tensor], k: Optional[torch.Tensor], v: torch.Tensor, valid: torch.Tensor,
                        q_sides: list[torch.Tensor], k_sides: list[torch.Tensor], tables: list[torch.Tensor],
                        seed: Optional[torch.Tensor], score_mod: str, normalize: str, causal: bool,
                        dropout_p: float) -> torch.Tensor:
    """Every argument is required: one left to its default would change the structure autograd
    expects back from the backward."""
    _check(q, k, v, valid, q_sides, k_sides, normalize)
    return lookup("score_mod_attention", v.device.type)(q, k, v, valid, q_sides, k_sides, tables, seed, score_mod,
                                                        normalize, causal, dropout_p)


@score_mod_attention.register_fake
def _(q, k, v, valid, q_sides, k_sides, tables, seed, score_mod, normalize, causal, dropout_p):
    _check(q, k, v, valid, q_sides, k_sides, normalize)
    return v.new_empty(v.shape)  # contiguous, like jagged_to_dense's result whatever v's strides


def _score_mod_attention_backward_dense(grad, q, k, v, valid, q_sides, k_sides, tables, score_mod, normalize, causal,
                                        seed, dropout_p):
    index, qj, kj, vj, offsets, positions, qs, ks = _packed(q, k, v, valid, q_sides, k_sides)
    dq, dk, dv, dqs, dks, dtables = lookup("jagged_attention_backward", v.device.type)(
        dense_to_jagged(grad, index).contiguous(), qj, kj, vj, offsets, positions, qs, ks, list(tables), seed,
        **_kwargs(q, valid, score_mod, normalize, causal, dropout_p))
    B, N = valid.shape
    dense = [jagged_to_dense(g, index, B, N) if q is not None else grad.new_empty(0) for g in (dq, dk)]
    sides = [jagged_to_dense(g, index, B, N) if s.is_floating_point() else grad.new_empty(0)
             for g, s in zip([*dqs, *dks], [*q_sides, *k_sides])]
    return [*dense, jagged_to_dense(dv, index, B, N), *sides, *(d.contiguous() for d in dtables)]


register_op("score_mod_attention_backward", reference=_score_mod_attention_backward_dense)


@torch.library.custom_op("grcompile::score_mod_attention_backward", mutates_args=())
def score_mod_attention_backward(grad: torch.Tensor, q: Optional[torch.Tensor], k: Optional[torch.Tensor],
                                 v: torch.Tensor, valid: torch.Tensor, q_sides: list[torch.Tensor],
                                 k_sides: list[torch.Tensor], tables: list[torch.Tensor], score_mod: str,
                                 normalize: str, causal: bool, seed: Optional[torch.Tensor],
                                 dropout_p: float) -> list[torch.Tensor]:
    """``[dq, dk, dv, *dq_sides, *dk_sides, *dtables]`` (dense; empty tensors for a missing q/k and
    for integer sides or tables)."""
    return lookup("score_mod_attention_backward", v.device.type)(grad, q, k, v, valid, q_sides, k_sides, tables,
                                                                 score_mod, normalize, causal, seed, dropout_p)


@score_mod_attention_backward.register_fake
def _(grad, q, k, v, valid, q_sides, k_sides, tables, score_mod, normalize, causal, seed, dropout_p):
    # every gradient is contiguous (the real one is scattered back densely), whatever the inputs' strides
    return [t.new_empty(t.shape) if t is not None else grad.new_empty(0) for t in (q, k)] + [v.new_empty(v.shape)] + \
        [t.new_empty(t.shape) if t.is_floating_point() else grad.new_empty(0) for t in (*q_sides, *k_sides, *tables)]


def _setup_context(ctx, inputs, output):
    q, k, v, valid, q_sides, k_sides, tables, seed, score_mod, normalize, causal, dropout_p = inputs
    ctx.has_qk, ctx.has_seed = q is not None, seed is not None
    ctx.counts = (len(q_sides), len(k_sides), len(tables))
    ctx.options = dict(score_mod=score_mod, normalize=normalize, causal=causal, dropout_p=dropout_p)
    ctx.save_for_backward(*([q, k] if q is not None else []), v, valid, *q_sides, *k_sides, *tables,
                          *([seed] if seed is not None else []))


def _backward(ctx, grad):
    saved = list(ctx.saved_tensors)
    seed = saved.pop() if ctx.has_seed else None
    q, k = (saved.pop(0), saved.pop(0)) if ctx.has_qk else (None, None)
    v, valid = saved.pop(0), saved.pop(0)
    nq, nk, _ = ctx.counts
    q_sides, k_sides, tables = saved[:nq], saved[nq:nq + nk], saved[nq + nk:]
    dq, dk, dv, *rest = torch.ops.grcompile.score_mod_attention_backward(
        grad.contiguous(), q, k, v, valid, q_sides, k_sides, tables, seed=seed, **ctx.options)
    if not ctx.has_qk:
        dq = dk = None
    rest = [d if t.is_floating_point() else None for d, t in zip(rest, [*q_sides, *k_sides, *tables])]
    return dq, dk, dv, None, rest[:nq], rest[nq:nq + nk], rest[nq + nk:], None, None, None, None, None


score_mod_attention.register_autograd(_backward, setup_context=_setup_context)
SCORE_MOD_ATTENTION = torch.ops.grcompile.score_mod_attention.default  # what fuse_attention emits
declare("fused_attention", SCORE_MOD_ATTENTION)
