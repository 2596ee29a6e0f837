"""Triton kernels of ``grcompile::jagged_attention`` (forward and analytic backward), with the
captured score_mod generated into the kernel source.

One kernel module is generated per *variant* (score_mod key, activation, causal, dropout, use_qk,
side and table dtypes / ranks) from the templates below and the score_mod's Triton code
(:mod:`.score_mod_codegen`), written to a cache directory and imported (Triton reads kernel source
from files). Head widths, scales, lengths and strides are runtime arguments; block sizes and the
head-width padding are constexprs.

Kernels, each over a grid of (block, row, head) with rows addressed by ``offsets``:

* ``fwd``: a query block against the key blocks it may see (causal: up to its last query),
  the interior ones (inside the row, every pair allowed) without masks and the edge ones (the
  causal diagonal, the row's last partial block) with them (the same split in both backward
  kernels), flash-style — ``tl.dot`` for ``q·kᵀ`` and ``A·v`` in fp32 accumulation; SiLU / identity, or an
  online softmax that stores the log-sum-exp per (token, head) for the backward; dropout with the
  reference's counter hash (the same 32-bit lowbias32 rounds, in uint32), so masks are bit-identical.
* ``bwd_kv``: a key block against the query blocks that see it: ``dk``, ``dv``, the gradients of the
  key-side float tensors (per head, summed on the host) and of every float table (``atomic_add``).
* ``bwd_q``: a query block against its key blocks: ``dq`` and the query-side tensors' gradients.

The softmax backward reads the forward's output and log-sum-exp, which ``jagged_attention_fwd``
returns and its autograd saves; called without them (``score_mod_attention``'s padded interface),
it reruns ``fwd`` first.

Index safety: every load is masked to the row; table indices are wrapped like torch indexing and
an index outside its table reads nothing and raises a ``ValueError`` after the kernel (torch raises
an ``IndexError`` there).
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .. import autotune
from ..autotune import TileTuner, device_cache_file
from ..score_mod import get_score_mod, live_state
from ..score_mod_codegen import HEAD_BOUND, POSITION_BOUND, ScoreModCode, Unsupported, generate
from .side_ranges import int64_side_ranges

_OP = "grcompile::jagged_attention"
_ACT = {"identity": 0, "silu": 1, "softmax": 2}
_TL = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
       torch.int64: "i64", torch.int32: "i32", torch.bool: "i1", torch.uint8: "u8", torch.int16: "i16",
       torch.int8: "i8"}


class TritonFallback(Exception):
    """This call cannot run the Triton kernel; the message says why (the op runs the reference)."""


# --------------------------------------------------------------------------------------------
# source templates ({...} are filled by _render; the score_mod code is indented into them)

_HEADER = '''\
import triton
import triton.language as tl


@triton.jit
def _hash32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _keep(seed, q_tok, k_tok, head, H, threshold):
    row = _hash32(((seed ^ (q_tok.to(tl.int64) * H + head)) & 0xFFFFFFFF).to(tl.uint32))
    u = _hash32(row ^ (k_tok.to(tl.int64) & 0xFFFFFFFF).to(tl.uint32)) >> 8
    return u >= threshold


@triton.jit
def _tile_ptrs(base, tok, stride_t, head, stride_h, cols):
    """Pointers to ``base[tok, head, cols]`` of a [tokens, heads, width] tensor: a [rows, cols] tile."""
    return base + tok[:, None] * stride_t + head * stride_h + cols[None, :]


@triton.jit
def _load_tile(base, tok, ok, stride_t, head, stride_h, cols, width):
    return tl.load(_tile_ptrs(base, tok, stride_t, head, stride_h, cols),
                   mask=ok[:, None] & (cols[None, :] < width), other=0.0)


@triton.jit
def _store_tile(base, tok, ok, stride_t, head, stride_h, cols, width, value):
    tl.store(_tile_ptrs(base, tok, stride_t, head, stride_h, cols), value.to(base.dtype.element_ty),
             mask=ok[:, None] & (cols[None, :] < width))


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # IEEE: 0 tensor-core native (bf16 / fp16), 1 fp32 without tf32, 2 both operands upcast to fp32
    # (the interpreter's bf16 dot is wrong; bf16 products are exact in fp32, so only the order of
    # the fp32 sum differs from a GPU)
    if IEEE == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE == 1:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
'''

# Positions as the kernels load them. With a score_mod clamped to [0, max_len): what the forward
# validated, kept by construction, so that a table index proven in range from the positions'
# bounds (statically, or from max_len under GUARDS) stays in range whatever a caller passes;
# without one they index nothing: loaded as they are.
_LOAD_POSITIONS = '''

@triton.jit
def _load_positions(POS, tok, ok, POS_MAX):
    pos = tl.load(POS + tok, mask=ok, other=0).to(tl.int32)
    return {value}
'''

_FWD = '''

@triton.jit
def fwd(Q, K, V, O, LSE, OFFS, POS, SEED, OOB, {extra_params}
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        H, DQK, DV, scale, out_scale, keep_scale, threshold, POS_MAX,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
        ACT: tl.constexpr, CAUSAL: tl.constexpr, USE_QK: tl.constexpr, DROPOUT: tl.constexpr,
        IEEE: tl.constexpr, OOB_ROWS: tl.constexpr, SPLIT: tl.constexpr, GUARDS: tl.constexpr):
    pid_m = tl.program_id(0)
    row = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(OFFS + row).to(tl.int32)  # token offsets in int32: the launcher checks numel < 2**31
    L = tl.load(OFFS + row + 1).to(tl.int32) - start
    m0 = pid_m * BLOCK_M
    if m0 >= L:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q_ok = offs_m < L
    q_tok = start + offs_m
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(Q, q_tok, q_ok, stride_qt, head, stride_qh, dqk, DQK)
    q_pos = _load_positions(POS, q_tok, q_ok, POS_MAX)[:, None]
{load_q_sides}
    seed = tl.load(SEED) if DROPOUT else 0
    # out-of-range table indices: flags per pair (sm_90: cheapest) or per query row (sm_80: the
    # per-pair flags spill there)
    oob = tl.zeros([BLOCK_M], tl.int32) if OOB_ROWS else tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    hi = tl.minimum(L, m0 + BLOCK_M) if CAUSAL else L
    # key blocks inside the row that every query of the block may see whole: no mask there
    full = ((m0 + 1) // BLOCK_N) * BLOCK_N if CAUSAL else (L // BLOCK_N) * BLOCK_N
{loops}
    if ACT == 2:
        live = l_i > 0
        acc = acc / tl.where(live, l_i, 1.0)[:, None]
        acc = tl.where(live[:, None], acc, 0.0)
        lse = tl.where(live, m_i + tl.log(tl.where(live, l_i, 1.0)), float("inf"))
        tl.store(LSE + q_tok * H + head, lse, mask=q_ok)
    acc = acc * out_scale
    _store_tile(O, q_tok, q_ok, stride_ot, head, stride_oh, dv, DV, acc)
    if (tl.max(oob, 0) if OOB_ROWS else tl.max(tl.max(oob, 1), 0)) != 0:
        tl.atomic_max(OOB, 1)
'''

_FWD_TILE = '''\
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_ok = {k_ok}
        k_tok = start + offs_n
        v = _load_tile(V, k_tok, k_ok, stride_vt, head, stride_vh, dv, DV)
        k_pos = _load_positions(POS, k_tok, k_ok, POS_MAX)[None, :]
{load_k_sides}
        PAIR = q_ok[:, None] & k_ok[None, :]
        QOK = q_ok[:, None]
        KOK = k_ok[None, :]
        if USE_QK:
            k = _load_tile(K, k_tok, k_ok, stride_kt, head, stride_kh, dqk, DQK)
            s = _dot(q, tl.trans(k), IEEE) * scale
        else:
            s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
{score_mod}
        allowed = {allowed}
        if ACT == 2:
            s_mod = tl.where(allowed, s_mod, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s_mod, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s_mod - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        elif ACT == 1:
            p = tl.where(allowed, s_mod / (1.0 + tl.exp(-s_mod)), 0.0)
        else:
            p = tl.where(allowed, s_mod, 0.0)
        if DROPOUT:
            keep = _keep(seed, q_tok[:, None], k_tok[None, :], head, H, threshold)
            p = tl.where(keep, p * keep_scale, 0.0)
        acc = acc + _dot(p.to(v.dtype), v, IEEE)
'''

# a query block's inputs in both backward kernels (bwd_q: its own block; bwd_kv: each block it loops over)
_LOAD_QUERY_BLOCK = [
    "q = _load_tile(Q, q_tok, q_ok, stride_qt, head, stride_qh, dqk, DQK)",
    "do = _load_tile(DO, q_tok, q_ok, stride_ot, head, stride_oh, dv, DV)",
    "q_pos = _load_positions(POS, q_tok, q_ok, POS_MAX)[:, None]",
    "if ACT == 2:",
    "    lse = tl.load(LSE + q_tok * H + head, mask=q_ok, other=float(\"inf\"))",
    "    delta = tl.load(DELTA + q_tok * H + head, mask=q_ok, other=0.0)",
]

# the shared body of both backward kernels: recompute the pair tile, then g_s (raw-score grad)
_BWD_PAIR = '''\
        PAIR = q_ok[:, None] & k_ok[None, :]
        QOK = q_ok[:, None]
        KOK = k_ok[None, :]
        if USE_QK:
            s = _dot(q, tl.trans(k), IEEE) * scale
        else:
            s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        # the forward reported these; unused here
        oob = tl.zeros([BLOCK_M], tl.int32) if OOB_ROWS else tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
{score_mod}
        allowed = {allowed}
        w = out_scale
        if DROPOUT:
            keep = _keep(seed, q_tok[:, None], k_tok[None, :], head, H, threshold)
            w = tl.where(keep, out_scale * keep_scale, 0.0)
        dad = _dot(do, tl.trans(v), IEEE)  # d(loss)/d(weight after dropout and out_scale)
        if ACT == 2:
            a = tl.where(allowed, tl.exp(tl.where(allowed, s_mod, 0.0) - lse[:, None]), 0.0)
            g_mod = a * (dad * w - delta[:, None])
        elif ACT == 1:
            sig = 1.0 / (1.0 + tl.exp(-s_mod))
            a = tl.where(allowed, s_mod * sig, 0.0)
            g_mod = tl.where(allowed, dad * w * sig * (1.0 + s_mod * (1.0 - sig)), 0.0)
        else:
            a = tl.where(allowed, s_mod, 0.0)
            g_mod = tl.where(allowed, dad * w, 0.0)
{score_mod_backward}
'''

_BWD_KV = '''

@triton.jit
def bwd_kv(Q, K, V, DO, LSE, DELTA, DK, DV_OUT, OFFS, POS, SEED, {extra_params} {grad_params}
           stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
           H, DQK, DV, scale, out_scale, keep_scale, threshold, POS_MAX,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
           ACT: tl.constexpr, CAUSAL: tl.constexpr, USE_QK: tl.constexpr, DROPOUT: tl.constexpr,
           IEEE: tl.constexpr, OOB_ROWS: tl.constexpr, SPLIT: tl.constexpr, GUARDS: tl.constexpr):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(OFFS + row).to(tl.int32)  # token offsets in int32: the launcher checks numel < 2**31
    L = tl.load(OFFS + row + 1).to(tl.int32) - start
    n0 = pid_n * BLOCK_N
    if n0 >= L:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k_ok = offs_n < L
    k_tok = start + offs_n
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    k = _load_tile(K, k_tok, k_ok, stride_kt, head, stride_kh, dqk, DQK)
    v = _load_tile(V, k_tok, k_ok, stride_vt, head, stride_vh, dv, DV)
    k_pos = _load_positions(POS, k_tok, k_ok, POS_MAX)[None, :]
{load_k_sides}
    seed = tl.load(SEED) if DROPOUT else 0
    rep = (pid_n + row + head) % NREP  # table-gradient replica (a sum of small ids: no int32 overflow)
    dk_acc = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
{init_k_side_grads}
    lo = (n0 // BLOCK_M) * BLOCK_M if CAUSAL else 0
    # query blocks inside the row whose every query sees every key of this block: no mask there
    mid = tl.minimum(((n0 + BLOCK_N + BLOCK_M - 2) // BLOCK_M) * BLOCK_M, L) if CAUSAL else 0
    full_end = tl.maximum((L // BLOCK_M) * BLOCK_M, mid)
{loops}
    _store_tile(DK, k_tok, k_ok, stride_kt, head, stride_kh, dqk, DQK, (dk_acc * scale))
    _store_tile(DV_OUT, k_tok, k_ok, stride_vt, head, stride_vh, dv, DV, dv_acc)
{store_k_side_grads}
'''

_BWD_Q = '''

@triton.jit
def bwd_q(Q, K, V, DO, LSE, DELTA, DQ, OFFS, POS, SEED, {extra_params} {grad_params}
          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
          H, DQK, DV, scale, out_scale, keep_scale, threshold, POS_MAX,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
          ACT: tl.constexpr, CAUSAL: tl.constexpr, USE_QK: tl.constexpr, DROPOUT: tl.constexpr,
          IEEE: tl.constexpr, OOB_ROWS: tl.constexpr, SPLIT: tl.constexpr, GUARDS: tl.constexpr):
    pid_m = tl.program_id(0)
    row = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(OFFS + row).to(tl.int32)  # token offsets in int32: the launcher checks numel < 2**31
    L = tl.load(OFFS + row + 1).to(tl.int32) - start
    m0 = pid_m * BLOCK_M
    if m0 >= L:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q_ok = offs_m < L
    q_tok = start + offs_m
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
{load_query_block}
{load_q_sides}
    seed = tl.load(SEED) if DROPOUT else 0
    dq_acc = tl.zeros([BLOCK_M, BLOCK_DQK], tl.float32)
{init_q_side_grads}
    hi = tl.minimum(L, m0 + BLOCK_M) if CAUSAL else L
    full = ((m0 + 1) // BLOCK_N) * BLOCK_N if CAUSAL else (L // BLOCK_N) * BLOCK_N  # as in fwd
{loops}
    _store_tile(DQ, q_tok, q_ok, stride_qt, head, stride_qh, dqk, DQK, (dq_acc * scale))
{store_q_side_grads}
'''

_BWD_KV_TILE = '''\
        offs_m = m0 + tl.arange(0, BLOCK_M)
        q_ok = {q_ok}
        q_tok = start + offs_m
{load_query_block}
{load_q_sides_inner}
{pair}
        dv_acc = dv_acc + _dot(tl.trans((a * w).to(do.dtype)), do, IEEE)
        if USE_QK:
            dk_acc = dk_acc + _dot(tl.trans(g_s.to(q.dtype)), q, IEEE)
{acc_k_side_grads}
'''

_BWD_Q_TILE = '''\
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_ok = {k_ok}
        k_tok = start + offs_n
        k = _load_tile(K, k_tok, k_ok, stride_kt, head, stride_kh, dqk, DQK)
        v = _load_tile(V, k_tok, k_ok, stride_vt, head, stride_vh, dv, DV)
        k_pos = _load_positions(POS, k_tok, k_ok, POS_MAX)[None, :]
{load_k_sides_inner}
{pair}
        if USE_QK:
            dq_acc = dq_acc + _dot(g_s.to(k.dtype), k, IEEE)
{acc_q_side_grads}
'''

_MASKED = "PAIR & (k_pos <= q_pos) if CAUSAL else PAIR"


def _block_loops(tile: str, var: str, split: list[tuple[str, bool]], whole: str, **fields: str) -> str:
    """A kernel's loops over ``var``'s blocks (``"m0"``: query blocks, ``"n0"``: key blocks). Under
    the constexpr ``SPLIT`` (:func:`split_interior`) one loop per ``(range, interior)`` of
    ``split``: an interior block lies inside the row and every pair of it is allowed, so its tile
    runs without masks (an all-true constant mask, which folds away); the others — the causal
    diagonal, the row's last partial block — with them. Otherwise one masked loop over ``whole``
    (a compile-time branch: the unused one is not compiled). A field named ``x_interior`` /
    ``x_edge`` fills ``{x}`` in the interior / edge tiles; the others fill both."""
    ok, block, offs = ("q_ok", "BLOCK_M", "offs_m") if var == "m0" else ("k_ok", "BLOCK_N", "offs_n")
    shared = {name: value for name, value in fields.items() if not name.endswith(("_interior", "_edge"))}

    def loop(bound: str, interior: bool) -> str:
        suffix = "_interior" if interior else "_edge"
        chosen = {name[:-len(suffix)]: value for name, value in fields.items() if name.endswith(suffix)}
        mask = f"tl.full([{block}], 1, tl.int1)" if interior else f"{offs} < L"
        body = f"    for {var} in range({bound}, {block}):\n" + tile.format(**{ok: mask}, **chosen, **shared)
        return "".join("    " + line if line.strip() else line for line in body.splitlines(keepends=True))
    return ("    if SPLIT:\n" + "".join(loop(bound, interior) for bound, interior in split) +
            "    else:\n" + loop(whole, False))


def _indent(lines: list[str], spaces: int) -> str:
    return "\n".join(" " * spaces + line for line in lines)


@dataclass(frozen=True)
class Variant:
    score_mod: str
    activation: str
    causal: bool
    use_qk: bool
    dropout: bool
    q_sides: tuple  # dtypes
    k_sides: tuple
    tables: tuple  # (shape, dtype) per table: the generated code drops the lookups' guards the sizes prove
    # per side (query sides first): the int32 interval the call's int64 values lie in, or None
    # (side_ranges.int64_side_ranges); the generated code computes with those sides in int32
    side_ranges: tuple = ()


def _render(code: Optional[ScoreModCode], n_q: int, n_k: int, table_ranks: list[int]) -> str:
    """The kernel module source for one variant."""
    n_tab = len(table_ranks)
    extra = [f"QS{i}" for i in range(n_q)] + [f"KS{i}" for i in range(n_k)]
    for t, rank in enumerate(table_ranks):
        extra += [f"tab{t}"] + [f"tab{t}_n{d}" for d in range(rank)] + [f"tab{t}_s{d}" for d in range(rank)]
    extra_params = "".join(f"{p}, " for p in extra)
    fq = code.float_q_sides if code else []
    fk = code.float_k_sides if code else []
    ft = code.float_tables if code else []
    grad_params = "".join(f"DQS{i}, " for i in fq) + "".join(f"DKS{i}, " for i in fk) + \
        "".join(f"dtab{t}, " for t in ft) + "NREP, "
    head_line = []
    forward = code.forward if code else ["s_mod = s"]
    backward = list(code.backward) if code else ["g_s = g_mod"]
    sm = _indent(head_line + forward, 8)
    backward_kv = _indent(backward, 8)
    # table gradients only in bwd_kv, so each pair adds once
    backward_q = _indent([line for line in backward if not line.startswith("tl.atomic_add")], 8)

    narrow = set(code.int32_sides) if code else set()

    def loads(prefix: str, n: int, axis: str, mask: str, tok: str, spaces: int) -> str:
        sl = "[:, None]" if axis == "q" else "[None, :]"
        return _indent([f"{prefix.lower()}{i} = tl.load({prefix}{i} + {tok}, mask={mask}, other=0){sl}"
                        + (".to(tl.int32)" if f"{prefix.lower()}{i}" in narrow else "") for i in range(n)], spaces)
    load_q = loads("QS", n_q, "q", "q_ok", "q_tok", 4)
    load_k = loads("KS", n_k, "k", "k_ok", "k_tok", 8)

    def pairs(backward_lines: str) -> dict:
        return {f"pair_{kind}": _BWD_PAIR.format(score_mod=sm, score_mod_backward=backward_lines, allowed=allowed)
                for kind, allowed in (("interior", "PAIR"), ("edge", _MASKED))}
    key_blocks = [("0, full", True), ("full, hi", False)]  # fwd, bwd_q: see `full` in their source
    src = _HEADER + _LOAD_POSITIONS.format(value="tl.minimum(tl.maximum(pos, 0), POS_MAX)" if code else "pos")
    src += _FWD.format(extra_params=extra_params, load_q_sides=load_q, loops=_block_loops(
        _FWD_TILE, "n0", key_blocks, "0, hi", allowed_interior="PAIR", allowed_edge=_MASKED, load_k_sides=load_k,
        score_mod=sm))
    # bwd_kv: k sides outside the loop, q sides inside
    src += _BWD_KV.format(
        extra_params=extra_params, grad_params=grad_params,
        load_k_sides=loads("KS", n_k, "k", "k_ok", "k_tok", 4),
        init_k_side_grads=_indent([f"gks_acc{i} = tl.zeros([1, BLOCK_N], tl.float32)" for i in fk], 4),
        loops=_block_loops(_BWD_KV_TILE, "m0", [("lo, mid", False), ("mid, full_end", True), ("full_end, L", False)],
                           "lo, L", load_query_block=_indent(_LOAD_QUERY_BLOCK, 8),
                           load_q_sides_inner=loads("QS", n_q, "q", "q_ok", "q_tok", 8),
                           acc_k_side_grads=_indent([f"gks_acc{i} = gks_acc{i} + g_ks{i}" for i in fk], 8),
                           **pairs(backward_kv)),
        store_k_side_grads=_indent([f"tl.store(DKS{i} + k_tok[None, :] * H + head, gks_acc{i}, mask=k_ok[None, :])"
                                    for i in fk], 4))
    src += _BWD_Q.format(
        extra_params=extra_params, grad_params=grad_params, load_query_block=_indent(_LOAD_QUERY_BLOCK, 4),
        load_q_sides=load_q, init_q_side_grads=_indent([f"gqs_acc{i} = tl.zeros([BLOCK_M, 1], tl.float32)" for i in fq], 4),
        loops=_block_loops(_BWD_Q_TILE, "n0", key_blocks, "0, hi", load_k_sides_inner=load_k,
                           acc_q_side_grads=_indent([f"gqs_acc{i} = gqs_acc{i} + g_qs{i}" for i in fq], 8),
                           **pairs(backward_q)),
        store_q_side_grads=_indent([f"tl.store(DQS{i} + q_tok[:, None] * H + head, gqs_acc{i}, mask=q_ok[:, None])"
                                    for i in fq], 4))
    del n_tab
    return src


_CACHE_DIR = Path(os.environ.get("GRCOMPILE_TRITON_CACHE", Path(tempfile.gettempdir()) / "grcompile-triton"))
_MODULES: dict[tuple, tuple] = {}  # (variant, the score_mod's live state) -> (module, code)


def _load_module(source: str):
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    name = f"grcompile_attention_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    _CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = _CACHE_DIR / f"{name}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def kernels_for(variant: Variant, q_sides, k_sides, tables):
    """``(module, code)`` of ``variant``: generated and imported once per process (and again
    when a global or closure value the score_mod reads has changed: ``score_mod.live_state``)."""
    key = (variant, live_state(variant.score_mod))
    hit = _MODULES.get(key)
    if hit is None:
        code = None
        if variant.score_mod:
            code = generate(get_score_mod(variant.score_mod), q_sides, k_sides, tables, backward=True,
                            side_ranges=variant.side_ranges)
        ranks = [t.dim() for t in tables] + ([c.dim() for c in code.constants] if code else [])
        module = _load_module(_render(code, len(q_sides), len(k_sides), ranks))
        hit = _MODULES[key] = (module, code)
    return hit


# --------------------------------------------------------------------------------------------
# launching


def _pad(d: int) -> int:
    return max(16, 1 << max(0, (d - 1).bit_length()))  # tl.dot needs >= 16


# GPU tiles: GPU_TILES[kernel][arch][bucket] = (BLOCK_M, BLOCK_N, num_warps, num_stages) for head
# widths max(dqk, dv) <= bucket. fwd / bwd_q own BLOCK_M queries and loop over BLOCK_N keys;
# bwd_kv owns BLOCK_N keys and loops over BLOCK_M queries. On sm_90 a tl.dot runs on wgmma only
# with M >= 64 (fwd / bwd_q: BLOCK_M; bwd_kv: BLOCK_M for q·kᵀ, do·vᵀ and BLOCK_N for dk, dv), else
# on mma.sync; sm_80 has mma.sync alone: hence a table per arch.
# Chosen by `python -m grcompile.lowering.tile_sweep --arch sm_80,sm_90 --bucket 64,128,256` (bf16,
# every score_mod of aot_cases at width = bucket, compiled as a launch specialises the integer
# arguments; the rule is in that module's docstring): no spills and the arch's MMA alone where some
# tile has them, the most work per program (BM·BN), a pipelined tile (a one-stage one counts as a
# size smaller), then the fewest registers. Exceptions, on sm_90: bwd_kv 64 / 128 has no spill-free
# tile with wgmma for all four dots (q·kᵀ, do·vᵀ or dk, dv stay on mma.sync); bwd_kv 256 keeps the
# spill-free 16 x 32 on mma.sync alone, where the rule would take 16 x 64 x 1 stage (wgmma for dk, dv;
# the bias tables spill 32-40 B). All entries re-swept as launched on 2026-11-28
# (docs/bench/tile-sweep-2026-11-28.json) but sm_80 fwd / bwd_q 256, re-swept that day before the
# one-size-down rule (their largest passing size has pipelined tiles, so it changes nothing there).
GPU_TILES = {
    "fwd": {"sm_80": {64: (32, 128, 8, 2), 128: (32, 64, 8, 2), 256: (16, 128, 8, 2)},
            "sm_90": {64: (128, 32, 8, 2), 128: (128, 32, 8, 2), 256: (64, 32, 8, 2)}},
    "bwd_kv": {"sm_80": {64: (64, 32, 8, 3), 128: (32, 64, 8, 3), 256: (16, 32, 8, 2)},
               "sm_90": {64: (128, 16, 8, 3), 128: (64, 16, 8, 2), 256: (16, 32, 8, 2)}},
    "bwd_q": {"sm_80": {64: (32, 128, 8, 2), 128: (32, 128, 8, 2), 256: (64, 32, 8, 2)},
              "sm_90": {64: (128, 32, 8, 2), 128: (128, 32, 8, 2), 256: (128, 16, 8, 2)}},
}
# float32 inputs: products in IEEE fp32 (PyTorch's default for float32 matmuls), computed by FMA
# instructions, not tensor cores: each thread holds its share of the tiles as 32-bit values, and
# the bf16 tiles spilled (HSTU at width 64 on sm_90: 24 KB in bwd_kv, 1.4 KB in fwd). Chosen
# 2026-11-29 by AOT compiles of HSTU, the per-head time table and SASRec at width = bucket
# (`python -m grcompile.lowering.tile_sweep --dtype fp32 --sizes 16,32,64 --stages 1,2 --max-area
# 2048` for fwd and bwd_kv sm_80 at 64 / 128, candidate tiles compiled one by one for the rest,
# docs/bench/fp32-tiles-2026-11-29.json): spill-free for all three at 64 and, but bwd_kv, at 128 and
# 256; the most work per program, pipelined where a pipelined tile was spill-free. bwd_kv holds dk
# and dv in fp32 registers: at 128 the 16 x 16 tile spills 8 B (SASRec, sm_80) / 32 B (HSTU, sm_90),
# at 256 ~1 KB — the least found; two stages spill KBs there (ptxas drops to 32 registers).
FP32_TILES = {
    "fwd": {"sm_80": {64: (16, 64, 8, 2), 128: (16, 64, 8, 2), 256: (16, 32, 8, 1)},
            "sm_90": {64: (16, 64, 8, 2), 128: (16, 64, 8, 2), 256: (16, 32, 8, 1)}},
    "bwd_kv": {"sm_80": {64: (32, 32, 8, 1), 128: (16, 16, 8, 1), 256: (16, 16, 8, 1)},
               "sm_90": {64: (16, 32, 8, 1), 128: (16, 16, 8, 1), 256: (16, 16, 8, 1)}},
    "bwd_q": {"sm_80": {64: (16, 64, 8, 2), 128: (16, 32, 8, 1), 256: (16, 16, 8, 1)},
              "sm_90": {64: (32, 32, 8, 2), 128: (16, 32, 8, 1), 256: (16, 16, 8, 1)}},
}
HEAD_BUCKETS = (64, 128, 256)
# Tiles timed natively on an H100 (Triton 3.6, bf16, one 8192-token row, 4 heads x 128; 2026-11-24,
# docs/lowering.md "Measured on an H100"), which beat the rule's tiles there and so override them.
# "plain": no score_mod and no dropout (fwd 1.60 -> 1.07 ms, bwd 2.60 -> 1.71 ms, one call on one machine);
# "score_mod": the HSTU RAB (bwd 10.0 -> 8.3 ms; its forward keeps the rule's tile, the fastest measured).
# Triton 3.9's AOT compile spills some of them (the report notes it, measured speed decides).
MEASURED_TILES = {
    ("sm_90", 128, "plain"): {"fwd": (64, 64, 4, 3), "bwd_kv": (64, 64, 4, 4), "bwd_q": (128, 64, 8, 3)},
    ("sm_90", 128, "score_mod"): {"bwd_kv": (32, 64, 8, 3), "bwd_q": (64, 32, 8, 3)},
}


def gpu_arch(device: torch.device) -> str:
    """The ``GPU_TILES`` arch of a CUDA device: ``"sm_90"`` from compute capability 9 on, else ``"sm_80"``."""
    return "sm_90" if torch.cuda.get_device_capability(device)[0] >= 9 else "sm_80"


def _bucket(width: int) -> int:
    bucket = next((b for b in HEAD_BUCKETS if width <= b), None)
    if bucket is None:
        raise ValueError(f"head width {width}: the kernels take at most {HEAD_BUCKETS[-1]}")
    return bucket


def tile_source(kernel: str, arch: str, bucket: int, plain: bool, dtype: torch.dtype = torch.bfloat16) -> str:
    """``"measured"`` where :data:`MEASURED_TILES` sets this tile, else ``"rule"`` (GPU_TILES, or
    FP32_TILES for float32 inputs)."""
    if dtype == torch.float32:
        return "rule"
    return "measured" if kernel in MEASURED_TILES.get((arch, bucket, "plain" if plain else "score_mod"), {}) \
        else "rule"


def launch_config(kernel: str, dqk: int, dv: int, device: Optional[torch.device] = None,
                  arch: Optional[str] = None, plain: bool = False,
                  dtype: torch.dtype = torch.bfloat16) -> tuple[dict, int, int]:
    """``(constexpr blocks, num_warps, num_stages)`` of ``kernel`` ("fwd", "bwd_kv", "bwd_q") on
    ``device`` (its arch read from the device), or for ``arch`` ("sm_80" / "sm_90") when given
    (ahead-of-time compiles: no device); ``plain``: the variant has no score_mod and no dropout;
    ``dtype``: of q, k, v (float32 has tiles of its own, :data:`FP32_TILES`)."""
    pads = dict(BLOCK_DQK=_pad(dqk), BLOCK_DV=_pad(dv))
    if arch is None:
        if device is None or device.type == "cpu":  # the interpreter: small tiles keep it fast
            return dict(BLOCK_M=16, BLOCK_N=16, **pads), 4, 1
        arch = gpu_arch(device)
    bucket = _bucket(max(dqk, dv))
    if dtype == torch.float32:
        tiles = FP32_TILES[kernel][arch][bucket]
    else:
        measured = MEASURED_TILES.get((arch, bucket, "plain" if plain else "score_mod"), {})
        tiles = measured.get(kernel) or GPU_TILES[kernel][arch][bucket]
    env = os.environ.get(f"GRCOMPILE_TILES_{kernel.upper()}")  # "BM,BN,warps,stages": for tuning runs
    bm, bn, warps, stages = tuple(int(x) for x in env.split(",")) if env else tiles
    return dict(BLOCK_M=bm, BLOCK_N=bn, **pads), warps, stages


def _as_kernel_input(t: torch.Tensor) -> torch.Tensor:
    """Bool tensors go in as uint8 (the generated code compares them with 0)."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _table_args(tables: list[torch.Tensor]) -> list:
    args = []
    for t in tables:
        args.append(_as_kernel_input(t))
        args += list(t.shape) + list(t.stride())
    return args


