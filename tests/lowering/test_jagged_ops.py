"""Property tests of the op library against padded dense references written like the models.

Every attention reference below copies the lines of models/hstu.py, models/fuxi.py and
models/sasrec.py (and uses models/common.py's bias modules themselves), on padded ``[B, N]``
tensors with any validity pattern; the jagged op must equal it at every valid position, and the
gradients of q, k, v and the tables must equal the dense ones (float64).
"""
from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import grcompile.lowering as lowering
from grcompile.lowering import attention as attention_mod
from grcompile.lowering.attention import buckets, chunks
from grcompile.lowering import jagged as J
from grcompile.lowering.score_mod import (get_score_mod, hstu_rab_key, register_score_mod,
                                          relative_position_bias_key)
from models.common import RelativePositionBias, RelativeTimeBias, causal_padding_mask
from models.sasrec import MASKED_SCORE

from . import PROFILE
from .attention import wrappers

SETTINGS = settings(parent=settings.get_profile(PROFILE))
SLOW = settings(parent=settings.get_profile("lowering-slow"))
F64 = torch.float64


# ------------------------------------------------------------------------------------------------
# cases


@dataclass
class Case:
    valid: torch.Tensor  # [B, N] bool
    q: torch.Tensor  # [B, N, H, dqk] float64 leaves
    k: torch.Tensor
    v: torch.Tensor  # [B, N, H, dv]
    timestamps: torch.Tensor  # [B, N] int64, 0 at padding
    position_bias: RelativePositionBias
    time_bias: RelativeTimeBias
    plan: dict  # attention knobs (bucketing / chunking, see KNOBS) to run under
    causal: bool = True

    @property
    def N(self) -> int:
        return self.valid.shape[1]

    def packed(self):
        index = J.jagged_index(self.valid)
        offsets = J.valid_to_offsets(self.valid)
        positions = J.padded_positions(index, self.N)
        return index, offsets, positions


PLANS = [
    {},  # the defaults
    {"BUCKET_WASTE": 0.0, "BUCKET_SLACK_PAIRS": 0},  # one bucket per distinct length
    {"BUCKET_WASTE": 1.0, "BUCKET_SLACK_PAIRS": 0},  # everything in one bucket
    {"CHUNK_ELEMENTS": 1, "MIN_Q_BLOCK": 1},  # one row per chunk, one query per block
    {"CHUNK_ELEMENTS": 50, "MIN_Q_BLOCK": 3, "BUCKET_SLACK_PAIRS": 0},
    {"CAUSAL_Q_BLOCK": 2},  # causal chunks cut into query blocks of 2
    {"COMPILE_CHUNKS": False},  # the plain eager chunk (the tests' default, tests/conftest.py)
]


# knob -> the module whose global it is (read at call time)
KNOBS = {"BUCKET_WASTE": buckets, "BUCKET_SLACK_PAIRS": buckets, "CHUNK_ELEMENTS": buckets, "MIN_Q_BLOCK": buckets,
         "CAUSAL_Q_BLOCK": buckets, "COMPILE_CHUNKS": chunks}


@contextlib.contextmanager
def plan(knobs: dict):
    old = {name: getattr(KNOBS[name], name) for name in knobs}
    try:
        for name, value in knobs.items():
            setattr(KNOBS[name], name, value)
        yield
    finally:
        for name, value in old.items():
            setattr(KNOBS[name], name, value)


@st.composite
def valid_masks(draw, max_B: int = 5, max_N: int = 10) -> torch.Tensor:
    B = draw(st.integers(1, max_B))
    N = draw(st.integers(1, max_N))
    padding = draw(st.sampled_from(["right", "left", "mask"]))
    if padding == "mask":
        bits = draw(st.lists(st.booleans(), min_size=B * N, max_size=B * N))
        return torch.tensor(bits, dtype=torch.bool).view(B, N)
    lengths = torch.tensor(draw(st.lists(st.one_of(st.just(0), st.just(1), st.just(N), st.integers(0, N)),
                                         min_size=B, max_size=B)))
    ar = torch.arange(N).unsqueeze(0)
    return ar < lengths[:, None] if padding == "right" else ar >= (N - lengths)[:, None]


@st.composite
def cases(draw, max_B: int = 5, max_N: int = 10, causal=st.just(True), heads=st.integers(1, 3),
          widths=st.integers(1, 4)) -> Case:
    causal = draw(causal)
    valid = draw(valid_masks(max_B, max_N))
    B, N = valid.shape
    H = draw(heads)
    dqk, dv = draw(widths), draw(widths)
    table_max_len = N + draw(st.integers(0, 3))
    num_buckets = draw(st.sampled_from([4, 128]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).requires_grad_()

    gaps = (10 ** (torch.rand(B, N, generator=gen, dtype=F64) * 7)).floor().long()
    gaps = gaps * (torch.rand(B, N, generator=gen) > 0.2)  # repeated timestamps too
    timestamps = (1_600_000_000 + torch.cumsum(gaps, dim=1)) * valid
    position_bias = RelativePositionBias(table_max_len).double()
    time_bias = RelativeTimeBias(num_buckets).double()
    with torch.no_grad():
        position_bias.weight.copy_(torch.randn(position_bias.weight.shape, generator=gen, dtype=F64))
        time_bias.weight.copy_(torch.randn(time_bias.weight.shape, generator=gen, dtype=F64))
    return Case(valid, randn(B, N, H, dqk), randn(B, N, H, dqk), randn(B, N, H, dv), timestamps,
                position_bias, time_bias, draw(st.sampled_from(PLANS)), causal)


# ------------------------------------------------------------------------------------------------
# dense references, line for line as in the models


def heads(x):  # [B, N, H, d] -> [B, H, N, d], the models' q.view(B, N, H, d).transpose(1, 2)
    return x.transpose(1, 2)


def query_timestamps(timestamps, valid):  # RelativeTimeBias' query side, packed by the op's caller
    next_ts = torch.cat([timestamps[:, 1:], timestamps[:, -1:]], dim=1)
    next_valid = torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)
    return torch.where(next_valid, next_ts, timestamps)


