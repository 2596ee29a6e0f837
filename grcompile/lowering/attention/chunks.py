"""One chunk of the CPU reference — its forward (:func:`_chunk_attention`) and its analytic backward
(:func:`_chunk_backward`, which recomputes the forward) — and their inductor-compiled copies, one
per option set.

``COMPILE_CHUNKS`` (default: ``GRCOMPILE_COMPILE_CHUNKS`` != ``0``) is read at call time: set it on
this module to run the eager chunk.
"""
from __future__ import annotations

import contextlib
import functools
import os
import types
import warnings
from typing import Callable

import torch
from torch.fx.experimental import _config as fx_config

from ..score_mod import get_score_mod
from .dropout import dropout_keep_rows
from .validation import _OP

# built once, reused by every call: torch's ``config.patch`` leaves a fresh ContextVar in the caller's
# context per patch object, so a patch built per call grows the context by one entry per call
_NO_DUCK_SHAPE = fx_config.patch(use_duck_shape=False)


def _chunk_attention(qb, kb, vb, q_pos, k_pos, q_lim, k_lim, q_sides, k_sides, tables, drop_rows, k_tok, dropout_p,
                     *, mod, use_qk, activation, scale, out_scale, causal, dropout):
    """qb [n, H, Lq, dqk], kb [n, H, Lk, dqk], vb [n, H, Lk, dv]; q_pos/q_lim/q_sides [n, Lq];
    k_pos/k_lim/k_sides/k_tok [n, Lk] -> ``(out [n, H, Lq, dv], lse)`` (padded query slots hold
    garbage); ``lse`` the softmax's log-sum-exp ``[n, H|1, Lq]`` (:func:`_masked_softmax`), None for
    SiLU / identity.
    ``q_lim``/``k_lim`` (:func:`mask_limits`) carry the mask; ``drop_rows`` (:func:`dropout_rows`),
    ``k_tok`` and ``dropout_p`` (a 0-d tensor, so that compiled kernels do not specialise on it)
    the dropout mask, used when ``dropout``."""
    s = _scores(qb, kb, vb, use_qk, scale)
    if mod is not None:
        s = _call_mod(mod, s, q_pos, k_pos, q_sides, k_sides, tables, vb)
    keep = dropout_keep_rows(drop_rows, k_tok, dropout_p) if dropout else None
    allowed = _allowed(q_lim, k_lim, causal)
    if activation == "softmax":
        act, lse = _masked_softmax(s, allowed)
    else:
        act, lse = _activate(s, allowed, activation), None
    a = _scale_and_drop(act, keep, dropout_p, out_scale)
    a = a.expand(vb.shape[0], vb.shape[1], q_lim.shape[1], k_lim.shape[1])  # [n, 1, ...] when not use_qk
    return torch.matmul(a, vb), lse


