"""Adversarial models for ``optimize(model, precision="fp8")``: each small user model below is
written to break the ``fp8_linear`` pass or its op (tied / transposed / computed / activation
weights, residuals that must not fuse, in-place adds, mutation between the ops a fusion moves
together, broadcast residuals, 1-D .. 4-D inputs, bf16 / fp16 models, NaN rows, zero-size and
all-padding batches, input gradients, graph breaks, dynamic shapes, nn.MultiheadAttention).
The contract checked each time: the optimized model equals the eager model whose converted
linears compute in emulated FP8 (``tests/fp8_emulation.py``) in values and gradients, and the
report counts what the pass converted, fused or left alone."""
from __future__ import annotations

import copy
from functools import partial
from typing import Callable, Sequence

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import grcompile
from models import build_encoder
from tests.fp8_emulation import assert_fp8_close, emulated_fp8_linears
from tests.passes.test_fuse_attention import random_batch

F32 = dict(rtol=1e-4, atol=1e-5)
HALF = dict(rtol=2e-2, atol=2e-2)  # bf16 / fp16: the fused residual skips one half-precision rounding


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _loss(out: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient differs per element (a plain sum would hide transposed gradients)."""
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(out.shape, generator=g)
    return (out.float().nan_to_num(0.0) * weights).sum()


def _run(module: nn.Module, inputs: Sequence[torch.Tensor], grads: bool, autocast: bool):
    """``(output, {name: grad} of parameters and inputs, inputs after the call)``."""
    for p in module.parameters():
        p.grad = None
    inputs = [t.detach().clone().requires_grad_(grads and t.is_floating_point() and t.requires_grad)
              for t in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(grads):
        out = module(*inputs)
    got = {}
    if grads:
        _loss(out).backward()
        got = {n.removeprefix("_orig_mod."): p.grad.float().clone() for n, p in module.named_parameters()
               if p.grad is not None}
        got.update({f"input{i}": t.grad.float().clone() for i, t in enumerate(inputs) if t.is_leaf and t.grad is not None})
    return out.detach(), got, [t.detach() for t in inputs]


def check(module: nn.Module, *inputs: torch.Tensor, tol: dict = F32, lowering: str = "eager", grads: bool = True,
          autocast: bool = False, whole_attention: bool = False, calls: Sequence[Sequence[torch.Tensor]] = (),
          **optimize_options):
    """Optimized ``module`` vs the eager one with emulated FP8 linears on ``inputs`` (then on each
    of ``calls``): outputs, parameter and input gradients (inputs marked ``requires_grad``), and
    the inputs themselves afterwards (in-place updates). Returns the optimized module."""
    twin = copy.deepcopy(module)
    optimized = grcompile.optimize(twin, lowering=lowering, precision="fp8", **optimize_options)
    for call in (inputs, *calls):
        with emulated_fp8_linears(whole_attention_modules=whole_attention):
            want, want_grads, want_inputs = _run(module, call, grads, autocast)
        got, got_grads, got_inputs = _run(optimized, call, grads, autocast)
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        assert_fp8_close(got, want, **tol, what="output")
        assert got_grads.keys() == want_grads.keys(), (sorted(got_grads), sorted(want_grads))
        for name, g in want_grads.items():
            assert_fp8_close(got_grads[name], g, **tol, what=f"gradient of {name}")
        for i, (a, b) in enumerate(zip(got_inputs, want_inputs)):
            assert_fp8_close(a, b, **tol, what=f"input {i} after the call")
    return optimized


def counters(optimized) -> dict[str, int]:
    """The fp8_linear pass's counters, without the pass prefix."""
    return {k.removeprefix("fp8_linear."): v for k, v in grcompile.report(optimized).counters.items()
            if k.startswith("fp8_linear.")}


def rand(*shape: int, grad: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(shape, generator=g).to(dtype).requires_grad_(grad)


class Lambda(nn.Module):
    """A model whose forward is ``fn(self, *inputs)``, with the named linears / parameters."""

    def __init__(self, fn: Callable, **members: nn.Module | nn.Parameter):
        super().__init__()
        torch.manual_seed(0)
        self.fn = fn
        for name, m in members.items():
            setattr(self, name, m)

    def forward(self, *inputs):
        return self.fn(self, *inputs)


def lin(k: int, n: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(k * 1000 + n)
    return nn.Linear(k, n, bias=bias)


# ---- weights -----------------------------------------------------------------------------------

def test_tied_weight_two_linears_and_an_embedding() -> None:
    """One weight read by two linears and an embedding (tied input / output embeddings)."""
    def fn(m, ids, x):
        h = m.a(x) + m.emb(ids)
        return F.linear(F.gelu(m.a(h)), m.emb.weight)  # logits over the 64 items, tied to the embedding
    model = Lambda(fn, a=lin(32, 32), emb=nn.Embedding(64, 32))
    optimized = check(model, torch.randint(0, 64, (4, 5)), rand(4, 5, 32, grad=True))
    assert counters(optimized)["fp8_linear"] == 3


def test_transposed_and_computed_weights() -> None:
    """A weight stored transposed (non-contiguous view), a masked weight, and one made contiguous
    in a column-major layout: the quantisation is per output row of whatever the linear reads."""
    def fn(m, x):
        mask = (torch.arange(32)[None, :] % 3 != 0).float()
        h = F.linear(x, m.wt.t(), m.b)                          # [K, N] stored, read as [N, K]
        h = F.linear(h, m.w * mask)                             # a computed weight
        return F.linear(h, m.w.t().contiguous().t())            # the same values, column-major
    torch.manual_seed(0)
    model = Lambda(fn, wt=nn.Parameter(torch.randn(32, 32) / 6), b=nn.Parameter(torch.randn(32)),
                   w=nn.Parameter(torch.randn(32, 32) / 6))
    optimized = check(model, rand(6, 32, grad=True))
    assert counters(optimized)["fp8_linear"] == 3


def test_weight_is_an_activation() -> None:
    """``F.linear(q, k)``: the "weight" is another input's projection (scores against candidates)."""
    def fn(m, x, cand):
        return F.linear(m.q(x), m.k(cand))  # [B, 32] x [16, 32]ᵀ
    model = Lambda(fn, q=lin(32, 32), k=lin(32, 32))
    optimized = check(model, rand(8, 32, grad=True), rand(16, 32, grad=True))
    assert counters(optimized)["fp8_linear"] == 3


def test_frozen_weight_input_gradient_only() -> None:
    """A frozen linear (``requires_grad=False``): only the input gets a gradient."""
    model = Lambda(lambda m, x: m.a(x).relu().sum(-1, keepdim=True) * x, a=lin(32, 16))
    model.a.requires_grad_(False)
    check(model, rand(5, 32, grad=True))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_models(dtype: torch.dtype, bias: bool) -> None:
    """``model.to(bf16 / fp16)``: the GEMM output, its residual and the gradients in that dtype."""
    def fn(m, x):
        return x + m.b(F.silu(m.a(F.layer_norm(x, (32,)))))
    model = Lambda(fn, a=lin(32, 64, bias), b=lin(64, 32, bias)).to(dtype)
    optimized = check(model, rand(3, 7, 32, grad=True, dtype=dtype), tol=HALF)
    assert counters(optimized) == {"fp8_linear": 2, "norm_layer": 1, "quantised_apart": 1, "residual_epilogue": 1}


def test_float64_model_is_left_alone_and_counted() -> None:
    model = Lambda(lambda m, x: m.a(x) + x, a=lin(32, 32)).double()
    optimized = check(model, rand(4, 32, grad=True, dtype=torch.float64))
    assert counters(optimized) == {"skipped_dtype": 1}


# ---- residuals and norms that must not fuse ------------------------------------------------------

def test_linear_output_used_by_the_residual_and_another_op() -> None:
    def fn(m, x, r):
        h = m.a(x)
        return (r + h) * torch.sigmoid(h)
    optimized = check(Lambda(fn, a=lin(32, 32)), rand(4, 32, grad=True), rand(4, 32, grad=True))
    assert counters(optimized) == {"fp8_linear": 1, "quantised_apart": 1}


def test_residual_is_the_linears_own_input() -> None:
    """``x + linear(x)``: x is both the GEMM's input and its epilogue's residual."""
    optimized = check(Lambda(lambda m, x: x + m.a(x), a=lin(32, 32)), rand(4, 5, 32, grad=True))
    assert counters(optimized)["residual_epilogue"] == 1


def test_sum_of_two_linears() -> None:
    """``a(x) + b(y)``: one fuses the other as its residual; neither is lost."""
    def fn(m, x, y):
        return m.a(x) + m.b(y)
    optimized = check(Lambda(fn, a=lin(32, 32), b=lin(16, 32)), rand(4, 32, grad=True), rand(4, 16, grad=True))
    assert counters(optimized) == {"fp8_linear": 2, "quantised_apart": 2, "residual_epilogue": 1}


def test_norm_used_elsewhere_is_not_fused() -> None:
    def fn(m, x, u):
        n = u * F.layer_norm(x, (32,))
        return m.a(n) + x + n.sum(-1, keepdim=True)
    optimized = check(Lambda(fn, a=lin(32, 32)), rand(4, 32, grad=True), rand(4, 32, grad=True))
    assert "norm_layer" not in counters(optimized) and counters(optimized)["quantised_apart"] == 1


def test_gated_norm_and_residual_fuse() -> None:
    """The positive case: ``x + linear(u * rms_norm(x))`` becomes one fp8_linear."""
    def fn(m, x, u):
        return x + m.a(F.rms_norm(x, (32,)) * u)
    optimized = check(Lambda(fn, a=lin(32, 32)), rand(4, 32, grad=True), rand(4, 32, grad=True))
    assert counters(optimized) == {"fp8_linear": 1, "norm_rms": 1, "residual_epilogue": 1}


@pytest.mark.parametrize("spelling", ["iadd", "add_"])
def test_in_place_residual_add(spelling: str) -> None:
    """``r += linear(h)`` / ``r.add_(linear(h))``, r an intermediate and a model input: the
    mutation stays (the input is updated as in eager)."""
    def fn(m, x, r):
        s = r * 2
        if spelling == "iadd":
            s += m.a(x)
            r += m.b(x)
        else:
            s.add_(m.a(x))
            r.add_(m.b(x))
        return s + r
    check(Lambda(fn, a=lin(32, 32), b=lin(32, 32)), rand(4, 32, grad=True), rand(4, 32), grads=False)
    model = Lambda(lambda m, x, r: r.mul(2).add_(m.a(x)), a=lin(32, 32))
    check(model, rand(4, 32, grad=True), rand(4, 32, grad=True))


@pytest.mark.parametrize("shape", [(32,), (4, 1, 32), (1, 5, 32)], ids=["[N]", "[B,1,N]", "[1,L,N]"])
def test_broadcast_residual_is_not_fused(shape: tuple[int, ...]) -> None:
    def fn(m, x, r):
        return m.a(x) + r
    optimized = check(Lambda(fn, a=lin(16, 32)), rand(4, 5, 16, grad=True), rand(*shape, grad=True))
    assert "residual_epilogue" not in counters(optimized)


WRITES = {
    "add_": lambda a: a.add_(1),
    "setitem": lambda a: a.__setitem__((slice(None), 0), 7.0),
    "relu-inplace": lambda a: F.relu(a, inplace=True),
    "out=": lambda a: torch.mul(a, 3, out=a),
}


@pytest.mark.parametrize("write", WRITES)
def test_mutation_between_linear_and_residual_add(write: str) -> None:
    """The fused GEMM runs where the add was: an in-place update of its input between the linear
    and the add must not leak into the GEMM (eager multiplied the value before the update)."""
    def fn(m, x):
        a = x * 2 - 1
        h = m.a(a)
        WRITES[write](a)
        return a + h
    optimized = check(Lambda(fn, a=lin(32, 32)), rand(4, 32), grads=False)
    assert counters(optimized) == {"fp8_linear": 1, "quantised_apart": 1}


def test_mutation_between_norm_and_linear() -> None:
    """Same for the norm fusion: the norm's input updated in place after the norm ran."""
    def fn(m, x, u):
        a = x * 2
        n = u * F.layer_norm(a, (32,))
        a.mul_(3)
        return m.a(n) * a
    optimized = check(Lambda(fn, a=lin(32, 32)), rand(4, 32), rand(4, 32), grads=False)
    assert counters(optimized) == {"fp8_linear": 1, "quantised_apart": 1}


@pytest.mark.parametrize("where", ["linear", "norm"])
def test_no_grad_block_is_not_fused_across(where: str) -> None:
    """A linear (or norm) under ``torch.no_grad()`` (a frozen teacher, a target network) and its
    residual add (or linear) outside: the fused op would run with gradients on and train the
    frozen path."""
    def fn(m, x, r):
        with torch.no_grad():
            t = m.a(x) if where == "linear" else F.layer_norm(x, (32,))
        return r + t if where == "linear" else m.a(t) * r
    optimized = check(Lambda(fn, a=lin(32, 32)), rand(4, 32, grad=True), rand(4, 32, grad=True))
    assert counters(optimized) == {"fp8_linear": 1, "quantised_apart": 1}


def test_writes_elsewhere_after_the_add_keep_the_fusions() -> None:
    """The guard above looks only between the ops a fusion joins: a write after them keeps both."""
    def fn(m, x, u):
        a = x * 2
        y = a + m.a(u * F.layer_norm(a, (32,)))
        a.mul_(3)
        return y * a
    optimized = check(Lambda(fn, a=lin(32, 32)), rand(4, 32), rand(4, 32), grads=False)
    assert counters(optimized) == {"fp8_linear": 1, "norm_layer": 1, "residual_epilogue": 1}


# ---- shapes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dims", [(32,), (6, 32), (2, 3, 32), (2, 3, 4, 32)], ids=["1d", "2d", "3d", "4d"])
def test_input_ranks(dims: tuple[int, ...]) -> None:
    def fn(m, x):
        return x + m.b(F.relu(m.a(x)))
    optimized = check(Lambda(fn, a=lin(32, 48), b=lin(48, 32, bias=False)), rand(*dims, grad=True))
    assert counters(optimized)["fp8_linear"] == 2


def test_non_contiguous_input() -> None:
    """Transposed and strided inputs (the GEMM reads rows of whatever layout it is given)."""
    model = Lambda(lambda m, x: m.a(x.transpose(1, 2)) + m.b(x[..., ::2]), a=lin(32, 32), b=lin(16, 32))
    check(model, rand(3, 32, 32, grad=True))


def test_dynamic_shapes_second_call() -> None:
    """New batch size and length on later calls (recompiles as dynamic shapes)."""
    def fn(m, x):
        return x + m.a(F.layer_norm(x, (32,)))
    model = Lambda(fn, a=lin(32, 32))
    optimized = check(model, rand(2, 5, 32, grad=True),
                      calls=[(rand(3, 9, 32, grad=True),), (rand(5, 2, 32, grad=True),), (rand(1, 1, 32, grad=True),)])
    assert counters(optimized)["residual_epilogue"] >= 2


def test_dynamic_true() -> None:
    model = Lambda(lambda m, x: x + m.a(x), a=lin(32, 32))
    check(model, rand(2, 5, 32, grad=True), calls=[(rand(4, 3, 32, grad=True),)], dynamic=True)


def test_zero_rows() -> None:
    """A dense batch of zero rows, first and between others (grcompile runs zero-size inputs'
    frames eagerly; the jagged zero-row GEMM is in the HSTU all-padding test)."""
    model = Lambda(lambda m, x: x + m.a(x), a=lin(32, 32))
    check(model, rand(0, 32, grad=True), calls=[(rand(3, 32, grad=True),), (rand(0, 32, grad=True),),
                                                (rand(5, 32, grad=True),)])


# ---- values ------------------------------------------------------------------------------------

def test_nan_row_stays_nan_and_other_rows_are_unaffected() -> None:
    """Row-wise scales: a NaN (or inf) in one row poisons that row only — and is not hidden."""
    model = Lambda(lambda m, x: m.a(x) + x, a=lin(32, 32))
    x = rand(4, 32)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    optimized = check(model, x, grads=False)
    out = optimized(x)
    assert out[1].isnan().all() and out[2].isnan().any() and torch.isfinite(out[[0, 3]]).all()


def test_zero_and_huge_rows() -> None:
    """An all-zero row (AMAX_FLOOR), tiny and huge magnitudes (scale per row, no overflow)."""
    model = Lambda(lambda m, x: m.b(m.a(x)), a=lin(32, 32), b=lin(32, 16, bias=False))
    x = rand(5, 32)
    x[0] = 0
    x[1] *= 1e-30
    x[2] *= 1e30
    check(model, x, tol=dict(rtol=1e-4, atol=1e-5))


def test_eval_under_no_grad_and_train_again() -> None:
    def fn(m, x):
        return x + m.a(F.dropout(F.layer_norm(x, (32,)), 0.0, m.training))
    model = Lambda(fn, a=lin(32, 32))
    optimized = check(model, rand(4, 32, grad=True))
    model.eval()
    optimized.eval()
    with torch.no_grad(), emulated_fp8_linears():
        want = model(rand(4, 32))
    with torch.no_grad():
        got = optimized(rand(4, 32))
    assert_fp8_close(got, want, **F32, what="no_grad eval output")
    model.train()
    optimized.train()
    check(model, rand(4, 32, grad=True))


def test_bf16_autocast_fp32_residual_stream() -> None:
    """bf16 autocast over a float32 residual stream, one block: the fused residual skips eager's
    bf16 rounding of the linear's output, within HALF."""
    def fn(m, x):
        return x + m.a(F.layer_norm(x, (32,)))
    optimized = check(Lambda(fn, a=lin(32, 32)), rand(3, 5, 32, grad=True), autocast=True, tol=HALF)
    assert counters(optimized)["residual_epilogue"] == 1


def test_bf16_autocast_residual_stream_feeding_another_fp8_linear() -> None:
    """The fused residual add rounds the GEMM result to the linear's bf16 first, as eager does: a
    later FP8 linear quantising that stream then sees eager's values (summing the unrounded result
    turned the difference into e4m3 flips: 9 % of b.weight's gradient off, up to 5 % of its max)."""
    def fn(m, x):
        h = x + m.a(F.layer_norm(x, (32,)))
        return h + m.b(F.gelu(m.c(h)))
    model = Lambda(fn, a=lin(32, 32), b=lin(64, 32), c=lin(32, 64))
    check(model, rand(3, 5, 32, grad=True), autocast=True, tol=HALF)


# ---- graph structure -------------------------------------------------------------------------

def test_linear_across_a_graph_break() -> None:
    def fn(m, x):
        h = m.a(x)
        torch._dynamo.graph_break()
        return h + m.b(h)
    optimized = check(Lambda(fn, a=lin(32, 32), b=lin(32, 32)), rand(4, 32, grad=True))
    assert counters(optimized)["fp8_linear"] == 2


@pytest.mark.parametrize("lowering", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_linears_inside_activation_checkpoint(lowering: str) -> None:
    """``torch.utils.checkpoint``: Dynamo keeps the body as a subgraph of a higher-order op; its
    linears (and a nested checkpoint's) are FP8 too, in the forward and the recomputation."""
    def fn(m, x):
        inner = partial(checkpoint, m.c, use_reentrant=False)
        return x + checkpoint(lambda t: m.b(F.gelu(inner(m.a(t)))), x, use_reentrant=False)
    model = Lambda(fn, a=lin(32, 64), b=lin(64, 32), c=lin(64, 64))
    optimized = check(model, rand(2, 5, 32, grad=True), lowering=lowering)
    assert counters(optimized)["fp8_linear"] == 3


def test_linears_inside_torch_cond_branches() -> None:
    def fn(m, x):
        return torch.cond(x.sum() > 0, lambda t: m.a(t) + t, lambda t: m.b(t), (x,))
    model = Lambda(fn, a=lin(32, 32), b=lin(32, 32))
    x = rand(4, 32)
    optimized = check(model, x.abs().requires_grad_(), calls=[(-x.abs().requires_grad_(),)])
    assert counters(optimized)["fp8_linear"] == 2


@pytest.mark.parametrize("spelling, fused", [("torch.add", True), ("method", True), ("alpha", False),
                                             ("sub", False)])
def test_residual_add_spellings(spelling: str, fused: bool) -> None:
    """``torch.add(y, r)`` and ``r.add(y)`` fuse; ``alpha=`` and subtraction are not residuals."""
    adds = {"torch.add": lambda y, r: torch.add(y, r), "method": lambda y, r: r.add(y),
            "alpha": lambda y, r: torch.add(r, y, alpha=0.5), "sub": lambda y, r: r - y}
    model = Lambda(lambda m, x: adds[spelling](m.a(x), x), a=lin(32, 32))
    optimized = check(model, rand(4, 32, grad=True))
    assert ("residual_epilogue" in counters(optimized)) == fused


def test_multihead_attention_module() -> None:
    """nn.MultiheadAttention: fused (its projections become FP8 linears) or left whole (reported)."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 2, batch_first=True)

    def fn(m, x):
        return x + m.out(m.mha(x, x, x, need_weights=False)[0])
    model = Lambda(fn, mha=mha, out=lin(32, 32))
    twin = copy.deepcopy(model)
    probe = grcompile.optimize(twin, lowering="eager", precision="fp8")
    probe(rand(2, 6, 32))
    whole = "skipped_whole_attention_module" in counters(probe)
    torch._dynamo.reset()
    optimized = check(model, rand(2, 6, 32, grad=True), whole_attention=whole)
    if whole:
        assert any("projections stay" in f["reason"] for f in grcompile.report(optimized).fallbacks)


def test_hstu_all_padding_and_short_rows() -> None:
    """The jagged HSTU on batches with empty (0) and length-1 users, then an all-padding batch."""
    torch.manual_seed(0)
    enc = build_encoder("hstu", "ml1m", num_items=50, max_len=16, dropout=0.0, embedding_dim=64, linear_dim=32,
                        attention_dim=32, num_heads=2, num_blocks=1)
    ids, ts = random_batch([0, 1, 16, 1], 16)
    empty_ids, empty_ts = random_batch([0, 0], 16)
    optimized = check(enc, ids, ts, calls=[(empty_ids, empty_ts)])
    assert counters(optimized)["fp8_linear"] >= 2


@pytest.mark.slow
def test_inductor_lowering_adversarial_mix() -> None:
    """Several of the cases above in one model under the default (inductor) lowering."""
    def fn(m, x, r):
        h = x + m.a(F.rms_norm(x, (32,)))          # norm + residual fused
        t = F.linear(h, m.a.weight.t())            # tied, transposed
        r += m.b(t)                                # in-place residual
        return r + t * torch.sigmoid(m.b(h))       # linear output used twice
    model = Lambda(fn, a=lin(32, 32), b=lin(32, 32))
    check(model, rand(3, 5, 32, grad=True), rand(3, 5, 32), lowering="inductor",
          calls=[(rand(2, 7, 32, grad=True), rand(2, 7, 32))])


def test_inductor_lowering_residual_and_broadcast() -> None:
    def fn(m, x):
        return x + m.a(F.layer_norm(x, (32,))) + m.bias
    model = Lambda(fn, a=lin(32, 32), bias=nn.Parameter(torch.randn(32)))
    check(model, rand(4, 32, grad=True), lowering="inductor")