def mask_of(c: Case) -> torch.Tensor:
    """The models' causal_padding_mask, or its bidirectional variant valid_i & valid_j."""
    if c.causal:
        return causal_padding_mask(c.valid)
    return c.valid.unsqueeze(1) & c.valid.unsqueeze(2)


def dense_hstu(c: Case):
    N = c.N
    q, k, v = heads(c.q), heads(c.k), heads(c.v)
    rab = c.position_bias(N, q.device).unsqueeze(0) + c.time_bias(c.timestamps, c.valid)
    scores = torch.matmul(q, k.transpose(-2, -1)) + rab.unsqueeze(1)
    attn = F.silu(scores) / N
    attn = attn * mask_of(c).unsqueeze(1)
    return torch.matmul(attn, v).transpose(1, 2)  # [B, N, H, dv]


def dense_fuxi(c: Case):
    N = c.N
    q, k, v = heads(c.q), heads(c.k), heads(c.v)
    mask = causal_padding_mask(c.valid).unsqueeze(1).to(q.dtype)
    semantic = F.silu(torch.matmul(q, k.transpose(-2, -1))) / N * mask
    positional = c.position_bias(N, q.device) * mask
    temporal = c.time_bias(c.timestamps, c.valid).unsqueeze(1) * mask
    channels = [torch.matmul(positional, v), torch.matmul(temporal, v), torch.matmul(semantic, v)]
    return torch.cat(channels, dim=-1).transpose(1, 2)


def dense_sasrec(c: Case):
    q, k, v = heads(c.q), heads(c.k), heads(c.v)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask_of(c).unsqueeze(1), MASKED_SCORE)
    attn = torch.softmax(scores, dim=-1)
    return torch.matmul(attn, v).transpose(1, 2)


# ------------------------------------------------------------------------------------------------
# jagged calls


def jagged_inputs(c: Case):
    index, offsets, positions = c.packed()
    q, k, v = (J.dense_to_jagged(x, index) for x in (c.q, c.k, c.v))
    q_ts = J.dense_to_jagged(query_timestamps(c.timestamps, c.valid), index)
    k_ts = J.dense_to_jagged(c.timestamps, index)
    return index, q, k, v, offsets, positions, q_ts, k_ts


def jagged_hstu(c: Case):
    index, q, k, v, offsets, positions, q_ts, k_ts = jagged_inputs(c)
    out = wrappers.hstu_attention(q, k, v, offsets, positions, N=c.N, query_timestamps=q_ts, timestamps=k_ts,
                                  position_table=c.position_bias.weight, time_table=c.time_bias.weight,
                                  table_max_len=c.position_bias.max_len, num_buckets=c.time_bias.num_buckets,
                                  causal=c.causal)
    return index, out


def jagged_fuxi(c: Case):
    index, q, k, v, offsets, positions, q_ts, k_ts = jagged_inputs(c)
    out = wrappers.fuxi_attention(q, k, v, offsets, positions, N=c.N, query_timestamps=q_ts, timestamps=k_ts,
                                  position_table=c.position_bias.weight, time_table=c.time_bias.weight,
                                  table_max_len=c.position_bias.max_len, num_buckets=c.time_bias.num_buckets)
    return index, out


def jagged_sasrec(c: Case):
    index, q, k, v, offsets, positions, _, _ = jagged_inputs(c)
    return index, wrappers.jagged_softmax_attention(q, k, v, offsets, positions, N=c.N, causal=c.causal)


def jagged_hstu_score_kind(c: Case):
    """The attention-capture convention: one ``score`` score_mod holding the whole pointwise region."""
    N, max_len, num_buckets = c.N, c.position_bias.max_len, c.time_bias.num_buckets

    def hstu_region(score, q_pos, k_pos, q_ts, k_ts, pos_w, time_w):
        delta = (q_ts - k_ts).abs().clamp(min=1)
        buckets = (torch.log(delta.float()) / 0.301).long().clamp(0, num_buckets)
        rab = pos_w[k_pos - q_pos + max_len - 1] + time_w[buckets]
        return F.silu(score + rab) / N

    key = register_score_mod(hstu_region, kind="score")
    index, q, k, v, offsets, positions, q_ts, k_ts = jagged_inputs(c)
    out = torch.ops.grcompile.jagged_attention(
        q, k, v, offsets, positions, [q_ts], [k_ts], [c.position_bias.weight, c.time_bias.weight], None,
        score_mod=key, use_qk=True, activation="identity", scale=1.0, out_scale=1.0, causal=c.causal, max_len=N)
    return index, out


