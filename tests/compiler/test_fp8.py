"""``optimize(model, precision="fp8")``: every aligned linear becomes an FP8 GEMM, fused with the
norm before it and the residual after it, and the optimized model computes *the user's model with
FP8 linears* — checked against the eager model whose ``F.linear`` is replaced by the same row-wise
FP8 math (straight-through backward) — in float32 and under bf16 autocast, train and eval."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

import grcompile
from grcompile.lowering import OPS, use_backend
from models import build_encoder
from tests.fp8_emulation import assert_fp8_close, emulated_fp8_linears
from tests.passes.test_fuse_attention import random_batch

FP8_DIMS = dict(embedding_dim=64, linear_dim=32, attention_dim=32, num_heads=2, num_blocks=2)


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(module, ids, ts, valid, autocast: bool, params):
    params.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(ids, ts)
    masked = out.float() * valid[..., None]
    masked.square().sum().backward()
    return masked.detach(), {n: p.grad.float().clone() for n, p in params.named_parameters() if p.grad is not None}


def _fp8_rewrites(optimized, graph: int = 0) -> list[tuple]:
    """``(site, norm, residual)`` of the fp8_linear rewrites in compiled graph ``graph``."""
    return sorted((r["site"], r["norm"], r["residual"]) for r in grcompile.report(optimized).rewrites
                  if r["pass"] == "fp8_linear" and r["graph"] == graph)


def _model_and_batch(model: str):
    """``(eager encoder, its twin to optimize, (ids, timestamps, valid))``: lengths 0, 1, full, 9."""
    torch.manual_seed(0)
    enc = build_encoder(model, "ml1m", num_items=50, max_len=16, dropout=0.0, **FP8_DIMS)
    ids, ts = random_batch([0, 1, 16, 9], 16)
    return enc, copy.deepcopy(enc), (ids, ts, (ids != 0).float())


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("model", ["hstu", "fuxi"])
def test_fp8_model_equals_the_model_with_fp8_linears(model: str, autocast: bool) -> None:
    enc, twin, (ids, ts, valid) = _model_and_batch(model)
    optimized = grcompile.optimize(twin, lowering="eager", precision="fp8")
    for mode in ("train", "eval", "train"):  # one optimized module through train -> eval -> train
        twin.train(mode == "train")
        enc.train(mode == "train")
        with emulated_fp8_linears():
            want, want_grads = _run(enc, ids, ts, valid, autocast, enc)
        got, got_grads = _run(optimized, ids, ts, valid, autocast, twin)
        # float32: only summation order differs; bf16: the fused residual skips one bf16 rounding
        tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
        assert_fp8_close(got, want, **tol, what=f"{mode} output")
        for name, g in want_grads.items():
            assert_fp8_close(got_grads[name], g, **tol, what=f"{mode} gradient of {name}")
    rewrites = _fp8_rewrites(optimized)
    fused_norms = [r for r in rewrites if r[1] != "none"]
    assert len(rewrites) >= 2 * FP8_DIMS["num_blocks"] and len(fused_norms) >= 2 * FP8_DIMS["num_blocks"], rewrites
    assert sum(r[2] for r in rewrites) == FP8_DIMS["num_blocks"], rewrites  # the output projection's residual
    assert all(site.startswith(f"{model}.py:") for site, *_ in rewrites)
    assert grcompile.report(optimized).fallbacks == []


def test_training_dropout_between_norm_and_gemm_quantises_apart() -> None:
    """A training-mode dropout after the gated norm keeps its place (and its random stream): the
    GEMM quantises the dropout's output; in eval mode the norm is fused again."""
    torch.manual_seed(0)
    enc = build_encoder("hstu", "ml1m", num_items=50, max_len=16, dropout=0.3, **FP8_DIMS)
    ids, ts = random_batch([0, 3, 16, 9], 16)
    optimized = grcompile.optimize(enc, lowering="eager", precision="fp8")
    optimized(ids, ts).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in enc.parameters() if p.grad is not None)
    trained = _fp8_rewrites(optimized)
    assert [r[1] for r in trained if r[2]] == ["none"] * FP8_DIMS["num_blocks"]
    torch._dynamo.reset()
    optimized = grcompile.optimize(enc.eval(), lowering="eager", precision="fp8")
    optimized(ids, ts)
    assert [r[1] for r in _fp8_rewrites(optimized) if r[2]] == ["layer"] * FP8_DIMS["num_blocks"]


class _Unaligned(nn.Module):
    def __init__(self):
        super().__init__()
        self.aligned, self.unaligned = nn.Linear(32, 16), nn.Linear(16, 10)

    def forward(self, x):
        return self.unaligned(self.aligned(x))


