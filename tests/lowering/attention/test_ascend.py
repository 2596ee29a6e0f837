"""The Ascend lowering of ``jagged_attention`` (``grcompile/lowering/attention/ascend.py``), checked at
graph level: no NPU and no torch_npu exist here, so the mxrec ops are CPU stubs (``mxrec_stub``) that
check their arguments like RecSDK's wrappers and compute RecSDK's golden math. Each test checks
which mxrec op is called with which arguments, and that the values and gradients equal the
reference implementation's; every case mxrec cannot express falls back with a reason."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from grcompile.lowering import OPS, use_backend
from grcompile.lowering import attention as ref
from grcompile.lowering.attention import ascend as asc
from grcompile.lowering.score_mod import (hstu_rab_key, register_score_mod, relative_position_bias_key,
                                          relative_time_bias_key)
from tests.lowering import mxrec_stub as stub
from tests.lowering.attention.wrappers import hstu_attention

N, H, D = 8, 2, 16
MIXES = ([0, 1, 8, 5], [8, 8, 3], [1, 0, 0, 7, 2, 8])  # empty, length-1 and full rows


@pytest.fixture
def mxrec():
    stub.install()
    yield stub
    stub.uninstall()


def batch(lengths, *, seed=0, dqk=D, dv=D, heads=H, dtype=torch.float32, layout="start"):
    """q, k, v, offsets and padded-row positions (``start``: 0..n-1, ``left``: N-n..N-1,
    ``holes``: 0, 2, 4, .. in the rows that fit) and sorted int timestamps."""
    g = torch.Generator().manual_seed(seed)
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    T = offs[-1]
    q, k = (torch.randn(T, heads, dqk, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(T, heads, dv, generator=g, dtype=dtype)
    rows = []
    for n in lengths:
        if layout == "left":
            rows.append(torch.arange(N - n, N))
        elif layout == "holes":  # every other position where the row fits
            rows.append(torch.arange(n) * (2 if 2 * n - 1 <= N else 1))
        else:
            rows.append(torch.arange(n))
    positions = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    ts = torch.cat([torch.sort(torch.randint(0, 100_000, (n,), generator=g)).values for n in lengths])
    return q, k, v, torch.tensor(offs), positions, ts


def next_timestamp(ts, offsets):
    """HSTU's query side: the next timestamp of the row (the row's last keeps its own)."""
    out = ts.clone()
    offs = offsets.tolist()
    for a, b in zip(offs[:-1], offs[1:]):
        if b - a > 1:
            out[a:b - 1] = ts[a + 1:b]
    return out


def run_both(q, k, v, offsets, positions, q_side, k_side, tables, seed=None, **kw):
    """(reference, ascend) forward outputs, and (reference, ascend) backward results."""
    kw = dict(dict(use_qk=True, activation="silu", scale=1.0, out_scale=1.0 / N, causal=True, max_len=N), **kw)
    args = (q, k, v, offsets, positions, q_side, k_side, tables, seed)
    g = torch.randn(q.shape[0], q.shape[1], v.shape[2], generator=torch.Generator().manual_seed(7), dtype=q.dtype)
    fwd = ref._attention_reference(*args, **kw), asc.attention_ascend(*args, **kw)
    bwd = ref._attention_backward_reference(g, *args, **kw), asc.attention_backward_ascend(g, *args, **kw)
    return fwd, bwd


def assert_same(fwd, bwd):
    torch.testing.assert_close(fwd[1], fwd[0], rtol=1e-4, atol=1e-5)
    r, a = bwd
    for x, y in zip(r[:3], a[:3]):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)
    for group in (3, 4, 5):
        for x, y in zip(r[group], a[group]):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)


def check_hstu_call(call, offsets, *, mask_type, silu_scale, alpha=1.0, bias=True, mask=False):
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    B, S = len(lengths), max(lengths)
    assert call["mask_type"] == mask_type
    assert call["max_seq_len"] == S
    assert torch.equal(call["seq_offset"], offsets)
    assert call["silu_scale"] == pytest.approx(silu_scale)
    assert call["alpha"] == pytest.approx(alpha)
    assert (call["attn_bias"] is not None) == bias
    if bias:
        assert tuple(call["attn_bias"].shape) == (B, H, S, S)
    assert (call["mask"] is not None) == mask
    if mask:
        assert tuple(call["mask"].shape) == (B, H, S, S)


def fresh(op: str, key: str) -> None:
    OPS[op].fallbacks.pop(key, None)


# --------------------------------------------------------------------------------------------
# what maps to mxrec


@pytest.mark.parametrize("same_sides", [True, False], ids=["t_i-t_j", "hstu_next_timestamp"])
@pytest.mark.parametrize("lengths", MIXES)
def test_hstu_rab(mxrec, lengths, same_sides):
    q, k, v, offsets, positions, ts = batch(lengths)
    q_side = [ts] if same_sides else [next_timestamp(ts, offsets)]
    tables = [torch.randn(2 * N - 1), torch.randn(129)]
    key = hstu_rab_key(N, 128)
    fresh("jagged_attention", key)
    fwd, bwd = run_both(q, k, v, offsets, positions, q_side, [ts], tables, score_mod=key)
    assert_same(fwd, bwd)
    assert key not in OPS["jagged_attention"].fallbacks
    S = max(lengths)
    [fcall] = mxrec.calls("hstu_jagged.equal")
    check_hstu_call(fcall, offsets, mask_type=0, silu_scale=1.0 / N)
    [bcall] = mxrec.calls("hstu_jagged_backward.equal")
    check_hstu_call(bcall, offsets, mask_type=0, silu_scale=1.0 / N)
    torch.testing.assert_close(bcall["attn_bias"], fcall["attn_bias"], rtol=0, atol=0)  # same bias both ways
    pos = mxrec.calls("relative_attn_bias_pos")
    assert len(pos) == 2 and pos[0]["past_valid_lens"] == [min(n, S - 1) for n in lengths]
    assert tuple(pos[0]["rel_pos_bias"].shape) == (S, S) and not pos[0]["identity"].any()
    time = mxrec.calls("relative_attn_bias_time")
    if same_sides:
        assert len(time) == 2
        assert time[0]["timestamps"].dtype == torch.int32 and tuple(time[0]["timestamps"].shape) == (len(lengths), S)
        assert tuple(time[0]["timestamps_weights"].shape) == (1, 129)
        assert time[0]["bucket_divisor"] == pytest.approx(0.301)
    else:  # mxrec's time op takes t_i − t_j from one sequence: HSTU's query side differs
        assert time == []
        assert "time bias evaluated on the grid" in asc.NOTES[key]


@pytest.mark.parametrize("layout", ["start", "left", "holes"])
def test_position_bias(mxrec, layout):
    lengths = [3, 0, 8, 1]
    q, k, v, offsets, positions, _ = batch(lengths, seed=1, layout=layout)
    key = relative_position_bias_key(N)
    fwd, bwd = run_both(q, k, v, offsets, positions, [], [], [torch.randn(2 * N - 1)], score_mod=key)
    assert_same(fwd, bwd)
    check_hstu_call(mxrec.calls("hstu_jagged.equal")[0], offsets, mask_type=0, silu_scale=1.0 / N)
    # the op works on row-local indices: with holes in the positions the bias is evaluated instead
    assert len(mxrec.calls("relative_attn_bias_pos")) == (0 if layout == "holes" else 2)


@pytest.mark.parametrize("num_buckets", [128, 16])
def test_time_bias(mxrec, num_buckets):
    lengths = [5, 8, 0, 1]
    q, k, v, offsets, positions, ts = batch(lengths, seed=2)
    key = relative_time_bias_key(num_buckets)
    fwd, bwd = run_both(q, k, v, offsets, positions, [ts], [ts], [torch.randn(num_buckets + 1)], score_mod=key,
                        causal=False)
    assert_same(fwd, bwd)
    check_hstu_call(mxrec.calls("hstu_jagged.equal")[0], offsets, mask_type=2, silu_scale=1.0 / N)
    assert len(mxrec.calls("relative_attn_bias_time")) == (2 if num_buckets == 128 else 0)


def test_no_score_mod(mxrec):
    q, k, v, offsets, positions, _ = batch([4, 8, 1, 0], seed=3)
    fwd, bwd = run_both(q, k, v, offsets, positions, [], [], [], score_mod="")
    assert_same(fwd, bwd)
    check_hstu_call(mxrec.calls("hstu_jagged.equal")[0], offsets, mask_type=0, silu_scale=1.0 / N, bias=False)


def hstu_captured(score, q_pos, k_pos, k_side_0, table_0):
    """What the attention-capture pass makes of ``F.silu(q @ kᵀ + rab[rel]) / N * tril * valid``."""
    rab = table_0[k_pos - q_pos + 8 - 1]
    keep = torch.where(k_pos - q_pos <= 0, torch.full((), 1.0), 0) * k_side_0
    return torch.nn.functional.silu(score + rab) / 8 * keep


@pytest.mark.parametrize("valid_dtype", [torch.bool, torch.float32])
def test_zoo_captured_score_mod(mxrec, valid_dtype):
    """A captured HSTU region (activation inside the score_mod, op activation "identity"): the
    additive part becomes the dense bias, the factors after SiLU a custom mask (type 3)."""
    lengths = [8, 2, 0, 6]
    q, k, v, offsets, positions, _ = batch(lengths, seed=4)
    valid = torch.rand(q.shape[0], generator=torch.Generator().manual_seed(3)) > 0.2  # holes in the rows
    valid = valid.to(valid_dtype) if valid_dtype == torch.bool else valid.to(valid_dtype) * 1.5
    key = register_score_mod(fx.symbolic_trace(hstu_captured), name="captured")
    table = torch.randn(2 * N - 1)
    for op in ("jagged_attention", "jagged_attention_backward"):
        fresh(op, key)
    fwd, bwd = run_both(q, k, v, offsets, positions, [], [valid], [table], score_mod=key, activation="identity",
                        out_scale=0.5)
    assert_same(fwd, bwd)
    check_hstu_call(mxrec.calls("hstu_jagged.equal")[0], offsets, mask_type=3, silu_scale=0.5, mask=True)
    assert ("dense tensors for mxrec (B = 4, H = 2, S = 8): bias mxrec takes [B, H, S, S] 2.0 KiB, "
            "custom mask mxrec takes [B, H, S, S] 2.0 KiB; 4.0 KiB for this call") in asc.NOTES[key]
    # a float factor after SiLU gets its gradient from a dense grid product (mxrec returns none)
    check_hstu_call(mxrec.calls("hstu_jagged_backward.equal")[0], offsets, mask_type=3, silu_scale=0.5, mask=True)
    assert key not in OPS["jagged_attention_backward"].fallbacks


def test_zoo_model_end_to_end(mxrec):
    """tests/zoo/hstu_gather_holes (head width 16) compiled with the Ascend kernels: the captured
    region runs on mxrec.hstu_jagged, forward and backward, with eager's values and gradients."""
    import grcompile
    from grcompile.lowering import set_backend
    from tests.zoo import hstu_gather_holes

    torch.manual_seed(0)
    user = hstu_gather_holes.factory(max_len=12, num_items=40, dropout=0.0, d=32)
    args = user.batch(5, 12, 0)
    try:
        compiled = grcompile.optimize(user.module, lowering="eager", backend="ascend")
        out = compiled(*args)
        out.sum().backward()
    finally:
        set_backend(None)
    grads = [p.grad.clone() for p in user.module.parameters()]
    user.module.zero_grad()
    eager = user.module(*args)
    eager.sum().backward()
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
    for g, p in zip(grads, user.module.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
    assert len(mxrec.calls("hstu_jagged.equal")) == 2 and len(mxrec.calls("hstu_jagged_backward.equal")) == 2
    assert all(c["mask_type"] == 3 for c in mxrec.calls("hstu_jagged.equal"))


def scaled_additive(score, q_pos, k_pos, head, table_0):
    """A per-head bias after a scaled score: silu is the op's; alpha = 0.5 · scale."""
    return score * 0.5 + table_0[head, k_pos - q_pos + 8 - 1]


def test_scaled_score_mod_with_head(mxrec):
    q, k, v, offsets, positions, _ = batch([7, 1, 8], seed=5)
    key = register_score_mod(scaled_additive, name="scaled_additive")
    fwd, bwd = run_both(q, k, v, offsets, positions, [], [], [torch.randn(H, 2 * N - 1)], score_mod=key,
                        scale=0.25, causal=False)
    assert_same(fwd, bwd)
    check_hstu_call(mxrec.calls("hstu_jagged.equal")[0], offsets, mask_type=2, silu_scale=1.0 / N, alpha=0.125)


def test_through_the_op_with_autograd(mxrec):
    """``use_backend("ascend")`` sends CPU tensors to the ascend slot; gradients flow through the
    backward op's ascend slot."""
    q, k, v, offsets, positions, ts = batch([0, 5, 8, 1], seed=6)
    tables = [torch.randn(2 * N - 1), torch.randn(129)]

    def step(backend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, *tables)]
        with use_backend(backend):
            out = hstu_attention(*leaves[:3], offsets, positions, N=N, query_timestamps=ts, timestamps=ts,
                                 position_table=leaves[3], time_table=leaves[4])
            out.pow(2).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    before = OPS["jagged_attention"].calls["ascend"]
    out_ref, grads_ref = step("reference")
    out_asc, grads_asc = step("ascend")
    assert OPS["jagged_attention"].calls["ascend"] == before + 1
    torch.testing.assert_close(out_asc, out_ref, rtol=1e-4, atol=1e-5)
    for a, r in zip(grads_asc, grads_ref):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)
    assert len(mxrec.calls("hstu_jagged.equal")) == 1 and len(mxrec.calls("hstu_jagged_backward.equal")) == 1


