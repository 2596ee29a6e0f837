"""Lookup-key extraction: the part of a traced forward that decides what the sparse lookups ask for.

This is where grcompile marks the first stage boundary of a sparse step (key routing, before the
dense model): the sparse lookup is one op in the graph, so the ids it receives are a slice of the
graph that a pipeline can run ahead of the forward — for the next micro-batch or the next batch —
and start the id and embedding all-to-alls early (``train/pipeline.py``).

Matches: every ``grcompile::sparse_lookup`` call in a functional graph (``make_fx`` of the model
with its parameters and buffers as inputs).
Emits: the same graph cut down to the ancestors of the lookups' ids arguments, returning those
ids in graph order, plus the feature each belongs to. Inputs are kept as they are (same calling
convention as the traced graph).
Declines — returns a sentence instead of a graph — when a lookup's ids depend on another lookup's
output (keys chosen from embeddings cannot be known ahead of the lookup), on a random op (computed
ahead, they would draw other numbers than in the forward), on an input the forward writes (a
buffer updated in place), or when there is no lookup at all. ``reads`` says which inputs the keys
come from (a schedule that extracts a whole step ahead must not read parameters).
Invariant: for the same inputs, parameters and buffers, the extracted graph computes exactly the
ids the forward's lookups receive, in the forward's order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

SPARSE_LOOKUP = "grcompile::sparse_lookup"


@dataclass
class LookupKeys:
    graph: fx.GraphModule  # same inputs as the traced graph; returns the ids of each lookup
    features: list[str]  # the feature of each returned ids tensor
    reads: set[int]  # positions of the (flattened) inputs the ids are computed from


def _is_lookup(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "name", lambda: "")() == SPARSE_LOOKUP


def _is_random(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in tags


def extract_lookup_keys(gm: fx.GraphModule) -> LookupKeys | str:
    """The key-routing slice of ``gm`` (see module docstring), or why there is none."""
    lookups = [n for n in gm.graph.nodes if _is_lookup(n)]
    if not lookups:
        return "the model makes no sparse lookup"
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mutated = {n.args[0] for n in gm.graph.nodes  # functionalized: an input written is a copy_ into it
               if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0] in placeholders}
    keep: set[fx.Node] = set()
    stack = [n.args[0] for n in lookups]
    while stack:
        node = stack.pop()
        if node in keep:
            continue
        if _is_lookup(node):
            return f"the ids of a lookup are computed from the embeddings of feature {node.args[3]!r}"
        if _is_random(node):
            return f"the ids of a lookup depend on a random op ({node.target}): computed ahead they would differ"
        if node in mutated:
            return f"the ids of a lookup depend on state the forward changes (input {node.name}): computed ahead " \
                   f"they would be the old ones"
        keep.add(node)
        stack.extend(node.all_input_nodes)
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    ids_nodes = [n.args[0] for n in lookups]
    output.args = (ids_nodes,)
    for node in reversed(list(graph.nodes)):
        if node.op in ("output", "placeholder") or node in keep:
            continue
        graph.erase_node(node)
    codegen = graph._codegen
    if getattr(codegen, "pytree_info", None) is not None:
        codegen.pytree_info = codegen.pytree_info._replace(out_spec=None)  # a plain list out
    graph.lint()
    gm.recompile()
    return LookupKeys(gm, [n.args[3] for n in lookups], {i for i, n in enumerate(placeholders) if n in keep})


__all__ = ["LookupKeys", "extract_lookup_keys"]
