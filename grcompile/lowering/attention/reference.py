"""The reference forward and backward of ``grcompile::jagged_attention`` (CPU, and the fallback of
every device without a kernel): rows bucketed (:mod:`.buckets`), each chunk computed by
:mod:`.chunks`; the backward recomputes each chunk under a local autograd tape."""
from __future__ import annotations

import contextlib

import torch

from .buckets import _chunks
from .chunks import _chunk_kernel, _compile_errors, _CompiledChunk
from .validation import _check_dropout, _check_meta, _check_values


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _gather_heads(x: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, H, d], index [n, L] -> [n, H, L, d] in ``dtype``."""
    return x[index].to(dtype).transpose(1, 2)


def _attention_reference(q, k, v, offsets, positions, q_side, k_side, tables, seed=None, *, score_mod, use_qk,
                         activation, scale, out_scale, causal, max_len, dropout_p=0.0):
    _check_meta(q, k, v, offsets, positions, q_side, k_side, tables, score_mod, activation, max_len)
    _check_dropout(seed, dropout_p, q.device)
    T, H, dv = q.shape[0], q.shape[1], v.shape[2]
    offs = _check_values(offsets, positions, T, max_len)
    out = torch.zeros(T, H, dv, dtype=q.dtype, device=q.device)
    cdtype = _compute_dtype(q.dtype)
    kernel = _chunk_kernel(score_mod, dtype=cdtype, use_qk=use_qk, activation=activation, scale=scale,
                           out_scale=out_scale, causal=causal, dropout_p=dropout_p,
                           head_widths=(q.shape[2], v.shape[2]))
    with torch.no_grad():
        for qi, qv, ki, kv in _chunks(offs, H, causal, q.device):
            o = kernel(_gather_heads(q, qi, cdtype), _gather_heads(k, ki, cdtype), _gather_heads(v, ki, cdtype),
                       positions[qi], positions[ki], kv, [t[qi] for t in q_side], [t[ki] for t in k_side], tables,
                       qi, ki, seed)
            out.index_copy_(0, qi[qv], o.transpose(1, 2)[qv].to(q.dtype))
    return out


@contextlib.contextmanager
def _autograd_reenabled():
    """Re-enable autograd inside a custom op's implementation.

    A custom op's kernel runs below the Autograd dispatch key (the autograd keys sit in the
    thread-local exclude set), so ``torch.enable_grad()`` alone records nothing. The backward
    recomputation needs a local tape: drop the autograd keys from the exclude set for its scope."""
    C, DK = torch._C, torch._C.DispatchKey
    include, exclude = C._dispatch_tls_local_include_set(), C._dispatch_tls_local_exclude_set()
    for key in (DK.AutogradFunctionality, DK.AutogradOther, DK.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def _grad_placeholder(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=t.device)


def _attention_backward_reference(grad_out, q, k, v, offsets, positions, q_side, k_side, tables, seed=None, *,
                                  score_mod, use_qk, activation, scale, out_scale, causal, max_len, dropout_p=0.0):
    H = q.shape[1]
    offs = offsets.tolist()
    cdtype = _compute_dtype(q.dtype)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d_qs = [torch.zeros_like(t) if t.is_floating_point() else _grad_placeholder(t) for t in q_side]
    d_ks = [torch.zeros_like(t) if t.is_floating_point() else _grad_placeholder(t) for t in k_side]
    table_leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tables]
    d_tables = [torch.zeros_like(t) if t.is_floating_point() else _grad_placeholder(t) for t in tables]
    kernel = _chunk_kernel(score_mod, dtype=cdtype, use_qk=use_qk, activation=activation, scale=scale,
                           out_scale=out_scale, causal=causal, dropout_p=dropout_p,
                           head_widths=(q.shape[2], v.shape[2]))

    def chunk_grads(qi, qv, ki, kv):
        with _autograd_reenabled():
            qb = _gather_heads(q, qi, cdtype).detach().requires_grad_(use_qk)
            kb = _gather_heads(k, ki, cdtype).detach().requires_grad_(use_qk)
            vb = _gather_heads(v, ki, cdtype).detach().requires_grad_()
            qs = [t[qi].detach().requires_grad_(t.is_floating_point()) for t in q_side]
            ks = [t[ki].detach().requires_grad_(t.is_floating_point()) for t in k_side]
            o = kernel(qb, kb, vb, positions[qi], positions[ki], kv, qs, ks, table_leaves, qi, ki, seed)
            go = torch.where(qv[:, :, None, None], grad_out[qi].to(cdtype), 0.0).transpose(1, 2)
            leaves = [x for x in [qb, kb, vb, *qs, *ks, *table_leaves] if x.requires_grad]
            return iter(torch.autograd.grad(o, leaves, go, allow_unused=True))

    for qi, qv, ki, kv in _chunks(offs, H, causal, q.device):
        try:
            grads = chunk_grads(qi, qv, ki, kv)
        except _compile_errors() as error:  # the compiled backward is built lazily, here
            if not isinstance(kernel.func, _CompiledChunk):
                raise
            kernel.func.give_up(error)
            grads = chunk_grads(qi, qv, ki, kv)
        qvalid, kvalid = qi[qv], ki[kv]

        def put(acc, index, valid_mask, heads: bool):
            g = next(grads)
            if g is None:
                return
            g = g.transpose(1, 2) if heads else g
            acc.index_add_(0, index, g[valid_mask].to(acc.dtype))

        if use_qk:
            put(dq, qvalid, qv, True)
            put(dk, kvalid, kv, True)
        put(dv, kvalid, kv, True)
        for acc, t in zip(d_qs, q_side):
            if t.is_floating_point():
                put(acc, qvalid, qv, False)
        for acc, t in zip(d_ks, k_side):
            if t.is_floating_point():
                put(acc, kvalid, kv, False)
        for acc, t in zip(d_tables, tables):
            if t.is_floating_point():
                g = next(grads)
                if g is not None:
                    acc += g.to(acc.dtype)
    return dq, dk, dv, d_qs, d_ks, d_tables