def check_against_dense(c: Case, jagged_fn, dense_fn, tables: bool):
    with plan(c.plan):
        index, out = jagged_fn(c)
    expected = J.dense_to_jagged(dense_fn(c), index)
    torch.testing.assert_close(out, expected)
    leaves = [c.q, c.k, c.v] + ([c.position_bias.weight, c.time_bias.weight] if tables else [])
    g = torch.randn_like(out)
    with plan(c.plan):
        got = torch.autograd.grad(out, leaves, g, allow_unused=True, materialize_grads=True)
    want = torch.autograd.grad(expected, leaves, g, allow_unused=True, materialize_grads=True)
    for name, a, b in zip(["q", "k", "v", "position_table", "time_table"], got, want):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"grad of {name}: {m}")


# ------------------------------------------------------------------------------------------------
# (1) jagged_attention == the padded models


@SETTINGS
@given(cases(causal=st.booleans()))
def test_hstu_attention_matches_padded_model(c: Case) -> None:
    check_against_dense(c, jagged_hstu, dense_hstu, tables=True)


@SETTINGS
@given(cases())
def test_fuxi_attention_matches_padded_model(c: Case) -> None:
    check_against_dense(c, jagged_fuxi, dense_fuxi, tables=True)


@SETTINGS
@given(cases(causal=st.booleans()))
def test_softmax_attention_matches_padded_sasrec(c: Case) -> None:
    check_against_dense(c, jagged_sasrec, dense_sasrec, tables=False)


@SETTINGS
@given(cases(max_B=3, max_N=8, causal=st.booleans()))
def test_score_kind_score_mod_matches_padded_hstu(c: Case) -> None:
    check_against_dense(c, jagged_hstu_score_kind, dense_hstu, tables=True)


@pytest.mark.slow
@SLOW
@given(cases(max_B=8, max_N=24, causal=st.booleans()), st.sampled_from(["hstu", "fuxi", "sasrec"]))
def test_attention_matches_padded_models_slow(c: Case, model: str) -> None:
    if model == "fuxi":
        c.causal = True  # FuXi-α's wrapper is used causally only
    fns = {"hstu": (jagged_hstu, dense_hstu, True), "fuxi": (jagged_fuxi, dense_fuxi, True),
           "sasrec": (jagged_sasrec, dense_sasrec, False)}
    check_against_dense(c, *fns[model])


def _compiled_chunk_entries() -> dict[tuple, int]:
    """Compiled entries per inductor-compiled chunk kernel (option set), and none gave up."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = {}
    for key, kernel in chunks._COMPILED_CHUNKS.items():
        assert not kernel.failed, f"the compiled chunk for {key} fell back to eager"
        entries[key] = len(_debug_get_cache_entry_list(kernel.compiled._torchdynamo_orig_callable))
    return entries


COMPILED = {"hstu": (jagged_hstu, dense_hstu, True), "sasrec": (jagged_sasrec, dense_sasrec, False)}


@SETTINGS
@given(cases(max_B=6, max_N=12, heads=st.just(2), widths=st.just(3)), st.sampled_from(sorted(COMPILED)))
def test_compiled_chunks_match_padded_models_without_recompiles(c: Case, model: str) -> None:
    """The inductor-compiled chunk (what users run; the other tests run the eager chunk, see
    tests/conftest.py) on random batch sizes, padded lengths and length mixes of one model width
    (heads and head width fixed, as in training: a width of 1 would specialise), all bucketing
    plans: values and gradients equal the padded model, and each option set compiles at most 4
    times (forward without grad,
    the backward's recomputation, its autograd view; a bias table of one entry specialises once
    more), whatever the sizes: rows and blocks of one token are padded to two, so Dynamo never
    specialises on a row count or length of 1 mid-training."""
    c.plan = {**c.plan, "COMPILE_CHUNKS": True}
    check_against_dense(c, *COMPILED[model])
    assert max(_compiled_chunk_entries().values(), default=0) <= 4, _compiled_chunk_entries()


@pytest.mark.slow
@SLOW
@given(cases(max_B=8, max_N=24, causal=st.booleans()), st.sampled_from(["hstu", "fuxi", "sasrec"]))
def test_compiled_chunks_match_padded_models_slow(c: Case, model: str) -> None:
    if model == "fuxi":
        c.causal = True
    fns = {"hstu": (jagged_hstu, dense_hstu, True), "fuxi": (jagged_fuxi, dense_fuxi, True),
           "sasrec": (jagged_sasrec, dense_sasrec, False)}
    c.plan = {**c.plan, "COMPILE_CHUNKS": True}
    check_against_dense(c, *fns[model])
    _compiled_chunk_entries()  # no option set gave up (widths vary: no bound on compiles; widths of 1 run eagerly)


def dense_keep(c: Case, seed: torch.Tensor, p: float) -> torch.Tensor:
    """The op's dropout mask on the padded grid ``[B, H, N, N]`` (padded slots: any value)."""
    index = J.jagged_index(c.valid)
    token = torch.zeros(c.valid.numel(), dtype=torch.int64)
    token[index] = torch.arange(index.numel())
    token = token.view(c.valid.shape)
    return attention_mod.dropout_keep(seed, token, token, c.q.shape[2], p)


