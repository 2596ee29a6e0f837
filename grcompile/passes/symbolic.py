"""Sizes that may be symbolic: decisions that never guard, and graph arguments for them.

After a shape change Dynamo traces the batch and sequence axes as symbols (``capture/shapes.py``),
so a pass sees ``torch.SymInt`` sizes. A pass must reason on what is *statically known* about
them and emit sizes as graph values, never as baked ints:

* comparing SymInts with ``==``, ``<``, ``bool()`` or ``int()`` records a guard on the ShapeEnv,
  which Dynamo installs with the graph: the graph silently specialises to this batch's sizes and
  the next batch recompiles. :func:`known_eq` / :func:`is_one` / :func:`known_ge` answer from the
  symbols' ranges and relations only (``statically_known_true``): an unknown answer is ``False``;
* a symbolic size written into a node's arguments must be a node: :class:`SizeArgs` finds a graph
  input that carries it (a SymInt input, or ``sym_size(input, d)``), so it is valid anywhere in
  the graph.

Facts a pass may rely on: a symbol is never *statically* 1 (Dynamo specialises sizes 0/1 of
backed symbols, and gives unbacked ones no value), so "statically 1" means "a broadcast axis in
the traced graph" whatever the runtime size: the traced graph's semantics were fixed at trace time
and are guarded (a symbolic axis that meets a different size in a broadcast got a guard or a runtime
assert then).
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .effects import remove_dead_code

__all__ = ["Size", "SizeArgs", "Unresolved", "gt_one", "is_one", "is_symbolic", "known_eq", "known_ge", "prod", "static_int"]

Size = "int | torch.SymInt"


def static_int(s: Any) -> int | None:
    """``s`` as a Python int when it is one (or a SymInt whose value is a known constant)."""
    if isinstance(s, bool):
        return int(s)
    if isinstance(s, int):
        return s
    if isinstance(s, torch.SymInt):
        return s.node.maybe_as_int()
    return None


def is_symbolic(s: Any) -> bool:
    return isinstance(s, torch.SymInt) and static_int(s) is None


def _known(cond: Any) -> bool:
    if isinstance(cond, bool):
        return cond
    return bool(statically_known_true(cond))


def known_eq(a: Any, b: Any) -> bool:
    """``a == b`` provably (ints, or symbols equal by their relations); never guards."""
    ia, ib = static_int(a), static_int(b)
    if ia is not None and ib is not None:
        return ia == ib
    if not isinstance(a, (int, torch.SymInt)) or not isinstance(b, (int, torch.SymInt)):
        return False
    return _known(a == b)


def known_ge(a: Any, b: Any) -> bool:
    """``a >= b`` provably; never guards."""
    ia, ib = static_int(a), static_int(b)
    if ia is not None and ib is not None:
        return ia >= ib
    if not isinstance(a, (int, torch.SymInt)) or not isinstance(b, (int, torch.SymInt)):
        return False
    return _known(a >= b)


def is_one(s: Any) -> bool:
    """A statically size-1 (broadcast) axis."""
    return static_int(s) == 1


def gt_one(s: Any) -> bool:
    """A size that may exceed 1 (a feature axis with real extent): static ``> 1``, or symbolic."""
    v = static_int(s)
    return v > 1 if v is not None else True


def prod(sizes: Iterable[Any]) -> Any:
    return math.prod(sizes, start=1)


class Unresolved(Exception):
    """A symbolic size no graph input carries (the pass then falls back, never bakes the int)."""


class SizeArgs:
    """Graph arguments for sizes of one graph: an int stays an int; a symbolic size becomes a node
    computed from a graph input (a SymInt input, else ``sym_size(input, d)``, inserted right after
    the inputs so it dominates every use), created once per graph."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.graph = gm.graph
        self._made: list[tuple[Any, fx.Node]] = []

    def __call__(self, s: Any) -> Any:
        value = static_int(s)
        if value is not None:
            return value
        if not isinstance(s, torch.SymInt):
            raise Unresolved(f"size {s!r} is not an int")
        for size, node in self._made:
            if known_eq(size, s) and node.graph is self.graph:
                return node
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        for n in placeholders:  # Dynamo passes symbolic sizes it needs as SymInt inputs
            ex = n.meta.get("example_value", n.meta.get("val"))
            if isinstance(ex, torch.SymInt) and known_eq(ex, s):
                self._made.append((s, n))
                return n
        for n in placeholders:
            ex = n.meta.get("example_value", n.meta.get("val"))
            if not isinstance(ex, torch.Tensor):
                continue
            for d, size in enumerate(ex.shape):
                if known_eq(size, s):
                    with self.graph.inserting_after(placeholders[-1]):
                        node = self.graph.call_function(torch.ops.aten.sym_size.int, (n, d))
                    node.meta["example_value"] = size
                    self._made.append((s, node))
                    return node
        raise Unresolved(f"no graph input carries the symbolic size {s}")


_SIZE_QUERIES = ("size", "sym_size")


def _is_size_query(n: fx.Node) -> bool:
    """``x.size(d)``, ``x.size()[d]`` / ``x.shape[d]``, ``sym_size(x, d)`` of a computed tensor."""
    if n.op == "call_method" and n.target == "size" and len(n.args) + len(n.kwargs) > 1:
        src = n.args[0]
    elif n.op == "call_function" and n.target is torch.ops.aten.sym_size.int:
        src = n.args[0]
    elif n.op == "call_function" and getattr(n.target, "__name__", "") == "getitem" and \
            isinstance(n.args[0], fx.Node) and n.args[0].op == "call_method" and n.args[0].target == "size":
        src = n.args[0].args[0]
    else:
        return False
    return isinstance(src, fx.Node) and src.op != "placeholder"


def hoist_sizes(gm: fx.GraphModule) -> int:
    """Read symbolic sizes from the graph inputs instead of from computed tensors.

    A dynamic graph reads ``B, N, D = x.shape`` from intermediate tensors; a rewrite that replaces
    ``x`` (the jagged form, a fused attention) would keep the dense ``x`` alive only to read its
    shape. Each such size query becomes the same size read from an input (``SizeArgs``); the
    query and what it read from become dead code. Returns how many were replaced."""
    sizes = SizeArgs(gm)
    count = 0
    for n in list(gm.graph.nodes):
        if not _is_size_query(n):
            continue
        value = n.meta.get("example_value", n.meta.get("val"))
        if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool):
            continue
        try:
            replacement = sizes(value)
        except Unresolved:
            continue
        n.replace_all_uses_with(replacement)
        count += 1
    for n in list(gm.graph.nodes):  # x.size() as a whole (expand(x.size()), view(x.size())): each size read from an input
        if not (n.op == "call_method" and n.target == "size" and len(n.args) == 1 and not n.kwargs
                and isinstance(n.args[0], fx.Node) and n.args[0].op != "placeholder"):
            continue
        value = n.meta.get("example_value", n.meta.get("val"))
        if not isinstance(value, torch.Size) or not n.users or any(
                u.op == "call_method" and u.args and u.args[0] is n for u in n.users):
            continue  # size.numel(), ...: a method of torch.Size, not of the tuple it would become
        try:
            parts = tuple(sizes(s) for s in value)
        except Unresolved:
            continue
        for user in list(n.users):
            user.args = fx.node.map_arg(user.args, lambda a: parts if a is n else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a: parts if a is n else a)
        count += 1
    if count:
        remove_dead_code(gm.graph)
    return count
