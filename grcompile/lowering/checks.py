"""``grcompile::check_index(index, low, high, what) -> index'``: raise a readable ``IndexError``
when a lookup index leaves ``[low, high)``, before any kernel reads it.

Generated C++ checks bounds too, but its ``index out of bounds: 0 <= tmp2 < 101L`` names neither
the input nor the table, and thrown inside a parallel region it can abort the process. This op
costs one min/max pass over the index and returns a copy of it (custom-op outputs may not alias
inputs) so that :func:`pin_checks` can make every reader of the index wait for the check: inductor
orders kernels by data dependencies, not by graph order. It is registered as side-effectful, so
dead-code elimination keeps it while nothing consumes its output yet.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

__all__ = ["check_index", "pin_checks"]


@torch.library.custom_op("grcompile::check_index", mutates_args=())
def check_index(index: torch.Tensor, low: int, high: int, what: str) -> torch.Tensor:
    if index.numel():
        lo, hi = (int(v) for v in torch.aminmax(index))
        if lo < low or hi >= high:
            bad = lo if lo < low else hi
            raise IndexError(f"index {bad} out of range [{low}, {high}) {what}")
    return index.clone()


@check_index.register_fake
def _(index, low, high, what):
    return torch.empty_like(index)


torch.fx.node.has_side_effect(torch.ops.grcompile.check_index.default)

CHECK_INDEX = torch.ops.grcompile.check_index.default


def _mutates(node: fx.Node) -> bool:
    """Conservatively: does ``node`` write into one of its inputs (``x.clamp_()``, ``x[i] = v``)?"""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function":
        if node.target in (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv):
            return True
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            return schema.is_mutable
        return getattr(node.target, "__name__", "").endswith("_")
    return False


# ops whose result may share memory with their (first) input: views, and conversions that return
# the input itself when nothing changes (``x.long()`` of an int64 ``x``)
_MAY_ALIAS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze", "transpose", "t",
    "permute", "expand", "expand_as", "narrow", "select", "unbind", "split", "split_with_sizes", "chunk",
    "tensor_split", "as_strided", "diagonal", "movedim", "moveaxis", "swapaxes", "swapdims", "unfold", "detach",
    "contiguous", "real", "imag", "view_as_real", "view_as_complex", "getitem", "to", "type", "type_as", "long",
    "int", "short", "byte", "char", "float", "double", "half", "bfloat16", "bool", "alias", "ravel", "T", "mT",
    "H", "mH", "adjoint", "align_as", "rename", "refine_names", "cpu", "cuda"})


def _may_alias_input(node: fx.Node) -> bool:
    if node.op not in ("call_method", "call_function"):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None:  # an aten overload says whether its output aliases an input
        return any(r.alias_info is not None for r in schema.returns)
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name in _MAY_ALIAS


def _alias_roots(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Each node's alias class (a representative node): a view and what it views share one."""
    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        while parent.get(n, n) is not n:
            n = parent[n]
        return n
    for node in gm.graph.nodes:
        if _may_alias_input(node):
            for arg in node.all_input_nodes:
                parent[find(node)] = find(arg)
                break  # the viewed tensor is the first input
    return {n: find(n) for n in gm.graph.nodes}


def pin_checks(gm: fx.GraphModule) -> int:
    """Make every ``check_index`` dominate the other readers of its index: the check moves right
    after the index is defined and the readers consume its output (graph outputs and in-place
    writers keep the original, whose identity they need). An index written in place anywhere in
    the graph — itself or any view of the same memory — is left where it is: moved earlier, the
    check would see values from before the write, and its readers would read that stale copy.
    Returns the number of checks pinned."""
    pinned = 0
    last_placeholder = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            last_placeholder = node
    roots = _alias_roots(gm)
    written = {roots[a] for n in gm.graph.nodes if _mutates(n) for a in n.all_input_nodes}
    for check in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is CHECK_INDEX]:
        index = check.args[0]
        if not isinstance(index, fx.Node) or roots[index] in written:
            continue
        (last_placeholder if index.op == "placeholder" else index).append(check)
        index.replace_all_uses_with(check, delete_user_cb=lambda u: u is not check and u.op != "output")
        if "example_value" in index.meta:
            check.meta.setdefault("example_value", index.meta["example_value"])
        pinned += 1
    if pinned:
        gm.graph.lint()
        gm.recompile()
    return pinned
