"""Ops declare their meaning to the passes where they register (grcompile/lowering/semantics.py)."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from grcompile.lowering import semantics  # importing the op layer registers (and declares) every op
from grcompile.passes.op_semantics import canonical


def _call(target) -> fx.Node:
    g = fx.Graph()
    x = g.placeholder("x")
    return g.call_function(target, (x,))


@pytest.mark.parametrize("target, meaning", [
    (torch.ops.grcompile.score_mod_attention.default, "fused_attention"),
    (torch.ops.grcompile.sparse_lookup.default, "embedding"),
    (torch.ops.grcompile.sparse_lookup, "embedding"),
])
def test_declared_ops_have_their_canonical_name(target, meaning: str) -> None:
    assert semantics.declared(target) == meaning
    assert canonical(_call(target)) == meaning


def test_undeclared_op_has_none_and_torch_ops_keep_theirs() -> None:
    assert semantics.declared(torch.ops.grcompile.gated_norm.default) is None
    assert canonical(_call(torch.ops.grcompile.gated_norm.default)) is None
    assert canonical(_call(torch.nn.functional.embedding)) == "embedding"


def test_unknown_meaning_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown meaning 'embeding'"):
        semantics.declare("embeding", torch.ops.grcompile.gated_norm.default)
    assert semantics.declared(torch.ops.grcompile.gated_norm.default) is None
