"""One chunk of the CPU reference (grcompile/lowering/attention/chunks.py): the analytic backward
equals autograd through the chunk's forward for every activation, eager and inductor-compiled;
the float mask limits equal the int64 mask they replace; NaN, unused inputs and bf16 gradients."""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from grcompile.lowering.attention import chunks
from grcompile.lowering.attention.dropout import dropout_rows
from grcompile.lowering.score_mod import get_score_mod, register_score_mod

F64 = torch.float64


def _chunk_inputs(seed: int, n: int, H: int, Lq: int, Lk: int, dtype: torch.dtype):
    """Random chunk tensors; row 0 has no valid key (a dead row), the others a random valid prefix."""
    g = torch.Generator().manual_seed(seed)
    qb, kb = (torch.randn(n, H, L, 3, generator=g, dtype=dtype) for L in (Lq, Lk))
    vb = torch.randn(n, H, Lk, 4, generator=g, dtype=dtype)
    k_pos = torch.arange(Lk).expand(n, Lk).contiguous()
    q_pos = torch.randint(0, Lk, (n, Lq), generator=g)
    k_valid = torch.arange(Lk)[None] < torch.randint(1, Lk + 1, (n, 1), generator=g)
    k_valid[0] = False
    mask_pos = chunks.mask_positions(torch.arange(max(Lq, Lk)), max(Lq, Lk))
    q_lim, k_lim = mask_pos[q_pos], torch.where(k_valid, mask_pos[k_pos], float("inf"))
    q_tok = torch.randint(0, 10**6, (n, Lq), generator=g)
    k_tok = torch.randint(0, 10**6, (n, Lk), generator=g)
    return qb, kb, vb, q_pos, k_pos, q_lim, k_lim, q_tok, k_tok, torch.randn(n, H, Lq, 4, generator=g, dtype=dtype)


def _bias(score, q_pos, k_pos, q_bucket, k_weight, table):
    """A score_mod reading a table (relative position), a float key side tensor and an int query side."""
    return score + table[(q_pos - k_pos).clamp(0, 7)] * k_weight + (q_bucket % 3) * 0.25


BIAS = register_score_mod(_bias, name="test_chunk_bias", kind="score")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("activation", ["softmax", "silu", "identity"])
@pytest.mark.parametrize("causal,use_qk,out_scale,p,score_mod", [
    (True, True, 1.0, 0.0, ""), (True, True, 0.5, 0.3, ""), (False, True, 1.0, 0.2, ""), (False, False, 2.0, 0.0, ""),
    (True, False, 1.0, 0.4, ""), (True, True, 1.0, 0.3, BIAS), (False, False, 0.5, 0.0, BIAS)])
