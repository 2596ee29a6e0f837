"""A softmax attention whose mask reads per-token data besides the padding (an extra ``keep`` /
``attention_mask`` input, HF-style additive masks): such a mask can hide every key of a valid
query, where eager's softmax spreads over all N positions (finite masks) and a fused one cannot.
The proof cannot evaluate the input, so the fused op runs behind a run-time check that every
valid query keeps its own key; a call that fails it runs as written, and the report says so.
A -inf mask with a NaN guard (eager gives 0 there too) and a SiLU attention need no check.
Values and parameter gradients equal eager (float64) on every call, checked or not."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

import grcompile
from grcompile.passes import attention_pipeline

N, D, V = 6, 8, 30


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class ExtraMask(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(V, D, padding_idx=0)
        self.qkv = nn.Linear(D, 3 * D)
        self.o = nn.Linear(D, D)

    def forward(self, ids, keep):
        n = ids.shape[1]
        valid = ids != 0
        x = self.emb(ids)
        q, k, v = self.qkv(x).chunk(3, -1)
        s = q @ k.transpose(1, 2) / math.sqrt(D)
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        if self.how == "hf_additive":  # an int attention_mask turned additive, HF style
            s = s + (1 - keep[:, None, :].to(s.dtype)) * -10000.0
            a = torch.softmax(s.masked_fill(~(causal & valid[:, None, :]), -1e9), -1)
        elif self.how == "silu":
            allowed = causal & valid[:, None, :] & keep[:, None, :].bool()
            a = torch.where(allowed, torch.nn.functional.silu(s), 0.0) / n
        else:
            allowed = causal & valid[:, None, :] & keep[:, None, :].bool()
            fill = -math.inf if self.how == "inf_nan_guard" else -1e9
            a = torch.softmax(s.masked_fill(~allowed, fill), -1)
            if self.how == "inf_nan_guard":
                a = torch.nan_to_num(a)
        return (x + self.o(a @ v)) * valid[..., None]


IDS = torch.tensor([[3, 4, 5, 0, 0, 0], [1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 0], [7, 0, 0, 0, 0, 0]])


def _keep(hide_first_keys: bool, dtype=torch.bool) -> torch.Tensor:
    keep = torch.ones(IDS.shape, dtype=dtype)
    if hide_first_keys:  # row 1: its first two queries have every key hidden
        keep[1, :2] = 0
        keep[0, 1] = 0
    return keep


def _step(model, optimized, keep, train=True):
    """One step of ``model`` and of ``optimized = (compiled, its module)``: outputs at valid
    positions and every parameter gradient equal."""
    fast, twin = optimized
    model.train(train)
    fast.train(train)
    valid = (IDS != 0)[..., None]
    outs, grads = [], []
    for m, params in ((model, model), (fast, twin)):
        params.zero_grad(set_to_none=True)
        out = m(IDS, keep)
        torch.where(valid, out, 0).square().sum().backward()
        outs.append(torch.where(valid, out, 0).detach())
        grads.append({n: p.grad for n, p in params.named_parameters()})
    torch.testing.assert_close(outs[1], outs[0])
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, msg=n)


@pytest.mark.parametrize("how", ["fill_1e9", "hf_additive"])
def test_extra_mask_runs_fused_behind_a_check(how):
    torch.manual_seed(0)
    model = ExtraMask(how).double()
    twin = copy.deepcopy(model)
    optimized = (grcompile.optimize(twin, passes=attention_pipeline()), twin)
    fast = optimized[0]
    dtype = torch.long if how == "hf_additive" else torch.bool
    _step(model, optimized, _keep(False, dtype))  # every valid query keeps its own key: fused
    report = grcompile.report(fast)
    assert report.counters.get("fuse_attention.score_mod_attention") == 1
    assert report.counters.get("fuse_attention.checked_at_run_time") == 1
    assert not report.unoptimized, report.unoptimized
    _step(model, optimized, _keep(True, dtype))  # some do not: this call runs as written
    _step(model, optimized, _keep(True, dtype), train=False)
    report = grcompile.report(fast)
    (entry,) = report.unoptimized
    assert entry["kind"] == "runtime_check" and entry["calls"] == 2 and "own key" in entry["error"], entry
    assert "keep" in entry["error"]
    _step(model, optimized, _keep(False, dtype))  # and back to the fused graph
    assert grcompile.report(fast).unoptimized[0]["calls"] == 2


@pytest.mark.parametrize("how", ["inf_nan_guard", "silu"])
def test_no_check_where_an_empty_row_agrees(how):
    torch.manual_seed(1)
    model = ExtraMask(how).double()
    twin = copy.deepcopy(model)
    optimized = (grcompile.optimize(twin, passes=attention_pipeline()), twin)
    for keep in (_keep(False), _keep(True)):
        _step(model, optimized, keep)
    report = grcompile.report(optimized[0])
    assert report.counters.get("fuse_attention.score_mod_attention") == 1
    assert "fuse_attention.checked_at_run_time" not in report.counters and not report.unoptimized


def test_strict_raises_where_the_check_fails():
    model = ExtraMask("fill_1e9").double()
    fast = grcompile.optimize(copy.deepcopy(model), passes=attention_pipeline(), strict=True)
    fast(IDS, _keep(False))
    with pytest.raises(RuntimeError, match="own key"):
        fast(IDS, _keep(True))
