"""One chunk of the CPU reference, differentiable (the forward runs it, the backward recomputes it
under ``enable_grad``), and its inductor-compiled copies, one per option set.

``COMPILE_CHUNKS`` (default: ``GRCOMPILE_COMPILE_CHUNKS`` != ``0``) is read at call time: set it on
this module to run the eager chunk.
"""
from __future__ import annotations

import functools
import os
import types
import warnings
from typing import Callable

import torch
from torch.fx.experimental import _config as fx_config

from ..score_mod import get_score_mod
from .dropout import dropout_keep
from .validation import _OP

# built once, reused by every call: torch's ``config.patch`` leaves a fresh ContextVar in the caller's
# context per patch object, so a patch built per call grows the context by one entry per call
_NO_DUCK_SHAPE = fx_config.patch(use_duck_shape=False)


def _chunk_attention(qb, kb, vb, q_pos, k_pos, k_valid, q_sides, k_sides, tables, q_tok, k_tok, seed, dropout_p,
                     *, mod, use_qk, activation, scale, out_scale, causal, dropout):
    """qb [n, H, Lq, dqk], kb [n, H, Lk, dqk], vb [n, H, Lk, dv]; q_pos/q_sides/q_tok [n, Lq];
    k_pos/k_sides/k_valid/k_tok [n, Lk] -> [n, H, Lq, dv] (padded query slots hold garbage).
    ``q_tok``/``k_tok``/``seed``/``dropout_p`` (a 0-d tensor, so that compiled kernels do not
    specialise on it) feed the dropout mask, used when ``dropout``."""
    dtype = vb.dtype
    if use_qk:
        s = torch.matmul(qb, kb.transpose(-2, -1))
        if scale != 1.0:
            s = s * scale
    else:
        s = torch.zeros((), dtype=dtype, device=vb.device)
    qp, kp = q_pos[:, None, :, None], k_pos[:, None, None, :]
    if mod is not None:
        s = mod(s, qp, kp, tuple(t[:, None, :, None] for t in q_sides),
                tuple(t[:, None, None, :] for t in k_sides), tuple(tables), heads=vb.shape[1])
        s = s.to(dtype)
    allowed = k_valid[:, None, None, :]
    if causal:
        allowed = allowed & (kp <= qp)
    if activation == "softmax":
        s = torch.where(allowed, s, float("-inf"))
        live = (s > float("-inf")).any(dim=-1, keepdim=True)  # a query with no allowed key -> 0
        a = torch.softmax(torch.where(live, s, 0.0), dim=-1)
        a = torch.where(live & allowed, a, 0.0)
    else:
        a = torch.nn.functional.silu(s) if activation == "silu" else s
        a = torch.where(allowed, a, 0.0)
    if dropout:
        keep = dropout_keep(seed, q_tok, k_tok, vb.shape[1], dropout_p)
        a = torch.where(keep, a / (1.0 - dropout_p), 0.0)
    if out_scale != 1.0:
        a = a * out_scale
    target = (vb.shape[0], vb.shape[1], q_pos.shape[1], k_pos.shape[1])
    if tuple(a.shape) != target:
        a = a.expand(target)
    return torch.matmul(a, vb)


_COMPILED_CHUNKS: dict[tuple, Callable] = {}
COMPILE_CHUNKS = os.environ.get("GRCOMPILE_COMPILE_CHUNKS", "1") != "0"


def _chunk_kernel(score_mod: str, *, dtype: torch.dtype, use_qk: bool, activation: str, scale: float,
                  out_scale: float, causal: bool, dropout_p: float, head_widths: tuple[int, int]) -> Callable:
    """``_chunk_attention`` with its options (and ``dropout_p``, as a 0-d tensor) bound, compiled by
    inductor once per option set (dynamic shapes): the score_mod, mask and activation become one
    fused loop instead of a dozen eager passes over ``[n, H, Lq, Lk]`` (2x on the HSTU backward at
    ML-1M size). The forward and the recomputing backward get the same kernel from here.

    Each option set gets its own function (a copy of the code object, the options as keyword
    defaults, no ``functools.partial``: Dynamo would trace a wrapper shared by all of them), so
    Dynamo's per-code cache and its recompile limit (8) are not shared by unrelated score_mods.
    Duck sizing is off while it compiles: equal sizes in one chunk (``n == Lq``) must not become a
    guard that the next chunk fails. ``GRCOMPILE_COMPILE_CHUNKS=0`` (or ``COMPILE_CHUNKS = False``)
    runs the plain eager chunk instead, and so do ``head_widths`` (q/k width, v width) with a 1:
    compiled, those aborted the process in the property tests
    (``test_compiled_chunks_match_padded_models_slow``; cause not found, see docs/lowering.md), so
    they run eagerly until it is understood. One head is fine (300 examples)."""
    mod = get_score_mod(score_mod) if score_mod else None
    p = torch.tensor(dropout_p, dtype=torch.float64)
    options = dict(mod=mod, use_qk=use_qk, activation=activation, scale=scale, out_scale=out_scale, causal=causal,
                   dropout=dropout_p > 0)
    if not COMPILE_CHUNKS or min(head_widths) < 2:
        return functools.partial(_chunk_attention, dropout_p=p, **options)
    key = (score_mod, dtype, use_qk, activation, scale, out_scale, causal, dropout_p > 0)
    fn = _COMPILED_CHUNKS.get(key)
    if fn is None:
        code = _chunk_attention.__code__
        own = types.FunctionType(code.replace(co_name=f"{code.co_name}_{len(_COMPILED_CHUNKS)}"),
                                 _chunk_attention.__globals__, code.co_name)
        own.__kwdefaults__ = options
        fn = _COMPILED_CHUNKS[key] = _CompiledChunk(torch.compile(own, dynamic=True, options=_inductor_options(score_mod)),
                                                    functools.partial(_chunk_attention, **options), key)
    return functools.partial(fn, dropout_p=p)


class _CompiledChunk:
    """A compiled chunk kernel, run without duck sizing. If inductor cannot compile it (an inductor
    bug on some shape; in the forward call or, lazily, in the backward's ``autograd.grad``), this
    option set runs the eager chunk from then on, with a warning: same values, slower."""

    def __init__(self, compiled: Callable, eager: Callable, key: tuple) -> None:
        self.compiled, self.eager, self.key, self.failed = compiled, eager, key, False

    def __call__(self, *args, **kwargs):
        if self.failed:
            return self.eager(*args, **kwargs)
        try:
            with _NO_DUCK_SHAPE:
                return self.compiled(*args, **kwargs)
        except _compile_errors() as error:
            self.give_up(error)
            return self.eager(*args, **kwargs)

    def give_up(self, error: Exception) -> None:
        warnings.warn(f"{_OP}: inductor could not compile the attention chunk for {self.key} "
                      f"({type(error).__name__}: {str(error).strip().splitlines()[0][:200]}); "
                      "it runs eagerly (same values, slower)", stacklevel=3)
        self.failed = True


def _inductor_options(score_mod: str) -> dict:
    """Inductor's vectorised C++ scatter-add, which a score_mod's table gradient becomes in the
    compiled backward, fails to compile on some dynamic shapes (a one-entry table) and, on others
    (2 rows of 7 tokens, 3 heads of width 1: the hypothesis case of
    ``test_hstu_attention_matches_padded_model``, seed 2), corrupts the heap; scalar code is
    exact. Kernels with a score_mod are compiled without vectorisation (~15 % slower steps)."""
    return {"cpp.simdlen": 1} if score_mod else {}


def _compile_errors() -> tuple[type, ...]:
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    return BackendCompilerFailed, InductorError