def test_no_tokens(mxrec):
    q, k, v, offsets, positions, _ = batch([0, 0])
    fwd, bwd = run_both(q, k, v, offsets, positions, [], [], [], score_mod="")
    assert fwd[1].shape == (0, H, D) and mxrec.CALLS == []


# --------------------------------------------------------------------------------------------
# what falls back, and why


def squared(score, q_pos, k_pos):
    return score * score


FALLBACKS = {  # case -> (batch kwargs, call kwargs, words of the reason)
    "softmax": ({}, dict(activation="softmax", out_scale=1.0), "softmax attention"),
    "dropout": ({}, dict(dropout_p=0.25), "has no dropout"),
    "float64": (dict(dtype=torch.float64), {}, "dtype torch.float64"),
    "17_heads": (dict(heads=17), {}, "17 heads"),
    "head_width_24": (dict(dqk=24, dv=24), {}, "head width 24"),
    "dqk_ne_dv": (dict(dv=32), {}, "!= v head width 32"),
    "no_qk": ({}, dict(use_qk=False, activation="identity", score_mod="pos"), "does not use q·kᵀ"),
    "identity": ({}, dict(activation="identity"), "identity attention without a SiLU"),
    "score_twice": ({}, dict(score_mod="squared"), "combines the score with itself"),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_fallbacks(mxrec, case):
    batch_kw, call_kw, words = FALLBACKS[case]
    q, k, v, offsets, positions, _ = batch([5, 0, 8, 1], seed=8, **batch_kw)
    tables = []
    key = call_kw.pop("score_mod", "")
    if key == "pos":
        key, tables = relative_position_bias_key(N), [torch.randn(2 * N - 1, dtype=q.dtype)]
    elif key == "squared":
        key = register_score_mod(squared)
    seed = torch.tensor([3]) if call_kw.get("dropout_p") else None
    fresh("jagged_attention", key)
    fresh("jagged_attention_backward", key)
    with pytest.warns(UserWarning, match="reference implementation runs instead"):
        fwd, bwd = run_both(q, k, v, offsets, positions, [], [], tables, seed, score_mod=key, **call_kw)
    assert_same(fwd, bwd)  # the reference ran: exactly its values
    assert words in OPS["jagged_attention"].fallbacks[key]
    assert words in OPS["jagged_attention_backward"].fallbacks[key]
    assert mxrec.calls("hstu_jagged.equal") == [] and mxrec.calls("hstu_jagged_backward.equal") == []


def test_too_many_rows(mxrec):
    q, k, v, offsets, positions, _ = batch([1] * 2049, heads=1)
    fresh("jagged_attention", "")
    out = asc.attention_ascend(q, k, v, offsets, positions, [], [], [], None, score_mod="", use_qk=True,
                               activation="silu", scale=1.0, out_scale=1.0, causal=True, max_len=N)
    torch.testing.assert_close(out, torch.nn.functional.silu((q * k).sum(-1, keepdim=True)) * v)
    assert "2049 rows: mxrec.hstu_jagged takes 1 to 2048" in OPS["jagged_attention"].fallbacks[""]
    assert mxrec.calls("hstu_jagged.equal") == []


@pytest.mark.parametrize("limit", ["MAX_SEQ_LEN", "DENSE_BIAS_MAX_BYTES"])
def test_size_limits(mxrec, monkeypatch, limit):
    """The limits are module constants (mxrec's 20480 tokens; the dense bias budget); lowered here
    so that a small batch crosses them."""
    monkeypatch.setattr(asc, limit, 6 if limit == "MAX_SEQ_LEN" else 1000)
    q, k, v, offsets, positions, _ = batch([8, 3], seed=9)
    key = relative_position_bias_key(N)
    fresh("jagged_attention", key)
    fwd, bwd = run_both(q, k, v, offsets, positions, [], [], [torch.randn(2 * N - 1)], score_mod=key)
    assert_same(fwd, bwd)
    words = ("a row of 8 tokens: mxrec.hstu_jagged's max_seq_len is at most 6" if limit == "MAX_SEQ_LEN" else
             "the bias mxrec takes would be a dense [B, H, S, S] = [2, 2, 8, 8] tensor of 1.0 KiB")
    assert words in OPS["jagged_attention"].fallbacks[key]
    assert mxrec.calls("hstu_jagged.equal") == []


def test_mxrec_not_loaded():
    """Without RecSDK's ops (every CI machine) the ascend slot runs the reference, with a reason."""
    stub.uninstall()
    q, k, v, offsets, positions, _ = batch([3, 8])
    fresh("jagged_attention", "")
    fwd, bwd = run_both(q, k, v, offsets, positions, [], [], [], score_mod="")
    assert_same(fwd, bwd)
    assert "torch.ops.mxrec.hstu_jagged.equal is not registered for cpu" in OPS["jagged_attention"].fallbacks[""]


def test_stub_rejects_what_mxrec_rejects(mxrec):
    """The stub is strict like RecSDK's wrappers (so the tests above would catch a bad call)."""
    q, k, v, offsets, _, _ = batch([3, 2])
    with pytest.raises(RuntimeError, match="maskType 1"):
        torch.ops.mxrec.hstu_jagged.equal(q, k, v, mask_type=1, max_seq_len=3, silu_scale=1.0, seq_offset=offsets)
    with pytest.raises(RuntimeError, match="attnBias should be"):
        torch.ops.mxrec.hstu_jagged.equal(q, k, v, attn_bias=torch.zeros(2, H, 4, 4), mask_type=0, max_seq_len=3,
                                          silu_scale=1.0, seq_offset=offsets)
    with pytest.raises(IndexError):  # past_valid_lens must stay inside the matrix (the golden indexes it)
        torch.ops.mxrec.relative_attn_bias_pos(torch.zeros(4, 4), torch.zeros(4, 4), [4])
    with pytest.raises(RuntimeError, match=r"\(2s, 2s\)"):  # an odd matrix: its kernel would read it skewed
        torch.ops.mxrec.relative_attn_bias_pos(torch.zeros(3, 3), torch.zeros(3, 3), [2])
    with pytest.raises(RuntimeError, match="0 < b <= 512"):
        torch.ops.mxrec.relative_attn_bias_time(torch.zeros(513, 2, dtype=torch.int32), torch.zeros(1, 129), 0.301)


def test_bfloat16(mxrec):
    """bf16: the bias goes to mxrec in q's dtype (its rule); relative_attn_bias_pos has float32 /
    float16 kernels only, so the table is evaluated on the grid."""
    lengths = [6, 1, 8]
    q, k, v, offsets, positions, ts = batch(lengths, seed=10, dtype=torch.bfloat16)
    tables = [torch.randn(2 * N - 1), torch.randn(129)]
    kw = dict(score_mod=hstu_rab_key(N, 128), use_qk=True, activation="silu", scale=1.0, out_scale=1.0 / N,
              causal=True, max_len=N)
    args = (q, k, v, offsets, positions, [ts], [ts], tables, None)
    torch.testing.assert_close(asc.attention_ascend(*args, **kw), ref._attention_reference(*args, **kw),
                               rtol=1.6e-2, atol=1e-2)
    [call] = mxrec.calls("hstu_jagged.equal")
    assert call["attn_bias"].dtype == torch.bfloat16
    assert mxrec.calls("relative_attn_bias_pos") == [] and mxrec.calls("relative_attn_bias_time") == []


# --------------------------------------------------------------------------------------------
# a review's cases (RecSDK's kernel and host sources simulated on the CPU, 2026-11-29)


@pytest.mark.parametrize("lengths", [[7, 3], [5, 1, 5], [1], [1, 0]])
def test_odd_longest_row_gets_an_even_position_matrix(mxrec, lengths):
    """relative_attn_bias_pos's matrix is (2s, 2s): its kernel reads rows with stride 2·(n // 2),
    so an odd S goes in padded to S + 1 and comes back sliced (the stub rejects an odd matrix)."""
    q, k, v, offsets, positions, _ = batch(lengths, seed=12)
    key = relative_position_bias_key(N)
    fresh("jagged_attention", key)
    fwd, bwd = run_both(q, k, v, offsets, positions, [], [], [torch.randn(2 * N - 1)], score_mod=key)
    assert_same(fwd, bwd)
    S = max(lengths)
    pos = mxrec.calls("relative_attn_bias_pos")
    assert len(pos) == 2 and tuple(pos[0]["rel_pos_bias"].shape) == (S + S % 2,) * 2
    assert pos[0]["past_valid_lens"] == [min(n, S + S % 2 - 1) for n in lengths]


def test_bias_ops_outside_their_limits_are_evaluated_on_the_grid(mxrec, monkeypatch):
    """At most 512 rows for both ops, rows of at most 4300 tokens for the time op and a (2s, 2s)
    matrix with s <= 4300 for the position op (lowered here so a small batch crosses them)."""
    monkeypatch.setattr(asc, "BIAS_OP_MAX_BATCH", 2)
    monkeypatch.setattr(asc, "BIAS_OP_MAX_S", 4)
    key = hstu_rab_key(N, 128)
    tables = [torch.randn(2 * N - 1), torch.randn(129)]
    for lengths, pos_calls, time_calls in (([3, 2, 1], 0, 0), ([5, 3], 2, 0), ([4, 3], 2, 2)):
        q, k, v, offsets, positions, ts = batch(lengths, seed=13)
        mxrec.CALLS.clear()
        fwd, bwd = run_both(q, k, v, offsets, positions, [ts], [ts], tables, score_mod=key)
        assert_same(fwd, bwd)
        assert len(mxrec.calls("relative_attn_bias_pos")) == pos_calls, lengths
        assert len(mxrec.calls("relative_attn_bias_time")) == time_calls, lengths
        if lengths == [5, 3]:
            assert "time bias evaluated on the grid: 2 rows of up to 5 tokens: it takes at most 2 rows of 4" in \
                asc.NOTES[key]


def test_timestamps_spanning_int32_are_evaluated_on_the_grid(mxrec):
    """The time kernel subtracts int32 timestamps: a span of 2**31 or more would wrap; timestamps
    each past int32 but close together are rebased on their smallest and go to the op."""
    lengths = [6, 8, 3]
    q, k, v, offsets, positions, _ = batch(lengths, seed=14)
    key = relative_time_bias_key(128)
    g = torch.Generator().manual_seed(5)
    wide = torch.randint(-2_000_000_000, 2_000_000_000, (q.shape[0],), generator=g)
    high = (1 << 40) + torch.randint(0, 1 << 20, (q.shape[0],), generator=g)
    for stamps, op_calls in ((wide, 0), (high, 2)):
        mxrec.CALLS.clear()
        fwd, bwd = run_both(q, k, v, offsets, positions, [stamps], [stamps], [torch.randn(129)], score_mod=key)
        assert_same(fwd, bwd)
        assert len(mxrec.calls("relative_attn_bias_time")) == op_calls
    assert "timestamps span 2**31 or more" not in asc.NOTES[key]  # the last call went to the op
    mxrec.CALLS.clear()
    run_both(q, k, v, offsets, positions, [wide], [wide], [torch.randn(129)], score_mod=key)
    assert "timestamps span 2**31 or more (its int32 differences would wrap)" in asc.NOTES[key]


def fp16_key_mask(score, q_pos, k_pos, k_side_0):
    return score + torch.where(k_side_0 > 0.5, 0.0, -1e4)  # the usual fp16 additive mask


def test_a_bias_overflowing_fp16_once_divided_by_alpha_falls_back(mxrec):
    """mxrec adds bias / alpha in q's dtype: −1e4 / 0.125 is −inf in float16, and silu(−inf) NaN."""
    q, k, v, offsets, positions, _ = batch([8, 5], seed=15, dtype=torch.float16)
    valid = (torch.rand(q.shape[0], generator=torch.Generator().manual_seed(2)) > 0.3).float()
    key = register_score_mod(fp16_key_mask)
    fresh("jagged_attention", key)
    kw = dict(score_mod=key, use_qk=True, activation="silu", scale=0.125, out_scale=1.0 / N, causal=True, max_len=N)
    args = (q, k, v, offsets, positions, [], [valid], [], None)
    with pytest.warns(UserWarning, match="reference implementation runs instead"):
        out = asc.attention_ascend(*args, **kw)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref._attention_reference(*args, **kw))
    assert "overflows torch.float16" in OPS["jagged_attention"].fallbacks[key]
    assert mxrec.calls("hstu_jagged.equal") == []


