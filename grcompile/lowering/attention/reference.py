"""The reference forward and backward of ``grcompile::jagged_attention`` (CPU, and the fallback of
every device without a kernel): rows bucketed (:mod:`.buckets`), each chunk computed by
:mod:`.chunks`. The backward is analytic per chunk (:func:`_analytic_backward`): each chunk's
forward recomputed and differentiated by hand, the score_mod by its VJP."""
from __future__ import annotations

import torch

from .buckets import _chunks
from .chunks import _chunk_backward_kernel, _chunk_kernel, mask_limits, mask_positions
from .dropout import dropout_rows
from .overflow import overflow_reason, warn_uncompiled
from .validation import _check_dropout, _check_meta, _check_values


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _gather_heads(x: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, H, d], index [n, L] -> [n, H, L, d] in ``dtype``."""
    return x[index].to(dtype).transpose(1, 2)


def _attention_reference(q, k, v, offsets, positions, q_side, k_side, tables, seed=None, *, score_mod, use_qk,
                         activation, scale, out_scale, causal, max_len, dropout_p=0.0, with_lse=False):
    """The output ``[T, H, dv]``; ``with_lse``: ``(out, lse)``, ``lse`` as
    ``jagged_attention_fwd`` returns it (``op.lse_like``)."""
    _check_meta(q, k, v, offsets, positions, q_side, k_side, tables, score_mod, activation, max_len)
    _check_dropout(seed, dropout_p, q.device)
    T, H, dv = q.shape[0], q.shape[1], v.shape[2]
    offs = _check_values(offsets, positions, T, max_len)
    out = torch.zeros(T, H, dv, dtype=q.dtype, device=q.device)
    cdtype = _compute_dtype(q.dtype)
    softmax = activation == "softmax"
    lse = torch.full((T, H) if softmax else (0,), float("inf"), dtype=cdtype, device=q.device)
    kernel = _chunk_kernel(score_mod, dtype=cdtype, use_qk=use_qk, activation=activation, scale=scale,
                           out_scale=out_scale, causal=causal, dropout_p=dropout_p,
                           head_widths=(q.shape[2], v.shape[2]),
                           uncompiled=_may_overflow(score_mod, q_side, k_side, tables, max_len, H))
    mask_pos = mask_positions(positions, max_len)
    with torch.no_grad():
        for qi, qv, ki, kv in _chunks(offs, H, causal, q.device):
            o, lse_chunk = kernel(_gather_heads(q, qi, cdtype), _gather_heads(k, ki, cdtype),
                                  _gather_heads(v, ki, cdtype), positions[qi], positions[ki],
                                  *mask_limits(mask_pos, qi, ki, kv), [t[qi] for t in q_side], [t[ki] for t in k_side],
                                  tables, _drop_rows(seed, qi, H, dropout_p), ki)
            out.index_copy_(0, qi[qv], o.transpose(1, 2)[qv].to(q.dtype))
            if softmax:  # [n, H or 1, Lq] (1: no q·k and no per-head score_mod)
                lse.index_copy_(0, qi[qv], lse_chunk.expand(o.shape[:3]).transpose(1, 2)[qv].to(cdtype))
    return (out, lse) if with_lse else out


def _may_overflow(score_mod: str, q_side, k_side, tables, max_len: int, heads: int) -> bool:
    """Whether the call must run uncompiled chunks, its score_mod's integers possibly overflowing
    (:mod:`.overflow`; warned once)."""
    reason = overflow_reason(score_mod, q_side, k_side, tables, max_len=max_len, heads=heads)
    if reason is not None:
        warn_uncompiled(score_mod, reason)
    return reason is not None


def _drop_rows(seed: torch.Tensor | None, q_index: torch.Tensor, heads: int, dropout_p: float) -> torch.Tensor:
    """The dropout hash's per-query half for a chunk (a placeholder without dropout)."""
    return dropout_rows(seed, q_index, heads) if dropout_p > 0 else q_index


def _grad_placeholder(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=t.device)


def _accumulator(t: torch.Tensor) -> torch.Tensor:
    """A zeroed gradient accumulator for ``t``: float32 for half-precision tensors (a key's gradient
    sums over every chunk that reads it: one rounding to bf16 at the end, not one per chunk)."""
    return torch.zeros_like(t, dtype=_compute_dtype(t.dtype)) if t.is_floating_point() else _grad_placeholder(t)


