"""bf16 models through the default pipeline (issue 12, first part): with bf16 weights or under
``torch.autocast(bfloat16)``, every rewrite the float32 model gets still fires, and values and
gradients at valid positions are as close to the float32 model as the eager bf16 model's are."""
from __future__ import annotations

import contextlib
import copy
from collections import Counter

import pytest
import torch

import grcompile
from models import build_encoder
from tests.passes.test_fuse_attention import random_batch


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _rewrites(optimized) -> Counter:
    return Counter((r["pass"], r["op"]) for r in grcompile.report(optimized).rewrites)


def _run(module, ids, ts, valid, autocast: bool, params=None):
    """Masked output and the gradients of ``params`` (default: the module's) of ``sum((out * valid)²)``,
    in float32 (an optimized module trains its eager module's parameters)."""
    params = params or module
    params.zero_grad()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        out = module(ids, ts)
    masked = out.float() * valid[..., None]
    masked.square().sum().backward()
    return masked.detach(), {n: p.grad.float().clone() for n, p in params.named_parameters() if p.grad is not None}


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("mode", ["weights", "autocast"])
@pytest.mark.parametrize("model", ["hstu", "fuxi", "sasrec"])
def test_bf16_keeps_every_rewrite_and_the_eager_accuracy(model, mode):
    torch.manual_seed(0)
    enc32 = build_encoder(model, "ml1m", num_items=50, max_len=16, num_blocks=2, dropout=0.0)
    ids, ts = random_batch([0, 1, 16, 9], 16)
    valid = (ids != 0).float()
    truth, truth_grads = _run(enc32, ids, ts, valid, autocast=False)
    copy32 = copy.deepcopy(enc32)
    opt32 = grcompile.optimize(copy32, lowering="eager")
    _run(opt32, ids, ts, valid, autocast=False, params=copy32)
    expected = _rewrites(opt32)
    torch._dynamo.reset()

    enc16 = copy.deepcopy(enc32)
    if mode == "weights":
        enc16 = enc16.to(torch.bfloat16)
    eager, eager_grads = _run(enc16, ids, ts, valid, autocast=mode == "autocast")
    optimized = grcompile.optimize(enc16, lowering="eager")
    got, got_grads = _run(optimized, ids, ts, valid, autocast=mode == "autocast", params=enc16)

    assert _rewrites(optimized) == expected
    assert grcompile.report(optimized).fallbacks == []
    eager_err, got_err = _error(eager, truth), _error(got, truth)
    assert got_err <= 2 * eager_err + 1e-3, (got_err, eager_err)
    assert _error(got, eager) < 3e-2
    for name, want in truth_grads.items():
        eager_g, got_g = _error(eager_grads[name], want), _error(got_grads[name], want)
        assert got_g <= 2 * eager_g + 1e-3, (name, got_g, eager_g)