def halved_by_keywords(score, q_pos, k_pos):
    return torch.div(input=score, other=2.0)


def shifted_by_keywords(score, q_pos, k_pos):
    return torch.sub(input=score, other=(k_pos - q_pos).float())


@pytest.mark.parametrize("fn", [halved_by_keywords, shifted_by_keywords])
def test_keyword_operands_are_read_as_operands(mxrec, fn):
    q, k, v, offsets, positions, _ = batch([5, 8], seed=16)
    key = register_score_mod(fx.symbolic_trace(fn), name=fn.__name__)
    fresh("jagged_attention", key)
    fwd, bwd = run_both(q, k, v, offsets, positions, [], [], [], score_mod=key)
    assert_same(fwd, bwd)
    assert key not in OPS["jagged_attention"].fallbacks
    [call] = mxrec.calls("hstu_jagged.equal")
    assert call["alpha"] == pytest.approx(0.5 if fn is halved_by_keywords else 1.0)


def test_memory_counts_the_bias_ops_outputs(mxrec, monkeypatch):
    """With one head the time op's [1, B, 2S, 2S] output is 4× the [B, H, S, S] bias: both are
    in the note, and each is held to DENSE_BIAS_MAX_BYTES before its op runs."""
    q, k, v, offsets, positions, ts = batch([8, 8, 3], seed=17, heads=1)
    key = relative_time_bias_key(128)
    args = (q, k, v, offsets, positions, [ts], [ts], [torch.randn(129)], None)
    kw = dict(score_mod=key, use_qk=True, activation="silu", scale=1.0, out_scale=1.0 / N, causal=True, max_len=N)
    asc.attention_ascend(*args, **kw)
    assert ("bias mxrec takes [B, H, S, S] 768 B, time-bias output [1, B, 2S, 2S] 3.0 KiB; 3.8 KiB for this "
            "call") in asc.NOTES[key]
    monkeypatch.setattr(asc, "DENSE_BIAS_MAX_BYTES", 3 * 1 * 8 * 8 * 4)  # the bias fits exactly
    fresh("jagged_attention", key)
    mxrec.CALLS.clear()
    with pytest.warns(UserWarning, match="reference implementation runs instead"):
        torch.testing.assert_close(asc.attention_ascend(*args, **kw), ref._attention_reference(*args, **kw))
    assert "the time-bias output would be a dense [1, B, 2S, 2S] = [1, 3, 16, 16] tensor of 3.0 KiB" in \
        OPS["jagged_attention"].fallbacks[key]
    assert mxrec.calls("relative_attn_bias_time") == []