def _attention_backward_reference(grad_out, q, k, v, offsets, positions, q_side, k_side, tables, seed=None,
                                  fwd_out=None, fwd_lse=None, *, score_mod, use_qk, activation, scale, out_scale,
                                  causal, max_len, dropout_p=0.0):
    """``fwd_out`` / ``fwd_lse``: the forward's output and log-sum-exp (softmax), read instead of
    recomputing the row's normaliser (see ``jagged_attention_backward``)."""
    offs = offsets.tolist()
    stats = None
    if activation == "softmax" and fwd_out is not None and fwd_lse is not None and fwd_lse.numel():
        cdtype = _compute_dtype(q.dtype)
        # Σ dO∘out from an output kept in the compute dtype; a half-precision output is rounded,
        # so each chunk sums Σ A∘G itself (as before: as close to float64 as bf16 gradients get)
        delta = (grad_out.to(cdtype) * fwd_out.to(cdtype)).sum(-1) if fwd_out.dtype == cdtype else None
        stats = (fwd_lse.to(cdtype), delta)
    dq, dk, dv = _accumulator(q), _accumulator(k), _accumulator(v)
    d_qs, d_ks, d_tables = ([_accumulator(t) for t in group] for group in (q_side, k_side, tables))
    _analytic_backward(grad_out, q, k, v, offs, positions, q_side, k_side, tables, seed, stats=stats,
                       grads=(dq, dk, dv, d_qs, d_ks, d_tables), score_mod=score_mod, use_qk=use_qk,
                       activation=activation, scale=scale, out_scale=out_scale, causal=causal, max_len=max_len,
                       dropout_p=dropout_p)
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    d_qs, d_ks, d_tables = ([g.to(t.dtype) if t.is_floating_point() else g for g, t in zip(gs, ts)]
                            for gs, ts in ((d_qs, q_side), (d_ks, k_side), (d_tables, tables)))
    return dq, dk, dv, d_qs, d_ks, d_tables


def _analytic_backward(grad_out, q, k, v, offs, positions, q_side, k_side, tables, seed, *, grads, score_mod, use_qk,
                       activation, scale, out_scale, causal, max_len, dropout_p, stats=None) -> None:
    """:func:`.chunks._chunk_backward` over every chunk, no autograd tape; adds into the
    accumulators ``grads``. Without a score_mod, side tensors and tables are read by nothing: no
    gradient. ``stats``: ``(lse, delta | None)`` ``[T, H]`` of the softmax's forward, or None."""
    dq, dk, dv, d_qs, d_ks, d_tables = grads
    H = q.shape[1]
    cdtype = _compute_dtype(q.dtype)
    kernel = _chunk_backward_kernel(score_mod, dtype=cdtype, use_qk=use_qk, activation=activation, scale=scale,
                                    out_scale=out_scale, causal=causal, dropout_p=dropout_p,
                                    head_widths=(q.shape[2], v.shape[2]),
                                    table_grads=bool(score_mod) and any(t.is_floating_point() for t in tables),
                                    stats=(stats is not None, stats is not None and stats[1] is not None),
                                    uncompiled=_may_overflow(score_mod, q_side, k_side, tables, max_len, H))
    mask_pos = mask_positions(positions, max_len)
    table_values = [t.detach() for t in tables]
    for qi, qv, ki, kv in _chunks(offs, H, causal, q.device):
        go = torch.where(qv[:, :, None, None], grad_out[qi].to(cdtype), 0.0).transpose(1, 2)
        extra = {}
        if stats is not None:  # delta 0 at padded query slots: their dO is 0, so is their Σ A∘G
            lse, delta = stats
            extra = dict(lse=lse[qi].transpose(1, 2))
            if delta is not None:
                extra["delta"] = torch.where(qv[:, :, None], delta[qi], 0.0).transpose(1, 2)
        d_qb, d_kb, d_vb, side_grads = kernel(
            _gather_heads(q, qi, cdtype), _gather_heads(k, ki, cdtype), _gather_heads(v, ki, cdtype), positions[qi],
            positions[ki], *mask_limits(mask_pos, qi, ki, kv), [t[qi] for t in q_side], [t[ki] for t in k_side],
            table_values, _drop_rows(seed, qi, H, dropout_p), ki, grad_out=go, **extra)
        qvalid, kvalid = qi[qv], ki[kv]
        if use_qk:
            dq.index_add_(0, qvalid, d_qb.transpose(1, 2)[qv].to(dq.dtype))
            dk.index_add_(0, kvalid, d_kb.transpose(1, 2)[kv].to(dk.dtype))
        dv.index_add_(0, kvalid, d_vb.transpose(1, 2)[kv].to(dv.dtype))
        if not score_mod:
            continue
        side_grads = iter(side_grads)  # q sides, k sides, tables: the floating ones, in that order
        for accs, tensors, index, valid in ((d_qs, q_side, qvalid, qv), (d_ks, k_side, kvalid, kv)):
            for acc, t in zip(accs, tensors):
                if t.is_floating_point():
                    acc.index_add_(0, index, next(side_grads)[valid].to(acc.dtype))
        for acc, t in zip(d_tables, tables):
            if t.is_floating_point():
                acc += next(side_grads).to(acc.dtype)