def _side_args(q_side, k_side, tables) -> list:
    return [*(_as_kernel_input(t.contiguous()) for t in (*q_side, *k_side)), *_table_args(tables)]


def _variant(q_side, k_side, tables, score_mod, activation, causal, use_qk, dropout) -> Variant:
    """The variant of a call; without a score_mod the sides are unused and not measured."""
    return Variant(score_mod, activation, causal, use_qk, dropout, tuple(t.dtype for t in q_side),
                   tuple(t.dtype for t in k_side), tuple((tuple(t.shape), t.dtype) for t in tables),
                   int64_side_ranges(q_side, k_side) if score_mod else ())


def _check_supported(q: torch.Tensor, v: torch.Tensor, tables, max_len: int) -> None:
    """What the kernels assume (int32 offsets and positions, tile sizes); outside it, the reference."""
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TritonFallback(f"the Triton kernel takes float32 / bfloat16 / float16, got {q.dtype}")
    if max(q.shape[2], v.shape[2]) > 256:
        raise TritonFallback(f"head widths {q.shape[2]}, {v.shape[2]}: the kernel takes at most 256")
    if max_len > POSITION_BOUND or q.shape[1] > HEAD_BOUND:
        raise TritonFallback(f"max_len {max_len} > {POSITION_BOUND} or {q.shape[1]} heads > {HEAD_BOUND}")
    # q and v as launched (launch_width pads their rows); token offsets are int32 in the kernels
    sizes = [("q", q.shape[0] * q.shape[1] * launch_width(q.shape[2])),
             ("v", v.shape[0] * v.shape[1] * launch_width(v.shape[2])),
             *((f"tables[{i}]", t.numel()) for i, t in enumerate(tables))]
    big = [name for name, n in sizes if n >= 1 << 31]
    if big or q.shape[0] * q.shape[1] >= 1 << 31:
        raise TritonFallback(f"{', '.join(big) or 'tokens x heads'} has 2**31 elements or more (int32 offsets)")


