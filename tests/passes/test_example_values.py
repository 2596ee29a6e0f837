"""``refresh_example_values`` on a graph whose batch is an unbacked symbol (the graph compiled
after a shape change, ``capture/shapes.py``): an op guarding on a data-dependent size must not
make a pass raise (it was reported as "an internal grcompile error" and the pass undone)."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from grcompile.passes.op_semantics import refresh_example_values


def _graph_with_unbacked_batch(build):
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        b = mode.shape_env.create_unbacked_symint()
        x = torch.empty(b, 6, 16)
    g = fx.Graph()
    p = g.placeholder("x")
    p.meta["example_value"] = x
    g.output(build(g, p))
    return fx.GraphModule(torch.nn.Module(), g)


def test_training_dropout_on_unbacked_batch_gets_a_value_in_strict_mode():
    # F.dropout checks numel() == 0: Eq(96*u0, 0) cannot be answered for an unbacked u0
    gm = _graph_with_unbacked_batch(lambda g, p: g.call_function(F.dropout, (p, 0.2, True)))
    refresh_example_values(gm)  # strict (detect_padding's reanalysis): raised GuardOnDataDependentSymNode
    drop = next(n for n in gm.graph.nodes if n.op == "call_function")
    value = drop.meta["example_value"]
    assert value.dim() == 3 and value.shape[1:] == (6, 16)
    rows = gm.graph.find_nodes(op="placeholder")[0].meta["example_value"].shape[0]
    assert value.shape[0].node.expr == rows.node.expr


def _branches_on_rows(x):
    return x if x.shape[0] == 0 else x * 2


def test_other_data_dependent_guard_leaves_no_value_and_does_not_raise():
    gm = _graph_with_unbacked_batch(lambda g, p: g.call_function(torch.relu, (g.call_function(_branches_on_rows, (p,)),)))
    refresh_example_values(gm)
    assert all("example_value" not in n.meta for n in gm.graph.nodes if n.op == "call_function")
