"""A ``post_grad_custom_post_pass`` the user configured still runs inside grcompile's inductor
compiles: grcompile chains its cache-keying ``OpsVersion`` after it instead of replacing it
(grcompile/capture/lowering_config.py, ``inductor_config``)."""
from __future__ import annotations

import uuid as uuid_module

import pytest
import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

import grcompile
from grcompile.capture.lowering_config import INDUCTOR_CONFIG, OpsVersion, inductor_config


class CountingPass(CustomGraphPass):
    """Counts the graphs it sees; its uuid is a fresh token (no earlier run's cache entry matches)."""

    def __init__(self) -> None:
        self.calls = 0
        self.token = uuid_module.uuid4().hex

    def __call__(self, graph: fx.Graph) -> None:
        self.calls += 1

    def uuid(self) -> str:
        return self.token


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train_step(fn) -> None:
    x = torch.randn(6, 8, requires_grad=True)
    fn(x).backward()


def _model(t: torch.Tensor) -> torch.Tensor:
    return (t.sin() * 2 + t.cos()).sum()


def test_without_a_user_pass_ops_version_alone() -> None:
    assert torch._inductor.config.post_grad_custom_post_pass is None
    assert inductor_config() == INDUCTOR_CONFIG


def test_a_user_pass_runs_first_then_ops_version() -> None:
    mine = CountingPass()
    with torch._inductor.config.patch(post_grad_custom_post_pass=mine):
        chained = inductor_config()["post_grad_custom_post_pass"]
        assert chained[0] is mine and isinstance(chained[1], OpsVersion) and len(chained) == 2
        with torch._inductor.config.patch(post_grad_custom_post_pass=chained):  # a compile nested in ours
            assert inductor_config()["post_grad_custom_post_pass"] == chained  # OpsVersion not twice


def test_a_user_pass_with_a_uuid_runs_under_optimize_and_keys_the_cache() -> None:
    mine = CountingPass()
    counters.clear()
    with torch._inductor.config.patch(post_grad_custom_post_pass=mine):
        optimized = grcompile.optimize(_model)
        _train_step(optimized)
    assert grcompile.report(optimized).lowering == "inductor"
    assert mine.calls == 2  # the forward graph and the backward graph
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0  # uuid'd passes keep the graph cacheable
    assert torch._inductor.config.post_grad_custom_post_pass is None  # the user's config is left as it was

    # same graph, same user pass: the caches answer (the pass does not run again) ...
    counters.clear()
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=mine):
        _train_step(grcompile.optimize(_model))
    assert mine.calls == 2
    assert counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"] >= 1
    # ... another uuid misses them: the user's uuid is in the key
    other = CountingPass()
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=other):
        _train_step(grcompile.optimize(_model))
    assert other.calls == 2


def test_a_user_pass_without_a_uuid_runs_and_bypasses_the_cache() -> None:
    calls = []
    counters.clear()
    with torch._inductor.config.patch(post_grad_custom_post_pass=lambda graph: calls.append(graph)):
        _train_step(grcompile.optimize(_model))
    assert len(calls) == 2
    assert counters["inductor"]["fxgraph_cache_bypass"] >= 1  # as inductor does for such a pass
