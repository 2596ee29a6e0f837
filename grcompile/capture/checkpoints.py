"""Activation-checkpointed regions (``torch.utils.checkpoint``) opened up for the passes.

Dynamo captures ``checkpoint(fn, *args, use_reentrant=False)`` as one higher-order op,
``tag_activation_checkpoint(body, *args)``, whose body is a graph of its own: the passes, which
walk the captured graph, would see an opaque call and leave the attention inside it dense (a
checkpointed HSTU block is the usual way to train a large one).

Matches: every ``tag_activation_checkpoint`` node without a selective-checkpoint policy (a
``context_fn``: its policy decides per op at trace time, which this cannot reproduce), whose
results are read whole or through ``getitem``.
Emits: the body's nodes in place of the call, each tagged the way AOTAutograd tags a checkpointed
region when it traces the call itself — ``meta["recompute"] = PREFER_RECOMPUTE`` and one
``meta["ac_graph_id"]`` per region, the fields the min-cut partitioner reads (both travel into the
joint graph) — so the region's activations are still recomputed in the backward, not saved.
Random ops are recomputed too, as in eager's checkpoint: AOTAutograd replays a region's aten
random draws from the forward's RNG state; ops torch cannot replay (a custom op that may draw,
an op with effects outside the graph) are tagged ``MUST_SAVE`` (``pass_manager.region_policy``).
A region holding an SDPA or multi-head attention with dropout stays closed: left unfused, that
one op's backward redraws the mask it drew inside.
Invariant: values and gradients unchanged — the body computes what the call computed; only which
activations are saved changes, as the checkpoint asked. The passes carry the tags onto what they
emit in a tagged node's place (``pass_manager.carry_checkpoint_tags``), and the new nodes that
sit inside one region join it (``pass_manager.join_checkpoint_regions``).
"""
from __future__ import annotations

import itertools
import operator

import torch
import torch.fx as fx

from torch.utils.checkpoint import CheckpointPolicy

from ..passes.op_semantics import arg, may_draw_random, target_name
from ..passes.pass_manager import region_policy

__all__ = ["inline_checkpoints", "save_random_draws"]

_REGION_IDS = itertools.count(1 << 20)  # apart from the ids AOTAutograd gives the regions it tags itself


def _is_checkpoint(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.higher_order.tag_activation_checkpoint


def inline_checkpoints(gm: fx.GraphModule) -> tuple[int, list[tuple[fx.Node, str]]]:
    """Inline ``gm``'s checkpointed regions (nested ones too); ``(how many, [(call, why not)])``."""
    inlined, refused = 0, []
    while True:
        todo = [n for n in gm.graph.nodes if _is_checkpoint(n) and n not in {r for r, _ in refused}]
        if not todo:
            break
        for call in todo:
            why = _inline(gm, call)
            if why is None:
                inlined += 1
            else:
                refused.append((call, why))
    if inlined:  # no dead-code elimination: it would drop an in-place op whose result is unused
        for node in list(gm.graph.nodes):
            if node.op == "get_attr" and not node.users and isinstance(getattr(gm, node.target, None), fx.GraphModule):
                gm.graph.erase_node(node)  # an inlined body
        gm.graph.lint()
        gm.recompile()
    return inlined, refused


def save_random_draws(gm: fx.GraphModule) -> int:
    """Tag ``MUST_SAVE`` every op outside a checkpointed region that may draw random numbers;
    returns how many. For ``optimize(remat=<budget>)``: AOTAutograd's memory-budget solver may
    recompute even the ops its min-cut bans, random ones among them, and a dropout recomputed
    outside a region draws a second mask (wrong gradients under both lowerings, 2026-11-29). A
    region's draws are replayed instead (:func:`pass_manager.region_policy`)."""
    tagged = 0
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and "recompute" not in node.meta and may_draw_random(node):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            tagged += 1
    return tagged


def _inline(gm: fx.GraphModule, call: fx.Node) -> str | None:
    body_attr = call.args[0]
    if not (isinstance(body_attr, fx.Node) and body_attr.op == "get_attr"):
        return "its body is not a graph attribute"
    body = getattr(gm, body_attr.target)
    if not isinstance(body, fx.GraphModule):
        return "its body is not a graph"
    if "_checkpoint_context_fn" in body.meta:
        return "it has a selective-checkpoint policy (context_fn), which decides per op when AOTAutograd traces it"
    if call.kwargs.get("use_reentrant"):
        return "it uses the reentrant implementation"
    if any(_library_attention_dropout(n) for n in body.graph.nodes):
        # its dropout mask is drawn inside one op: tagged, that op's backward redrew it (wrong gradients)
        return "it holds a library attention with dropout (SDPA / multi-head attention), whose mask must not be redrawn"
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    operands = list(call.args[1:])
    if len(placeholders) != len(operands):
        return "its operands do not match its body's inputs"
    (output,) = [n for n in body.graph.nodes if n.op == "output"]
    results = output.args[0]
    many = isinstance(results, (tuple, list))
    if many and any(u.target is not operator.getitem or not isinstance(u.args[1], int) for u in call.users):
        return "its results are read other than one by one"

    region = next(_REGION_IDS)
    trace = call.meta.get("stack_trace")
    env: dict[fx.Node, fx.Node] = dict(zip(placeholders, operands))
    g = gm.graph
    with g.inserting_before(call):
        for node in body.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "get_attr":  # a constant or a nested body: owned by gm from now on
                name = _fresh_name(gm, f"{body_attr.target}_{node.target}")
                setattr(gm, name, getattr(body, node.target))
                new = g.get_attr(name)
                new.meta = dict(node.meta)
            else:
                new = g.node_copy(node, env.__getitem__)
                new.meta = dict(node.meta)
                new.meta["recompute"] = region_policy(node)
                new.meta["ac_graph_id"] = region
            if trace and not new.meta.get("stack_trace"):
                new.meta["stack_trace"] = trace  # the body's ops lack one: name the checkpoint call
            env[node] = new
    mapped = fx.node.map_arg(results, env.__getitem__)
    if many:
        for user in list(call.users):
            user.replace_all_uses_with(mapped[user.args[1]])
            g.erase_node(user)
    else:
        call.replace_all_uses_with(mapped)
    g.erase_node(call)
    return None


def _library_attention_dropout(node: fx.Node) -> bool:
    """``node`` is an SDPA / ``multi_head_attention_forward`` whose dropout probability is not 0."""
    name = target_name(node)
    if "scaled_dot_product_attention" in name:  # (query, key, value, attn_mask, dropout_p, ...)
        p, training = arg(node, 4, "dropout_p", 0.0), True
    elif "multi_head_attention_forward" in name:  # (..., add_zero_attn, dropout_p, out_proj_weight, out_proj_bias, training, ...)
        p, training = arg(node, 10, "dropout_p", 0.0), arg(node, 13, "training", True)
    else:
        return False
    return training is not False and not (isinstance(p, (int, float)) and p == 0)


def _fresh_name(gm: fx.GraphModule, base: str) -> str:
    base = base.replace(".", "_")
    for i in itertools.count():
        name = base if i == 0 else f"{base}_{i}"
        if not hasattr(gm, name):
            return name
    raise AssertionError("unreachable")