def split_interior(has_score_mod: bool) -> bool:
    """Whether the kernels run interior blocks in an unmasked loop apart (``SPLIT``): without a
    score_mod. With one, its table gathers, not the mask, are the kernels' cost, and the second
    copy of its code is unmeasured on a GPU: compiled as launched (2026-11-28) it is spill-free on
    every rule tile but raises the H100-measured HSTU bwd_kv tile's spill from 24 to 112 B (an
    unspecialised compile had shown spills on three rule tiles, the reason it was first left off)."""
    return not has_score_mod


def _common(q, k, v, offsets, positions, seed, *, activation, causal, use_qk, scale, out_scale, dropout_p,
            max_len, code=None, split=False):
    H = q.shape[1]
    threshold = round(dropout_p * (1 << 24))
    seed_t = seed if seed is not None else torch.zeros(1, dtype=torch.int64, device=q.device)
    return dict(H=H, DQK=q.shape[2], DV=v.shape[2], scale=float(scale), out_scale=float(out_scale),
                keep_scale=1.0 / (1.0 - dropout_p) if dropout_p > 0 else 1.0, threshold=threshold,
                ACT=_ACT[activation], CAUSAL=causal, USE_QK=use_qk, DROPOUT=dropout_p > 0,
                IEEE=2 if q.device.type == "cpu" else int(q.dtype == torch.float32),
                OOB_ROWS=q.device.type == "cuda" and gpu_arch(q.device) == "sm_80", SPLIT=split,
                POS_MAX=max_len - 1, GUARDS=code.guard_bits(max_len, H) if code else 0), seed_t


