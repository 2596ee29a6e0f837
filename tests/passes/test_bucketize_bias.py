"""Relative attention biases bucketed with ``torch.bucketize`` — a time gap or a relative position
cut by a boundaries tensor (a buffer, a constant, a parameter), looked up in a shared or per-head
table — fuse into one padding-free op whose score_mod runs ``bucketize`` per pair, with eager's
values and every gradient (the bias table's included), in train and eval mode, on length mixes
with empty, length-1 and full rows. What cannot be fused exactly (unsorted boundaries, boundaries
that vary per token) stays as written, with the reason.

Eager lowering and the eager chunk (fast, float64); the Triton kernels of these score_mods are
checked in tests/lowering/attention/test_bucketize_kernels.py, the Ascend lowering in
tests/lowering/attention/test_ascend.py.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import grcompile
from grcompile.passes import attention_pipeline

N, D, H, VOCAB = 8, 8, 2, 30
LENGTHS = [0, 1, N, 5, 3]  # an empty row, a length-1 row, a full row
BOUNDS = [1.0, 3.0, 10.0, 30.0, 100.0]


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def batch(lengths=LENGTHS, n=N, seed=0, ts_dtype=torch.float64, nan_at=None):
    """``(ids, ts)``: right-padded ids and per-row non-decreasing timestamps (gaps 0..39, so the
    gaps fall on, between and beyond the boundaries; ties included)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), n), generator=g)
    for b, length in enumerate(lengths):
        ids[b, length:] = 0
    ts = torch.cumsum(torch.randint(0, 40, (len(lengths), n), generator=g), 1).to(ts_dtype)
    if nan_at is not None:
        ts[nan_at] = math.nan
    return ids, ts


def heads(x: torch.Tensor) -> torch.Tensor:  # [B, N, D] -> [B, H, N, D/H]
    return x.view(x.shape[0], x.shape[1], H, -1).transpose(1, 2)