def test_backward_equals_autograd(compiled: bool, activation: str, causal: bool, use_qk: bool, out_scale: float,
                                  p: float, score_mod: str) -> None:
    """The analytic backward (and the score_mod's VJP: side and table gradients) == autograd through
    the eager forward chunk, for every activation; a dead row (no valid key) gets finite gradients."""
    dtype = torch.float32 if compiled else F64
    old = chunks.COMPILE_CHUNKS
    chunks.COMPILE_CHUNKS = compiled
    try:
        for seed, (n, H, Lq, Lk) in enumerate([(2, 2, 5, 7), (3, 2, 9, 9), (2, 3, 16, 17)]):
            qb, kb, vb, q_pos, k_pos, q_lim, k_lim, q_tok, k_tok, go = _chunk_inputs(seed, n, H, Lq, Lk, dtype)
            rows = dropout_rows(torch.tensor([seed + 11]), q_tok, H) if p else q_tok
            q_sides = [q_tok % 5] if score_mod else []
            k_sides = [torch.rand(n, Lk, dtype=dtype)] if score_mod else []
            tables = [torch.randn(8, dtype=dtype)] if score_mod else []
            opts = dict(dtype=dtype, use_qk=use_qk, scale=0.7, out_scale=out_scale, causal=causal, dropout_p=p,
                        head_widths=(3, 4))
            forward = functools.partial(chunks._chunk_attention, mod=get_score_mod(score_mod) if score_mod else None,
                                        activation=activation, use_qk=use_qk, scale=0.7, out_scale=out_scale,
                                        causal=causal, dropout=p > 0, dropout_p=torch.tensor(p, dtype=F64))
            leaves = [t.clone().requires_grad_(True) for t in (qb, kb, vb, *k_sides, *tables)]
            qkv, floats = leaves[:3], leaves[3:]
            out, lse = forward(*qkv, q_pos, k_pos, q_lim, k_lim, q_sides, floats[:len(k_sides)],
                               floats[len(k_sides):], rows, k_tok)
            want = torch.autograd.grad(out, (qkv if use_qk else qkv[2:]) + floats, go)
            # softmax: also with the forward's log-sum-exp and Σ dO∘out given (what the op passes)
            for stats in ([(False, False), (True, False), (True, True)] if activation == "softmax" else
                          [(False, False)]):
                backward = chunks._chunk_backward_kernel(score_mod, activation=activation, table_grads=bool(tables),
                                                         stats=stats, **opts)
                extra = dict(lse=lse.detach().expand(out.shape[:3])) if stats[0] else {}
                if stats[1]:
                    extra["delta"] = (go * out.detach()).sum(-1)
                dq, dk, dv, side_grads = backward(qb, kb, vb, q_pos, k_pos, q_lim, k_lim, q_sides, k_sides, tables,
                                                  rows, k_tok, grad_out=go, **extra)
                got = ([dq, dk] if use_qk else []) + [dv] + list(side_grads)
                if not use_qk:
                    assert dq is None and dk is None
                assert len(got) == len(want)
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b)
                    assert torch.isfinite(a).all()
    finally:
        chunks.COMPILE_CHUNKS = old


def test_mask_limits_equal_the_integer_mask() -> None:
    """allowed = k_lim <= q_lim (causal) / k_lim < inf equals k_valid & (k_pos <= q_pos) / k_valid,
    also for positions past 2²⁴ (float64 limits)."""
    for max_len in (50, (1 << 24) + 100):
        g = torch.Generator().manual_seed(max_len % 97)
        positions = torch.randint(max_len - 40, max_len, (30,), generator=g)
        q_index, k_index = torch.randint(0, 30, (2, 6), generator=g), torch.randint(0, 30, (2, 9), generator=g)
        k_valid = torch.rand(2, 9, generator=g) < 0.7
        q_lim, k_lim = chunks.mask_limits(chunks.mask_positions(positions, max_len), q_index, k_index, k_valid)
        qp, kp = positions[q_index][:, None, :, None], positions[k_index][:, None, None, :]
        assert torch.equal(chunks._allowed(q_lim, k_lim, True), k_valid[:, None, None, :] & (kp <= qp))
        assert torch.equal(chunks._allowed(q_lim, k_lim, False).expand(2, 1, 6, 9),
                           k_valid[:, None, None, :].expand(2, 1, 6, 9))


def _op(q, k, v, offsets, positions, q_side=(), k_side=(), tables=(), score_mod="", use_qk=True):
    return torch.ops.grcompile.jagged_attention(
        q, k, v, offsets, positions, list(q_side), list(k_side), list(tables), None, score_mod=score_mod,
        use_qk=use_qk, activation="softmax", scale=0.5, out_scale=1.0, causal=True, max_len=64)


def test_nan_score_propagates_like_eager() -> None:
    """A NaN key reaches every query that attends to it (as eager's softmax does), not a silent 0."""
    q, k, v = (torch.randn(4, 2, 3, dtype=F64) for _ in range(3))
    k[1] = float("nan")
    out = _op(q, k, v, torch.tensor([0, 4]), torch.arange(4))
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1:]).all()


def _ignores_score(score, q_pos, k_pos):
    return (q_pos - k_pos) * -0.1