def _chunk_backward(qb, kb, vb, q_pos, k_pos, q_lim, k_lim, q_sides, k_sides, tables, drop_rows, k_tok,
                    dropout_p, grad_out, lse=None, delta=None, *, mod, use_qk, activation, scale, out_scale, causal,
                    dropout):
    """The analytic backward of :func:`_chunk_attention`: ``grad_out [n, H, Lq, dv]``
    -> ``(dq, dk, dv, grads)``, ``dq``/``dk`` None unless ``use_qk``, ``grads`` those of the
    floating ``q_sides``, ``k_sides`` and ``tables`` in that order (what the score_mod reads).

    Recomputes the forward's scores and activation (nothing is stored); ``G = dO·vᵀ``. Softmax, with
    ``A = P∘keep/(1 − p)·out_scale`` the matrix the forward multiplied by v: ``dv = Aᵀ·dO``,
    ``dS = A∘G − P·Σⱼ A∘G`` (dropout and output scale folded in, so the dropout hash runs once).
    SiLU / identity: ``dS = (G∘keep/(1 − p)·out_scale)·act'(S)`` on the mask, 0 off it. The
    score_mod's own backward is its vector-Jacobian product (``torch.func.vjp``, traced into the
    same graph): it turns ``dS`` into the gradient of the raw scores and those of the side tensors
    and tables. Five matmuls and one fused pass over the scores, where autograd through the
    compiled forward recomputed the forward, stored its masks as bools (slow stores) and ran a
    second graph.

    ``lse`` / ``delta`` ``[n, H, Lq]`` (softmax, when the forward's are kept): the forward's
    log-sum-exp and ``Σ dO∘out`` per query (0 at padded query slots), so ``P = exp(s − lse)`` needs
    no row max or sum and ``Σⱼ A∘G = delta`` (``delta`` None: summed here)."""
    s_raw = _scores(qb, kb, vb, use_qk, scale)
    differentiable = [t for t in (*q_sides, *k_sides, *tables) if t.is_floating_point()]
    if mod is None:
        s = s_raw
    else:
        def modded(raw, *floats):
            replaced = iter(floats)
            qs, ks, tabs = ([next(replaced) if t.is_floating_point() else t for t in group]
                            for group in (q_sides, k_sides, tables))
            return _call_mod(mod, raw, q_pos, k_pos, qs, ks, tabs, vb)
        s, mod_vjp = _vjp(modded, s_raw, *differentiable)
    full = (vb.shape[0], vb.shape[1], q_lim.shape[1], k_lim.shape[1])  # s is [n, 1, ...] when not use_qk
    allowed = _allowed(q_lim, k_lim, causal)
    keep = dropout_keep_rows(drop_rows, k_tok, dropout_p) if dropout else None
    if activation == "softmax" and lse is not None:  # dead rows: lse = +inf, so exp(· − lse) = 0
        act = torch.where(allowed, torch.exp(torch.where(allowed, s, 0.0) - lse[..., None]), 0.0).expand(full)
    else:
        act = _activate(s, allowed, activation).expand(full)  # softmax: exactly 0 off the mask and on dead rows
    a = _scale_and_drop(act, keep, dropout_p, out_scale)
    dv = torch.matmul(a.transpose(-2, -1), grad_out)
    if not use_qk and (mod is None or not differentiable):
        return None, None, dv, []
    g = torch.matmul(grad_out, vb.transpose(-2, -1))
    if activation == "softmax":
        a_g = a * g
        d_s = a_g - act * (a_g.sum(dim=-1, keepdim=True) if delta is None else delta[..., None])
    else:
        d_a = _scale_and_drop(g, keep, dropout_p, out_scale)
        if activation == "silu":
            sig = torch.sigmoid(s)
            d_a = d_a * (sig * (1.0 + s * (1.0 - sig)))
        d_s = torch.where(allowed, d_a, 0.0)
    grads = []
    if mod is not None:
        d_s, *grads = mod_vjp(d_s.sum_to_size(s.shape))
    if not use_qk:
        return None, None, dv, grads
    d_s = d_s.expand(full)
    if scale != 1.0:
        d_s = d_s * scale
    return torch.matmul(d_s, kb), torch.matmul(d_s.transpose(-2, -1), qb), dv, grads


def _call_mod(mod, s, q_pos, k_pos, q_sides, k_sides, tables, vb: torch.Tensor) -> torch.Tensor:
    """The score_mod on scores ``[n, H, Lq, Lk]``: query tensors broadcast over keys, key tensors over
    queries; the result in the chunk's compute dtype (``vb``'s)."""
    return mod(s, q_pos[:, None, :, None], k_pos[:, None, None, :], tuple(t[:, None, :, None] for t in q_sides),
               tuple(t[:, None, None, :] for t in k_sides), tuple(tables), heads=vb.shape[1]).to(vb.dtype)