class Bucketed(nn.Module):
    """Softmax attention with a bucketed relative bias, spelled as ``how`` says."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(VOCAB, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.register_buffer("bounds", torch.tensor(BOUNDS))
        self.register_buffer("int_bounds", torch.tensor([1, 3, 10, 30, 100]))
        self.learned_bounds = nn.Parameter(torch.tensor(BOUNDS))  # requires grad: bucketize passes none
        self.shared = nn.Embedding(len(BOUNDS) + 1, 1)
        self.per_head = nn.Parameter(torch.randn(len(BOUNDS) + 1, H))
        self.t5 = nn.Embedding(6, H)
        self.t5_bi = nn.Embedding(2 * 5, H)  # T5's bidirectional buckets: 5 per direction
        self.register_buffer("log_bounds", torch.tensor([1, 2, 4, 8]))  # exact below 2, log-spaced above

    def forward(self, ids, ts):
        B, n = ids.shape
        valid = ids != 0
        q, k, v = (heads(t) for t in self.qkv(self.emb(ids)).chunk(3, dim=-1))
        dt = (ts[:, :, None] - ts[:, None, :]).abs()  # [B, N, N]
        if self.how == "buffer":  # [K+1, 1] table, squeezed, broadcast over heads
            bias = self.shared(torch.bucketize(dt, self.bounds)).squeeze(-1)[:, None]
        elif self.how == "per_head_right":  # [K+1, H] gathered, then permuted; right=True
            bias = self.per_head[torch.bucketize(dt, self.bounds, right=True)].permute(0, 3, 1, 2)
        elif self.how == "constant_int32":  # boundaries built in forward, int32 buckets
            buckets = torch.bucketize(dt, torch.tensor([1.0, 3.0, 10.0, 30.0, 100.0]), out_int32=True)
            bias = self.shared(buckets).squeeze(-1).unsqueeze(1)
        elif self.how == "int_gap":  # integer timestamps, int64 boundaries
            bias = self.shared(torch.bucketize(dt.long(), self.int_bounds)).squeeze(-1)[:, None]
        elif self.how == "int32_gap_float_bounds":  # int32 gaps against float boundaries
            bias = self.shared(torch.bucketize(dt.int(), self.bounds)).squeeze(-1)[:, None]
        elif self.how == "learned_bounds":  # a parameter as boundaries: no gradient reaches it
            bias = self.shared(torch.bucketize(dt, self.learned_bounds)).squeeze(-1)[:, None]
        elif self.how == "t5":  # T5-style: the relative position k - q through bucketize
            pos = torch.arange(n)
            rel = pos[None, :] - pos[:, None]
            bias = self.t5(torch.bucketize(rel, torch.tensor([-4, -2, -1, 0, 1]))).permute(2, 0, 1)[None]
        elif self.how == "t5_bidirectional":  # T5's bucketing written with bucketize: direction + log distance
            pos = torch.arange(n)
            rel = pos[None, :] - pos[:, None]
            buckets = (rel > 0).long() * 5 + torch.bucketize(rel.abs(), self.log_bounds, right=True)
            bias = self.t5_bi(buckets).permute(2, 0, 1).unsqueeze(0)
        elif self.how == "unsorted":
            bias = self.shared(torch.bucketize(dt, torch.tensor([1.0, 30.0, 3.0, 10.0, 100.0]))).squeeze(-1)[:, None]
        elif self.how == "per_token_bounds":  # row 0's timestamps as boundaries: per-token data
            bias = self.shared(torch.bucketize(dt, ts[0]).clamp(max=len(BOUNDS))).squeeze(-1)[:, None]
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
        s = s.masked_fill(~valid[:, None, None, :], -1e9)
        return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, n, D)


def fused(report) -> list[dict]:
    return [r for r in report.rewrites if r["pass"] == "fuse_attention"]


def reasons(report) -> list[str]:
    return [f"{f['site']}: {f['reason']}" for f in report.fallbacks if f["pass"] == "fuse_attention"]


def check(module: nn.Module, ids, ts, modes=("train", "eval"), lowering="eager", rtol=None, atol=None):
    """``optimize(module)`` vs ``module``: outputs at valid positions and every parameter gradient
    of a loss over them, in each mode; returns the report."""
    valid = (ids != 0)[..., None]
    optimized = grcompile.optimize(module, passes=attention_pipeline(), lowering=lowering)
    for mode in modes:
        module.train(mode == "train")
        module.zero_grad(set_to_none=True)
        got = optimized(ids, ts)
        torch.where(valid, got, 0).square().sum().backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        module.zero_grad(set_to_none=True)
        ref = module(ids, ts)
        torch.where(valid, ref, 0).square().sum().backward()
        torch.testing.assert_close(torch.where(valid, got, 0), torch.where(valid, ref, 0), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{mode}: values differ\n{m}")
        assert grads.keys() == {n for n, p in module.named_parameters() if p.grad is not None}, mode
        for n, p in module.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(grads[n], p.grad, rtol=rtol, atol=atol, msg=lambda m, n=n: f"{mode}: {n}\n{m}")
    return grcompile.report(optimized)


def assert_bucketize_fused(report, *, tables: int, head_index: bool) -> None:
    """Every compiled graph fused its attention, whose score_mod calls torch.bucketize (not a
    materialised bias), with no fallback and no run-time own-key check."""
    from grcompile.lowering.score_mod import get_score_mod
    rewrites = fused(report)
    assert not report.unoptimized, report.unoptimized
    assert report.compiles >= 1 and len(rewrites) == report.compiles, (rewrites, report.fallbacks)
    assert report.counters["fuse_attention.score_mod_attention"] == report.compiles
    assert "fuse_attention.checked_at_run_time" not in report.counters, report.counters
    assert not reasons(report), reasons(report)
    for r in rewrites:
        assert (r["bias_tables"], r["head_index"]) == (tables, head_index), r
        gm = get_score_mod(r["score_mod"]).fn
        assert any(n.target is torch.bucketize for n in gm.graph.nodes), gm.code


SPELLINGS = [("buffer", False), ("per_head_right", True), ("constant_int32", False), ("int_gap", False),
             ("int32_gap_float_bounds", False), ("learned_bounds", False), ("t5", True), ("t5_bidirectional", True)]


@pytest.mark.parametrize("how,head_index", SPELLINGS, ids=[s for s, _ in SPELLINGS])
def test_bucketized_bias_fuses_and_stays_exact(how, head_index):
    torch.manual_seed(0)
    m = Bucketed(how).double()
    ids, ts = batch()
    report = check(m, ids, ts)
    assert_bucketize_fused(report, tables=2, head_index=head_index)  # the boundaries and the bias table
    if how == "learned_bounds":
        assert m.learned_bounds.grad is None  # eager passes it none; neither does the fused op


def test_nan_timestamps_bucket_like_torch():
    """A NaN gap falls in the last bucket in torch (K); the fused op computes the same bias."""
    torch.manual_seed(0)
    ids, ts = batch(nan_at=(2, 3))
    report = check(Bucketed("per_head_right").double(), ids, ts)
    assert_bucketize_fused(report, tables=2, head_index=True)


@pytest.mark.parametrize("seed", range(4))
def test_random_length_mixes(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, N + 1, (5,), generator=g).tolist() + [0, 1, N]
    torch.manual_seed(seed)
    ids, ts = batch(lengths, seed=seed)
    report = check(Bucketed(["buffer", "per_head_right", "t5", "int_gap"][seed]).double(), ids, ts)
    assert fused(report) and not reasons(report)


def test_a_new_sequence_length_reuses_the_fused_graph():
    """A second padded length compiles the graph for any N: the bucketize proof holds there too
    (the T5 spelling's buckets of k - q are seen through on the frame for every N)."""
    torch.manual_seed(0)
    m = Bucketed("t5").double()
    optimized = grcompile.optimize(m, passes=attention_pipeline(), lowering="eager")
    for n in (N, N + 3, N + 5):
        ids, ts = batch([0, 1, n, 4], n=n, seed=n)
        valid = (ids != 0)[..., None]
        torch.testing.assert_close(torch.where(valid, optimized(ids, ts), 0), torch.where(valid, m(ids, ts), 0))
    report = grcompile.report(optimized)
    assert report.compiles == 2 and len(fused(report)) == 2 and not reasons(report), (report.compiles, reasons(report))


class WindowByBuckets(nn.Module):
    """A local causal window written through bucketize: keys with ``-W < k - q <= 0`` (bucket 1 of
    the boundaries ``[-W, 0]``) are kept, the rest masked. The mask itself is decided by buckets."""

    def __init__(self, window: int = 3):
        super().__init__()
        self.window = window
        self.emb = nn.Embedding(VOCAB, D)
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, ids):
        B, n = ids.shape
        valid = ids != 0
        q, k, v = (heads(t) for t in self.qkv(self.emb(ids)).chunk(3, dim=-1))
        pos = torch.arange(n)
        bucket = torch.bucketize(pos[None, :] - pos[:, None], torch.tensor([-self.window, 0]))
        s = (q @ k.transpose(-1, -2)).masked_fill(bucket != 1, -1e9)
        s = s.masked_fill(~valid[:, None, None, :], -1e9)
        return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, n, D)


