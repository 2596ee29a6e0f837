"""Which nodes of a Dynamo graph act beyond their output, and dead-code removal that keeps them.

Dynamo keeps the user's in-place writes as they were written: ``pe.mul_(0.5)``, ``a[i] = v``,
``relu(a, inplace=True)``, ``torch.add(a, b, out=c)``. The written tensor is read later through
the *original* node, so the write itself often has no users — and ``fx.Graph.eliminate_dead_code``
(``Node.is_impure``) does not know that a ``call_method`` ending in ``_`` writes: it would drop the
write and every later reader would see the unwritten values. Every pass removes dead code through
``remove_dead_code``.

A pass that moves a read (packs a value where it was defined, computes a fused op where its last
input was read) changes what the read sees if a write to the same storage lies between:
``written_aliases`` says which values may share storage with a tensor written in place, so passes
leave them where the user put them.
"""
from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx as fx

from ..lowering.semantics import has_effects

_IN_PLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                       operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor,
                       operator.ilshift, operator.irshift, operator.setitem)


def _in_place_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


def writes(node: fx.Node) -> bool:
    """Whether ``node`` writes into a tensor it received (or may: unknown modules count)."""
    if node.op == "call_module":
        return True
    if node.op == "call_method":
        return _in_place_name(node.target) or node.target == "__setitem__"
    if node.op != "call_function":
        return False
    if any(node.target is op for op in _IN_PLACE_OPERATORS) or node.kwargs.get("out") is not None:
        return True
    if getattr(getattr(node.target, "_schema", None), "is_mutable", False):
        return True
    # torch.relu_, F.relu_: in place; operator.and_ / or_ / not_: keywords spelled with an underscore
    if getattr(node.target, "__module__", None) != "_operator" and _in_place_name(getattr(node.target, "__name__", "")):
        return True
    try:
        params = list(inspect.signature(node.target).parameters)
    except (TypeError, ValueError):  # builtins without a signature
        return node.kwargs.get("inplace") is True
    if "inplace" not in params:
        return False
    index = params.index("inplace")
    value = node.args[index] if len(node.args) > index else node.kwargs.get("inplace")
    return value is True


def is_impure(node: fx.Node) -> bool:
    """Must stay even without users: torch's side-effectful ops (grad mode, autocast, asserts), a
    write, or an op that declared effects outside the graph (a sparse runtime's lookup)."""
    return node.is_impure() or writes(node) or (node.op == "call_function" and has_effects(node.target))


def remove_dead_code(graph: fx.Graph) -> bool:
    """``graph.eliminate_dead_code`` that keeps writes and effects (module docstring)."""
    return graph.eliminate_dead_code(is_impure_node=is_impure)


# canonical ops that always return a new tensor (never a view of, nor their input itself)
_FRESH = {"ne", "eq", "gt", "ge", "lt", "le", "and", "or", "not", "sub", "div", "neg", "matmul", "einsum",
          "linear", "addmm", "layer_norm", "rms_norm", "normalize", "embedding", "softmax", "reduce", "where",
          "masked_fill", "tril", "triu", "factory", "arange", "cat", "one_hot", "repeat", "repeat_interleave",
          "add", "mul", "class_loss", "bucketize"}  # add / mul: the in-place spellings (iadd, imul) are writes, caught before this
# value-wise ops that may return their input itself (same dtype, already contiguous) or a view of it
_MAY_RETURN_INPUT = {"contiguous", "to", "float", "long", "int", "bool", "half", "bfloat16", "type_as", "detach",
                     "double", "cuda", "cpu", "view_as", "expand_as", "reshape_as", "requires_grad_"}