def _activate(s: torch.Tensor, allowed: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation over the mask: the masked softmax, or SiLU / identity masked by ``where`` (a
    non-finite score off the mask never reaches a product)."""
    if activation == "softmax":
        return _masked_softmax(s, allowed)[0]
    return torch.where(allowed, torch.nn.functional.silu(s) if activation == "silu" else s, 0.0)


def _scale_and_drop(x: torch.Tensor, keep: torch.Tensor | None, dropout_p: torch.Tensor,
                    out_scale: float) -> torch.Tensor:
    """``x`` through the dropout (``keep``: None when off) and the output scale, in that order."""
    if keep is not None:
        x = torch.where(keep, x / (1.0 - dropout_p), 0.0)
    return x * out_scale if out_scale != 1.0 else x


def _vjp(fn: Callable, *primals: torch.Tensor) -> tuple[torch.Tensor, Callable]:
    """``torch.func.vjp`` where Dynamo traces it (the compiled chunk: one graph, no autograd at run
    time); eagerly, a local autograd tape (functorch's wrappers would reach the op's callers, and
    ``opcheck``'s schema mode cannot read their storage)."""
    if torch.compiler.is_compiling():
        return torch.func.vjp(fn, *primals)
    with _autograd_reenabled(), _FloorDivisionDifferentiable():
        leaves = [t.detach().requires_grad_(True) for t in primals]
        out = fn(*leaves)

    def vjp_fn(cotangent: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not out.requires_grad:  # the score_mod reads none of them (torch.func.vjp: zeros too)
            return tuple(torch.zeros_like(t) for t in leaves)
        with _autograd_reenabled():
            return torch.autograd.grad(out, leaves, cotangent, allow_unused=True, materialize_grads=True)
    return out.detach(), vjp_fn


class _FloorDivisionDifferentiable(torch.overrides.TorchFunctionMode):
    """``floor_divide`` (``a // b``) has no derivative in torch: autograd raises in the backward
    even when only other inputs need one (a float side that needs no gradient, differentiated
    here because every float side is). ``div(rounding_mode="floor")`` computes the same values
    with a zero derivative — what the Triton kernels give it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FLOOR_DIVIDES and len(args) == 2 and not kwargs:
            a, b = args
            if func is torch.Tensor.__rfloordiv__:
                a, b = b, a
            if not isinstance(a, torch.Tensor):
                a = torch.as_tensor(a, device=b.device)
            return torch.div(a, b, rounding_mode="floor")
        return func(*args, **kwargs)


_FLOOR_DIVIDES = (torch.floor_divide, torch.Tensor.floor_divide, torch.Tensor.__floordiv__,
                  torch.Tensor.__rfloordiv__)


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


def _scores(qb, kb, vb, use_qk: bool, scale: float) -> torch.Tensor:
    if not use_qk:
        return torch.zeros((), dtype=vb.dtype, device=vb.device)
    s = torch.matmul(qb, kb.transpose(-2, -1))
    return s * scale if scale != 1.0 else s


def _allowed(q_lim: torch.Tensor, k_lim: torch.Tensor, causal: bool) -> torch.Tensor:
    k_lim = k_lim[:, None, None, :]
    return k_lim <= q_lim[:, None, :, None] if causal else k_lim < float("inf")


def _masked_softmax(s: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, lse)``: the softmax over the allowed keys, exactly 0 elsewhere and on a query with
    no allowed key, and its log-sum-exp ``[..., Lq]`` (``+inf`` on such a query).

    Spelled ``amax``, then ``sum(exp(s − amax))``: inductor's online softmax computes both in one
    pass (a guard on the row max between them broke that pattern: 1.7x slower chunks). A query
    with no allowed key has ``amax = −inf`` and NaN sums, which ``where`` drops."""
    s = torch.where(allowed, s, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    live = m != float("-inf")  # NaN stays live: it propagates as in eager
    a = torch.where(live & allowed, e / total, 0.0)
    lse = torch.where(live, m + torch.log(total), float("inf"))
    return a, lse.squeeze(-1)


def mask_positions(positions: torch.Tensor, max_len: int) -> torch.Tensor:
    """``positions`` as the floats :func:`mask_limits` compares: exact, since positions lie in
    ``[0, max_len)`` and float32 holds every integer up to 2²⁴ (float64 is used above that)."""
    return positions.to(torch.float32 if max_len <= (1 << 24) else torch.float64)


def mask_limits(mask_pos: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor,
                k_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's mask as floats: ``q_lim`` the query slots' positions, ``k_lim`` the key slots'
    positions with ``+inf`` at padding slots, so that ``allowed = k_lim <= q_lim`` (causal) or
    ``k_lim < inf``: one vectorised float compare per score. The int64 compare and bool ``&`` it
    replaces cost 3-4x the whole softmax in inductor's AVX2 code. ``mask_pos``: :func:`mask_positions`."""
    return mask_pos[q_index], torch.where(k_valid, mask_pos[k_index], float("inf"))


_COMPILED_CHUNKS: dict[tuple, Callable] = {}
COMPILE_CHUNKS = os.environ.get("GRCOMPILE_COMPILE_CHUNKS", "1") != "0"


def _chunk_kernel(score_mod: str, *, dtype: torch.dtype, use_qk: bool, activation: str, scale: float,
                  out_scale: float, causal: bool, dropout_p: float, head_widths: tuple[int, int],
                  uncompiled: bool = False) -> Callable:
    """``_chunk_attention`` with its options (and ``dropout_p``, as a 0-d tensor) bound, compiled by
    inductor once per option set (dynamic shapes): the score_mod, mask and activation become one
    fused loop instead of a dozen eager passes over ``[n, H, Lq, Lk]`` (2x on the HSTU backward at
    ML-1M size). It computes no gradient: the backward is :func:`_chunk_backward`, compiled apart.

    Each option set gets its own function (a copy of the code object, the options as keyword
    defaults, no ``functools.partial``: Dynamo would trace a wrapper shared by all of them), so
    Dynamo's per-code cache and its recompile limit (8) are not shared by unrelated score_mods.
    Duck sizing is off while it compiles: equal sizes in one chunk (``n == Lq``) must not become a
    guard that the next chunk fails. ``GRCOMPILE_COMPILE_CHUNKS=0`` (or ``COMPILE_CHUNKS = False``)
    runs the plain eager chunk instead, and so do ``head_widths`` (q/k width, v width) with a 1:
    compiled, those aborted the process in the property tests
    (``test_compiled_chunks_match_padded_models_slow``; cause not found, see docs/lowering.md), so
    they run eagerly until it is understood. One head is fine (300 examples). ``uncompiled``: run
    the eager chunk (a score_mod whose integer arithmetic may overflow, see :mod:`.overflow`)."""
    mod = get_score_mod(score_mod) if score_mod else None
    p = torch.tensor(dropout_p, dtype=torch.float64)
    options = dict(mod=mod, use_qk=use_qk, activation=activation, scale=scale, out_scale=out_scale, causal=causal,
                   dropout=dropout_p > 0)
    key = (score_mod, dtype, use_qk, activation, scale, out_scale, causal, dropout_p > 0)
    return functools.partial(_compiled(_chunk_attention, key, options, head_widths, uncompiled), dropout_p=p)


def _chunk_backward_kernel(score_mod: str, *, dtype: torch.dtype, use_qk: bool, activation: str, scale: float,
                           out_scale: float, causal: bool, dropout_p: float, head_widths: tuple[int, int],
                           table_grads: bool, stats: tuple[bool, bool] = (False, False),
                           uncompiled: bool = False) -> Callable:
    """:func:`_chunk_backward` bound and compiled like :func:`_chunk_kernel`'s forward
    (``table_grads``: it computes gradients of score_mod tables, a graph of its own;
    ``stats``: whether it is given the forward's ``lse``, ``delta``: a graph of their own)."""
    options = dict(mod=get_score_mod(score_mod) if score_mod else None, use_qk=use_qk, activation=activation,
                   scale=scale, out_scale=out_scale, causal=causal, dropout=dropout_p > 0)
    key = ("backward", score_mod, dtype, use_qk, activation, scale, out_scale, causal, dropout_p > 0, table_grads,
           stats)
    return functools.partial(_compiled(_chunk_backward, key, options, head_widths, uncompiled),
                             dropout_p=torch.tensor(dropout_p, dtype=torch.float64))


def _compiled(fn: Callable, key: tuple, options: dict, head_widths: tuple[int, int],
              uncompiled: bool = False) -> Callable:
    """``fn`` with ``options`` bound, compiled once per ``key`` (or eager: see :func:`_chunk_kernel`).

    Vectorised, table gradients included; where inductor cannot vectorise (its scatter-add of the
    gradient of a one-entry table fails an assertion), scalar code (``cpp.simdlen=1``), and where
    that fails too, the eager chunk (:class:`_CompiledChunk`). All backward chunks that compute
    table gradients were scalar from 2026-11-24 to 2026-11-29 — vectorised, that scatter-add had
    also corrupted the heap on 3 heads of width 1, and widths of 1 run the eager chunk since —
    which made the HSTU backward chunk 5x slower and the ML-1M training step 1.8x."""
    if uncompiled or not COMPILE_CHUNKS or min(head_widths) < 2:
        return functools.partial(fn, **options)
    compiled = _COMPILED_CHUNKS.get(key)
    if compiled is None:
        def compile_copy(inductor_options: dict) -> Callable:
            code = fn.__code__  # a code object of its own: Dynamo's cache and recompile limit are per code
            own = types.FunctionType(code.replace(co_name=f"{code.co_name}_{len(_COMPILED_CHUNKS)}"
                                                  f"{'_scalar' if inductor_options else ''}"),
                                     fn.__globals__, code.co_name, fn.__defaults__)
            own.__kwdefaults__ = options
            return torch.compile(own, dynamic=True, options=inductor_options)
        compiled = _COMPILED_CHUNKS[key] = _CompiledChunk(compile_copy, functools.partial(fn, **options), key)
    return compiled


class _CompiledChunk:
    """A compiled chunk kernel, run without duck sizing. If inductor cannot compile it (an inductor
    bug on some shape), this option set runs scalar compiled code from then on and, if that fails
    too, the eager chunk, with a warning: same values, slower."""

    def __init__(self, compile_copy: Callable[[dict], Callable], eager: Callable, key: tuple) -> None:
        self.compile_copy, self.eager, self.key, self.failed = compile_copy, eager, key, False
        self.compiled, self.scalar = compile_copy({}), False

    def __call__(self, *args, **kwargs):
        if self.failed:
            return self.eager(*args, **kwargs)
        try:
            with _NO_DUCK_SHAPE:
                return self.compiled(*args, **kwargs)
        except _compile_errors() as error:
            if not self.scalar:
                self.compiled, self.scalar = self.compile_copy({"cpp.simdlen": 1}), True
                return self(*args, **kwargs)
            self.give_up(error)
            return self.eager(*args, **kwargs)

    def give_up(self, error: Exception) -> None:
        warnings.warn(f"{_OP}: inductor could not compile the attention chunk for {self.key} "
                      f"({type(error).__name__}: {str(error).strip().splitlines()[0][:200]}); "
                      "it runs eagerly (same values, slower)", stacklevel=3)
        self.failed = True


def _compile_errors() -> tuple[type, ...]:
    """What a failed compile raises. ``TorchRuntimeError``: Dynamo could not trace the chunk on fake
    tensors (``torch.func.vjp`` through ``floor_divide``, which has no derivative); the eager chunk
    then runs it, or raises the user's own error if there is one."""
    from torch._dynamo.exc import BackendCompilerFailed, TorchRuntimeError
    from torch._inductor.exc import InductorError

    return BackendCompilerFailed, InductorError, TorchRuntimeError
