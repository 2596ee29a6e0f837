"""The pass manager: what a pass is, what it may record, and how the ordered pipeline runs.

A pass (``GraphPass``) receives the Dynamo-captured ``torch.fx.GraphModule`` (pre-autograd torch
IR: torch functions and ``Tensor`` methods, parameters lifted to placeholders) and mutates it in
place. It tells the world what it did through its ``PassContext``: ``ctx.rewrite(...)`` for every
site it changed, ``ctx.fallback(...)`` for every site it recognised but chose to leave alone, and
``ctx.counters`` for anything else worth counting (inductor's ``counters["inductor"]`` idea).

``run_pipeline`` is transactional per pass: a pass that raises, or that leaves a graph failing
``lint()``, is undone (graph and submodules restored, its records dropped) and recorded as a
fallback. A wrong rewrite is worse than none.
"""
from __future__ import annotations

import copy
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..lowering.semantics import has_effects
from ..lowering.source_site import node_site
from .op_semantics import may_draw_random

__all__ = ["GraphPass", "PassContext", "PassResult", "copy_graph", "graph_break", "node_site", "pass_name",
           "join_checkpoint_regions", "run_pipeline", "substitute"]


def ends_at_return(gm: fx.GraphModule) -> bool:
    """The graph ends at the frame's return (no graph break after it): its outputs are what the
    user gets, and their padded positions are not part of the contract."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return reason is not None and getattr(reason, "graph_break", True) is False


def graph_break(gm: fx.GraphModule | None) -> tuple[str, str] | None:
    """``(reason, site)`` of the graph break that ends ``gm`` (Dynamo's message and the user's
    line, ``file.py:27 in forward``); None when the graph ends at the frame's return or Dynamo
    said nothing."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or getattr(reason, "graph_break", False) is not True:
        return None
    stack = getattr(reason, "user_stack", None) or []
    frame = stack[-1] if stack else None
    site = f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}" if frame is not None else "<unknown>"
    return str(getattr(reason, "reason", "")), site


class GraphPass:
    """One graph transformation. Subclasses implement ``__call__``.

    Contract:
      * ``__call__(gm, ctx) -> None`` mutates ``gm.graph`` in place (it may add submodules or
        attributes to ``gm``); it need not call ``recompile()`` or ``lint()``, the pass manager
        does both after it.
      * Every changed site is reported with ``ctx.rewrite(op, node)``; a site that matched but was
        left alone is reported with ``ctx.fallback(node, reason)``.
      * The values computed by the graph at every valid output position must not change
        (and so neither may gradients); a pass that cannot guarantee that for a site leaves it.
      * Raising is allowed and safe: the pass manager restores the graph as it was before.

    ``name`` labels dump files, report rows and counters; it defaults to the snake-cased class name.
    """

    name: str = ""

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={pass_name(self)!r})"


def pass_name(p: Any) -> str:
    """``p.name`` or the snake-cased class name (``FuseAttention`` -> ``fuse_attention``)."""
    name = getattr(p, "name", "") or ""
    if name:
        return name
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(p).__name__).lower()


_MAX_ERROR = 200


# object reprs an exception message may carry -> the name the user wrote
_REPRS = ((re.compile(r"<built-in method (\w+) of type object at 0x[0-9a-fA-F]+>"), r"torch.\1"),
          (re.compile(r"<method '(\w+)' of 'torch\._C\.TensorBase' objects>"), r"Tensor.\1"),
          (re.compile(r"<(?:built-in )?function (\w+)(?: at 0x[0-9a-fA-F]+)?>"), r"\1"),
          (re.compile(r" at 0x[0-9a-fA-F]+"), ""))