def test_unaligned_linear_stays_and_says_why() -> None:
    module = _Unaligned()
    x = torch.randn(3, 32)
    optimized = grcompile.optimize(module, lowering="eager", precision="fp8")
    out = optimized(x)
    with emulated_fp8_linears():
        first = module.aligned(x)
    assert_fp8_close(out, module.unaligned(first), rtol=1e-5, atol=1e-6)
    report = grcompile.report(optimized)
    fp8 = [f for f in report.fallbacks if f["pass"] == "fp8_linear"]
    assert len(fp8) == 1 and fp8[0]["site"].startswith("test_fp8.py:")
    assert "multiples of 16 (weight is [10, 16])" in fp8[0]["reason"]
    assert [r["norm"] for r in report.rewrites if r["pass"] == "fp8_linear"] == ["none"]


def test_precision_option_is_checked() -> None:
    with pytest.raises(ValueError, match="torch.autocast"):
        grcompile.optimize(nn.Linear(16, 16), precision="bf16")
    with pytest.raises(ValueError, match="precision must be one of"):
        grcompile.optimize(nn.Linear(16, 16), precision="int4")


def test_fp8_under_inductor_matches_eager_lowering() -> None:
    a, b, (ids, ts, valid) = _model_and_batch("hstu")
    want, want_grads = _run(grcompile.optimize(a, lowering="eager", precision="fp8"), ids, ts, valid, False, a)
    torch._dynamo.reset()
    got, got_grads = _run(grcompile.optimize(b, precision="fp8"), ids, ts, valid, False, b)
    assert_fp8_close(got, want, rtol=1e-4, atol=1e-5, what="output")
    for name, g in want_grads.items():
        assert_fp8_close(got_grads[name], g, rtol=1e-4, atol=1e-5, what=f"gradient of {name}")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1 set before Triton is imported")
def test_fp8_model_with_the_triton_kernels_equals_the_model_with_fp8_linears() -> None:
    """The whole model through the Triton kernels (norm_quant_fp8, scaled_linear_fp8, in Triton's
    interpreter) on jagged values, forward and backward."""
    enc, twin, (ids, ts, valid) = _model_and_batch("hstu")
    with emulated_fp8_linears():
        want, want_grads = _run(enc, ids, ts, valid, False, enc)
    optimized = grcompile.optimize(twin, lowering="eager", precision="fp8")
    before = {name: dict(OPS[name].calls) for name in ("norm_quant_fp8", "scaled_linear_fp8")}
    with use_backend("triton"):
        got, got_grads = _run(optimized, ids, ts, valid, False, twin)
    for name, calls in before.items():
        assert OPS[name].calls["triton"] > calls.get("triton", 0), f"{name} did not run its Triton kernel"
    assert_fp8_close(got, want, rtol=1e-4, atol=1e-5, what="output")
    for name, g in want_grads.items():
        assert_fp8_close(got_grads[name], g, rtol=1e-4, atol=1e-5, what=f"gradient of {name}")


def test_fp8_filter_picks_layers_by_module_path() -> None:
    """``fp8_filter(path)``: the blocks' output projections stay in the model's precision (counted),
    the input projections go FP8; the optimized model equals the eager one with exactly those
    linears in emulated FP8 — paths survive the jagged rewrite."""
    enc, twin, (ids, ts, valid) = _model_and_batch("hstu")
    seen: list[str] = []

    def keep_output_projections(path: str) -> bool:
        seen.append(path)
        return not path.endswith("output")

    optimized = grcompile.optimize(twin, lowering="eager", precision="fp8", fp8_filter=keep_output_projections)
    got, got_grads = _run(optimized, ids, ts, valid, False, twin)
    assert sorted(set(seen)) == [f"blocks.{i}.{name}" for i in range(2) for name in ("output", "uvqk")]
    assert [r[0].split(" ")[0] for r in _fp8_rewrites(optimized)] == ["hstu.py:28"] * 2
    assert grcompile.report(optimized).counters["fp8_linear.skipped_filtered"] == 2
    uvqk = {id(block.uvqk.weight) for block in enc.blocks}
    with emulated_fp8_linears(only=lambda weight: id(weight) in uvqk):
        want, want_grads = _run(enc, ids, ts, valid, False, enc)
    assert_fp8_close(got, want, rtol=1e-4, atol=1e-5, what="output")
    for name, g in want_grads.items():
        assert_fp8_close(got_grads[name], g, rtol=1e-4, atol=1e-5, what=f"gradient of {name}")
    with pytest.raises(ValueError, match="fp8_filter"):
        grcompile.optimize(nn.Linear(16, 16), fp8_filter=keep_output_projections)
