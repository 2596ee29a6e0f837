"""The failure policy: code eager runs but Dynamo cannot trace, a graph the lowering cannot
compile, and Dynamo's recompile limit. By default the model still runs (the user's code or the
captured graph, exactly), with an UnoptimizedWarning and a report().unoptimized entry naming the
error and the user's line; strict=True raises instead."""
from __future__ import annotations

import contextlib
import copy
import warnings

import numpy as np
import pytest
import torch
import torch.fx as fx

import grcompile
from grcompile import GraphPass, PassContext, UnoptimizedWarning


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class NumpyIndex(torch.nn.Module):
    """Eager runs it; Dynamo's fake tensors reject torch.LongTensor(int32 array)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = torch.LongTensor(np.array([1, 2, 3], dtype=np.int32))  # the untraceable line
        return self.emb(idx).sum(0) * x


def test_untraceable_frame_runs_eagerly_with_warning_and_report():
    torch.manual_seed(0)
    eager = NumpyIndex()
    model = copy.deepcopy(eager)
    fast = grcompile.optimize(model)
    x = torch.randn(4, requires_grad=True)
    with pytest.warns(UnoptimizedWarning, match=r"TorchRuntimeError.*test_failure_policy\.py:\d+ in forward"):
        out = fast(x)
    expected = eager(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(model.emb.weight.grad, eager.emb.weight.grad)

    report = grcompile.report(fast)
    [entry] = report.unoptimized
    assert entry["kind"] == "trace_error" and entry["graph"] is None
    assert entry["error"].startswith("TorchRuntimeError: ") and "LongTensor" in entry["error"]
    line = NumpyIndex.forward.__code__.co_firstlineno + 1
    assert entry["site"] == f"test_failure_policy.py:{line} in forward"
    assert "eagerly" in entry["ran"]
    assert "1 unoptimized" in str(report) and f"test_failure_policy.py:{line}" in str(report)
    assert '"unoptimized"' in report.to_json()
    # the frame stays eager on later calls, without a second warning or entry
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnoptimizedWarning)
        torch.testing.assert_close(fast(x), eager(x))
    assert len(grcompile.report(fast).unoptimized) == 1


def test_untraceable_frame_strict_raises():
    fast = grcompile.optimize(NumpyIndex(), strict=True)
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match="LongTensor"):
        fast(torch.randn(4))


class NumpyIndexToo(NumpyIndex):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # its own code object, not marked by Dynamo
        idx = torch.LongTensor(np.array([1, 2, 3], dtype=np.int32))
        return self.emb(idx).sum(0) * x


def test_suppression_is_scoped_to_the_optimized_model():
    fast = grcompile.optimize(NumpyIndex())
    with pytest.warns(UnoptimizedWarning):
        fast(torch.randn(4))
    assert torch._dynamo.config.suppress_errors is False
    plain = torch.compile(NumpyIndexToo(), backend="eager")
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError):
        plain(torch.randn(4))


def test_code_skipped_by_dynamo_is_reported_as_no_graph():
    """Dynamo marks a failed frame's code to run eagerly for the whole process: a second model of
    the same class never reaches the backend. That is reported, not passed off as optimized."""
    with pytest.warns(UnoptimizedWarning):
        grcompile.optimize(NumpyIndex())(torch.randn(4))
    second = grcompile.optimize(NumpyIndex())
    with pytest.warns(UnoptimizedWarning, match="no graph"):
        second(torch.randn(4))
    [entry] = grcompile.report(second).unoptimized
    assert entry["kind"] == "no_graph" and entry["frame"].startswith("NumpyIndex.forward (test_failure_policy.py:")
    with pytest.raises(RuntimeError, match="strict.*no graph"):
        grcompile.optimize(NumpyIndex(), strict=True)(torch.randn(4))


class SkippedAtGraphBreak(torch.nn.Module):
    """A graph break inside a context manager Dynamo cannot resume from: the frame is skipped
    (a soft failure Dynamo logs at INFO only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with contextlib.suppress(ValueError):
            x = x + 1
            torch._dynamo.graph_break()
        return x * 2


def test_frame_skipped_at_graph_break_is_reported():
    fast = grcompile.optimize(SkippedAtGraphBreak(), lowering="eager")
    x = torch.randn(5)
    with pytest.warns(UnoptimizedWarning, match="cannot resume from.*graph_break"):
        torch.testing.assert_close(fast(x), (x + 1) * 2)
    [entry] = grcompile.report(fast).unoptimized
    assert entry["kind"] == "trace_error" and "context manager" in entry["error"]
    assert entry["frame"].startswith("SkippedAtGraphBreak.forward (test_failure_policy.py:")


# --- lowering failures ------------------------------------------------------------------------

_FAKE_FAILS = {"on": False}


@torch.library.custom_op("grcompile_test::fragile", mutates_args=())
def fragile(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@fragile.register_fake
def _(x):
    if _FAKE_FAILS["on"]:
        raise RuntimeError("simulated lowering failure")
    return torch.empty_like(x)


fragile.register_autograd(lambda ctx, grad: grad * 2)


@torch.library.custom_op("grcompile_test::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@no_fake.register_fake
def _(x):
    raise RuntimeError("simulated: this op cannot be lowered")


class Small(torch.nn.Module):
    def __init__(self, use_fragile: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.use_fragile = use_fragile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x))
        if self.use_fragile:
            h = torch.ops.grcompile_test.fragile(h)
        return h.sum(-1)


class InsertUnlowerable(GraphPass):
    """Test pass: wraps the relu in an op that eager runs and inductor cannot trace."""

    name = "insert_unlowerable"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
        with gm.graph.inserting_after(relu):
            wrapped = gm.graph.call_function(torch.ops.grcompile_test.no_fake.default, (relu,))
        relu.replace_all_uses_with(wrapped, delete_user_cb=lambda u: u is not wrapped)
        ctx.rewrite("no_fake", relu)


class BreakFakes(GraphPass):
    """Test pass: from now on the user's op cannot be traced by the lowering (graph unchanged)."""

    name = "break_fakes"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        _FAKE_FAILS["on"] = True


def _check_same(model: torch.nn.Module, fast: torch.nn.Module, eager: torch.nn.Module) -> None:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    out, expected = fast(x), eager(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(model.lin.weight.grad, eager.lin.weight.grad)


def test_transformed_graph_fails_to_lower_captured_graph_is_lowered():
    torch.manual_seed(0)
    eager = Small()
    model = copy.deepcopy(eager)
    fast = grcompile.optimize(model, passes=[InsertUnlowerable()])
    with pytest.warns(UnoptimizedWarning, match="cannot be lowered"):
        _check_same(model, fast, eager)
    [entry] = grcompile.report(fast).unoptimized
    assert entry["kind"] == "lowering_error" and entry["graph"] == 0
    assert "RuntimeError: simulated: this op cannot be lowered" in entry["error"]
    assert entry["site"].startswith("test_failure_policy.py:") and entry["site"].endswith("in forward")
    assert entry["ran"] == "the captured graph without grcompile's passes, lowered by inductor"


def test_captured_graph_fails_too_runs_eagerly():
    torch.manual_seed(0)
    eager = Small(use_fragile=True)
    model = copy.deepcopy(eager)
    fast = grcompile.optimize(model, passes=[BreakFakes()])
    try:
        with pytest.warns(UnoptimizedWarning, match="simulated lowering failure"):
            _check_same(model, fast, eager)
    finally:
        _FAKE_FAILS["on"] = False
    [entry] = grcompile.report(fast).unoptimized
    assert entry["kind"] == "lowering_error"
    assert entry["ran"].startswith("the captured graph, eagerly (inductor failed on it too: ")


def test_lowering_failure_strict_raises():
    fast = grcompile.optimize(Small(), passes=[InsertUnlowerable()], strict=True)
    with pytest.raises(Exception, match="cannot be lowered"):
        fast(torch.randn(3, 8))


# --- the recompile limit ----------------------------------------------------------------------

class Scaled(Small):
    """Dynamo specialises on the Python int: each new ``k`` is a recompile (whatever the shape
    policy does with tensor axes)."""

    def forward(self, x: torch.Tensor, k: int) -> torch.Tensor:
        return super().forward(x) * k


def test_recompile_limit_is_reported_with_the_shapes_that_ran_eagerly():
    torch.manual_seed(0)
    eager = Scaled()
    fast = grcompile.optimize(copy.deepcopy(eager), lowering="eager", dynamic=False)
    x = torch.randn(3, 8)
    with torch._dynamo.config.patch(recompile_limit=2):
        for k in (1, 2):
            torch.testing.assert_close(fast(x, k), eager(x, k))
        assert grcompile.report(fast).unoptimized == []
        with pytest.warns(UnoptimizedWarning, match="recompile_limit"):
            torch.testing.assert_close(fast(x, 3), eager(x, 3))
        for k in (4, 4, 1):  # two more calls past the limit, one signature compiled before it
            torch.testing.assert_close(fast(x, k), eager(x, k))
    report = grcompile.report(fast)
    assert report.compiles == 2
    [entry] = report.unoptimized
    assert entry["kind"] == "recompile_limit" and entry["calls"] == 3 and entry["shapes"] == 2
    assert "3 call(s) with 2 new input shape(s)" in str(report) and "recompile_limit (2)" in str(report)


def test_recompile_limit_strict_raises():
    fast = grcompile.optimize(Scaled(), lowering="eager", dynamic=False, strict=True)
    with torch._dynamo.config.patch(recompile_limit=1):
        fast(torch.ones(2, 8), 1)
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            fast(torch.ones(2, 8), 2)


# --- graph breaks Dynamo does not count ------------------------------------------------------

class BranchOnRows(torch.nn.Module):
    """Data-dependent branching, then an explicit break: Dynamo's counters["graph_break"] holds
    only the second one (torch 2.13)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids * 2
        if (ids != 0).nonzero().shape[0] > 3:  # the first break
            x = x * 2
        y = x + 1
        torch._dynamo.graph_break()
        return (y * 3).reshape(-1)


def test_every_graph_break_is_counted_with_the_users_line():
    fast = grcompile.optimize(BranchOnRows(), lowering="eager")
    ids = torch.tensor([[1, 2, 0], [3, 4, 5]])
    torch.testing.assert_close(fast(ids), BranchOnRows()(ids))
    report = grcompile.report(fast)
    assert report.graph_breaks == 2, str(report)
    sites = sorted(r.split(":")[1].split(" ")[0] for r in report.graph_break_reasons)
    line = BranchOnRows.forward.__code__.co_firstlineno
    assert sites == [str(line + 2), str(line + 5)], report.graph_break_reasons
    assert all(r.startswith("test_failure_policy.py:") and " in forward: " in r for r in report.graph_break_reasons)
    assert "2 graph break(s)" in str(report) and "data-dependent" in str(report)


class AttentionThenBreak(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(31, 16, padding_idx=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, N = ids.shape
        x = self.emb(ids).view(B, N, 2, 8).transpose(1, 2)
        mask = torch.ones(N, N, dtype=torch.bool).tril() & (ids != 0)[:, None, None, :]
        a = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
        torch._dynamo.graph_break()
        return a.transpose(1, 2).reshape(B, N, 16)


def test_attention_kept_dense_before_a_graph_break_names_the_break():
    fast = grcompile.optimize(AttentionThenBreak(), lowering="eager")
    fast(torch.tensor([[1, 2, 0, 0], [3, 4, 5, 6]]))
    report = grcompile.report(fast)
    [why] = [f["reason"] for f in report.fallbacks if f["pass"] == "fuse_attention"]
    line = AttentionThenBreak.forward.__code__.co_firstlineno + 5
    assert f"after a graph break (the break at test_failure_policy.py:{line} in forward: " in why, why
    assert report.graph_breaks == 1, str(report)