@SETTINGS
@given(cases(causal=st.booleans()), st.sampled_from([0.1, 0.5, 0.9]), st.integers(0, 2**31 - 2),
       st.sampled_from(["hstu", "sasrec"]))
def test_attention_dropout_equals_dense_with_the_same_mask(c: Case, p: float, seed: int, model: str) -> None:
    """Dropout inside the op == the padded model's ``attn * keep / (1 − p)`` with the op's mask."""
    seed_t = torch.tensor([seed])
    drop = dense_keep(c, seed_t, p).to(F64) / (1 - p)
    if model == "hstu":
        def jagged_fn(c):
            index, q, k, v, offsets, positions, q_ts, k_ts = jagged_inputs(c)
            return index, wrappers.hstu_attention(
                q, k, v, offsets, positions, N=c.N, query_timestamps=q_ts, timestamps=k_ts,
                position_table=c.position_bias.weight, time_table=c.time_bias.weight,
                table_max_len=c.position_bias.max_len, num_buckets=c.time_bias.num_buckets, causal=c.causal,
                dropout_p=p, seed=seed_t)

        def dense_fn(c):
            q, k, v = heads(c.q), heads(c.k), heads(c.v)
            rab = c.position_bias(c.N, q.device).unsqueeze(0) + c.time_bias(c.timestamps, c.valid)
            attn = F.silu(torch.matmul(q, k.transpose(-2, -1)) + rab.unsqueeze(1)) * drop / c.N
            return torch.matmul(attn * mask_of(c).unsqueeze(1), v).transpose(1, 2)
    else:
        def jagged_fn(c):
            index, q, k, v, offsets, positions, _, _ = jagged_inputs(c)
            return index, wrappers.jagged_softmax_attention(q, k, v, offsets, positions, N=c.N, causal=c.causal,
                                                            dropout_p=p, seed=seed_t)

        def dense_fn(c):
            q, k, v = heads(c.q), heads(c.k), heads(c.v)
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            scores = scores.masked_fill(~mask_of(c).unsqueeze(1), MASKED_SCORE)
            return torch.matmul(torch.softmax(scores, dim=-1) * drop, v).transpose(1, 2)
    check_against_dense(c, jagged_fn, dense_fn, tables=model == "hstu")


def test_long_rows_with_query_tiling_match() -> None:
    """A row longer than the chunk budget is split into query blocks (causal: keys up to the block)."""
    gen = torch.Generator().manual_seed(3)
    valid = torch.zeros(3, 40, dtype=torch.bool)
    valid[0, :40], valid[1, 5:30], valid[2, :1] = True, True, True
    c = Case(valid, *(torch.randn(3, 40, 2, 3, generator=gen, dtype=F64).requires_grad_() for _ in range(3)),
             torch.cumsum(torch.randint(0, 10**5, (3, 40), generator=gen), 1) * valid,
             RelativePositionBias(40).double(), RelativeTimeBias(128).double(),
             {"CHUNK_ELEMENTS": 2 * 40 * 7, "MIN_Q_BLOCK": 4})
    check_against_dense(c, jagged_hstu, dense_hstu, tables=True)
    check_against_dense(c, jagged_sasrec, dense_sasrec, tables=False)


def test_softmax_row_without_allowed_key_is_zero() -> None:
    """A score_mod may mask every allowed key of a query (-inf): that row gives 0, grads stay finite."""
    def forbid_first_two(q_pos, k_pos, q_side, k_side, tables):
        return torch.where(q_pos < 2, float("-inf"), 0.0) + tables[0][0] * 0

    key = register_score_mod(forbid_first_two)
    q, k, v, offsets, positions, *_ = small_attention_args()
    table = torch.zeros(1, dtype=F64, requires_grad=True)
    out = torch.ops.grcompile.jagged_attention(
        q, k, v, offsets, positions, [], [], [table], None, score_mod=key, use_qk=True, activation="softmax",
        scale=1.0, out_scale=1.0, causal=True, max_len=5)
    early = positions < 2
    assert early.any() and (~early).any()
    assert (out[early] == 0).all() and (out[~early] != 0).any()
    grads = torch.autograd.grad((out * out).sum(), [q, k, v, table])
    assert all(torch.isfinite(g).all() for g in grads)


