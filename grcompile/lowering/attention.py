"""``grcompile::jagged_attention``: causal / bidirectional attention over jagged rows with a
pointwise activation (SiLU, identity) or a softmax and a registered score_mod bias.

    jagged_attention(q [T, H, dqk], k [T, H, dqk], v [T, H, dv], offsets [B+1] int64,
                     positions [T] int64, q_side: list[[T]], k_side: list[[T]], tables: list,
                     seed: int64 [1] | None, *, score_mod: str, use_qk: bool, activation: str,
                     scale: float, out_scale: float, causal: bool, max_len: int,
                     dropout_p: float = 0.0) -> [T, H, dv]

Per row ``b`` (tokens ``offsets[b]:offsets[b+1]``) and head, with ``mod`` the registered score_mod
(``""``: none):

    s(i, j)  = mod(score = scale·q_i·k_j if use_qk else 0, q_pos = positions[i], k_pos = positions[j], ...)
    allowed  = positions[j] <= positions[i] if causal else True
    silu / identity:  A(i, j) = act(s)·out_scale where allowed, else exactly 0
    softmax:          A(i, ·) = softmax over allowed j of s, times out_scale (no allowed key: 0)
    dropout:          A(i, j) ← A(i, j)·keep(i, j)/(1 − dropout_p)   (training only)
    out_i    = Σ_j A(i, j) v_j

``keep`` is ``dropout_keep(seed, ...)``: a counter-based hash of (seed, query token, head, key token),
so the forward and the recomputing backward draw the same mask without storing it, whatever the
bucketing; the graph draws a fresh ``seed`` per step from the default generator.

which equals, at valid positions, the padded models' ``act(q kᵀ + rab)/N * causal_padding_mask``
(HSTU, FuXi-α's three channels) and SASRec's masked softmax. ``positions`` are padded-row
coordinates and must increase strictly within a row (row-major packing gives that).

Reference implementation (CPU, and the fallback of devices without a kernel): padding-free up to
a bounded waste. Rows are sorted by length and grouped greedily into buckets whose padded *pair*
area wastes at most ``BUCKET_WASTE`` (12.5 %) of the bucket — or at most ``BUCKET_SLACK_PAIRS``
pairs in absolute terms, since a tiny bucket costs more in per-op overhead than its padding.
A bucket is padded to its longest row only, computed with batched matmuls, and split into chunks
of at most ``CHUNK_ELEMENTS`` score elements (rows first; for one long row, blocks of queries, and
a causal query block only reads the keys up to its end), so no ``B×N×N`` tensor ever exists.
Padded slots repeat the row's last real token, so a score_mod only ever sees real
(position, side) values and never indexes out of bounds; they are removed by ``torch.where``
(never multiplied), so nothing non-finite leaks.

Autograd is flash-like: the forward saves only its inputs; ``grcompile::jagged_attention_backward``
recomputes each chunk under ``enable_grad`` and uses ``torch.autograd.grad``, returning gradients
for q, k, v and every floating side tensor and table (integer ones get ``None``).

Kernels: ``triton`` (:mod:`.attention_triton`: CUDA, or CPU tensors under ``TRITON_INTERPRET=1``
with ``GRCOMPILE_BACKEND=triton``) generates the score_mod into the kernel; a call it cannot run
(a score_mod op it does not know, float64) runs this reference, with a warning. ``ascend``
(:mod:`.attention_ascend`) maps calls to Ascend RecSDK's ``mxrec.hstu_jagged`` where the math matches (tested
against stubs only: nothing has run on an NPU).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import types
import warnings
from typing import Callable, Optional, Sequence

import torch
from torch.fx.experimental import _config as fx_config

from . import lookup, register_op
from .score_mod import get_score_mod, hstu_rab_key, relative_position_bias_key, relative_time_bias_key

ACTIVATIONS = ("silu", "softmax", "identity")
BUCKET_WASTE = 0.125  # max fraction of a bucket's padded pair area that is padding
BUCKET_SLACK_PAIRS = 8192  # ... or this many padded pairs, whichever is larger
CHUNK_ELEMENTS = 1 << 22  # max elements of one chunk's [n, H, Lq, Lk] score tensor
MIN_Q_BLOCK = 16  # smallest query block when a single row exceeds CHUNK_ELEMENTS

_OP = "grcompile::jagged_attention"


# --------------------------------------------------------------------------------------------
# validation


def _fail(msg: str) -> None:
    raise ValueError(f"{_OP}: {msg}")


def _check_meta(q, k, v, offsets, positions, q_side, k_side, tables, score_mod, activation, max_len) -> None:
    """Shape / dtype / device checks (valid on fake tensors too)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            _fail(f"{name} must be [T, H, d] (rank 3), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            _fail(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.shape[0] != k.shape[0] or q.shape[0] != v.shape[0]:
        _fail(f"q, k, v must have the same number of tokens T, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if q.shape[1] != k.shape[1] or q.shape[1] != v.shape[1]:
        _fail(f"q, k, v must have the same number of heads H, got {q.shape[1]}, {k.shape[1]}, {v.shape[1]}")
    if q.shape[2] != k.shape[2]:
        _fail(f"q and k must have the same head width dqk, got {q.shape[2]} and {k.shape[2]}")
    if offsets.dim() != 1 or offsets.shape[0] < 1:
        _fail(f"offsets must be 1-D [B + 1] with B >= 0, got shape {tuple(offsets.shape)}")
    if offsets.dtype != torch.int64:
        _fail(f"offsets must be int64, got {offsets.dtype}")
    if positions.dim() != 1 or positions.shape[0] != q.shape[0]:
        _fail(f"positions must be 1-D [T] with T = {q.shape[0]}, got shape {tuple(positions.shape)}")
    if positions.dtype != torch.int64:
        _fail(f"positions must be int64, got {positions.dtype}")
    for group, tensors in (("q_side", q_side), ("k_side", k_side)):
        for i, t in enumerate(tensors):
            if t.dim() != 1 or t.shape[0] != q.shape[0]:
                _fail(f"{group}[{i}] must be 1-D [T] with T = {q.shape[0]}, got shape {tuple(t.shape)}")
    for group, tensors in (("k", [k]), ("v", [v]), ("offsets", [offsets]), ("positions", [positions]),
                           ("q_side", q_side), ("k_side", k_side), ("tables", tables)):
        for t in tensors:
            if t.device != q.device:
                _fail(f"{group} is on {t.device} but q is on {q.device}")
    if activation not in ACTIVATIONS:
        _fail(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if max_len < 1:
        _fail(f"max_len must be >= 1, got {max_len}")
    if score_mod:
        get_score_mod(score_mod)  # raises a KeyError naming the key


def _check_dropout(seed: Optional[torch.Tensor], dropout_p: float, device: torch.device) -> None:
    if not 0.0 <= dropout_p < 1.0:
        _fail(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and seed is None:
        _fail("dropout_p > 0 needs a seed (an int64 tensor of one element)")
    if seed is not None:
        if seed.dtype != torch.int64 or seed.numel() != 1:
            _fail(f"seed must be an int64 tensor of one element, got {seed.dtype} {tuple(seed.shape)}")
        if seed.device != device:
            _fail(f"seed is on {seed.device} but q is on {device}")


def _check_values(offsets: torch.Tensor, positions: torch.Tensor, T: int, max_len: int) -> list[int]:
    """Data checks (real tensors only); returns the offsets as a list."""
    offs = offsets.tolist()
    if offs[0] != 0:
        _fail(f"offsets must start at 0, got offsets[0] = {offs[0]}")
    if offs[-1] != T:
        _fail(f"offsets must end at T = {T} (the number of tokens of q), got offsets[-1] = {offs[-1]}")
    lengths = [b - a for a, b in zip(offs[:-1], offs[1:])]
    if lengths and min(lengths) < 0:
        row = min(range(len(lengths)), key=lengths.__getitem__)
        _fail(f"offsets must be non-decreasing, but offsets[{row + 1}] = {offs[row + 1]} < offsets[{row}] = {offs[row]}")
    if lengths and max(lengths) > max_len:
        row = max(range(len(lengths)), key=lengths.__getitem__)
        _fail(f"row {row} has length {lengths[row]} > max_len = {max_len}")
    if T:
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= max_len:
            _fail(f"positions must lie in [0, max_len = {max_len}), got values in [{lo}, {hi}]")
        if T > 1:
            starts = offsets[1:-1]
            same_row = torch.ones(T - 1, dtype=torch.bool, device=positions.device)
            inner = starts[(starts > 0) & (starts < T)]
            same_row[inner - 1] = False  # token t and t + 1 straddle a row start
            if bool(((positions[1:] <= positions[:-1]) & same_row).any()):
                _fail("positions must increase strictly within each row (padded-row coordinates "
                      "of a row-major packing)")
    return offs


# --------------------------------------------------------------------------------------------
# bucketing


def plan_buckets(lengths: Sequence[int], waste: Optional[float] = None,
                 slack_pairs: Optional[int] = None) -> list[list[int]]:
    """Group the non-empty rows into buckets (lists of row ids, longest first).

    Rows sorted by decreasing length are added greedily to the current bucket while the padding
    of the bucket's pair area ``n·M² − Σ l²`` (``M``: its longest row) stays within ``waste`` of
    ``n·M²`` or within ``slack_pairs``. Attention cost is quadratic in the length, so the waste is
    measured on pairs, not tokens. Defaults: the module's ``BUCKET_WASTE`` / ``BUCKET_SLACK_PAIRS``."""
    waste = BUCKET_WASTE if waste is None else waste
    slack_pairs = BUCKET_SLACK_PAIRS if slack_pairs is None else slack_pairs
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    M = count = sum_sq = 0
    for row in order:
        n = lengths[row]
        if buckets:
            area = (count + 1) * M * M
            padded = area - (sum_sq + n * n)
            if padded <= waste * area or padded <= slack_pairs:
                buckets[-1].append(row)
                count, sum_sq = count + 1, sum_sq + n * n
                continue
        buckets.append([row])
        M, count, sum_sq = n, 1, n * n
    return buckets


def _chunks(offs: list[int], heads: int, causal: bool, device: torch.device, budget: Optional[int] = None):
    """Yield ``(q_index [n, Lq], q_valid, k_index [n, Lk], k_valid)`` per chunk: the token of each
    slot (a padded slot repeats its row's last real token) and whether the slot is real.

    ``n``, ``Lq`` and ``Lk`` are at least 2 (a lone row is paired with a copy of itself whose slots
    are all padding, a one-token block gets a padding slot): the compiled chunk kernel is dynamic
    in them, and a size of 1 would be a specialisation, hence a recompile, in the middle of
    training."""
    budget = CHUNK_ELEMENTS if budget is None else budget
    lengths = [b - a for a, b in zip(offs[:-1], offs[1:])]
    for bucket in plan_buckets(lengths):
        M = lengths[bucket[0]]
        per_row = heads * M * M
        rows_per_chunk = max(1, budget // max(per_row, 1))
        for c in range(0, len(bucket), rows_per_chunk):
            rows = bucket[c:c + rows_per_chunk]
            L = lengths[rows[0]]  # longest of this chunk
            q_block = L if len(rows) > 1 or heads * L * L <= budget else max(MIN_Q_BLOCK, budget // (heads * L))
            live = [True] * len(rows) + [False] * (len(rows) < 2)
            rows = rows + rows[:1] * (len(rows) < 2)
            starts = torch.tensor([offs[r] for r in rows], dtype=torch.int64, device=device)
            lens = torch.tensor([lengths[r] for r in rows], dtype=torch.int64, device=device)
            live_t = torch.tensor(live, dtype=torch.bool, device=device)
            for q0 in range(0, L, q_block):
                q1 = min(L, q0 + q_block)
                k1 = q1 if causal else L  # positions increase within a row: later keys are masked
                yield _slots(starts, lens, live_t, q0, q1, device) + _slots(starts, lens, live_t, 0, k1, device)


def _slots(starts, lens, live, lo: int, hi: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots ``lo .. max(hi, lo + 2)`` of each row; those at or past ``hi`` are padding."""
    ar = torch.arange(lo, max(hi, lo + 2), dtype=torch.int64, device=device).unsqueeze(0)
    valid = (ar < lens.unsqueeze(1)) & (ar < hi) & live.unsqueeze(1)
    index = starts.unsqueeze(1) + torch.minimum(ar, lens.unsqueeze(1) - 1)
    return index, valid


# --------------------------------------------------------------------------------------------
# one chunk, differentiable (used by the forward and, under enable_grad, by the backward)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x · c mod 2³²`` for int64 ``x`` in ``[0, 2³²)`` without int64 overflow (c split in 16-bit halves)."""
    return (x * (c & 0xFFFF) + ((x * (c >> 16)) & 0xFFFF) * 65536) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32): avalanche of every input bit, on int64 in ``[0, 2³²)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def dropout_keep(seed: torch.Tensor, q_tok: torch.Tensor, k_tok: torch.Tensor, heads: int,
                 p: float | torch.Tensor) -> torch.Tensor:
    """The attention-dropout mask: ``keep[.., h, i, j]`` for query tokens ``q_tok [n, Lq]`` and key
    tokens ``k_tok [n, Lk]`` (indices into the jagged values) -> bool ``[n, H, Lq, Lk]``.

    A counter-based hash of (seed, query token, head, key token): the same pair gets the same
    decision wherever it is computed (forward, recomputing backward, any bucketing or chunking),
    and nothing is stored. ``P(keep) = 1 − p`` up to 2⁻²⁴."""
    h = torch.arange(heads, dtype=torch.int64, device=q_tok.device)[None, :, None, None]
    row = _hash32((seed.reshape(()) ^ (q_tok[:, None, :, None] * heads + h)) & _M32)
    u = _hash32(row ^ (k_tok[:, None, None, :] & _M32)) >> 8  # 24 bits
    return u >= (p * (1 << 24)).round().long() if isinstance(p, torch.Tensor) else u >= round(p * (1 << 24))


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
            with fx_config.patch(use_duck_shape=False):
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


def _gather_heads(x: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, H, d], index [n, L] -> [n, H, L, d] in ``dtype``."""
    return x[index].to(dtype).transpose(1, 2)


# --------------------------------------------------------------------------------------------
# reference forward / backward


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


register_op("jagged_attention", reference=_attention_reference,
            triton="grcompile.lowering.attention_triton:attention_triton",
            ascend="grcompile.lowering.attention_ascend:attention_ascend")
register_op("jagged_attention_backward", reference=_attention_backward_reference,
            triton="grcompile.lowering.attention_triton:attention_backward_triton",
            ascend="grcompile.lowering.attention_ascend:attention_backward_ascend")


# --------------------------------------------------------------------------------------------
# the custom ops


@torch.library.custom_op("grcompile::jagged_attention", mutates_args=())
def jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                     positions: torch.Tensor, q_side: list[torch.Tensor], k_side: list[torch.Tensor],
                     tables: list[torch.Tensor], seed: Optional[torch.Tensor], *, score_mod: str,
                     use_qk: bool, activation: str, scale: float, out_scale: float, causal: bool, max_len: int,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """See the module docstring. ``seed`` is required (``None`` without dropout): an argument left
    to its default would change the structure autograd expects back from the backward."""
    note_variant(q, v, q_side, k_side, tables, score_mod=score_mod, activation=activation, causal=causal,
                 use_qk=use_qk, dropout_p=dropout_p)
    impl = lookup("jagged_attention", q.device.type)
    return impl(q, k, v, offsets, positions, list(q_side), list(k_side), list(tables), seed, score_mod=score_mod,
                use_qk=use_qk, activation=activation, scale=scale, out_scale=out_scale, causal=causal,
                max_len=max_len, dropout_p=dropout_p)


# (score_mod, activation, causal, use_qk, dropout, dtype, dqk, dv, q_side dtypes, k_side dtypes,
# table (shape, dtype)s) -> calls: the attention variants this process ran, whatever the kernel
# (the bench compiles their Triton kernels ahead of time from this)
SEEN_VARIANTS: dict[tuple, int] = {}


def note_variant(q, v, q_side, k_side, tables, *, score_mod: str, activation: str, causal: bool, use_qk: bool,
                 dropout_p: float) -> None:
    key = (score_mod, activation, causal, use_qk, dropout_p > 0, q.dtype, int(q.shape[2]), int(v.shape[2]),
           tuple(t.dtype for t in q_side), tuple(t.dtype for t in k_side),
           tuple((tuple(int(n) for n in t.shape), t.dtype) for t in tables))
    SEEN_VARIANTS[key] = SEEN_VARIANTS.get(key, 0) + 1


@jagged_attention.register_fake
def _(q, k, v, offsets, positions, q_side, k_side, tables, seed, *, score_mod, use_qk, activation, scale,
      out_scale, causal, max_len, dropout_p=0.0):
    _check_meta(q, k, v, offsets, positions, q_side, k_side, tables, score_mod, activation, max_len)
    _check_dropout(seed, dropout_p, q.device)
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("grcompile::jagged_attention_backward", mutates_args=())
def jagged_attention_backward(
        grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
        positions: torch.Tensor, q_side: list[torch.Tensor], k_side: list[torch.Tensor],
        tables: list[torch.Tensor], seed: Optional[torch.Tensor] = None, *, score_mod: str, use_qk: bool,
        activation: str, scale: float, out_scale: float, causal: bool, max_len: int, dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Gradients of ``jagged_attention`` by recomputation (the dropout mask is recomputed from
    ``seed``); integer side tensors / tables get an empty float placeholder (the autograd wrapper
    turns it into ``None``)."""
    impl = lookup("jagged_attention_backward", q.device.type)
    return impl(grad_out, q, k, v, offsets, positions, list(q_side), list(k_side), list(tables), seed,
                score_mod=score_mod, use_qk=use_qk, activation=activation, scale=scale, out_scale=out_scale,
                causal=causal, max_len=max_len, dropout_p=dropout_p)


@jagged_attention_backward.register_fake
def _(grad_out, q, k, v, offsets, positions, q_side, k_side, tables, seed=None, *, score_mod, use_qk, activation,
      scale, out_scale, causal, max_len, dropout_p=0.0):
    def like(ts):
        return [torch.empty_like(t) if t.is_floating_point() else _grad_placeholder(t) for t in ts]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), like(q_side), like(k_side), like(tables)


_KWARGS = ("score_mod", "use_qk", "activation", "scale", "out_scale", "causal", "max_len", "dropout_p")


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, offsets, positions, q_side, k_side, tables, seed = inputs
    ctx.n_q_side, ctx.n_k_side = len(q_side), len(k_side)
    ctx.has_seed = seed is not None
    ctx.save_for_backward(q, k, v, offsets, positions, *q_side, *k_side, *tables, *([seed] if ctx.has_seed else []))
    ctx.kwargs = {name: keyword_only_inputs[name] for name in _KWARGS}
    ctx.floating = [t.is_floating_point() for t in (*q_side, *k_side, *tables)]


def _backward(ctx, grad_out):
    q, k, v, offsets, positions, *rest = ctx.saved_tensors
    seed = rest.pop() if ctx.has_seed else None
    q_side, k_side = rest[:ctx.n_q_side], rest[ctx.n_q_side:ctx.n_q_side + ctx.n_k_side]
    tables = rest[ctx.n_q_side + ctx.n_k_side:]
    dq, dk, dv, d_qs, d_ks, d_tables = torch.ops.grcompile.jagged_attention_backward(
        grad_out.contiguous(), q, k, v, offsets, positions, list(q_side), list(k_side), list(tables), seed,
        **ctx.kwargs)
    flags = iter(ctx.floating)
    d_qs = [g if next(flags) else None for g in d_qs]
    d_ks = [g if next(flags) else None for g in d_ks]
    d_tables = [g if next(flags) else None for g in d_tables]
    return dq, dk, dv, None, None, d_qs, d_ks, d_tables, None


jagged_attention.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# named wrappers for the three models


def hstu_attention(q, k, v, offsets, positions, *, N: int, query_timestamps=None, timestamps=None,
                   position_table=None, time_table=None, table_max_len: Optional[int] = None,
                   num_buckets: int = 128, causal: bool = True, dropout_p: float = 0.0,
                   seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """HSTU: ``silu(q·kᵀ + rab) / N`` under the causal mask, ``rab`` = relative position table
    (``[2·table_max_len − 1]``) + log time-bucket table (``[num_buckets + 1]``, query side
    ``query_timestamps`` = the next valid timestamp, key side ``timestamps``), either optional;
    ``dropout_p`` > 0 drops attention weights with the mask hashed from ``seed``."""
    table_max_len = N if table_max_len is None else table_max_len
    tables, q_side, k_side = [], [], []
    if time_table is not None:
        q_side, k_side = [query_timestamps], [timestamps]
    if position_table is not None and time_table is not None:
        key, tables = hstu_rab_key(table_max_len, num_buckets), [position_table, time_table]
    elif position_table is not None:
        key, tables = relative_position_bias_key(table_max_len), [position_table]
    elif time_table is not None:
        key, tables = relative_time_bias_key(num_buckets), [time_table]
    else:
        key = ""
    return torch.ops.grcompile.jagged_attention(
        q, k, v, offsets, positions, q_side, k_side, tables, seed, score_mod=key, use_qk=True, activation="silu",
        scale=1.0, out_scale=1.0 / N, causal=causal, max_len=N, dropout_p=dropout_p)


def fuxi_attention(q, k, v, offsets, positions, *, N: int, query_timestamps, timestamps, position_table,
                   time_table, table_max_len: Optional[int] = None, num_buckets: int = 128,
                   causal: bool = True) -> torch.Tensor:
    """FuXi-α's three channels ``[positional, temporal, semantic]`` concatenated on the last dim:
    ``pos_table[j − i] @ v``, ``time_table[bucket] @ v``, ``silu(q·kᵀ)/N @ v``, all causal."""
    table_max_len = N if table_max_len is None else table_max_len
    common = dict(causal=causal, max_len=N)
    positional = torch.ops.grcompile.jagged_attention(
        q, k, v, offsets, positions, [], [], [position_table], None,
        score_mod=relative_position_bias_key(table_max_len),
        use_qk=False, activation="identity", scale=1.0, out_scale=1.0, **common)
    temporal = torch.ops.grcompile.jagged_attention(
        q, k, v, offsets, positions, [query_timestamps], [timestamps], [time_table], None,
        score_mod=relative_time_bias_key(num_buckets), use_qk=False, activation="identity", scale=1.0,
        out_scale=1.0, **common)
    semantic = torch.ops.grcompile.jagged_attention(
        q, k, v, offsets, positions, [], [], [], None, score_mod="", use_qk=True, activation="silu", scale=1.0,
        out_scale=1.0 / N, **common)
    return torch.cat([positional, temporal, semantic], dim=-1)


def jagged_softmax_attention(q, k, v, offsets, positions, *, N: int, scale: Optional[float] = None,
                             causal: bool = True, dropout_p: float = 0.0,
                             seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SASRec: ``softmax(q·kᵀ · scale)`` over the allowed keys, ``scale`` = 1/sqrt(dqk) by default;
    ``dropout_p`` > 0 drops attention weights after the softmax (mask hashed from ``seed``)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.grcompile.jagged_attention(
        q, k, v, offsets, positions, [], [], [], seed, score_mod="", use_qk=True, activation="softmax",
        scale=scale, out_scale=1.0, causal=causal, max_len=N, dropout_p=dropout_p)


__all__ = ["jagged_attention", "jagged_attention_backward", "hstu_attention", "fuxi_attention",
           "jagged_softmax_attention", "plan_buckets", "dropout_keep", "ACTIVATIONS"]