def _written_arguments(node: fx.Node) -> list[Any]:
    """The arguments ``node`` writes into (``writes(node)`` is true)."""
    if node.op == "call_module":
        return list(node.args) + list(node.kwargs.values())  # unknown code: any tensor it gets
    if node.kwargs.get("out") is not None:
        out = node.kwargs["out"]
        return list(out) if isinstance(out, (tuple, list)) else [out]
    schema = getattr(node.target, "_schema", None)
    if node.op == "call_function" and getattr(schema, "is_mutable", False):
        return [a for a, arg in zip(node.args, schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write]
    return list(node.args[:1])  # x.op_(...), torch.op_(x, ...), op(x, inplace=True), x += y, x[i] = v


def _may_alias_input(node: fx.Node) -> bool:
    """Whether ``node``'s value may share storage with one of its tensor inputs."""
    from .op_semantics import canonical  # op_semantics imports symbolic, which imports this module

    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if writes(node):
        return True  # x.relu_() returns x
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in node.target._schema.returns)
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name in _MAY_RETURN_INPUT:
        return True
    if node.op == "call_method" and name == "roll" or node.op == "call_function" and _is_shift(node.target):
        return False  # torch.roll and F.pad always allocate their result (no canonical name: matched here)
    return canonical(node) not in _FRESH and not (canonical(node) == "unary" and name not in _MAY_RETURN_INPUT)


def _is_shift(target: Any) -> bool:
    try:
        return target in (torch.roll, torch.nn.functional.pad, torch._C._nn.pad)
    except TypeError:  # unhashable target
        return False


def fresh(node: fx.Node) -> bool:
    """Whether ``node`` is an op known to return a new tensor (sharing storage with none of its
    inputs) and writing none of them."""
    return node.op in ("call_function", "call_method") and not _may_alias_input(node)


def _is_write(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method", "call_module") and writes(node)


def _written_nodes(node: fx.Node) -> list[fx.Node]:
    return [a for a in _written_arguments(node) if isinstance(a, fx.Node)]


def _scalar(node: fx.Node) -> bool:
    """A node whose value is a number or a symbolic size (or a tuple of them), not a tensor."""
    value = node.meta.get("example_value", node.meta.get("val"))
    scalars = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
    return isinstance(value, scalars) or (isinstance(value, (tuple, list, torch.Size)) and len(value) > 0
                                          and all(isinstance(v, scalars) for v in value))


def _alias_links(graph: fx.Graph) -> dict[fx.Node, set[fx.Node]]:
    """Undirected "may share storage" edges: a write with what it writes (``x.mul_(m)`` aliases
    ``x``, not ``m``), any other op not known to return a fresh tensor with its inputs."""
    links: dict[fx.Node, set[fx.Node]] = {}
    for node in graph.nodes:
        if _is_write(node) and node.op != "call_module":
            linked = _written_nodes(node)
        elif _may_alias_input(node):
            linked = node.all_input_nodes
        else:
            continue
        for a in linked:
            if _scalar(a):
                continue  # a size or number argument (expand(B, ...)) holds no storage
            links.setdefault(node, set()).add(a)
            links.setdefault(a, set()).add(node)
    return links


def _reach(starts: list[fx.Node], links: dict[fx.Node, set[fx.Node]]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(links.get(n, ()))
    return seen


def written_aliases(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Every value that may share storage with a tensor some node writes in place -> those writes,
    in graph order. Conservative: an op not known to return a fresh tensor is taken to alias its
    inputs; placeholders and attributes never alias each other."""
    links = _alias_links(graph)
    out: dict[fx.Node, list[fx.Node]] = {}
    for write in filter(_is_write, graph.nodes):
        for value in _reach(_written_nodes(write), links):
            out.setdefault(value, []).append(write)
    return out


class WriteOrder:
    """Answers, for the graph as it was when built: does a write to ``value``'s storage lie
    strictly between ``value``'s definition and ``reader``? Then a pass that makes ``reader`` read
    a copy taken at the definition (a packed value, a fused op's operand) would miss the write."""

    def __init__(self, graph: fx.Graph) -> None:
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.writes_to = written_aliases(graph)

    def between(self, value: fx.Node, reader: fx.Node) -> fx.Node | None:
        """The first write to ``value``'s storage after ``value`` and before ``reader``, or None."""
        lo, hi = self.order.get(value), self.order.get(reader)
        if lo is None or hi is None:
            return None
        return next((w for w in self.writes_to.get(value, ()) if lo < self.order[w] < hi), None)


__all__ = ["fresh", "writes", "is_impure", "remove_dead_code", "written_aliases", "WriteOrder"]