def test_float32_close_to_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    valid = torch.rand(4, 12, generator=gen) < 0.7
    index, offsets = J.jagged_index(valid), J.valid_to_offsets(valid)
    positions = J.padded_positions(index, 12)
    T = index.numel()
    q, k, v = (torch.randn(T, 2, 4, generator=gen, dtype=F64) for _ in range(3))
    table = torch.randn(23, generator=gen, dtype=F64)
    key = relative_position_bias_key(12)

    def run(dtype):
        return torch.ops.grcompile.jagged_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), offsets, positions, [], [], [table.to(dtype)], None, score_mod=key,
            use_qk=True, activation="silu", scale=0.5, out_scale=1 / 12, causal=True, max_len=12)

    torch.testing.assert_close(run(torch.float32), run(F64).float(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(run(torch.bfloat16).float(), run(F64).float(), atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------------------------
# (2) opcheck


def small_attention_args(requires_grad: bool = True):
    gen = torch.Generator().manual_seed(1)
    valid = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    index = J.jagged_index(valid)
    T = index.numel()
    q, k = (torch.randn(T, 2, 3, generator=gen, dtype=F64, requires_grad=requires_grad) for _ in range(2))
    v = torch.randn(T, 2, 2, generator=gen, dtype=F64, requires_grad=requires_grad)
    ts = torch.cumsum(torch.randint(0, 10**4, (T,), generator=gen), 0)
    tables = [torch.randn(9, generator=gen, dtype=F64, requires_grad=requires_grad),
              torch.randn(129, generator=gen, dtype=F64, requires_grad=requires_grad)]
    return q, k, v, J.valid_to_offsets(valid), J.padded_positions(index, 5), [ts + 7], [ts], tables


@pytest.mark.parametrize("variant", ["hstu", "softmax", "bias_only", "softmax_dropout"])
def test_opcheck_jagged_attention(variant: str) -> None:
    q, k, v, offsets, positions, q_side, k_side, tables = small_attention_args()
    kwargs = dict(score_mod=hstu_rab_key(5, 128), use_qk=True, activation="silu", scale=1.0, out_scale=0.2,
                  causal=True, max_len=5)
    seed = None
    if variant == "softmax_dropout":
        kwargs.update(score_mod="", activation="softmax", dropout_p=0.4)
        q_side, k_side, tables, seed = [], [], [], torch.tensor([99])
    elif variant == "softmax":
        kwargs.update(score_mod="", activation="softmax", scale=0.5, causal=False)
        q_side, k_side, tables = [], [], []
    elif variant == "bias_only":
        kwargs.update(use_qk=False, activation="identity", out_scale=1.0)
    torch.library.opcheck(torch.ops.grcompile.jagged_attention.default,
                          (q, k, v, offsets, positions, q_side, k_side, tables, seed), kwargs)


def test_opcheck_jagged_attention_backward() -> None:
    q, k, v, offsets, positions, q_side, k_side, tables = small_attention_args(requires_grad=False)
    grad = torch.randn(q.shape[0], 2, 2, dtype=F64)
    torch.library.opcheck(torch.ops.grcompile.jagged_attention_backward.default,
                          (grad, q, k, v, offsets, positions, q_side, k_side, tables),
                          dict(score_mod=hstu_rab_key(5, 128), use_qk=True, activation="silu", scale=1.0,
                               out_scale=0.2, causal=True, max_len=5))


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("gated", [True, False])
def test_opcheck_gated_norm(kind: str, gated: bool) -> None:
    x = torch.randn(7, 6, dtype=F64, requires_grad=True)
    u = torch.randn(7, 6, dtype=F64, requires_grad=True) if gated else None
    torch.library.opcheck(torch.ops.grcompile.gated_norm.default, (x, u), dict(kind=kind, eps=1e-6))


# ------------------------------------------------------------------------------------------------
# (3) inside torch.compile: forward + backward, no graph break


def test_ops_compile_fullgraph_fwd_bwd() -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(2)
    B, N, H = 3, 6, 2
    valid = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1], [0] * 6], dtype=torch.bool)
    index, offsets = J.jagged_index(valid), J.valid_to_offsets(valid)
    positions = J.padded_positions(index, N)
    T = index.numel()
    q, k, v, u = (torch.randn(T, H, 3, generator=gen, dtype=F64, requires_grad=True) for _ in range(4))
    ts = torch.cumsum(torch.randint(0, 10**5, (T,), generator=gen), 0)
    pos_w = torch.randn(2 * N - 1, generator=gen, dtype=F64, requires_grad=True)
    time_w = torch.randn(129, generator=gen, dtype=F64, requires_grad=True)

    def step(q, k, v, u, pos_w, time_w, offsets, positions, ts):
        h = wrappers.hstu_attention(q, k, v, offsets, positions, N=N, query_timestamps=ts + 1, timestamps=ts,
                                    position_table=pos_w, time_table=time_w)
        f = wrappers.fuxi_attention(q, k, v, offsets, positions, N=N, query_timestamps=ts + 1, timestamps=ts,
                                    position_table=pos_w, time_table=time_w)
        s = wrappers.jagged_softmax_attention(q, k, v, offsets, positions, N=N)
        g = lowering.gated_norm(h.reshape(T, -1), u.reshape(T, -1), kind="layer", eps=1e-6)
        return (g.sin().sum() + f.cos().sum() + (s * s).sum()
                + lowering.gated_norm(s.reshape(T, -1), None, kind="rms", eps=1e-6).sum())

    inputs = (q, k, v, u, pos_w, time_w, offsets, positions, ts)
    leaves = (q, k, v, u, pos_w, time_w)
    eager = step(*inputs)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(*inputs)
    got_grads = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, eager)
    for a, b in zip(got_grads, eager_grads):
        torch.testing.assert_close(a, b)


def test_jagged_helpers_compile_fullgraph() -> None:
    torch._dynamo.reset()
    valid = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    index, offsets = J.jagged_index(valid), J.valid_to_offsets(valid)
    x = torch.randn(3, 5, 4, dtype=F64, requires_grad=True)

    def f(x, index, offsets):
        values = J.dense_to_jagged(x, index)
        T = values.shape[0]
        scale = (J.positions_in_row(offsets, T) + J.row_of(offsets, T) + J.padded_positions(index, 5) + 1)
        return J.jagged_to_dense(values * scale[:, None], index, 3, 5, padding_value=0.5)

    eager = f(x, index, offsets)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x, index, offsets)
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), [x])[0], torch.autograd.grad(eager.sum(), [x])[0])