# --------------------------------------------------------------------------------------------
# torch.bucketize in the score_mod: mxrec has no bucket op, so the bias is evaluated on the grid


def bucketized_time_captured(score, q_pos, k_pos, head, q_side_0, k_side_0, k_side_1, table_0, table_1):
    """What capture makes of ``F.silu(q @ kᵀ + table[bucketize(|Δt|, bounds)].permute(..)) / N *
    tril * valid``: the boundaries are ``table_0``, the per-head table ``table_1``."""
    rab = table_1[(torch.bucketize((q_side_0 - k_side_0).abs(), table_0, right=True), head)]
    keep = torch.where(k_pos - q_pos <= 0, torch.full((), 1.0), 0) * k_side_1
    return torch.nn.functional.silu(score + rab) / 8 * keep


def bucketized_time_additive(score, q_pos, k_pos, head, q_side_0, k_side_0, table_0, table_1):
    return score + table_1[(torch.bucketize((q_side_0 - k_side_0).abs(), table_0, out_int32=True), head)]


@pytest.mark.parametrize("captured", [True, False], ids=["captured_identity", "additive_silu"])
def test_bucketized_time_bias_is_a_dense_bias(mxrec, captured):
    """The bucket (ties, NaN-free gaps beyond the last boundary) is computed by torch.bucketize on
    the padded grid: mxrec gets the dense bias; values and the table's gradient equal the reference,
    and the boundaries get none (0, as the reference's)."""
    lengths = [8, 1, 0, 6]
    q, k, v, offsets, positions, ts = batch(lengths, seed=21)
    bounds = torch.tensor([10.0, 1000.0, 1000.0, 20_000.0, 60_000.0])  # a repeated boundary
    ts = (ts // 1000 * 1000).float()  # gaps that equal boundaries
    table = torch.randn(bounds.numel() + 1, H)
    fn = bucketized_time_captured if captured else bucketized_time_additive
    key = register_score_mod(fx.symbolic_trace(fn), name=fn.__name__)
    for op in ("jagged_attention", "jagged_attention_backward"):
        fresh(op, key)
    k_side = [ts, torch.ones_like(ts)] if captured else [ts]
    kw = dict(activation="identity", out_scale=0.5) if captured else dict(out_scale=0.5)
    fwd, bwd = run_both(q, k, v, offsets, positions, [ts], k_side, [bounds, table], score_mod=key, **kw)
    assert_same(fwd, bwd)
    assert key not in OPS["jagged_attention"].fallbacks and key not in OPS["jagged_attention_backward"].fallbacks
    check_hstu_call(mxrec.calls("hstu_jagged.equal")[0], offsets, mask_type=3 if captured else 0, silu_scale=0.5,
                    mask=captured)
    assert bwd[1][5][1].abs().sum() > 0 and torch.equal(bwd[1][5][0], torch.zeros_like(bounds))


def test_bucketized_model_end_to_end(mxrec):
    """An HSTU-style block whose time bias is ``per_head[bucketize(|Δt|, boundaries buffer)]``,
    compiled with the Ascend kernels: the captured region runs on mxrec.hstu_jagged forward and
    backward, with eager's values and every gradient (the bias table's included)."""
    import torch.nn as nn
    import torch.nn.functional as F

    import grcompile
    from grcompile.lowering import set_backend

    class BucketedHSTU(nn.Module):
        def __init__(self, d=32, heads=2, vocab=40):
            super().__init__()
            self.h = heads
            self.emb = nn.Embedding(vocab, d)
            self.uvqk = nn.Linear(d, 4 * d)
            self.register_buffer("bounds", torch.tensor([60.0, 3600.0, 86_400.0, 7 * 86_400.0]))
            self.time_bias = nn.Parameter(torch.randn(5, heads) * 0.1)

        def forward(self, ids, ts):
            B, n = ids.shape
            valid = ids != 0
            u, v, q, k = (t.view(B, n, self.h, -1).transpose(1, 2) for t in self.uvqk(self.emb(ids)).chunk(4, -1))
            dt = (ts[:, :, None] - ts[:, None, :]).abs()
            rab = self.time_bias[torch.bucketize(dt, self.bounds)].permute(0, 3, 1, 2)  # [B, H, N, N]
            mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
            attn = F.silu(q @ k.transpose(-1, -2) + rab) / n * mask
            return ((attn @ v) * u).transpose(1, 2).reshape(B, n, -1)

    torch.manual_seed(0)
    model = BucketedHSTU()
    lengths = [0, 1, 12, 7, 4]
    ids = torch.randint(1, 40, (5, 12))
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
    ts = torch.cumsum(torch.randint(0, 2 * 86_400, (5, 12)), 1).float()
    valid = (ids != 0)[..., None]
    try:
        compiled = grcompile.optimize(model, lowering="eager", backend="ascend")
        out = compiled(ids, ts)
        torch.where(valid, out, 0).square().sum().backward()
    finally:
        set_backend(None)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    eager = model(ids, ts)
    torch.where(valid, eager, 0).square().sum().backward()
    torch.testing.assert_close(torch.where(valid, out, 0), torch.where(valid, eager, 0), rtol=1e-4, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    assert grads["time_bias"].abs().sum() > 0
    report = grcompile.report(compiled)
    assert report.counters.get("fuse_attention.score_mod_attention") == 1, report.fallbacks
    assert len(mxrec.calls("hstu_jagged.equal")) == 1 and len(mxrec.calls("hstu_jagged_backward.equal")) == 1