TABLE_GRAD_REPLICAS = int(os.environ.get("GRCOMPILE_TABLE_GRAD_REPLICAS", "32"))  # at most; see table_grad_lines
TABLE_GRAD_BYTES = 64 << 20  # the replicas' memory, at most


def _table_grad_replicas(numels: list[int], programs: int) -> int:
    """How many copies of the float tables' gradients bwd_kv's programs spread their atomics over:
    up to TABLE_GRAD_REPLICAS, no more than programs, within TABLE_GRAD_BYTES and int32 offsets."""
    if not numels:
        return 1
    fits = min(TABLE_GRAD_BYTES // max(1, 4 * sum(numels)), (1 << 31) // max(1, max(numels)))
    return max(1, min(TABLE_GRAD_REPLICAS, programs, fits))


# (module, kernel, dtype, DQK, DV) -> the tile that fit, after the table's did not (see _launch)
_FITTED: dict[tuple, tuple[dict, int, int]] = {}


def _fallback_tiles(blocks: dict, warps: int, stages: int):
    """Smaller tiles to try when ``blocks`` needs more shared memory than the device has (float32
    inputs double the bf16 tiles' footprint): one pipeline stage, then halving the larger block."""
    yield blocks, warps, 1
    bm, bn = blocks["BLOCK_M"], blocks["BLOCK_N"]
    while max(bm, bn) > 16:
        bm, bn = (bm // 2, bn) if bm >= bn else (bm, bn // 2)
        yield dict(blocks, BLOCK_M=bm, BLOCK_N=bn), warps, 1


def _is_plain(meta: dict, has_score_mod: bool) -> bool:
    return not has_score_mod and not meta["DROPOUT"]


# Tiles the autotuner times besides the table's (BLOCK_M, BLOCK_N, num_warps, num_stages): the
# tiles that won a kernel in the H100 sweeps (docs/lowering.md, "Measured on an H100") and the
# usual flash-attention shapes; a tile over the device's shared memory is skipped.
TUNE_TILES = {
    "fwd": [(64, 64, 4, 3), (64, 32, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 8, 3), (128, 64, 4, 3)],
    "bwd_kv": [(64, 64, 4, 4), (32, 64, 8, 3), (64, 64, 8, 3), (32, 64, 4, 3), (16, 64, 8, 3), (64, 128, 8, 3)],
    "bwd_q": [(128, 64, 8, 3), (64, 32, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3), (128, 32, 8, 3), (64, 16, 8, 2)],
}
_TUNERS: dict[str, TileTuner] = {}  # device -> its tuner


def tuner(device: torch.device) -> TileTuner:
    """``device``'s tile tuner (its choices persist in the kernel cache directory, per GPU model)."""
    name = str(device)
    if name not in _TUNERS:
        _TUNERS[name] = TileTuner(cache_file=device_cache_file(_CACHE_DIR, device) if device.type == "cuda" else None)
    return _TUNERS[name]


def tuned_tiles() -> list[dict]:
    """The tiles the autotuner chose in this process, with every trial's time (bench JSON)."""
    return [record for t in _TUNERS.values() for record in t.report()]


def _tunes(kernel: str, device: torch.device) -> bool:
    return autotune.AUTOTUNE and device.type == "cuda" and not os.environ.get(f"GRCOMPILE_TILES_{kernel.upper()}")


# the constexprs a generated module is compiled with besides its tile: each its own tuning key
_VARIANT_CONSTEXPRS = ("ACT", "CAUSAL", "USE_QK", "DROPOUT", "IEEE", "OOB_ROWS", "SPLIT", "GUARDS")


def _tune_key(module, kernel: str, meta: dict, dtype: torch.dtype, max_len: int) -> str:
    """The autotuner's key: the module (its source digest: score_mod, sides, tables), the kernel,
    every constexpr but the tile, dtype, head widths and the max-length bucket (whether the
    variant is "plain" follows from the module and DROPOUT)."""
    return "|".join(str(part) for part in (
        module.__name__, kernel, dtype, meta["DQK"], meta["DV"], *(f"{c}={meta[c]}" for c in _VARIANT_CONSTEXPRS),
        autotune.length_bucket(max_len)))


def _run_tile(module, kernel: str, meta: dict, max_len: int, B: int, args: tuple, tile: tuple) -> None:
    blocks, warps, stages = tile
    block = blocks["BLOCK_N"] if kernel == "bwd_kv" else blocks["BLOCK_M"]
    getattr(module, kernel)[(math.ceil(max_len / block), B, meta["H"])](*args, **meta, **blocks, num_warps=warps,
                                                                         num_stages=stages)


def _launch(module, kernel: str, meta: dict, max_len: int, B: int, *args, plain: bool = False,
            accumulators: tuple = ()) -> None:
    """Launch ``kernel`` with its tuned tile (on CUDA, :mod:`..autotune`; ``accumulators``: the
    buffers it ``atomic_add``s into, zeroed after the trials) or its table tile; a tile the
    device's shared memory cannot hold is replaced by a smaller one (remembered), and
    TritonFallback when none fits."""
    from triton.runtime.errors import OutOfResources

    device = args[0].device
    if _tunes(kernel, device):
        pads = dict(BLOCK_DQK=_pad(meta["DQK"]), BLOCK_DV=_pad(meta["DV"]))
        candidates = [launch_config(kernel, meta["DQK"], meta["DV"], device, plain=plain, dtype=args[0].dtype)] + \
            [(dict(BLOCK_M=bm, BLOCK_N=bn, **pads), warps, stages) for bm, bn, warps, stages in TUNE_TILES[kernel]]
        key = _tune_key(module, kernel, meta, args[0].dtype, max_len)
        tiles = tuner(device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            tile = tiles.remembered(key)  # timing would synchronise the captured stream: a choice made before
        else:
            tile = tiles.choose(key, candidates, lambda t: _run_tile(module, kernel, meta, max_len, B, args, t),
                                accumulators)
        if tile is not None:
            try:
                _run_tile(module, kernel, meta, max_len, B, args, tile)
                return
            except OutOfResources:  # a remembered tile this device cannot hold: the table's, shrunk
                tiles.forget(key)
    key = (module.__name__, kernel, args[0].dtype, meta["DQK"], meta["DV"], plain,
           os.environ.get(f"GRCOMPILE_TILES_{kernel.upper()}"))  # a tuning run's tile is its own entry
    first = _FITTED.get(key) or launch_config(kernel, meta["DQK"], meta["DV"], device, plain=plain,
                                              dtype=args[0].dtype)
    last = None
    for tile in (first, *_fallback_tiles(*first)):
        try:
            _run_tile(module, kernel, meta, max_len, B, args, tile)
        except OutOfResources as exc:  # raised while loading the compiled kernel, before it runs
            last = exc
            continue
        if tile != first:
            _FITTED[key] = tile
        return
    raise TritonFallback(f"no tile of the {kernel} kernel fits this device ({last})")


def launch_width(d: int) -> int:
    """The head width the kernels get for width ``d``: rounded up to a multiple of 16, zeros in the
    pad. Triton's launcher declares a stride or width divisible by 16 only when it is; only then
    are a tile's rows provably aligned, and its loads 16-byte vectors and (in a pipelined loop)
    asynchronous copies — at width 50 every key and value element was a 2-byte scalar load, in
    a loop that was not pipelined (AOT report). Zero columns change no dot product."""
    return -(-d // 16) * 16


def _at_launch_width(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[T, H, d]`` contiguous at :func:`launch_width` (zero-padded; no copy when it is)."""
    t = t.contiguous()
    width = launch_width(t.shape[-1])
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _prepare(q, k, v, q_side, k_side, tables, *, score_mod, use_qk, activation, causal, max_len, dropout_p):
    """``(q, k, v, module, code, all_tables)``: contiguous inputs at the launch width and the
    variant's kernels; raises TritonFallback / Unsupported when the kernels cannot run this call."""
    _check_supported(q, v, tables, max_len)
    q, k, v = _at_launch_width(q), _at_launch_width(k), _at_launch_width(v)
    variant = _variant(q_side, k_side, tables, score_mod, activation, causal, use_qk, dropout_p > 0)
    module, code = kernels_for(variant, q_side, k_side, tables)
    # contiguous: the gradient buffers are, and a lookup's offset uses the table's strides for both
    all_tables = [t.contiguous() for t in tables] + [c.to(q.device).contiguous() for c in
                                                     (code.constants if code else [])]
    _check_sorted(code, all_tables, len(tables))
    return q, k, v, module, code, all_tables


def _check_sorted(code, all_tables: list[torch.Tensor], n_inputs: int) -> None:
    """The kernels count a ``torch.bucketize``'s boundaries, which equals torch's binary search
    only on sorted boundaries (torch requires them sorted and defines nothing else; a NaN among
    them is unsorted): a call whose boundaries are not runs the reference, which calls torch."""
    if code is None or not code.sorted_tables:
        return
    checked = [all_tables[i] for i in code.sorted_tables if all_tables[i].numel() > 1]
    if not checked:
        return
    ok = torch.stack([(t[1:] >= t[:-1]).all() for t in checked])
    if not bool(ok.all()):  # one synchronisation (the op's argument checks synchronise already)
        bad = [i for i, good in zip((i for i in code.sorted_tables if all_tables[i].numel() > 1), ok.tolist())
               if not good]
        names = ", ".join(f"tables[{i}]" if i < n_inputs else "a constant of the score_mod" for i in bad)
        raise TritonFallback(f"the boundaries of torch.bucketize ({names}) are not sorted (or hold NaN): torch "
                             "defines buckets for sorted boundaries only, and the kernel counts boundaries")


def _forward(q, k, v, offsets, positions, q_side, k_side, tables, seed, *, score_mod, use_qk, activation, scale,
             out_scale, causal, max_len, dropout_p):
    """``(out, lse, (q, k, v), module, code, all_tables)``, q / k / v as launched (at the launch
    width); raises TritonFallback / Unsupported before launching."""
    width = v.shape[2]
    q, k, v, module, code, all_tables = _prepare(q, k, v, q_side, k_side, tables, score_mod=score_mod, use_qk=use_qk,
                                                 activation=activation, causal=causal, max_len=max_len,
                                                 dropout_p=dropout_p)
    T, H, dv = q.shape[0], q.shape[1], v.shape[2]
    out = torch.empty(T, H, dv, dtype=q.dtype, device=q.device)
    # the kernel stores it under ACT == 2 only; else empty, as jagged_attention_fwd returns it
    lse = torch.empty((T, H) if activation == "softmax" else (0,), dtype=torch.float32, device=q.device)
    oob = torch.zeros(1, dtype=torch.int32, device=q.device)
    meta, seed_t = _common(q, k, v, offsets, positions, seed, activation=activation, causal=causal, use_qk=use_qk,
                           scale=scale, out_scale=out_scale, dropout_p=dropout_p, max_len=max_len, code=code,
                           split=split_interior(code is not None))
    B = offsets.shape[0] - 1
    if T and B:
        lse_arg = lse if lse.numel() else torch.empty(1, dtype=torch.float32, device=q.device)
        _launch(module, "fwd", meta, max_len, B, q, k, v, out, lse_arg, offsets, positions, seed_t, oob,
                *_side_args(q_side, k_side, all_tables),
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                out.stride(0), out.stride(1), plain=_is_plain(meta, code is not None))
        if int(oob.item()):
            raise ValueError(f"{_OP}: the score_mod {score_mod!r} indexes one of its tables out of range "
                             "(torch raises IndexError on this input)")
    if out.shape[2] != width:
        out = out[..., :width].contiguous()
    return out, lse, (q, k, v), module, code, all_tables


def attention_triton(q, k, v, offsets, positions, q_side, k_side, tables, seed=None, *, score_mod, use_qk,
                     activation, scale, out_scale, causal, max_len, dropout_p=0.0, with_lse=False):
    """The Triton forward; the reference when the kernel cannot run this call (with a warning).
    ``with_lse``: ``(out, lse)`` as ``jagged_attention_fwd`` returns them."""
    from . import _attention_reference, _check_dropout, _check_meta, _check_values
    _check_meta(q, k, v, offsets, positions, q_side, k_side, tables, score_mod, activation, max_len)
    _check_dropout(seed, dropout_p, q.device)
    _check_values(offsets, positions, q.shape[0], max_len)
    try:
        out, lse = _forward(q, k, v, offsets, positions, q_side, k_side, tables, seed, score_mod=score_mod,
                            use_qk=use_qk, activation=activation, scale=scale, out_scale=out_scale, causal=causal,
                            max_len=max_len, dropout_p=dropout_p)[:2]
        return (out, lse) if with_lse else out
    except (TritonFallback, Unsupported) as why:
        _note_fallback(score_mod, str(why))
        return _attention_reference(q, k, v, offsets, positions, q_side, k_side, tables, seed, score_mod=score_mod,
                                    use_qk=use_qk, activation=activation, scale=scale, out_scale=out_scale,
                                    causal=causal, max_len=max_len, dropout_p=dropout_p, with_lse=with_lse)


def _note_fallback(score_mod: str, why: str, op: str = "jagged_attention") -> None:
    """The reference runs this call; the registry keeps why (``report()`` shows it), warned once."""
    from .. import note_fallback
    if note_fallback(op, score_mod, why):
        import warnings
        warnings.warn(f"{_OP}: the Triton kernel does not run score_mod {score_mod or '(none)'!r}: {why}; "
                      "the reference implementation runs instead (same values, slower)", stacklevel=3)


def attention_backward_triton(grad_out, q, k, v, offsets, positions, q_side, k_side, tables, seed=None,
                              fwd_out=None, fwd_lse=None, *, score_mod, use_qk, activation, scale, out_scale, causal,
                              max_len, dropout_p=0.0):
    """The Triton backward. ``fwd_out`` / ``fwd_lse``: the forward's output and log-sum-exp
    (softmax); without them the forward runs again first to get them."""
    from . import _attention_backward_reference, _grad_placeholder
    kwargs = dict(score_mod=score_mod, use_qk=use_qk, activation=activation, scale=scale, out_scale=out_scale,
                  causal=causal, max_len=max_len, dropout_p=dropout_p)
    stats = activation == "softmax" and fwd_out is not None and fwd_lse is not None and fwd_lse.numel() > 0
    dqk, dv_width = q.shape[2], v.shape[2]
    given = (grad_out, q, k, v)  # the reference, if the kernels fail, takes the call as given
    try:
        if activation == "softmax" and not stats:  # the gradient needs the row's log-sum-exp: rerun the forward
            out, lse, (q, k, v), module, code, all_tables = _forward(q, k, v, offsets, positions, q_side, k_side,
                                                                     tables, seed, **kwargs)
        else:  # the forward's statistics, or SiLU / identity (pointwise: recomputed tile by tile)
            q, k, v, module, code, all_tables = _prepare(q, k, v, q_side, k_side, tables, score_mod=score_mod,
                                                         use_qk=use_qk, activation=activation, causal=causal,
                                                         max_len=max_len, dropout_p=dropout_p)
            if stats:
                out, lse = fwd_out, fwd_lse.float().contiguous()
    except (TritonFallback, Unsupported) as why:
        _note_fallback(score_mod, str(why), "jagged_attention_backward")
        return _attention_backward_reference(*given, offsets, positions, q_side, k_side, tables, seed,
                                             fwd_out, fwd_lse, **kwargs)
    T, H = q.shape[0], q.shape[1]
    if activation == "softmax":
        delta = (grad_out.float() * out.float()).sum(-1).contiguous()
    else:  # the kernels read lse and delta under ACT == 2 only
        lse = delta = torch.empty(1, dtype=torch.float32, device=q.device)
    grad_out = _at_launch_width(grad_out)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    fq = code.float_q_sides if code else []
    fk = code.float_k_sides if code else []
    ft = code.float_tables if code else []
    dqs = {i: torch.zeros(T, H, dtype=torch.float32, device=q.device) for i in fq}
    dks = {i: torch.zeros(T, H, dtype=torch.float32, device=q.device) for i in fk}
    meta, seed_t = _common(q, k, v, offsets, positions, seed, activation=activation, causal=causal, use_qk=use_qk,
                           scale=scale, out_scale=out_scale, dropout_p=dropout_p, max_len=max_len, code=code,
                           split=split_interior(code is not None))
    plain = _is_plain(meta, code is not None)
    blocks_kv = launch_config("bwd_kv", q.shape[2], v.shape[2], q.device, plain=plain, dtype=q.dtype)[0]
    replicas = _table_grad_replicas([tables[i].numel() for i in ft],
                                    math.ceil(max_len / blocks_kv["BLOCK_N"]) * (offsets.shape[0] - 1) * H)
    dtabs = {i: torch.zeros((replicas, *tables[i].shape), dtype=torch.float32, device=q.device) for i in ft}
    grad_args = [dqs[i] for i in fq] + [dks[i] for i in fk] + [dtabs[i] for i in ft] + [replicas]
    B = offsets.shape[0] - 1
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               grad_out.stride(0), grad_out.stride(1))
    try:
        if T and B:
            side_args = _side_args(q_side, k_side, all_tables)
            _launch(module, "bwd_kv", meta, max_len, B, q, k, v, grad_out, lse, delta, dk, dv, offsets, positions,
                    seed_t, *side_args, *grad_args, *strides, plain=plain, accumulators=tuple(dtabs.values()))
            if use_qk or fq:  # without q·k and query-side gradients there is nothing for bwd_q to compute
                _launch(module, "bwd_q", meta, max_len, B, q, k, v, grad_out, lse, delta, dq, offsets, positions,
                        seed_t, *side_args, *grad_args, *strides, plain=plain)
    except TritonFallback as why:
        _note_fallback(score_mod, str(why), "jagged_attention_backward")
        return _attention_backward_reference(*given, offsets, positions, q_side, k_side, tables, seed,
                                             fwd_out, fwd_lse, **kwargs)
    if not use_qk:
        dq.zero_(), dk.zero_()
    if dq.shape[2] != dqk:
        dq, dk = dq[..., :dqk].contiguous(), dk[..., :dqk].contiguous()
    if dv.shape[2] != dv_width:
        dv = dv[..., :dv_width].contiguous()

    def side_grads(sides, acc):
        return [acc[i].sum(1).to(t.dtype) if i in acc else
                (torch.zeros_like(t) if t.is_floating_point() else _grad_placeholder(t)) for i, t in enumerate(sides)]
    d_tables = [dtabs[i].sum(0).to(t.dtype) if i in dtabs else
                (torch.zeros_like(t) if t.is_floating_point() else _grad_placeholder(t)) for i, t in enumerate(tables)]
    return dq, dk, dv, side_grads(q_side, dqs), side_grads(k_side, dks), d_tables


__all__ = ["attention_triton", "attention_backward_triton", "kernels_for", "Variant", "aot_configs",
           "TritonFallback", "tuned_tiles", "TUNE_TILES"]


# --------------------------------------------------------------------------------------------
# ahead-of-time compile configs (python -m grcompile.lowering.aot)


def _kernel_signature(fn, q_dtype: torch.dtype, q_sides, k_sides, tables) -> dict[str, str]:
    """Triton argument types of a generated kernel for tensors of these dtypes."""
    elem = {**_TL, torch.bool: "u8"}
    side = {**{f"QS{i}": elem[t.dtype] for i, t in enumerate(q_sides)},
            **{f"KS{i}": elem[t.dtype] for i, t in enumerate(k_sides)},
            **{f"tab{i}": elem[t.dtype] for i, t in enumerate(tables)}}
    import inspect

    signature = {}
    # the Python signature, not fn.params: under TRITON_INTERPRET the kernel is an InterpretedFunction
    for name, param in inspect.signature(getattr(fn, "fn", fn)).parameters.items():
        if "constexpr" in str(param.annotation):
            signature[name] = "constexpr"
        elif name in ("Q", "K", "V", "O", "DO", "DK", "DV_OUT", "DQ"):
            signature[name] = "*" + _TL[q_dtype]
        elif name in ("LSE", "DELTA") or name.startswith(("DQS", "DKS", "dtab")):
            signature[name] = "*fp32"
        elif name in ("OFFS", "POS", "SEED"):
            signature[name] = "*i64"
        elif name == "OOB":
            signature[name] = "*i32"
        elif name in side:
            signature[name] = "*" + side[name]
        elif name in ("scale", "out_scale", "keep_scale"):
            signature[name] = "fp32"
        else:  # strides, sizes, H, DQK, DV, threshold
            signature[name] = "i32"
    return signature


def _aot_time_bucket_per_head(score, q_pos, k_pos, head, q_side_0, k_side_0, table_0):
    """A zoo-style captured bias: log-bucketed time gap, one table column per head."""
    bucket = torch.clamp(torch.log1p((k_side_0 - q_side_0).abs().float()).div(0.7).long(), 0, 127)
    return score + table_0[(bucket, head)]


def _aot_bucketized_time_per_head(score, q_pos, k_pos, head, q_side_0, k_side_0, table_0, table_1):
    """A bucketized time bias: the gap cut by ``torch.bucketize`` at 6 boundaries (compared one by
    one, scalar loads), one table column per head."""
    return score + table_1[(torch.bucketize((k_side_0 - q_side_0).abs(), table_0), head)]


def aot_cases() -> dict[str, tuple]:
    """The score_mods of the AOT report, by model: ``(score_mod key, activation, use_qk, dropout,
    q_sides, k_sides, tables)`` — SASRec (none, softmax, dropout), HSTU (relative position +
    time-bucket tables, SiLU) on timestamps in seconds (the variant with int32 time gaps, see
    :mod:`.side_ranges`) and in milliseconds (int64), FuXi-α's positional channel (no q·k), a
    zoo-style per-head time-bucket table and a ``torch.bucketize``-d one (6 boundaries: a minute to
    a week). The sides' values choose the variant, as at a launch."""
    from ..score_mod import hstu_rab_key, register_score_mod, relative_position_bias_key
    N, H = AOT_TOKENS, AOT_HEADS
    stamps = torch.tensor([1_700_000_000, 1_700_086_400])
    milliseconds = stamps * 1000
    hstu_tables = [torch.zeros(2 * N - 1), torch.zeros(129)]
    return {
        "sasrec": ("", "softmax", True, True, [], [], []),
        "hstu": (hstu_rab_key(N, 128), "silu", True, False, [stamps], [stamps], hstu_tables),
        "hstu_ms": (hstu_rab_key(N, 128), "silu", True, False, [milliseconds], [milliseconds], hstu_tables),
        "fuxi_positional": (relative_position_bias_key(N), "identity", False, False, [], [], [torch.zeros(2 * N - 1)]),
        "time_bucket_per_head": (register_score_mod(_aot_time_bucket_per_head), "softmax", True, True,
                                 [stamps], [stamps], [torch.zeros(128, H)]),
        "bucketize_per_head": (register_score_mod(_aot_bucketized_time_per_head), "softmax", True, True,
                               [stamps], [stamps], [torch.tensor([60, 3600, 21600, 86400, 259200, 604800]),
                                                    torch.zeros(7, H)]),
    }


# the AOT report's launch: one row of this many tokens, this many heads (aot_cases' sizes)
AOT_TOKENS, AOT_HEADS = 8192, 8


def _aot_int_args(signature: dict, d: int, heads: int, dropout: bool, tables: list, float_table_numels: list[int],
                  block_n: int) -> dict[str, int]:
    """The integer arguments the launcher passes at the AOT report's size (contiguous ``[T, heads,
    d]`` inputs, contiguous tables; ``block_n``: bwd_kv's key block), for the report to compile
    the specialisation a launch runs."""
    width = launch_width(d)
    values = {f"stride_{x}t": heads * width for x in "qkvo"} | {f"stride_{x}h": width for x in "qkvo"}
    values |= dict(H=heads, DQK=width, DV=width, threshold=round(0.1 * (1 << 24)) if dropout else 0,
                   POS_MAX=AOT_TOKENS - 1,
                   NREP=_table_grad_replicas(float_table_numels, math.ceil(AOT_TOKENS / block_n) * heads))
    for i, t in enumerate(tables):
        values |= {f"tab{i}_n{j}": n for j, n in enumerate(t.shape)}
        values |= {f"tab{i}_s{j}": st for j, st in enumerate(t.contiguous().stride())}
    return {name: values[name] for name, kind in signature.items() if kind == "i32"}


def aot_kernels(model: str) -> tuple[str, ...]:
    """The kernels a model's attention launches (no q·k: nothing for bwd_q, see its launch)."""
    return ("fwd", "bwd_kv", "bwd_q") if aot_cases()[model][2] else ("fwd", "bwd_kv")


def aot_config(model: str, kernel: str, arch: str, d: int, tile: Optional[tuple] = None,
               heads: int = AOT_HEADS, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The AOT compile config of ``kernel`` for ``model``'s score_mod (:func:`aot_cases`) at head
    width ``d`` with ``heads`` heads, in ``dtype``, for ``arch``: its launch tile, or ``tile`` =
    (BLOCK_M, BLOCK_N, num_warps, num_stages) when given (tile sweeps)."""
    return case_aot_config(aot_cases()[model], kernel, arch, d, tile, model=model, heads=heads, dtype=dtype)


def case_aot_config(case: tuple, kernel: str, arch: str, d: int, tile: Optional[tuple] = None,
                    model: str = "custom", heads: int = AOT_HEADS, dtype: torch.dtype = torch.bfloat16) -> dict:
    """:func:`aot_config` of one ``(score_mod key, activation, use_qk, dropout, q_sides, k_sides,
    tables)`` case (the shape of :func:`aot_cases`' values). float32 compiles as a launch of
    float32 inputs does: IEEE products, no tensor cores (``ieee``)."""
    key, activation, use_qk, dropout, q_sides, k_sides, tables = case
    variant = _variant(q_sides, k_sides, tables, key, activation, True, use_qk, dropout)  # sides: as their values
    module, code = kernels_for(variant, q_sides, k_sides, tables)
    all_tables = list(tables) + list(code.constants if code else [])
    plain = not key and not dropout
    if tile is None:
        blocks, warps, stages = launch_config(kernel, d, d, arch=arch, plain=plain, dtype=dtype)
    else:
        blocks, (warps, stages) = dict(BLOCK_M=tile[0], BLOCK_N=tile[1], BLOCK_DQK=_pad(d), BLOCK_DV=_pad(d)), tile[2:]
    ieee = dtype == torch.float32
    constexprs = dict(blocks, ACT=_ACT[activation], CAUSAL=True, USE_QK=use_qk, DROPOUT=dropout, IEEE=int(ieee),
                      OOB_ROWS=arch == "sm_80", SPLIT=split_interior(bool(key)),
                      GUARDS=code.guard_bits(AOT_TOKENS, heads) if code else 0)
    fn = getattr(module, kernel)
    signature = _kernel_signature(fn, dtype, q_sides, k_sides, all_tables)
    float_tables = [all_tables[i].numel() for i in (code.float_tables if code else [])]
    # the launcher sizes the table-gradient replicas (NREP) by bwd_kv's key block, for both backward kernels
    kv_block_n = blocks["BLOCK_N"] if kernel == "bwd_kv" else \
        launch_config("bwd_kv", d, d, arch=arch, plain=plain, dtype=dtype)[0]["BLOCK_N"]
    return dict(kernel=f"jagged_attention_{kernel}", fn=fn, arch=arch, signature=signature,
                int_args=_aot_int_args(signature, d, heads, dropout, all_tables, float_tables, kv_block_n),
                constexprs=constexprs, num_warps=warps, num_stages=stages, uses_dot=True, ieee=ieee,
                config=dict(model=model, score_mod=key.split("-")[0] or "none", activation=activation,
                            dtype=_TL[dtype], head_dim=d, heads=heads, dropout=dropout, arch=arch, **blocks,
                            tiles="swept" if tile else tile_source(kernel, arch, _bucket(d), plain, dtype)))


# (model, head width, heads[, dtype]) of the AOT report: the bf16 training dtype, head widths 64 and
# 128 (HSTU on millisecond timestamps at 128); the original SASRec's one head of width 50, launched
# at width 64 (launch_width) and specialised differently (H = 1 a constant); and float32 (IEEE
# products on FMA, FP32_TILES) for HSTU and that SASRec, as the papers' configurations train
AOT_REPORT = (("sasrec", 64, AOT_HEADS), ("hstu", 128, AOT_HEADS), ("hstu", 64, AOT_HEADS),
              ("hstu_ms", 128, AOT_HEADS), ("fuxi_positional", 64, AOT_HEADS), ("time_bucket_per_head", 64, AOT_HEADS),
              ("bucketize_per_head", 64, AOT_HEADS),
              ("sasrec", 50, 1), ("hstu", 64, AOT_HEADS, torch.float32), ("sasrec", 50, 1, torch.float32))


def aot_tune_configs() -> list[dict]:
    """The autotuner's candidates (:data:`TUNE_TILES`) as the H100 bench launches them — HSTU's
    relative bias (SiLU) and no bias (SiLU and softmax), width 128, four heads, sm_90 — for
    ``python -m grcompile.lowering.aot --providers grcompile.lowering.attention.triton:aot_tune_configs``
    (not in the default report: the tuner times them, so a spill is noted, not failed)."""
    cases = {"hstu": aot_cases()["hstu"], "plain_silu": ("", "silu", True, False, [], [], []),
             "plain_softmax": ("", "softmax", True, False, [], [], [])}
    configs = []
    for name, case in cases.items():
        for kernel, tiles in TUNE_TILES.items():
            for tile in tiles:
                cfg = case_aot_config(case, kernel, "sm_90", 128, tile, model=name, heads=4)
                cfg["config"]["tiles"] = "candidate"
                configs.append(cfg)
    return configs


def aot_configs() -> list[dict]:
    """The AOT report's configs: every kernel of :data:`AOT_REPORT` once per arch, with that arch's
    ``GPU_TILES`` (``FP32_TILES``) tile (the ``arch`` key: compiled for that arch only)."""
    return [aot_config(model, kernel, arch, d, heads=heads, dtype=dtype[0] if dtype else torch.bfloat16)
            for model, d, heads, *dtype in AOT_REPORT for kernel in aot_kernels(model) for arch in ("sm_80", "sm_90")]
