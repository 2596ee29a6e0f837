"""Pass ``remat_policy`` (``optimize(model, remat="selective")``): ULTRA-HSTU's per-block selective
rematerialisation — a block keeps its input (and what its attention produced) for the backward and
recomputes the normed input, the input projection (``uvqk``) and its split there; the fused gated
norms recompute their outputs.

Matches: every fused norm (``grcompile::gated_norm``, and ``fp8_linear`` with a fused norm), then,
forward from it, every node reached only through cheap or projection ops: one ``linear`` /
``fp8_linear`` per chain reading a tagged value (its activation input), value-wise unary ops (``silu``, casts), ``split`` /
``chunk`` / ``getitem``, views and layout changes, identity dropouts (eval mode, p = 0). The walk stops at anything else — attention,
reductions, the residual add, random ops (dropout: recomputing it would need the same random
stream), in-place writes.
Emits: no new nodes; the matched nodes get ``meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE``,
the tag ``torch.utils.checkpoint``'s selective checkpointing sets. It travels into AOTAutograd's
joint graph (``recompute`` is a preserved node-meta field) and the min-cut partitioner never saves
a tagged node's output: whatever the backward needs of it is recomputed from what is saved.
Also, with any ``remat`` (the policy or a partitioner budget, which appends this pass with
``selective=False``): every op that declared effects outside the graph (``grcompile::sparse_lookup``:
the sparse runtime's collectives) gets ``CheckpointPolicy.MUST_SAVE``. Under a budget the
partitioner's knapsack may recompute any op it believes functional, custom ops included; a
recomputed lookup would run the runtime's exchange a second time in the backward.
Invariant: values and gradients unchanged — the recomputed ops are deterministic functions of
saved tensors (no random op is ever tagged); only what is saved for the backward changes.
Runs last (after ``fuse_norm_gate`` and ``fp8_linear``: it reads the fused ops they emit).
"""
from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .pass_manager import GraphPass, PassContext
from .op_semantics import canonical, dropout_is_identity
from ..lowering.fp8 import FP8_LINEAR
from ..lowering.norm import GATED_NORM
from ..lowering.semantics import has_effects

RECOMPUTE = "recompute"
# value-wise or layout-only: recomputing them from a recomputed input is cheap and exact
_CHEAP = {"unary", "split", "chunk", "unbind", "getitem", "reshape", "transpose", "permute", "unsqueeze", "squeeze"}
_PROJECTIONS = {"linear"}


def _is_seed(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is GATED_NORM:
        return True
    return node.target is FP8_LINEAR and node.kwargs.get("norm", "none") != "none"


def _propagates(node: fx.Node) -> bool:
    """Whether a node reading a recomputed value is recomputed too."""
    if node.op != "call_function" and node.op != "call_method":
        return False
    if node.target is FP8_LINEAR or dropout_is_identity(node):
        return True
    name = canonical(node)
    if name not in _CHEAP | _PROJECTIONS:
        return False
    # in-place methods (``silu_``, ``.add_``) and ``inplace=True`` write: never recompute a write
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return not (target.endswith("_") and not target.endswith("__")) and node.kwargs.get("inplace") is not True


def _is_projection(node: fx.Node) -> bool:
    return node.target is FP8_LINEAR or canonical(node) in _PROJECTIONS


def tag_recompute(graph: fx.Graph) -> list[fx.Node]:
    """Tag the per-block recompute sets (module docstring); return the tagged nodes in graph order.
    At most one GEMM per chain is recomputed: a projection reading a value that a recomputed
    projection made is left to the partitioner (a feed-forward's second linear, say)."""
    gemms: dict[fx.Node, int] = {}  # tagged node -> projections recomputed on its chain
    for node in graph.nodes:
        if _is_seed(node):
            gemms[node] = int(node.target is FP8_LINEAR)
        elif _propagates(node):
            if _is_projection(node):
                first = node.args[0] if node.args else node.kwargs.get("input")
                if isinstance(first, fx.Node) and gemms.get(first) == 0:  # its activation, not its weight
                    gemms[node] = 1
            else:
                depths = [gemms[a] for a in node.all_input_nodes if a in gemms]
                if depths:
                    gemms[node] = max(depths)
    for node in gemms:
        node.meta[RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
    return list(gemms)


def protect_effects(graph: fx.Graph) -> list[fx.Node]:
    """Tag every node of an op with effects outside the graph ``MUST_SAVE``; return them."""
    effectful = [n for n in graph.nodes if n.op == "call_function" and has_effects(n.target)]
    for node in effectful:
        node.meta[RECOMPUTE] = CheckpointPolicy.MUST_SAVE
    return effectful


class RematPolicy(GraphPass):
    """Tag every block's norm → input projection → split chain for recomputation (module
    docstring); ``selective=False``: only protect the ops with effects (a partitioner budget)."""

    def __init__(self, selective: bool = True) -> None:
        self.selective = selective

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        saved = protect_effects(gm.graph)
        if saved:
            ctx.count("must_save.effects", len(saved))
        if not self.selective:
            return
        tagged = tag_recompute(gm.graph)
        for node in tagged:
            if _is_seed(node):
                ctx.rewrite("recompute", node)
        ctx.count("recompute.nodes", len(tagged))
        ctx.count("recompute.projections", sum(1 for n in tagged if _is_projection(n)))