IGNORES_SCORE = register_score_mod(_ignores_score, name="test_ignores_score", kind="score")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_backward_with_unused_sides_and_a_bias_of_positions_only(compiled: bool) -> None:
    """Float side tensors and tables without a score_mod get zero gradients; a score_mod that reads
    neither the score nor a float input has a zero VJP (eager: no autograd graph to differentiate)."""
    dtype = torch.float32 if compiled else F64
    old = chunks.COMPILE_CHUNKS
    chunks.COMPILE_CHUNKS = compiled
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(7, 2, 3, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
        offsets, positions = torch.tensor([0, 3, 7]), torch.tensor([0, 1, 2, 0, 1, 2, 3])
        side = torch.rand(7, dtype=dtype, requires_grad=True)
        table = torch.rand(5, dtype=dtype, requires_grad=True)
        out = _op(q, k, v, offsets, positions, q_side=[side], k_side=[side], tables=[table])
        grads = torch.autograd.grad(out.sum(), [q, k, v, side, table], allow_unused=True, materialize_grads=True)
        assert (grads[3] == 0).all() and (grads[4] == 0).all() and grads[2].abs().sum() > 0
        out = _op(q, k, v, offsets, positions, score_mod=IGNORES_SCORE)
        dq, dk, dv = torch.autograd.grad(out.sum(), [q, k, v])
        assert (dq == 0).all() and (dk == 0).all() and dv.abs().sum() > 0
    finally:
        chunks.COMPILE_CHUNKS = old


def test_half_precision_gradients_accumulate_in_float32() -> None:
    """A key read by several causal query blocks gets its gradient summed in float32 and rounded to
    bf16 once: as close to the float64 result as one bf16 rounding allows."""
    from grcompile.lowering.attention import buckets

    g = torch.Generator().manual_seed(1)
    T = 64
    q, k, v = (torch.randn(T, 2, 4, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3))
    offsets, positions = torch.tensor([0, T]), torch.arange(T)
    go = torch.randn(T, 2, 4, generator=g).to(torch.bfloat16)
    old = buckets.CAUSAL_Q_BLOCK
    buckets.CAUSAL_Q_BLOCK = 4  # 16 query blocks: the first keys are read by all of them
    try:
        got = torch.autograd.grad(_op(q, k, v, offsets, positions), [q, k, v], go)
    finally:
        buckets.CAUSAL_Q_BLOCK = old
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(_op(*leaves, offsets, torch.arange(T)).to(torch.float64), leaves, go.double())
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b, rtol=2 ** -7, atol=1e-3)


def _days(score, q_pos, k_pos, k_side_0):
    return score + (k_side_0 // 86400.0) * 0.01 + (3600.0 // (k_side_0 + 1.0)) * 0.001


@pytest.mark.parametrize("compiled", [False, True])
def test_floor_division_of_a_float_side_differentiates_to_zero(compiled, monkeypatch):
    """``//`` has no derivative in torch: the backward, which differentiates every float side,
    raised ``derivative for aten::floor_divide is not implemented`` where eager (whose side needs
    no gradient) runs. It is zero, as in the Triton kernels; q, k, v match eager."""
    from grcompile.lowering.attention.reference import _attention_backward_reference, _attention_reference
    monkeypatch.setattr(chunks, "COMPILE_CHUNKS", compiled)
    monkeypatch.setattr(chunks, "_COMPILED_CHUNKS", {})
    T = 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, 1, 8, generator=g, dtype=F64, requires_grad=True) for _ in range(3))
    ts = torch.tensor([0.0, 90000.0, 200000.0, 400000.0], dtype=F64)
    kwargs = dict(score_mod=register_score_mod(_days), use_qk=True, activation="silu", scale=0.25, out_scale=1.0,
                  causal=True, max_len=T)
    args = (q, k, v, torch.tensor([0, T]), torch.arange(T), [], [ts], [], None)
    grad = torch.randn(T, 1, 8, generator=g, dtype=F64)
    with pytest.warns(UserWarning) if compiled else contextlib.nullcontext():  # inductor gives up: eager chunk
        dq, dk, dv, _, (d_ts,), _ = _attention_backward_reference(grad, *args, **kwargs)
    s = (q[:, 0] @ k[:, 0].T) * 0.25
    s = _days(s, None, None, ts[None, :])
    p = torch.nn.functional.silu(s).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), 0.0)
    want = torch.autograd.grad((p @ v[:, 0]).unsqueeze(1), (q, k, v), grad)
    torch.testing.assert_close(_attention_reference(*args, **kwargs), (p @ v[:, 0]).unsqueeze(1))
    for got, expected in zip((dq, dk, dv), want):
        torch.testing.assert_close(got, expected)
    assert not d_ts.any()


