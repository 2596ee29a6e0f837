"""grcompile's inductor lowering runs without inductor's own graph pattern rewrites
(grcompile/capture/lowering_config.py, docs/lowering.md), scoped to grcompile's compile.

* softmax over a non-last axis: inductor's attention patterns rewrite it into
  ``scaled_dot_product_attention`` (a last-axis softmax) and return wrong values; grcompile must not;
* the process-wide ``torch._inductor.config`` is the same before and after a grcompile compile
  (forward and the lazily compiled backward), and a plain ``torch.compile`` in the same process
  still applies inductor's attention patterns.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import grcompile


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x.view(2, x.shape[1], 2, 3).permute(0, 2, 1, 3)


def softmax_over_queries(q, k, v):  # the issue's reproduction: softmax over dim -2
    return torch.softmax(_heads(q) @ _heads(k).transpose(-1, -2), dim=-2) @ _heads(v)


def softmax_over_keys(q, k, v):  # the same with the usual last-axis softmax
    return torch.softmax(_heads(q) @ _heads(k).transpose(-1, -2), dim=-1) @ _heads(v)


def _qkv(requires_grad: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 5, 6), (2, 4, 6), (2, 4, 6)]
    return [torch.randn(s, generator=g).requires_grad_(requires_grad) for s in shapes]


def _no_compile_caches():
    """A hit in inductor's / AOTAutograd's on-disk caches would skip the pattern passes whose
    effect these tests observe."""
    return torch._inductor.config.patch(fx_graph_cache=False, autotune_local_cache=False)


def _values_and_grads(fn, inputs):
    out = fn(*inputs)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), inputs)
    return out, grads


@pytest.mark.parametrize("fn", [softmax_over_queries, softmax_over_keys])
def test_softmax_attention_exact_values_and_grads(fn) -> None:
    inputs = _qkv(requires_grad=True)
    expected, expected_grads = _values_and_grads(fn, inputs)
    optimized = grcompile.optimize(fn)
    with _no_compile_caches():
        actual, actual_grads = _values_and_grads(optimized, inputs)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(actual_grads, expected_grads)
    assert grcompile.report(optimized).lowering == "inductor"


def test_issue_reproduction_inference() -> None:
    q, k, v = _qkv()
    with _no_compile_caches():
        actual = grcompile.optimize(softmax_over_queries)(q, k, v)
    torch.testing.assert_close(actual, softmax_over_queries(q, k, v))


def test_lowering_config_is_scoped_to_grcompile() -> None:
    before = torch._inductor.config.get_config_copy()
    assert before["pattern_matcher"] is True  # the process default this test relies on
    counters.clear()
    with _no_compile_caches():
        optimized = grcompile.optimize(softmax_over_keys)
        inference = optimized(*_qkv())
        _values_and_grads(optimized, _qkv(requires_grad=True))  # training: forward + lazy backward
    assert counters["inductor"]["pattern_matcher_count"] == 0  # no inductor rewrite ran anywhere
    assert counters["inductor"]["fuse_attention"] == 0
    assert torch._inductor.config.get_config_copy() == before

    # plain torch.compile, same process, afterwards: inductor's attention rewrite still fires
    # (in torch 2.13 this spelling matches an inference-only pattern, hence no-grad inputs)
    counters.clear()
    with _no_compile_caches():
        plain = torch.compile(softmax_over_keys)(*_qkv())
    assert counters["inductor"]["fuse_attention"] >= 1
    torch.testing.assert_close(plain, inference)


def test_caches_are_keyed_by_the_op_layer() -> None:
    """A grcompile op's autograd formula is traced into the compiled backward but is in neither
    cache key: the op layer's source hash is (INDUCTOR_CONFIG's no-op pass), so an upgraded op
    misses the cache instead of getting its old backward back. The caches themselves stay on."""
    from pathlib import Path

    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    import grcompile.lowering
    from grcompile.capture.lowering_config import INDUCTOR_CONFIG

    version = INDUCTOR_CONFIG["post_grad_custom_post_pass"]
    assert isinstance(version, CustomGraphPass)  # a CustomGraphPass keeps the graph cacheable
    sources = sorted(str(p) for p in Path(grcompile.lowering.__file__).parent.rglob("*.py"))
    assert any(s.endswith("fp8/__init__.py") for s in sources) and any(s.endswith("norm/__init__.py") for s in sources)
    assert version.uuid() == get_hash_for_files(tuple(sources), extra="grcompile op layer")

    x = torch.randn(6, 8, requires_grad=True)
    counters.clear()
    for _ in range(2):  # the second compile finds the first one's graph in the (on-disk) caches
        torch._dynamo.reset()
        grcompile.optimize(lambda t: (t.sin() * 2).sum())(x).backward()
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    assert hits >= 1, dict(counters["inductor"])