# ------------------------------------------------------------------------------------------------
# (4) clear errors


def call(q, k, v, offsets, positions, q_side=(), k_side=(), tables=(), **overrides):
    kwargs = dict(score_mod="", use_qk=True, activation="silu", scale=1.0, out_scale=1.0, causal=True, max_len=5)
    kwargs.update(overrides)
    return torch.ops.grcompile.jagged_attention(q, k, v, offsets, positions, list(q_side), list(k_side),
                                                list(tables), None, **kwargs)


def test_bad_inputs_raise_clear_errors() -> None:
    q, k, v, offsets, positions, *_ = small_attention_args(requires_grad=False)
    T = q.shape[0]
    call(q, k, v, offsets, positions)  # the good call works
    bad = [
        (dict(offsets=offsets + 1), "offsets must start at 0"),
        (dict(offsets=torch.tensor([0, 5, 3, T])), "non-decreasing"),
        (dict(offsets=torch.tensor([0, 3, T - 1])), "must end at T"),
        (dict(offsets=offsets.int()), "offsets must be int64"),
        (dict(offsets=offsets.view(1, -1)), "offsets must be 1-D"),
        (dict(positions=positions.int()), "positions must be int64"),
        (dict(positions=positions + 5), r"positions must lie in \[0, max_len"),
        (dict(positions=positions - 1), r"positions must lie in \[0, max_len"),
        (dict(positions=positions.flip(0)), "increase strictly"),
        (dict(positions=positions[:-1]), "positions must be 1-D"),
        (dict(k=k.float()), "share one dtype"),
        (dict(q=q[..., :2]), "same head width"),
        (dict(v=v[:-1]), "same number of tokens"),
        (dict(q=q.reshape(T, -1)), r"q must be \[T, H, d\]"),
        (dict(q_side=[torch.zeros(T + 1)]), r"q_side\[0\] must be 1-D"),
        (dict(max_len=3), "length 4 > max_len = 3"),
        (dict(activation="relu"), "activation must be one of"),
    ]
    base = dict(q=q, k=k, v=v, offsets=offsets, positions=positions)
    for change, message in bad:
        args = {**base, **{n: x for n, x in change.items() if n in base}}
        extra = {n: x for n, x in change.items() if n not in base}
        with pytest.raises(ValueError, match=message):
            call(**args, **extra)
    with pytest.raises(KeyError, match="not registered"):
        call(q, k, v, offsets, positions, score_mod="nope-000000000000")
    for seed, p, message in [(None, 0.3, "needs a seed"), (torch.tensor([1]), 1.0, r"dropout_p must be in \[0, 1\)"),
                             (torch.tensor([1.0]), 0.3, "seed must be an int64"),
                             (torch.tensor([1, 2]), 0.3, "seed must be an int64 tensor of one element")]:
        with pytest.raises(ValueError, match=message):
            torch.ops.grcompile.jagged_attention(q, k, v, offsets, positions, [], [], [], seed, score_mod="",
                                                 use_qk=True, activation="softmax", scale=1.0, out_scale=1.0,
                                                 causal=True, max_len=5, dropout_p=p)
    with pytest.raises(ValueError, match="kind must be one of"):
        lowering.gated_norm(torch.randn(2, 3), None, kind="batch", eps=1e-6)
    with pytest.raises(ValueError, match="u must have the shape"):
        lowering.gated_norm(torch.randn(2, 3), torch.randn(2, 4), kind="rms", eps=1e-6)


def test_empty_batch_and_all_empty_rows() -> None:
    for B in (0, 3):
        offsets = torch.zeros(B + 1, dtype=torch.int64)
        q = torch.zeros(0, 2, 3, dtype=F64, requires_grad=True)
        out = call(q, q, q, offsets, torch.zeros(0, dtype=torch.int64))
        assert out.shape == (0, 2, 3)
        (grad,) = torch.autograd.grad(out.sum(), [q])
        assert grad.shape == (0, 2, 3)


# ------------------------------------------------------------------------------------------------
# (5) jagged helpers


@SETTINGS
@given(valid_masks(max_B=6, max_N=9), st.integers(0, 3))
def test_jagged_helpers_round_trip(valid: torch.Tensor, extra_dims: int) -> None:
    B, N = valid.shape
    x = torch.randn(B, N, *([2] * extra_dims), dtype=F64, requires_grad=True)
    index = J.jagged_index(valid)
    offsets = J.valid_to_offsets(valid)
    values = J.dense_to_jagged(x, index)
    T = int(valid.sum())
    assert values.shape == (T, *x.shape[2:])
    mask = valid.view(B, N, *([1] * extra_dims))
    torch.testing.assert_close(J.jagged_to_dense(values, index, B, N), x * mask)
    filled = J.jagged_to_dense(values, index, B, N, padding_value=-3.0)
    torch.testing.assert_close(filled, torch.where(mask, x, torch.full_like(x, -3.0)))
    # differentiable both ways
    (grad,) = torch.autograd.grad(J.jagged_to_dense(values, index, B, N).sum(), [x])
    torch.testing.assert_close(grad, mask.expand_as(x).to(F64))
    # offsets, rows, positions: padded and jagged
    torch.testing.assert_close(offsets, J.lengths_to_offsets(valid.sum(1)))
    assert offsets.dtype == torch.int64 and offsets.shape == (B + 1,)
    rows = [b for b in range(B) for n in range(N) if valid[b, n]]
    padded = [n for b in range(B) for n in range(N) if valid[b, n]]
    in_row = [int(valid[b, :n].sum()) for b in range(B) for n in range(N) if valid[b, n]]
    assert J.row_of(offsets, T).tolist() == rows
    assert J.padded_positions(index, N).tolist() == padded
    assert J.positions_in_row(offsets, T).tolist() == in_row
    assert index.tolist() == [b * N + n for b, n in zip(rows, padded)]