def error_text(exc: BaseException) -> str:
    """``TypeName: first line of the message``, object reprs replaced by names, at most ``_MAX_ERROR`` chars."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    for pattern, name in _REPRS:
        text = pattern.sub(name, text)
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 1] + "…"


@dataclass
class PassContext:
    """What a pass may record, for one captured graph. ``pass_name`` is set by the pipeline."""

    graph_index: int = 0
    pass_name: str = ""
    counters: Counter[str] = field(default_factory=Counter)
    rewrites: list[dict[str, Any]] = field(default_factory=list)
    fallbacks: list[dict[str, Any]] = field(default_factory=list)
    # checks over the graph's inputs that must hold for the transformed graph to be exact on a
    # call; where one does not, the backend runs the graph as captured (exit_checks.py)
    preconditions: list[dict[str, Any]] = field(default_factory=list)
    # the inputs of the call this graph is compiled for (real tensors, in placeholder order), when
    # the backend has them: a pass may try a run-time check on them before it relies on one
    example_inputs: Sequence[Any] | None = None

    def rewrite(self, op: str, node: fx.Node | None, **extra: Any) -> None:
        """Record that this pass rewrote ``node`` into ``op`` (also counted as ``<pass>.<op>``)."""
        self.rewrites.append({"pass": self.pass_name, "op": op, "site": node_site(node),
                              "graph": self.graph_index, **extra})
        self.counters[f"{self.pass_name}.{op}"] += 1

    def fallback(self, node: fx.Node | None, reason: str) -> None:
        """Record that this pass recognised ``node`` but left it as it was, and why."""
        site = node_site(node) if node is not None else f"<graph {self.graph_index}>"
        self.fallbacks.append({"pass": self.pass_name, "site": site, "reason": reason,
                               "graph": self.graph_index})

    def precondition(self, check: Callable[..., bool], node: fx.Node | None, reason: str) -> None:
        """The transformed graph is exact on a call only where ``check(*inputs)`` is True;
        ``reason`` says what it checks (a sentence naming the user's op)."""
        self.preconditions.append({"pass": self.pass_name, "site": node_site(node), "check": check,
                                   "reason": reason, "graph": self.graph_index})
        self.counters[f"{self.pass_name}.checked_at_run_time"] += 1

    def count(self, key: str, n: int = 1) -> None:
        """Bump the pass-scoped counter ``<pass>.<key>``."""
        self.counters[f"{self.pass_name}.{key}"] += n


@dataclass
class PassResult:
    """What one pass did to one graph; handed to the ``on_pass`` callback (dumps, logging)."""

    index: int  # 1-based position in the pipeline
    name: str
    nodes_before: int
    nodes_after: int
    rewrites: list[dict[str, Any]]
    counters: dict[str, int]
    error: str | None = None  # set when the pass was undone: "TypeName: message"


OnPass = Callable[[fx.GraphModule, PassResult], None]


# Attributes Dynamo sets on nodes outside ``meta`` (AOTAutograd reads them); a graph deepcopy drops them.
_NODE_ATTRIBUTES = ("_dynamo_source",)


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` to restore on failure: node copies whose meta (fake tensors) is shared,
    not copied, and which keep Dynamo's node attributes."""
    saved = copy.deepcopy(graph)
    for old, new in zip(graph.nodes, saved.nodes):
        for attr in _NODE_ATTRIBUTES:
            if hasattr(old, attr):
                setattr(new, attr, getattr(old, attr))
    return saved


# the tags of a torch.utils.checkpoint region (capture/checkpoints.py) that AOTAutograd's partitioner reads
CHECKPOINT_META = ("recompute", "ac_graph_id")


def region_policy(node: fx.Node) -> CheckpointPolicy:
    """How ``node``, inside a checkpointed region, is tagged: recomputed in the backward, unless the
    recomputation could differ from the forward — an op with effects outside the graph, or one that
    may draw random numbers where torch cannot replay them. AOTAutograd replays the draws of a
    region's aten random ops (``functionalize_rng_ops``: the forward's RNG state is saved, the
    recomputation runs from it), so a torch dropout is recomputed, mask and all, as eager's
    checkpoint does; an op of another library (a custom op) draws where it cannot see, and is saved."""
    if has_effects(node.target) or (may_draw_random(node) and not _torch_op(node)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _torch_op(node: fx.Node) -> bool:
    """``node`` is a torch function, a Tensor method or an aten / prims op: one that AOTAutograd
    traces into aten ops."""
    target = node.target
    if node.op == "call_method":
        return True
    namespace = getattr(target, "namespace", None)  # an OpOverload(Packet)
    if namespace is not None:
        return namespace in ("aten", "prims")
    return (getattr(target, "__module__", None) or "").split(".")[0] == "torch"


def carry_checkpoint_tags(source: fx.Node, new: fx.Node, save: bool = False) -> None:
    """``new``, emitted in place of ``source``, joins ``source``'s checkpoint region, if any
    (``save``: as a value the backward must not recompute: a random draw)."""
    if "ac_graph_id" not in source.meta:
        return
    for key in CHECKPOINT_META:
        if key in source.meta:
            new.meta[key] = source.meta[key]
    if save:
        new.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def join_checkpoint_regions(graph: fx.Graph, old: set[fx.Node]) -> int:
    """Tag the nodes a pass emitted *inside* one checkpoint region as that region's: read only by
    the region's nodes and reading nothing from another region. Untagged, the partitioner would be
    free to save them (an expanded ``nn.MultiheadAttention`` kept 3x the activations the checkpoint
    kept). Tagged by :func:`region_policy`, as the region's own nodes are. Returns how many joined."""
    if not any("ac_graph_id" in n.meta for n in graph.nodes):
        return 0
    joined = 0
    for node in reversed(graph.nodes):  # readers first: a chain of new nodes joins in one sweep
        if node in old or node.op not in ("call_function", "call_method") or "ac_graph_id" in node.meta:
            continue
        regions = {u.meta.get("ac_graph_id") for u in node.users}
        if len(regions) != 1 or None in regions:
            continue
        (region,) = regions
        if any(a.meta.get("ac_graph_id", region) != region for a in node.all_input_nodes):
            continue
        node.meta["ac_graph_id"] = region
        node.meta["recompute"] = region_policy(node)
        joined += 1
    return joined


def substitute(graph: fx.Graph, fused: fx.Node, replaced: fx.Node, source: fx.Node) -> None:
    """Put ``fused`` (already inserted) in place of ``replaced`` — the last node of a matched chain
    that starts at ``source`` (``replaced`` itself or its user) — and erase both. ``fused`` keeps
    ``replaced``'s meta (its value) and ``source``'s stack trace (the user's line reports name)."""
    fused.meta = dict(replaced.meta)
    if "stack_trace" in source.meta:
        fused.meta["stack_trace"] = source.meta["stack_trace"]
    replaced.replace_all_uses_with(fused)
    graph.erase_node(replaced)
    if replaced is not source:
        graph.erase_node(source)


def run_pipeline(gm: fx.GraphModule, passes: Sequence[GraphPass], ctx: PassContext,
                 on_pass: OnPass | None = None) -> fx.GraphModule:
    """Run ``passes`` in order over ``gm`` (in place); lint + recompile after each one.

    A pass that raises (or breaks ``lint``) is rolled back and becomes a fallback at site
    ``<graph k>``; the next pass sees the graph as it was before the failed one.
    """
    for i, graph_pass in enumerate(passes, start=1):
        name = pass_name(graph_pass)
        ctx.pass_name = name
        saved_graph = copy_graph(gm.graph)
        saved_modules = (dict(gm._modules), dict(gm._parameters), dict(gm._buffers))
        saved_attrs = set(vars(gm))
        n_rewrites, saved_counters = len(ctx.rewrites), Counter(ctx.counters)
        n_fallbacks = len(ctx.fallbacks)
        nodes_before = len(gm.graph.nodes)
        old_nodes = set(gm.graph.nodes)
        error: str | None = None
        try:
            graph_pass(gm, ctx)
            if joined := join_checkpoint_regions(gm.graph, old_nodes):
                ctx.counters["passes.checkpoint_region_joined"] += joined
            gm.graph.lint()
            gm.recompile()
        except Exception as exc:  # noqa: BLE001 - any failure means "leave the graph alone"
            error = error_text(exc)
            del ctx.rewrites[n_rewrites:], ctx.fallbacks[n_fallbacks:]
            ctx.counters.clear()
            ctx.counters.update(saved_counters)
            for attr in set(vars(gm)) - saved_attrs:
                delattr(gm, attr)
            for table, saved in zip((gm._modules, gm._parameters, gm._buffers), saved_modules):
                table.clear()
                table.update(saved)
            gm.graph = saved_graph
            gm.recompile()
            kind, _, message = error.partition(": ")
            ctx.fallback(None, f"the {name} pass raised {kind}" + (f" ({message})" if message else "")
                         + f", an internal grcompile error; its changes were undone and the graph was left "
                           f"as it was before {name}")
        if on_pass is not None:
            delta = {k: v - saved_counters.get(k, 0) for k, v in ctx.counters.items()
                     if v != saved_counters.get(k, 0)}
            on_pass(gm, PassResult(i, name, nodes_before, len(gm.graph.nodes),
                                   ctx.rewrites[n_rewrites:], delta, error))
    ctx.pass_name = ""
    return gm
