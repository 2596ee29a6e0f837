"""optimize(remat=...): activation rematerialisation through AOTAutograd's activation memory budget
(issue 12). The saved activations shrink, values and gradients stay those of the eager model."""
from __future__ import annotations

import copy

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


def _saved_bytes_and_grads(module, params, ids, ts, valid):
    """Bytes the forward saves for the backward (every saved tensor, counted once per save), the
    masked output and the parameter gradients."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    params.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(ids, ts)
    masked = out * valid[..., None]
    masked.square().sum().backward()
    return sum(saved), masked.detach(), {n: p.grad.clone() for n, p in params.named_parameters() if p.grad is not None}


def test_remat_saves_less_and_keeps_values_and_gradients():
    torch.manual_seed(0)
    enc = build_encoder("hstu", "ml1m", num_items=50, max_len=32, num_blocks=2, dropout=0.0)
    ids, ts = random_batch([0, 1, 32, 17, 9, 32], 32)
    valid = (ids != 0).float()
    _, want, want_grads = _saved_bytes_and_grads(enc, enc, ids, ts, valid)
    results = {}
    for remat in (None, True):
        torch._dynamo.reset()
        model = copy.deepcopy(enc)
        optimized = grcompile.optimize(model, remat=remat)
        _saved_bytes_and_grads(optimized, model, ids, ts, valid)  # compiles forward and backward
        results[remat] = _saved_bytes_and_grads(optimized, model, ids, ts, valid)
        saved, out, grads = results[remat]
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        for name, g in want_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)
        report = grcompile.report(optimized)
        assert ("remat: saved activations capped at 0.4" in str(report)) == (remat is True)
        assert report.unoptimized == []
    assert results[True][0] < 0.7 * results[None][0], (results[True][0], results[None][0])


def test_remat_option_is_checked():
    with pytest.raises(ValueError, match="budget in"):
        grcompile.optimize(torch.nn.Linear(2, 2), remat=1.5)
    with pytest.raises(ValueError, match="needs lowering='inductor'"):
        grcompile.optimize(torch.nn.Linear(2, 2), remat=True, lowering="eager")