def test_left_and_right_padding_positions() -> None:
    right = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    left = right.flip(1)
    for valid in (right, left):
        index, offsets = J.jagged_index(valid), J.valid_to_offsets(valid)
        assert offsets.tolist() == [0, 3, 4]
        assert J.positions_in_row(offsets, 4).tolist() == [0, 1, 2, 0]
    assert J.padded_positions(J.jagged_index(right), 4).tolist() == [0, 1, 2, 0]
    assert J.padded_positions(J.jagged_index(left), 4).tolist() == [1, 2, 3, 3]


# ------------------------------------------------------------------------------------------------
# (6) gated_norm


@SETTINGS
@given(st.integers(0, 6), st.integers(1, 9), st.sampled_from(["layer", "rms"]), st.booleans(),
       st.sampled_from([1e-6, 1e-8, 1e-2]), st.integers(0, 2**31 - 1))
def test_gated_norm_matches_torch(T: int, D: int, kind: str, gated: bool, eps: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, D, generator=gen, dtype=F64) * 3 + 1).requires_grad_()
    u = torch.randn(T, D, generator=gen, dtype=F64).requires_grad_() if gated else None
    norm = F.layer_norm(x, (D,), eps=eps) if kind == "layer" else F.rms_norm(x, (D,), eps=eps)
    expected = norm * u if gated else norm
    got = lowering.gated_norm(x, u, kind=kind, eps=eps)
    torch.testing.assert_close(got, expected)
    g = torch.randn(T, D, generator=gen, dtype=F64)
    leaves = [x, u] if gated else [x]
    for a, b in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(expected, leaves, g)):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------------
# registries


def test_score_mod_keys_are_stable() -> None:
    def make(offset):
        def bias(q_pos, k_pos, q_side, k_side, tables):
            return tables[0][k_pos - q_pos + offset]
        return bias

    a, b, c = make(3), make(3), make(4)
    key = register_score_mod(a)
    assert register_score_mod(a) == key  # same function
    assert register_score_mod(b) == key  # identical code and constants
    assert register_score_mod(c) != key  # different constant
    assert key.startswith("bias-") and get_score_mod(key).fn is a
    assert register_score_mod(a, kind="score") != key
    assert relative_position_bias_key(7) == relative_position_bias_key(7) != relative_position_bias_key(8)
    with pytest.raises(ValueError, match="kind"):
        register_score_mod(a, kind="mask")


def test_graph_module_score_mod_keys() -> None:
    import torch.fx as fx

    def region(score, q_pos, k_pos, table):
        return score + table[k_pos - q_pos + 4]

    gm1, gm2 = fx.symbolic_trace(region), fx.symbolic_trace(region)
    key = register_score_mod(gm1)  # kind inferred from the first placeholder's name
    assert get_score_mod(key).kind == "score"
    assert register_score_mod(gm2, kind="score") == key
    assert get_score_mod(key)(torch.tensor(1.0), torch.tensor(2), torch.tensor(1), (), (),
                              (torch.arange(9.0),)) == 4.0


def test_op_registry_lookup() -> None:
    assert {"jagged_attention", "jagged_attention_backward", "gated_norm"} <= set(lowering.OPS)
    ref = lowering.OPS["gated_norm"].reference
    assert lowering.lookup("gated_norm", "cpu") is ref
    from grcompile.lowering.norm import triton as norm_triton  # the lazy triton slot, resolved on CUDA
    assert lowering.OPS["gated_norm"].kernel_for("cuda") == ("triton", norm_triton.gated_norm_triton)
    with pytest.raises(KeyError, match="no op named"):
        lowering.lookup("nope", "cpu")
    kernel = lambda x: x + 1  # noqa: E731
    lowering.register_op("test_dummy", reference=ref, triton=kernel)
    try:
        assert lowering.lookup("test_dummy", "cuda")(1) == 2
        assert lowering.lookup("test_dummy", "npu") is ref
        assert dict(lowering.OPS["test_dummy"].calls) == {"triton": 1, "reference": 1}
    finally:
        del lowering.OPS["test_dummy"]