def _bucketized(score, q_pos, k_pos, head, q_side_0, k_side_0, table_0, table_1, table_2):
    """A float gap bucketized (right=True, int32 buckets) into a per-head table, and an int64 gap
    against int64 boundaries used as a number."""
    fgap = (q_side_0.float() - k_side_0.float()).abs()
    rab = table_1[(torch.bucketize(fgap, table_0, right=True, out_int32=True), head)]
    return score + rab - 0.1 * torch.bucketize(k_side_0 - q_side_0, table_2).float()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bucketize_score_mod_in_compiled_chunks(compiled, monkeypatch):
    """torch.bucketize in a score_mod: the inductor-compiled chunk (inductor lowers bucketize to
    its own search) gives the eager chunk's values and gradients — ties, repeated boundaries,
    NaN-free gaps beyond the last boundary —, compiles without giving up, and the overflow proof
    keeps it compiled (a bucket is in [0, K]; the int64 gap of measured timestamps fits)."""
    import warnings

    from grcompile.lowering.attention.overflow import overflow_reason
    from grcompile.lowering.attention.reference import _attention_backward_reference, _attention_reference
    monkeypatch.setattr(chunks, "_COMPILED_CHUNKS", {})
    lengths = [9, 0, 1, 6]
    T, H = sum(lengths), 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, H, 8, generator=g) for _ in range(3))
    ts = torch.cumsum(torch.randint(0, 30, (T,), generator=g), 0) + 1_700_000_000
    tables = [torch.tensor([1.0, 10.0, 10.0, 30.0, 100.0]), torch.randn(6, H, generator=g),
              torch.tensor([-20, -5, 0, 5, 20])]
    key = register_score_mod(_bucketized)
    kwargs = dict(score_mod=key, use_qk=True, activation="softmax", scale=0.5, out_scale=1.0, causal=False,
                  max_len=max(lengths))
    args = (q, k, v, torch.tensor([0, 9, 9, 10, 16]), torch.cat([torch.arange(n) for n in lengths]), [ts], [ts],
            tables, None)
    assert overflow_reason(key, [ts], [ts], tables, max_len=9, heads=H) is None
    grad = torch.randn(T, H, 8, generator=g)

    def run(on: bool):
        monkeypatch.setattr(chunks, "COMPILE_CHUNKS", on)
        return _attention_reference(*args, **kwargs), _attention_backward_reference(grad, *args, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got_out, got = run(compiled)
    ours = [str(w.message) for w in caught if "jagged_attention" in str(w.message)]
    assert not ours, ours  # no fallback to the eager chunk, nothing run uncompiled
    want_out, want = run(False)
    torch.testing.assert_close(got_out, want_out)
    for a, b in zip([*got[:3], got[5][1]], [*want[:3], want[5][1]]):
        torch.testing.assert_close(a, b)
    assert got[5][1].abs().sum() > 0 and not got[5][0].any() and not got[5][2].any()
    if compiled:
        assert chunks._COMPILED_CHUNKS and not any(c.failed for c in chunks._COMPILED_CHUNKS.values())