def test_a_mask_decided_by_buckets_is_proved_causal_for_every_length():
    """The proof evaluates bucketize with its constant boundaries: the window is causal, for the
    static graph (every pair) and for the graph that serves any N (bucketize of k - q is monotone,
    a function of comparisons with the boundaries)."""
    torch.manual_seed(0)
    m = WindowByBuckets().double()
    optimized = grcompile.optimize(m, passes=attention_pipeline(), lowering="eager")
    for n in (N, N + 3):
        ids, _ = batch([0, 1, n, 4], n=n, seed=n)
        valid = (ids != 0)[..., None]
        torch.testing.assert_close(torch.where(valid, optimized(ids), 0), torch.where(valid, m(ids), 0))
    report = grcompile.report(optimized)
    assert report.compiles == 2 and not reasons(report), reasons(report)
    assert [r["causal"] for r in fused(report)] == [True, True], fused(report)


@pytest.mark.parametrize("how,expected", [
    ("unsorted", "are not sorted ([1, 30, 3, 10, 100])"),
    ("per_token_bounds", "vary per token or per pair")])
def test_what_cannot_fuse_exactly_stays_as_written(how, expected):
    torch.manual_seed(0)
    ids, ts = batch()
    report = check(Bucketed(how).double(), ids, ts)
    assert not fused(report)
    (why,) = reasons(report)
    assert why.startswith("test_bucketize_bias.py:") and expected in why, why


def test_buffer_boundaries_unsorted_at_compile_time_are_refused():
    torch.manual_seed(0)
    m = Bucketed("buffer").double()
    with torch.no_grad():
        m.bounds.copy_(torch.tensor([1.0, 30.0, 3.0, 10.0, 100.0]))
    ids, ts = batch()
    report = check(m, ids, ts, modes=("eval",))
    assert not fused(report) and "are not sorted" in reasons(report)[0]


@pytest.mark.slow
def test_inductor_lowering():
    torch.manual_seed(0)
    ids, ts = batch()
    report = check(Bucketed("per_head_right"), ids, ts.float(), lowering="inductor", rtol=1e-4, atol=1e-5)
    assert_bucketize_fused(report, tables=2, head_index=True)