def test_a_kernels_handoff_moves_only_the_call_dispatched_to_it() -> None:
    """A kernel that hands its call to the reference (or a library) moves that one call's count,
    once; called directly, not through the op, it takes nothing back from earlier calls."""
    def kernel(x, handoffs=1):
        for _ in range(handoffs):
            lowering.note_fallback("test_handoff", "k", "test")
            lowering.note_library("test_handoff", "cublas")
        return x

    lowering.register_op("test_handoff", reference=lambda x, handoffs=1: x, triton=kernel)
    calls = lowering.OPS["test_handoff"].calls
    try:
        lowering.OPS["test_handoff"].triton = lambda x, handoffs=1: x
        for _ in range(3):
            lowering.lookup("test_handoff", "cuda")(0)
        assert dict(calls) == {"triton": 3}
        lowering.OPS["test_handoff"].triton = kernel
        lowering.lookup("test_handoff", "cuda")(0, handoffs=2)
        assert (calls["triton"], calls["reference"], calls["cublas"]) == (3, 2, 2)
        kernel(0)  # direct: the three dispatched triton calls stay counted
        assert (calls["triton"], calls["reference"], calls["cublas"]) == (3, 3, 3)
        assert lowering.kernel_usage()["test_handoff"] == {"triton": 3, "reference": 3, "cublas": 3}
    finally:
        del lowering.OPS["test_handoff"]


def test_a_backend_asked_for_by_name_that_cannot_run_says_why(monkeypatch) -> None:
    """``backend="triton"`` on CPU tensors without Triton's interpreter, ``"ascend"`` for an op with
    no Ascend kernel: the reference runs and the registry keeps why (report() shows it)."""
    entry = lowering.OPS["gated_norm"]
    monkeypatch.setattr(entry, "fallbacks", {})
    monkeypatch.setattr(lowering, "triton_interpreting", lambda: False)
    assert entry.kernel_for("cpu", "triton") == ("reference", entry.reference)
    assert "only in its interpreter, which is off" in entry.fallbacks["backend triton"]
    assert entry.kernel_for("cpu", "ascend") == ("reference", entry.reference)
    assert entry.fallbacks["backend ascend"] == "the op has no ascend kernel"
    assert entry.kernel_for("cpu", "auto")[0] == "reference" and len(entry.fallbacks) == 2  # auto: no note


def test_the_interpreter_is_read_from_triton_not_from_the_environment_now() -> None:
    """TRITON_INTERPRET set after Triton was imported (in compiled mode: ``torch._dynamo`` imports it) or
    spelled ``true``: grcompile follows what Triton decided — the reference with a reason in the
    first case, the interpreted kernels in the second — instead of crashing inside Triton."""
    body = ("from grcompile import lowering\n"
            "x = torch.randn(3, 8)\n"
            "with lowering.use_backend('triton'):\n"
            "    torch.ops.grcompile.gated_norm(x, None, kind='layer', eps=1e-5)\n"
            "print(lowering.triton_interpreting(), dict(lowering.OPS['gated_norm'].calls),"
            " lowering.OPS['gated_norm'].fallbacks.get('backend triton', ''))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for setting, expected in (("import torch, triton, os; os.environ['TRITON_INTERPRET'] = '1'\n",
                               "False {'reference': 1} Triton runs CPU tensors only in its interpreter"),
                              ("import os; os.environ['TRITON_INTERPRET'] = 'true'; import torch\n",
                               "True {'triton': 1}")):
        done = subprocess.run([sys.executable, "-c", setting + body], capture_output=True, text=True, env=env,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.startswith(expected), done.stdout


def test_valid_lengths_count_what_jagged_index_packs() -> None:
    for valid in (torch.tensor([[1, 1, 0], [2, 0, 0]]), torch.tensor([[0.5, 1.0, 0.0], [0.25, 0.0, 0.0]])):
        assert lowering.jagged.valid_to_offsets(valid).tolist() == [0, 2, 3]
        assert lowering.jagged.jagged_index(valid).numel() == 3


def test_without_triton_the_reason_says_so(monkeypatch) -> None:
    entry = lowering.OPS["gated_norm"]
    monkeypatch.setattr(entry, "fallbacks", {})
    monkeypatch.setattr(lowering, "_triton_mode", lambda: None)
    assert entry.kernel_for("cpu", "triton") == ("reference", entry.reference)
    assert entry.fallbacks["backend triton"] == "Triton is not installed"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_segment_softmax_normalises_half_precision_in_float32(dtype):
    """Summed in bf16, 2000 weights of one row added up to 1.75 (torch's softmax accumulates in
    float32, and so does the jagged one now)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2000, generator=g).to(dtype)
    rows = torch.arange(2).repeat_interleave(2000)
    got = J.segment_softmax(x.reshape(-1), rows, 2).reshape(2, 2000)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float().sum(1), torch.ones(2), rtol=0, atol=2e-3)
    torch.testing.assert_close(got, torch.softmax(x, dim=1))
    got_log = J.segment_softmax(x.reshape(-1), rows, 2, log=True).reshape(2, 2000)
    torch.testing.assert_close(got_log, torch.log_softmax(x, dim=1))


def test_jagged_helpers_take_int32_indices():
    offsets = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    assert J.positions_in_row(offsets, 5).dtype == torch.int64
    assert J.positions_in_row(offsets, 5).tolist() == [0, 1, 0, 1, 2]
    values, index = torch.arange(3.0), torch.tensor([0, 3, 4], dtype=torch.int32)
    assert J.jagged_to_dense(values, index, 2, 3).tolist() == [[0.0, 0.0, 0.0], [1.0, 2.0, 0.0]]
