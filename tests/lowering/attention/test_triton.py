"""The Triton jagged attention (forward and backward, score_mod generated into the kernel) equals
the reference implementation, run by Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``).

Each case draws a length mix with empty, length-1 and full rows, heads, head widths, an activation,
causal or not, dropout or not, and a score_mod from those the models and the zoo use (HSTU's
relative position + time buckets, position only, a per-head ``[H, N, N]`` table indexed by the head,
an additive float key-side mask that receives a gradient, log-bucketed time with a per-head table)."""
from __future__ import annotations

import os
import sys
import warnings

# GRCOMPILE_TEST_DEVICE=cuda runs the kernel-vs-reference cases natively on a GPU, e.g.
#   GRCOMPILE_TEST_DEVICE=cuda pytest tests/lowering/attention/test_triton.py -k "reference or bias or bf16"
DEVICE = os.environ.get("GRCOMPILE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import assume, given, settings, strategies as st  # noqa: E402

from grcompile.lowering import OPS, use_backend  # noqa: E402
from grcompile.lowering import attention as ref  # noqa: E402
from grcompile.lowering import score_mod as S  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton on CPU tensors needs TRITON_INTERPRET=1 before triton is imported")

at = pytest.importorskip("grcompile.lowering.attention.triton")


def additive_mask(score, q_pos, k_pos, k_side_0):
    future = torch.where(k_pos - q_pos >= 1, torch.full((), -1e9), 0.0)
    return score * 0.125 + future + k_side_0


def per_head_table(score, q_pos, k_pos, head, table_0):
    return score + table_0[(head, q_pos, k_pos)]


def head_only_table(score, q_pos, k_pos, head, table_0):
    """A per-head scalar (a learned temperature per head): one index per program."""
    return score * table_0[head]


def time_buckets_per_head(score, q_pos, k_pos, head, q_side_0, k_side_0, table_0):
    delta = (k_side_0 - q_side_0).abs().float()
    bucket = torch.clamp(torch.log1p(delta).div(0.7).long(), 0, 15)
    return torch.nn.functional.silu(score + table_0[(bucket, head)]) / 12 * torch.where(k_pos <= q_pos, 1.0, 0.0)


def scalar_tables(score, q_pos, k_pos, k_side_0, table_0, table_1, table_2):
    """0-d tensors used as numbers (a padded length kept as a tensor, a learned temperature)."""
    return torch.nn.functional.silu(score + table_1[k_pos - q_pos + table_0 - 1]) / table_2 * k_side_0


def exact_int_gap(score, q_pos, k_pos, q_side_0, k_side_0):
    """Integer math on timestamps beyond float32's 2**24: abs must stay an integer op."""
    return score + ((k_side_0 - q_side_0).abs() > 16_777_216).float()


def hour_of_gap(score, q_pos, k_pos, q_side_0, k_side_0, table_0):
    """Integer floor division and remainder of negative gaps (torch floors; C truncates), a float
    remainder that carries a gradient, and a floor-rounded division of positions."""
    gap = k_side_0 - q_side_0
    hour = (gap // 3600) % 24 + torch.div(k_pos - q_pos, 3, rounding_mode="floor") % 2
    return score % 2.5 + table_0[hour] + torch.log2(torch.exp2(score * 0.1) + 1.0)


BIASES = ["none", "hstu", "position", "mask", "per_head", "time_per_head", "scalar_tables", "exact_int_gap",
          "hour_of_gap", "head_only"]


def _setup(bias: str, N: int, H: int, T: int, gen: torch.Generator, dtype=torch.float32):
    """(score_mod key, q_side, k_side, tables)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    def stamps():
        return torch.randint(0, 10_000, (T,), generator=gen)
    if bias == "none":
        return "", [], [], []
    if bias == "hstu":
        return S.hstu_rab_key(N, 16), [stamps()], [stamps()], [rnd(2 * N - 1), rnd(17)]
    if bias == "position":
        return S.relative_position_bias_key(N), [], [], [rnd(2 * N - 1)]
    if bias == "mask":
        return S.register_score_mod(additive_mask), [], [rnd(T)], []
    if bias == "head_only":
        return S.register_score_mod(head_only_table), [], [], [rnd(H) + 1.5]
    if bias == "per_head":
        return S.register_score_mod(per_head_table), [], [], [rnd(H, N, N)]
    if bias == "time_per_head":
        return S.register_score_mod(time_buckets_per_head), [stamps()], [stamps()], [rnd(16, H)]
    if bias == "scalar_tables":
        return (S.register_score_mod(scalar_tables), [], [rnd(T)],
                [torch.tensor(N), rnd(2 * N - 1), torch.rand((), generator=gen, dtype=dtype) + 0.5])
    if bias == "hour_of_gap":
        return S.register_score_mod(hour_of_gap), [stamps() * 40], [stamps() * 40], [rnd(25)]
    if bias == "exact_int_gap":  # gaps of exactly 2**24 + 1: float32 would round them to 2**24
        base = torch.randint(0, 2, (T,), generator=gen) * (16_777_217 - 5) + 1_700_000_000
        return S.register_score_mod(exact_int_gap), [base], [base + torch.randint(0, 6, (T,), generator=gen)], []
    raise AssertionError(bias)


def _case(lengths, H, dqk, dv, activation, causal, dropout, bias, seed, dtype=torch.float32, use_qk=True):
    gen = torch.Generator().manual_seed(seed)
    N = max(max(lengths), 1)
    T = sum(lengths)
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    positions = torch.cat([torch.arange(n) for n in lengths]).long() if T else torch.zeros(0, dtype=torch.long)
    q, k = (torch.randn(T, H, dqk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(T, H, dv, generator=gen).to(dtype)
    key, q_side, k_side, tables = _setup(bias, N, H, T, gen)
    seed_t = torch.tensor([seed * 7919 + 1], dtype=torch.int64) if dropout else None
    kwargs = dict(score_mod=key, use_qk=use_qk, activation=activation, scale=0.5, out_scale=1.0 / N,
                  causal=causal, max_len=N, dropout_p=dropout)
    args = (q, k, v, offsets, positions, q_side, k_side, tables, seed_t)
    return _to(args, DEVICE), kwargs


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


def _assert_match(args, kwargs, rtol=1e-4, atol=1e-5, grad_atol=1e-4, fallback=False):
    """The kernels' values and every gradient equal the reference's; unless ``fallback``, the
    kernels ran them (a handoff to the reference would pass the comparison by construction)."""
    (q, k, v, offsets, positions, q_side, k_side, tables, seed) = args
    handed = [OPS[op].calls["reference"] for op in ("jagged_attention", "jagged_attention_backward")]
    got = at.attention_triton(*args, **kwargs)
    want = ref._attention_reference(*args, **kwargs)
    grad = torch.randn_like(want)
    g = at.attention_backward_triton(grad, *args, **kwargs)
    if not fallback:  # a handoff counts a reference call (the warning comes once per score_mod only)
        assert [OPS[op].calls["reference"] for op in ("jagged_attention", "jagged_attention_backward")] == handed, \
            [OPS[op].fallbacks.get(kwargs["score_mod"]) for op in ("jagged_attention", "jagged_attention_backward")]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    r = ref._attention_backward_reference(grad, *args, **kwargs)
    for name, a, b in [("dq", g[0], r[0]), ("dk", g[1], r[1]), ("dv", g[2], r[2])]:
        torch.testing.assert_close(a, b, rtol=rtol, atol=grad_atol, msg=lambda m: f"{name}: {m}")
    for group, ga, ra in (("q_side", g[3], r[3]), ("k_side", g[4], r[4]), ("table", g[5], r[5])):
        assert len(ga) == len(ra)
        for i, (a, b) in enumerate(zip(ga, ra)):
            torch.testing.assert_close(a, b, rtol=rtol, atol=grad_atol, msg=lambda m: f"{group}[{i}]: {m}")


lengths_strategy = st.lists(st.integers(0, 37), min_size=1, max_size=4).map(
    lambda ls: ls + [0, 1] if len(ls) < 3 else ls)


@settings(max_examples=8, deadline=None)
@given(lengths=lengths_strategy, H=st.integers(1, 3), dqk=st.sampled_from([3, 8, 16]),
       dv=st.sampled_from([5, 16]), activation=st.sampled_from(["silu", "softmax", "identity"]),
       causal=st.booleans(), dropout=st.sampled_from([0.0, 0.3]), bias=st.sampled_from(BIASES),
       seed=st.integers(0, 2**16))
def test_triton_attention_matches_reference(lengths, H, dqk, dv, activation, causal, dropout, bias, seed):
    # identity weights of unmasked -1e9 pairs cancel in dv: fp32 summation error, not a kernel error
    assume(not (bias == "mask" and activation == "identity" and not causal))
    _assert_match(*_case(lengths, H, dqk, dv, activation, causal, dropout, bias, seed))


@pytest.mark.slow
@settings(max_examples=120, deadline=None)
@given(lengths=lengths_strategy, H=st.integers(1, 3), dqk=st.sampled_from([3, 8, 16, 32]),
       dv=st.sampled_from([5, 16, 32]), activation=st.sampled_from(["silu", "softmax", "identity"]),
       causal=st.booleans(), dropout=st.sampled_from([0.0, 0.3]), bias=st.sampled_from(BIASES),
       seed=st.integers(0, 2**16))
def test_triton_attention_matches_reference_slow(lengths, H, dqk, dv, activation, causal, dropout, bias, seed):
    # identity weights of unmasked -1e9 pairs cancel in dv: fp32 summation error, not a kernel error
    assume(not (bias == "mask" and activation == "identity" and not causal))
    _assert_match(*_case(lengths, H, dqk, dv, activation, causal, dropout, bias, seed))


@pytest.mark.parametrize("bias", BIASES)
def test_every_bias_with_full_empty_and_single_rows(bias):
    args, kwargs = _case([33, 0, 1, 20], 2, 8, 8, "softmax" if bias == "mask" else "silu", True, 0.2, bias, 3)
    _assert_match(args, kwargs)


def test_bias_only_channel_without_qk():
    """FuXi-α's positional channel: no q·k, identity activation, the table is the whole weight."""
    args, kwargs = _case([17, 1, 0, 9], 2, 4, 8, "identity", True, 0.0, "position", 5, use_qk=False)
    _assert_match(args, kwargs)


@pytest.mark.parametrize("activation,stats", [("silu", False), ("softmax", False), ("softmax", True)])
def test_odd_head_widths_run_padded_to_a_multiple_of_16(monkeypatch, activation, stats):
    """Widths 25 / 50 reach the kernels as 32 / 64 (zero-padded: a launch specialises strides and
    widths divisible by 16, the key and value tiles load as vectors); the caller gets its widths
    back, contiguous, with the reference's values and gradients — and the reference's own widths
    if the kernels fail after padding."""
    assert [at.launch_width(d) for d in (1, 16, 25, 50, 64, 100, 256)] == [16, 16, 32, 64, 64, 112, 256]
    args, kwargs = _case([33, 0, 1, 20], 2, 25, 50, activation, True, 0.2, "hstu", 4)
    seen = []
    launch = at._launch

    def recording(module, kernel, meta, *rest, **kw):
        seen.append((kernel, meta["DQK"], meta["DV"]))
        return launch(module, kernel, meta, *rest, **kw)
    monkeypatch.setattr(at, "_launch", recording)
    out, lse = at.attention_triton(*args, **kwargs, with_lse=True)
    want = ref._attention_reference(*args, **kwargs)
    assert out.shape == want.shape and out.is_contiguous()
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    grad = torch.randn_like(want)
    extra = (out, lse) if stats else ()
    g = at.attention_backward_triton(grad, *args, *extra, **kwargs)
    r = ref._attention_backward_reference(grad, *args, **kwargs)
    for name, a, b in (("dq", g[0], r[0]), ("dk", g[1], r[1]), ("dv", g[2], r[2])):
        assert a.shape == b.shape and a.is_contiguous(), name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(g[5][0], r[5][0], rtol=1e-4, atol=1e-4)
    assert seen and all((dqk, dv) == (32, 64) for _, dqk, dv in seen), seen

    def failing(module, kernel, *rest, **kw):
        if kernel == "bwd_q":
            raise at.TritonFallback("no tile fits (test)")
        return launch(module, kernel, *rest, **kw)
    monkeypatch.setattr(at, "_launch", failing)
    with warnings.catch_warnings():  # the fallback warns once per process
        warnings.simplefilter("ignore")
        g = at.attention_backward_triton(grad, *args, *extra, **kwargs)
    for a, b in zip(g[:3], r[:3]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_int32_offsets_are_checked_at_the_launch_width():
    """Width 50 pads to 64: 33,554,433 tokens fit int32 offsets at 50 wide and not at 64."""
    T = (1 << 31) // 64 + 1
    q = torch.empty(T, 1, 50, device="meta")
    at._check_supported(q[:, :, :48], q[:, :, :48], [], 128)  # 48 is its own launch width: fits
    with pytest.raises(at.TritonFallback, match="q, v has 2"):
        at._check_supported(q, q, [], 128)


def test_bf16_within_bf16_rounding():
    args, kwargs = _case([40, 7, 1], 2, 16, 16, "softmax", True, 0.0, "hstu", 11, dtype=torch.bfloat16)
    args32 = [a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in args]
    got = at.attention_triton(*args, **kwargs)
    assert got.dtype == torch.bfloat16
    want = ref._attention_reference(*args32, **kwargs)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.mark.skipif(DEVICE == "cpu", reason="the GPU tiles (64-256 wide) need a GPU; the interpreter runs the same "
                                            "kernel source with 16 x 16 tiles in the tests above")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 128, 256])
@pytest.mark.parametrize("bias,activation", [("none", "softmax"), ("hstu", "silu"), ("time_per_head", "silu"),
                                             ("mask", "softmax"), ("per_head", "identity")])
def test_gpu_tiles_on_long_rows(bias, activation, width, dtype):
    """Rows longer than every tile, not multiples of it, with empty and length-1 rows, at the widths of
    each tile bucket: every output and gradient against the float64 reference of the same inputs."""
    dropout = 0.0 if bias == "none" else 0.1  # no bias, no dropout: the "plain" tiles (MEASURED_TILES)
    args, kwargs = _case([300, 0, 1, 129, 64], 2, width, width, activation, True, dropout, bias, 21, dtype=dtype)
    args64 = (*(a.double() for a in args[:3]), *args[3:5], *([t.double() if t.is_floating_point() else t for t in group] for group in args[5:8]),
              args[8])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    got = at.attention_triton(*args, **kwargs)
    want = ref._attention_reference(*args64, **kwargs)
    assert got.dtype == dtype
    assert _relative_error(got, want) < tol
    grad = torch.randn_like(got)
    g = at.attention_backward_triton(grad, *args, **kwargs)
    r = ref._attention_backward_reference(grad.double(), *args64, **kwargs)
    pairs = [("dq", g[0], r[0]), ("dk", g[1], r[1]), ("dv", g[2], r[2])]
    pairs += [(f"{group}[{i}]", a, b) for group, ga, ra in (("q_side", g[3], r[3]), ("k_side", g[4], r[4]),
                                                           ("table", g[5], r[5]))
              for i, (a, b) in enumerate(zip(ga, ra)) if b.is_floating_point()]
    errors = {name: _relative_error(a, b) for name, a, b in pairs}
    assert max(errors.values()) < tol, errors


def test_dropout_masks_are_bit_identical_to_the_reference():
    """Dropout decisions, not just their statistics: with v = identity rows, every kept / dropped pair
    shows in the output, so any hash difference would fail exactly."""
    L, H = 24, 2
    offsets = torch.tensor([0, L], dtype=torch.int64)
    positions = torch.arange(L)
    q = k = torch.zeros(L, H, 16)
    v = torch.eye(L)[:, None, :].expand(L, H, L).contiguous()
    seed = torch.tensor([987654321987], dtype=torch.int64)
    kwargs = dict(score_mod="", use_qk=True, activation="identity", scale=1.0, out_scale=1.0, causal=False,
                  max_len=L, dropout_p=0.5)
    # q·k = 0, so a bias of 1 makes every pair's weight exactly keep / (1 - p)
    key = S.register_score_mod(lambda q_pos, k_pos, q_side, k_side, tables: (k_pos - q_pos).float() * 0 + 1.0,
                               name="one")
    kwargs["score_mod"] = key
    args = (q, k, v, offsets, positions, [], [], [], seed)
    got = at.attention_triton(*args, **kwargs)
    want = ref._attention_reference(*args, **kwargs)
    assert torch.equal(got != 0, want != 0)
    assert 0.3 < (got != 0).float().mean() < 0.7


def _flags_per_row(monkeypatch) -> None:
    """Run the kernels with OOB_ROWS (sm_80's out-of-range flags per query row) on any device."""
    common = at._common

    def rows(*args, **kwargs):
        meta, seed = common(*args, **kwargs)
        return dict(meta, OOB_ROWS=True), seed
    monkeypatch.setattr(at, "_common", rows)


@pytest.mark.parametrize("per_row", [False, True])
def test_table_index_out_of_range_raises_naming_the_score_mod(per_row, monkeypatch):
    if per_row:
        _flags_per_row(monkeypatch)
    key = S.register_score_mod(lambda q_pos, k_pos, q_side, k_side, tables: tables[0][k_pos + 5],
                               name=f"too_far_{per_row}")
    args, kwargs = _case([6, 2], 1, 4, 4, "silu", True, 0.0, "none", 1)
    args = (*args[:7], [torch.randn(8)], args[8])
    kwargs["score_mod"] = key
    with pytest.raises(ValueError, match=f"too_far_{per_row}.*out of range"):
        at.attention_triton(*args, **kwargs)


def test_unknown_op_in_score_mod_falls_back_to_the_reference_with_a_reason():
    def cumulative(score, q_pos, k_pos):
        return score + torch.cumsum(q_pos.float(), dim=-2)
    key = S.register_score_mod(cumulative)
    args, kwargs = _case([9, 3], 2, 8, 8, "silu", True, 0.0, "none", 2)
    kwargs["score_mod"] = key
    with pytest.warns(UserWarning, match="reference implementation runs instead"):
        got = at.attention_triton(*args, **kwargs)
    torch.testing.assert_close(got, ref._attention_reference(*args, **kwargs))
    assert "cumsum" in OPS["jagged_attention"].fallbacks[key]


def test_the_custom_op_runs_the_triton_kernel_when_selected():
    args, kwargs = _case([12, 5, 0], 2, 8, 8, "softmax", True, 0.0, "none", 4)
    q, k, v = (t.clone().requires_grad_() for t in args[:3])
    before = OPS["jagged_attention"].calls["triton"], OPS["jagged_attention_backward"].calls["triton"]
    with use_backend("triton"):
        out = torch.ops.grcompile.jagged_attention(q, k, v, *args[3:], **kwargs)
        out.sum().backward()
    assert OPS["jagged_attention"].calls["triton"] == before[0] + 1
    assert OPS["jagged_attention_backward"].calls["triton"] == before[1] + 1
    want = ref._attention_reference(*args, **kwargs)
    torch.testing.assert_close(out.detach(), want)


def test_report_names_the_kernel_backend_and_why_a_kernel_did_not_run():
    import grcompile
    from tests.zoo import harness

    user, _ = harness.load("sdpa_float_mask")
    model = grcompile.optimize(user.module, lowering="eager")
    with use_backend("triton"):
        out = model(*user.batch(3, 12, 0))
        harness._tensors(out)[0].float().sum().backward()
    report = grcompile.report(model)
    assert report.kernels["jagged_attention"].get("triton", 0) >= 1, report.kernels
    assert report.kernels["jagged_attention_backward"].get("triton", 0) >= 1, report.kernels
    assert "kernels run (this process): " in str(report)

    def cumulative_keys(score, q_pos, k_pos):
        return score + torch.cumsum(k_pos.float(), dim=-1)
    key = S.register_score_mod(cumulative_keys)
    args, kwargs = _case([5, 2], 1, 8, 8, "silu", True, 0.0, "none", 9)
    kwargs["score_mod"] = key
    with use_backend("triton"), pytest.warns(UserWarning):
        torch.ops.grcompile.jagged_attention(*args, **kwargs)
    assert any(key in line and "cumsum" in line for line in grcompile.report(model).kernel_fallbacks)


def test_optimize_backend_option_sets_the_process_kernel_backend():
    import grcompile
    from grcompile.lowering import preferred_backend, set_backend

    with pytest.raises(ValueError, match="backend must be one of"):
        grcompile.optimize(torch.nn.Linear(2, 2), backend="cuda")
    before = preferred_backend()
    with pytest.raises(ValueError, match="lowering must be one of"):  # a failed call changes nothing
        grcompile.optimize(torch.nn.Linear(2, 2), backend="reference" if before != "reference" else "triton",
                           lowering="no such lowering")
    assert preferred_backend() == before
    try:
        grcompile.optimize(torch.nn.Linear(2, 2), backend="triton")
        assert preferred_backend() == "triton"
        args, kwargs = _case([7, 3], 2, 8, 8, "softmax", True, 0.0, "none", 6)
        before = OPS["jagged_attention"].calls["triton"]
        torch.ops.grcompile.jagged_attention(*args, **kwargs)
        assert OPS["jagged_attention"].calls["triton"] == before + 1
        with use_backend("reference"):
            assert preferred_backend() == "reference"
    finally:
        set_backend(None)
    assert preferred_backend() == "auto"


def test_launch_config_picks_the_device_archs_tiles(monkeypatch):
    """sm_90 tiles from compute capability 9 on, sm_80 tiles below, by head-width bucket
    (max(dqk, dv) <= 64 / 128 / 256); the interpreter's small tiles on CPU; one AOT config per arch."""
    cc = {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc["now"])
    for kernel in ("fwd", "bwd_kv", "bwd_q"):
        monkeypatch.delenv(f"GRCOMPILE_TILES_{kernel.upper()}", raising=False)
    cuda = torch.device("cuda", 0)
    for now, arch in (((8, 0), "sm_80"), ((8, 6), "sm_80"), ((9, 0), "sm_90"), ((10, 0), "sm_90")):
        cc["now"] = now
        for kernel in ("fwd", "bwd_kv", "bwd_q"):
            for dqk, dv, bucket in ((8, 64, 64), (65, 16, 128), (128, 128, 128), (100, 129, 256), (256, 256, 256)):
                blocks, warps, stages = at.launch_config(kernel, dqk, dv, cuda)
                measured = at.MEASURED_TILES.get((arch, bucket, "score_mod"), {}).get(kernel)
                assert (blocks["BLOCK_M"], blocks["BLOCK_N"], warps, stages) == (
                    measured or at.GPU_TILES[kernel][arch][bucket])
                plain = at.launch_config(kernel, dqk, dv, cuda, plain=True)
                measured = at.MEASURED_TILES.get((arch, bucket, "plain"), {}).get(kernel)
                assert (plain[0]["BLOCK_M"], plain[0]["BLOCK_N"], *plain[1:]) == (
                    measured or at.GPU_TILES[kernel][arch][bucket])
                assert (blocks["BLOCK_DQK"], blocks["BLOCK_DV"]) == (at._pad(dqk), at._pad(dv))
                assert at.launch_config(kernel, dqk, dv, arch=arch) == (blocks, warps, stages)
                for is_plain in (False, True):  # float32 (FMA products): its own tiles, none measured
                    fp32 = at.launch_config(kernel, dqk, dv, cuda, plain=is_plain, dtype=torch.float32)
                    assert (fp32[0]["BLOCK_M"], fp32[0]["BLOCK_N"], *fp32[1:]) == at.FP32_TILES[kernel][arch][bucket]
    for kernel, per_bucket in ((k, t["sm_90"]) for k, t in at.GPU_TILES.items()):
        for bm, bn, warps, _ in per_bucket.values():  # whole warpgroups (which dots get wgmma: the AOT report)
            assert warps % 4 == 0 and min(bm, bn) >= 16, (kernel, per_bucket)
    assert at.launch_config("fwd", 64, 64, torch.device("cpu")) == (
        dict(BLOCK_M=16, BLOCK_N=16, BLOCK_DQK=64, BLOCK_DV=64), 4, 1)
    with pytest.raises(ValueError, match="at most 256"):
        at.launch_config("fwd", 257, 64, arch="sm_80")
    monkeypatch.setenv("GRCOMPILE_TILES_BWD_Q", "32,16,4,1")
    assert at.launch_config("bwd_q", 64, 64, arch="sm_90") == (
        dict(BLOCK_M=32, BLOCK_N=16, BLOCK_DQK=64, BLOCK_DV=64), 4, 1)
    monkeypatch.delenv("GRCOMPILE_TILES_BWD_Q")
    configs = at.aot_configs()
    assert {c["arch"] for c in configs} == {"sm_80", "sm_90"}
    for c in configs:
        kernel = c["kernel"].removeprefix("jagged_attention_")
        d, plain = at._bucket(c["config"]["head_dim"]), c["config"]["score_mod"] == "none" and not c["config"]["dropout"]
        if c["config"]["dtype"] == "fp32":
            tile = at.FP32_TILES[kernel][c["arch"]][d]
            assert c["ieee"] and c["constexprs"]["IEEE"] == 1 and c["config"]["tiles"] == "rule"
        else:
            tile = at.MEASURED_TILES.get((c["arch"], d, "plain" if plain else "score_mod"), {}).get(kernel) or \
                at.GPU_TILES[kernel][c["arch"]][d]
            assert c["config"]["tiles"] == ("measured" if tile != at.GPU_TILES[kernel][c["arch"]][d] else "rule")
        assert (c["constexprs"]["BLOCK_M"], c["constexprs"]["BLOCK_N"], c["num_warps"], c["num_stages"]) == tile
        assert c["config"]["arch"] == c["arch"]
    per_arch = {a: sorted((c["kernel"], c["config"]["model"], c["config"]["head_dim"], c["config"]["dtype"])
                          for c in configs if c["arch"] == a)
                for a in ("sm_80", "sm_90")}
    assert per_arch["sm_80"] == per_arch["sm_90"] and len(configs) == 2 * len(per_arch["sm_80"])  # once per arch


def test_non_contiguous_table_gets_its_gradient_in_its_own_layout():
    """A lookup's offset uses the table's strides; the gradient buffer is contiguous: a transposed
    table must still receive every entry's gradient at that entry."""
    args, kwargs = _case([21, 0, 1, 9], 2, 8, 8, "silu", True, 0.0, "per_head", 17)
    table = args[7][0]
    transposed = table.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides (N*N, 1, N)
    assert not transposed.is_contiguous()
    _assert_match((*args[:7], [transposed], args[8]), kwargs)


def test_table_gradient_replicas_fit_memory_and_int32():
    assert at._table_grad_replicas([], 1000) == 1
    assert at._table_grad_replicas([129, 16383], 1000) == at.TABLE_GRAD_REPLICAS
    assert at._table_grad_replicas([129], 3) == 3  # no more copies than programs
    assert at._table_grad_replicas([at.TABLE_GRAD_BYTES // 4], 1000) == 1
    assert at._table_grad_replicas([at.TABLE_GRAD_BYTES // 16], 1000) == 4


def test_a_tile_over_shared_memory_is_shrunk_then_remembered(monkeypatch):
    """OutOfResources (raised when the compiled kernel is loaded, before it runs) retries smaller
    tiles; the one that fits is kept for later calls; none fitting is a fallback, not a crash."""
    from triton.runtime.errors import OutOfResources

    launched = []

    class FakeKernel:
        def __init__(self, limit):
            self.limit = limit

        def __getitem__(self, grid):
            def run(*args, BLOCK_M, BLOCK_N, num_stages, **meta):
                if BLOCK_M * BLOCK_N * num_stages > self.limit:
                    raise OutOfResources(BLOCK_M * BLOCK_N * num_stages, self.limit, "shared memory")
                launched.append((grid, BLOCK_M, BLOCK_N, num_stages))
            return run

    class Module:
        __name__ = "fake_module"
        fwd = FakeKernel(limit=64 * 32)
    monkeypatch.setattr(at, "launch_config", lambda *a, **k: (dict(BLOCK_M=128, BLOCK_N=64, BLOCK_DQK=64,
                                                                   BLOCK_DV=64), 8, 3))
    monkeypatch.setattr(at, "_FITTED", {})
    meta = dict(H=2, DQK=64, DV=64)
    q = torch.zeros(4, 2, 64)
    at._launch(Module, "fwd", meta, 300, 3, q)
    assert launched[-1] == ((10, 3, 2), 32, 64, 1)  # 128x64 (3 stages, then 1) and 64x64 did not fit
    launched.clear()
    at._launch(Module, "fwd", meta, 300, 3, q)
    assert launched == [((10, 3, 2), 32, 64, 1)]  # remembered: no retries
    monkeypatch.setenv("GRCOMPILE_TILES_FWD", "128,64,8,3")  # a tuning run's tile: remembered apart
    at._launch(Module, "fwd", meta, 300, 3, q)
    assert len(at._FITTED) == 2
    Module.fwd = FakeKernel(limit=1)
    monkeypatch.setattr(at, "_FITTED", {})
    with pytest.raises(at.TritonFallback, match="no tile of the fwd kernel fits"):
        at._launch(Module, "fwd", meta, 300, 3, q)


def test_out_of_range_flags_per_row_as_on_sm80(monkeypatch):
    """sm_80 keeps the out-of-range flags per query row (OOB_ROWS): same values (the error:
    test_table_index_out_of_range_raises_naming_the_score_mod[True])."""
    _flags_per_row(monkeypatch)
    _assert_match(*_case([23, 0, 1, 7], 2, 8, 8, "silu", True, 0.0, "hstu", 5))


def test_autotuned_tiles_keep_values_and_gradients(monkeypatch, tmp_path):
    """The autotuner times candidate tiles on the call itself: the result is the chosen tile's
    (the table gradients, which bwd_kv adds atomically, are zeroed after the trials, else every
    trial would add into them); a tile over shared memory is skipped; the choice is reused for the
    same length bucket, tuned again for another, and read back from the cache file by a new
    process's tuner."""
    from triton.runtime.errors import OutOfResources

    from grcompile.lowering import autotune

    small = {"fwd": [(32, 16, 4, 1), (16, 32, 4, 1)], "bwd_kv": [(16, 32, 4, 1), (32, 16, 4, 1)],
             "bwd_q": [(32, 16, 4, 1), (16, 32, 4, 1)]}
    monkeypatch.setattr(at, "TUNE_TILES", small)
    monkeypatch.setattr(at, "_tunes", lambda kernel, device: True)
    monkeypatch.setattr(autotune, "LENGTH_BUCKETS", (32, 64))  # small rows, two buckets
    timed = []

    def timer(fn):  # the last candidate is fastest, the first one does not fit
        timed.append(fn)
        if len(timed) % 3 == 1:
            raise OutOfResources(1 << 20, 1 << 17, "shared memory")
        for _ in range(2):  # run it more than once, as do_bench does
            fn()
        return 9.0 if len(timed) % 3 == 2 else 8.0
    cache = tmp_path / "tiles.json"
    monkeypatch.setattr(at, "_TUNERS", {"cpu": autotune.TileTuner(timer=timer, cache_file=cache)})
    args, kwargs = _case([23, 0, 1, 7], 2, 8, 8, "silu", True, 0.2, "hstu", 11)
    _assert_match(args, kwargs)
    tuner = at._TUNERS["cpu"]
    assert len(tuner.chosen) == 3 and len(timed) == 9, (tuner.chosen, len(timed))
    assert all(tile[0]["BLOCK_M"] == (16 if key.split("|")[1] != "bwd_kv" else 32) for key, tile in
               tuner.chosen.items()), tuner.chosen
    assert all(trials[0][1] is None for trials in tuner.timings.values())  # the table tile "did not fit"
    _assert_match(args, kwargs)
    assert len(timed) == 9  # reused
    long_args, long_kwargs = _case([40, 2], 2, 8, 8, "silu", True, 0.0, "hstu", 12)
    _assert_match(long_args, long_kwargs)  # another length bucket (and no dropout: another kernel module)
    assert len(tuner.chosen) == 6 and len(timed) == 18
    fresh = autotune.TileTuner(timer=timer, cache_file=cache)
    key = next(iter(tuner.chosen))
    assert fresh.choose(key, [], lambda tile: None) == tuner.chosen[key]
    assert autotune.TileTuner(cache_file=cache).remembered(key) == tuner.chosen[key]  # what a CUDA graph capture reads
    assert len(timed) == 18


def test_length_buckets():
    from grcompile.lowering.autotune import LENGTH_BUCKETS, length_bucket
    assert [length_bucket(n) for n in (1, 256, 257, 1024, 4096, 4097, 16384, 1 << 20)] == \
        [256, 256, 1024, 1024, 4096, 16384, 16384, LENGTH_BUCKETS[-1]]


@pytest.mark.parametrize("bias", ["none", "hstu", "mask"])
def test_softmax_backward_reads_the_forwards_statistics(monkeypatch, bias):
    """Given the forward's output and log-sum-exp, the Triton softmax backward does not rerun the
    forward, and its gradients equal the reference's."""
    args, kwargs = _case([23, 0, 1, 7], 2, 8, 8, "softmax", True, 0.2, bias, 5)
    out, lse = at.attention_triton(*args, **kwargs, with_lse=True)
    r_out, r_lse = ref._attention_reference(*args, **kwargs, with_lse=True)
    torch.testing.assert_close(out, r_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, r_lse, rtol=1e-4, atol=1e-5)
    grad = torch.randn_like(out)
    want = ref._attention_backward_reference(grad, *args, **kwargs)
    monkeypatch.setattr(at, "_forward", lambda *a, **k: pytest.fail("the backward reran the forward"))
    got = at.attention_backward_triton(grad, *args, out, lse, **kwargs)
    for a, b in zip([*got[:3], *got[4], *got[5]], [*want[:3], *want[4], *want[5]]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tiles,causal,activation,bias", [
    ((16, 16), True, "softmax", "hstu"), ((32, 16), True, "softmax", "hstu"), ((16, 32), True, "softmax", "hstu"),
    ((32, 16), True, "silu", "hstu"), ((16, 32), True, "identity", "none"), ((32, 16), False, "softmax", "hstu"),
    ((16, 32), False, "silu", "hstu"), ((32, 16), True, "softmax", "none")], ids=str)
def test_interior_blocks_run_unmasked_with_the_same_values(monkeypatch, tiles, causal, activation, bias):
    """Each kernel runs the blocks inside the row that every query may see whole without masks and
    the diagonal / last partial blocks with them: rows of many blocks (and of exactly one, two, and
    one more than a block), unequal query and key blocks, equal the reference in values and every
    gradient. (Biases that mask the future themselves, like an additive -1e9, would hide a block
    wrongly run unmasked: these do not.)"""
    bm, bn = tiles
    monkeypatch.setattr(at, "split_interior", lambda has_score_mod: True)  # also where a score_mod turns it off
    monkeypatch.setattr(at, "launch_config", lambda kernel, dqk, dv, *a, **k: (
        dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_DQK=at._pad(dqk), BLOCK_DV=at._pad(dv)), 4, 1))
    lengths = [70, 0, 1, 32, 33, 16, 17]
    _assert_match(*_case(lengths, 2, 8, 8, activation, causal, 0.25, bias, 21))


def test_a_remembered_tile_the_device_cannot_load_is_forgotten(monkeypatch):
    """A tuned tile that raises OutOfResources when loaded (a cache file from another setup) is
    dropped and the table's tile runs; variants of one module source (activation, causal, ...:
    constexprs) are tuned apart."""
    from triton.runtime.errors import OutOfResources

    from grcompile.lowering import autotune

    launched = []

    class FakeKernel:
        def __getitem__(self, grid):
            def run(*args, BLOCK_M, BLOCK_N, num_warps, num_stages, **meta):
                if BLOCK_M == 64:
                    raise OutOfResources(1 << 20, 1 << 17, "shared memory")
                launched.append((BLOCK_M, BLOCK_N))
            return run

    class Module:
        __name__ = "fake_module_remembered"
        fwd = FakeKernel()
    monkeypatch.setattr(at, "_tunes", lambda kernel, device: True)
    monkeypatch.setattr(at, "_FITTED", {})
    tuner = autotune.TileTuner(timer=lambda fn: pytest.fail("nothing is tuned: the choice is remembered"))
    monkeypatch.setattr(at, "_TUNERS", {"cpu": tuner})
    meta = dict(H=2, DQK=64, DV=64, ACT=1, CAUSAL=True, USE_QK=True, DROPOUT=False, IEEE=2, OOB_ROWS=False,
                SPLIT=False, GUARDS=0)
    key = at._tune_key(Module, "fwd", meta, torch.float32, 300)
    assert key != at._tune_key(Module, "fwd", dict(meta, ACT=2), torch.float32, 300)
    assert key != at._tune_key(Module, "fwd", dict(meta, CAUSAL=False), torch.float32, 300)
    tuner.chosen[key] = (dict(BLOCK_M=64, BLOCK_N=64, BLOCK_DQK=64, BLOCK_DV=64), 4, 3)
    at._launch(Module, "fwd", meta, 300, 3, torch.zeros(4, 2, 64))
    assert key not in tuner.chosen and launched == [(16, 16)]  # the interpreter's table tile


def test_lookups_proven_in_range_by_max_len_run_unguarded_and_longer_rows_stay_checked():
    """The relative position lookup ``k - q + N - 1`` needs no wrap or bounds check when the
    launch's max_len is at most N: the kernels run it without (GUARDS = 0), with the same values and
    gradients. With a longer max_len the guards are back and a row that indexes past the table
    raises as before."""
    args, kwargs = _case([9, 0, 1, 9, 4], 2, 8, 8, "silu", True, 0.0, "position", 3)
    _, code = at.kernels_for(at._variant(args[5], args[6], args[7], kwargs["score_mod"], "silu", True, True,
                                         False), args[5], args[6], args[7])
    assert code.guards and code.guard_bits(kwargs["max_len"], 2) == 0
    _assert_match(args, kwargs)
    longer, longer_kwargs = _case([12, 3], 2, 8, 8, "silu", True, 0.0, "none", 3)
    longer = (*longer[:7], args[7], longer[8])
    longer_kwargs["score_mod"] = kwargs["score_mod"]
    assert code.guard_bits(longer_kwargs["max_len"], 2) != 0
    with pytest.raises(ValueError, match="out of range"):
        at.attention_triton(*longer, **longer_kwargs)


def capped_position(score, q_pos, k_pos, table_0):
    return score + table_0[k_pos.clamp(max=2)]  # in [0, 2] from positions >= 0: no guard generated


def test_a_backward_called_with_positions_outside_max_len_reads_and_writes_inside_its_tables():
    """The kernels with a score_mod clamp the positions they load to [0, max_len): a lookup whose
    guard was dropped on the positions' bounds stays inside its table (and its gradient's buffer)
    even when the backward op is called directly with positions the forward would reject."""
    key = S.register_score_mod(capped_position)
    gen = torch.Generator().manual_seed(0)
    T, H, d = 4, 1, 16
    q, k, v, grad = (torch.randn(T, H, d, generator=gen) for _ in range(4))
    offsets = torch.tensor([0, T])
    table = torch.tensor([1000.0, 0.5, -0.5, 0.25])[1:]  # a view: index -1 would read the 1000
    kwargs = dict(score_mod=key, use_qk=True, activation="silu", scale=0.5, out_scale=1.0, causal=False, max_len=T,
                  dropout_p=0.0)
    _, code = at.kernels_for(at._variant([], [], [table], key, "silu", False, True, False), [], [], [table])
    assert not code.guards
    outside = at.attention_backward_triton(grad, q, k, v, offsets, torch.tensor([-1, 0, 1, 2]), [], [], [table],
                                           **kwargs)
    clamped = at.attention_backward_triton(grad, q, k, v, offsets, torch.tensor([0, 0, 1, 2]), [], [], [table],
                                           **kwargs)
    for got, want in zip(outside[:3], clamped[:3]):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(outside[5][0], clamped[5][0])


def add_with_alpha(score, q_pos, k_pos, table_0):
    return score + table_0[torch.add(k_pos, q_pos, alpha=-1) + 7]


def masked_fill_keyword(score, q_pos, k_pos, table_0):
    return score.masked_fill(k_pos > q_pos, value=-3.0) + table_0[(k_pos - q_pos).abs().clamp(max=7)]


def constant_wrapped_by_torch(score, q_pos, k_pos, table_0):
    return score + table_0[(k_pos.int() // 2147483648 + 1).long()]  # torch divides by -2**31


@pytest.mark.parametrize("fn, runs_in_kernel, reason", [
    (add_with_alpha, False, "keyword arguments"), (masked_fill_keyword, True, None),
    (constant_wrapped_by_torch, False, "wraps")])
def test_spellings_the_generator_does_not_model_run_the_reference(fn, runs_in_kernel, reason):
    key = S.register_score_mod(fn)
    args, kwargs = _case([8, 1, 0, 5], 2, 8, 8, "silu", True, 0.0, "none", 4)
    args = (*args[:7], [torch.randn(15)], args[8])
    kwargs["score_mod"] = key
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _assert_match(args, kwargs, fallback=not runs_in_kernel)
    fell_back = key in OPS["jagged_attention"].fallbacks
    assert fell_back != runs_in_kernel, caught
    if reason:
        assert reason in OPS["jagged_attention"].fallbacks[key]


# Spellings where Triton's own type promotion or scalar handling differs from torch's (a second
# review): the generator converts operands as torch promotes them. Each reads a table whose next
# element (past its end) is 1000, so an index the kernel computes differently shows.
def int_over_float64(score, q_pos, k_pos, q_side_0, k_side_0, table_0):
    return score + table_0[(k_side_0.clamp(2**25 + 1, 2**25 + 3) / q_side_0.clamp(1, 1).double()).long() - 2**25]


_NEARLY_THREE = torch.tensor(2.9999999, dtype=torch.float64)


def float64_constant(score, q_pos, k_pos, q_side_0, k_side_0, table_0):
    return score + table_0[(k_side_0.clamp(0, 1) * _NEARLY_THREE).long()]  # float64: 2, float32: 3


def floor_of_an_integer(score, q_pos, k_pos, q_side_0, k_side_0, table_0):
    return score + table_0[torch.floor(k_side_0.clamp(2**25 + 1, 2**25 + 3)) - (2**25 + 1)]


def integer_filled_with_a_float(score, q_pos, k_pos, q_side_0, k_side_0, table_0):
    filled = k_side_0.clamp(2**25 + 1, 2**25 + 3).masked_fill(q_side_0 > 5, 0.5)
    return score + table_0[(filled - 2**25).clamp(min=0)]


def int8_minus_uint8(score, q_pos, k_pos, q_side_0, k_side_0, table_0):
    return score + table_0[(q_side_0 - k_side_0 + 383).long()]  # int16 in torch, uint8 in Triton


def constants_beyond_int32(score, q_pos, k_pos, q_side_0, k_side_0, table_0):
    small = (k_side_0.clamp(0, 100).float() * 0.5).long()  # held in int32
    return score + table_0[torch.clamp(k_pos, max=2**40) % 3] + (small < 2**31).float()


@pytest.mark.parametrize("fn, q_side, k_side, size", [
    (int_over_float64, torch.ones(6, dtype=torch.int64), torch.full((6,), 2**25 + 3), 4),
    (float64_constant, torch.zeros(6, dtype=torch.int64), torch.ones(6, dtype=torch.int64), 3),
    (floor_of_an_integer, torch.zeros(6, dtype=torch.int64), torch.full((6,), 2**25 + 3), 3),
    (integer_filled_with_a_float, torch.zeros(6, dtype=torch.int64), torch.full((6,), 2**25 + 3), 4),
    (int8_minus_uint8, torch.zeros(6, dtype=torch.int8), torch.ones(6, dtype=torch.uint8), 511),
    (constants_beyond_int32, torch.zeros(6, dtype=torch.int64), torch.arange(6), 3)])
def test_operands_are_promoted_as_torch_promotes_them(fn, q_side, k_side, size):
    key = S.register_score_mod(fn)
    args, kwargs = _case([6], 1, 8, 8, "silu", False, 0.0, "none", 5)
    base = torch.zeros(size + 1)
    base[size] = 1000.0
    args = (*args[:5], [q_side], [k_side], [base[:size]], args[8])
    kwargs["score_mod"] = key
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel runs it: no fallback warning
        _assert_match(args, kwargs)
    assert key not in OPS["jagged_attention"].fallbacks


def test_the_aot_spec_keeps_every_kernel_a_process_ran_and_merges_only_identical_ones():
    from grcompile.lowering.attention_aot_spec import spec_for_seen
    key = S.register_score_mod(capped_position)
    table = (((3,), torch.float32),)

    def seen(activation, causal, max_len):
        return (key, activation, causal, True, False, torch.bfloat16, 64, 64, (), (), table, (max_len, 2), ())
    # two max_lens with the same GUARDS: one kernel, its calls summed; another activation: its own
    entries = spec_for_seen({seen("silu", False, 64): 3, seen("silu", False, 128): 2, seen("softmax", True, 64): 1},
                            archs=("sm_90",))
    fwd = [e for e in entries if e["kernel"] == "jagged_attention_fwd"]
    assert sorted((e["constexprs"]["ACT"], e["config"]["calls"]) for e in fwd) == [(1, 5), (2, 1)]


# A third review's cases: derivatives generated with the forward's promotion left over, bool sums,
# tensor clamp bounds without a gradient, a float remainder near a multiple of the divisor.
def score_times_side_with_an_unused_integer_last(score, q_pos, k_pos, k_side_0):
    value = score * k_side_0 + k_side_0 * k_side_0
    unused = q_pos * 3  # noqa: F841 - the last node generated: its int64 promotion must not leak
    return value


def mask_plus_mask(score, q_pos, k_pos, k_side_0):
    return score + ((k_side_0 > 0) + (k_side_0 > 0.5)).float()  # True + True is True in torch


def clamped_by_a_side(score, q_pos, k_pos, k_side_0):
    return torch.clamp(score, min=-k_side_0.abs(), max=k_side_0 * 2)


def remainder_near_the_divisor(score, q_pos, k_pos, k_side_0):
    return score + (q_pos - k_pos - 9) % (k_side_0.abs() + 0.9)  # fmod moved to the divisor's sign


@pytest.mark.parametrize("fn", [score_times_side_with_an_unused_integer_last, mask_plus_mask, clamped_by_a_side,
                                remainder_near_the_divisor])
def test_float_side_spellings_match_values_and_every_gradient(fn):
    key = S.register_score_mod(fn)
    args, kwargs = _case([7, 1, 0, 4], 2, 8, 8, "silu", True, 0.0, "none", 6)
    k_side = torch.tensor([0.0, 0.3, -1.0, 0.9, 2.0, -0.2, 0.7, 1.5, -3.0, 0.05, 0.6, 0.0])
    args = (*args[:6], [k_side], args[7], args[8])
    kwargs["score_mod"] = key
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_match(args, kwargs)


def gap_floor_by_two_to_31(score, q_pos, k_pos, q_side_0, k_side_0):
    return score + ((q_side_0 - k_side_0) // (2**31)).float()


def gap_trunc_by_two_to_31(score, q_pos, k_pos, q_side_0, k_side_0):
    return score + torch.div(q_side_0 - k_side_0, 2**31, rounding_mode="trunc").float()


@pytest.mark.parametrize("fn", [gap_floor_by_two_to_31, gap_trunc_by_two_to_31])
def test_integer_division_by_a_constant_beyond_int32_stays_integer(fn):
    """The constant 2**31 is generated as ``tl.full([], 2147483648, tl.int64)``; whether the
    division is an integer one comes from torch's dtype, not from the dot in that text (it was
    computed in float32: off by one quotient, found by a review)."""
    args, kwargs = _case([3, 2], 1, 8, 8, "silu", False, 0.0, "none", 0)
    i32 = (1 << 31) - 1
    q_side = [torch.tensor([0, i32, 1, i32 - 1, 0]).to(DEVICE)]
    k_side = [torch.tensor([i32, 0, i32, 2, i32 - 3]).to(DEVICE)]
    kwargs["score_mod"] = S.register_score_mod(fn)
    _assert_match((*args[:5], q_side, k_side, [], args[8]), kwargs)


DECAY = 0.1  # a module-level hyper-parameter a score_mod reads (annealed, swept)


def global_decay(score, q_pos, k_pos):
    return score - DECAY * (q_pos - k_pos).float()


def _decay_with_closure():
    slope = [0.5]  # noqa: F841 - read by closure_decay

    def closure_decay(score, q_pos, k_pos):
        return score - slope[0] * (q_pos - k_pos).float()

    def set_slope(value):
        slope[0] = value  # in place: the cell keeps the same list
    return closure_decay, set_slope


def test_a_kernel_is_regenerated_when_a_global_or_closure_the_score_mod_reads_changes(monkeypatch):
    """Tracing bakes a global's value into the kernel: with 5.0 after 0.1 the kernel kept 0.1
    (off by 1.86) while eager and the reference read 5.0."""
    closure_decay, set_slope = _decay_with_closure()
    for fn, change in ((global_decay, lambda v: monkeypatch.setattr(sys.modules[__name__], "DECAY", v)),
                       (closure_decay, set_slope)):
        key = S.register_score_mod(fn)
        for value in (0.1, 5.0):
            change(value)
            args, kwargs = _case([5, 0, 3], 2, 16, 16, "softmax", True, 0.0, "none", seed=3)
            kwargs["score_mod"] = key
            _assert_match(args, kwargs)
            want_shift = ref._attention_reference(*args, **kwargs)
        change(0.1)
        args, kwargs = _case([5, 0, 3], 2, 16, 16, "softmax", True, 0.0, "none", seed=3)
        kwargs["score_mod"] = key
        assert not torch.allclose(at.attention_triton(*args, **kwargs), want_shift)
