"""Calls of an optimized model add nothing to the thread's ``contextvars.Context``.

torch's ``config.patch(...)`` (torch/utils/_config_module.py, ``ConfigPatch``) makes a fresh
``ContextVar`` per patch object and leaves it set in the caller's context on exit (it ``set``s the
old stack back instead of ``reset``-ting its token). A patch built per call therefore leaks one
context entry per call, forever: grcompile did that once per model call (capture/shapes.py) and
once per attention chunk call (lowering/attention/chunks.py), ~10 entries a training step of the
bench's HSTU. The fix builds each patch once and reuses it (a ``ConfigPatch`` is re-entrant).
These tests count the context's entries over many calls: the count must not move.
"""
from __future__ import annotations

import contextvars

import pytest
import torch

import grcompile
from models import SampledSoftmaxRetrieval, build_encoder
from tests.compiler.test_dynamic_shapes import ITEMS, MAX_LEN, TINY, retrieval_batch


def context_entries() -> int:
    return len(contextvars.copy_context())


def test_attention_chunk_calls_leave_the_context_unchanged():
    from grcompile.lowering.attention.chunks import _CompiledChunk

    chunk = _CompiledChunk(lambda inductor_options: (lambda x: x + 1), lambda x: x + 1, key=("test",))
    chunk(torch.zeros(1))
    before = context_entries()
    for _ in range(50):
        chunk(torch.zeros(1))
    assert context_entries() == before


@pytest.fixture
def _eager_chunks(monkeypatch):
    torch._dynamo.reset()
    from grcompile.lowering.attention import chunks

    monkeypatch.setattr(chunks, "COMPILE_CHUNKS", False)  # the chunk site has its own test above
    yield
    torch._dynamo.reset()


def test_training_steps_leave_the_context_unchanged(_eager_chunks):
    torch.manual_seed(0)
    model = grcompile.optimize(SampledSoftmaxRetrieval(
        build_encoder("hstu", "ml1m", num_items=ITEMS, max_len=MAX_LEN, **TINY)), lowering="eager")
    shapes = [(4, MAX_LEN), (3, MAX_LEN - 2)] + [(2 + i % 5, MAX_LEN - i % 7) for i in range(30)]
    entries = []
    for i, (B, N) in enumerate(shapes):
        model(*retrieval_batch(B, N, seed=i)).backward()
        entries.append(context_entries())
    assert grcompile.report(model).compiles == 2  # the static and the symbolic graph: steady state after
    assert entries[-1] == entries[2], f"context entries per step: {entries}"
