"""Pass ``guard_indices``: every table lookup checks its index the way eager would, and says where.

Matches: ``F.embedding(index, weight)`` / ``torch.embedding`` (valid ``[0, rows)``),
``table[index]`` with integer tensor indices, also inside a tuple of slices and ints (valid
``[-size, size)``, Python's negative indexing), ``index_select`` / ``gather`` (``[0, size)``),
wherever the table's size along the indexed dim is static.
Emits: ``grcompile::check_index(index, low, high, what)`` beside the lookup, on the index *as
captured* — dense, before any later pass packs it: eager checks every position, padded ones
included (``arange(N)`` into a position table of ``max_len`` rows raises in eager even when
every row is short). ``what`` names the table (module path), the index (the user's input name, or
the variable it was computed into) and the user's line. No check where the index's range is
proved at compile time — interval arithmetic over ``arange`` / constants / ``clamp`` / ``%`` /
``bucketize`` / integer ops (bucketed-time gathers), or, for an index computed from constants only
(relative positions, T5 buckets), by evaluating it; a range proved *out* of bounds keeps its check,
so the call raises like eager. The backend pins each check before the index's readers.
Counters (no rewrite entries: a guard rewrites none of the user's computation): ``check_index``
(one per check emitted), ``proved`` (no check needed), ``unchecked``: a computed index larger than
the inputs (a ``[B, N, N]`` bucket tensor) whose range cannot be proved is left to the lowering's
own bounds check (checking it would materialise it, and nothing is lost to optimization).
Invariant: values and gradients unchanged; only inputs eager would reject raise, as IndexError.
"""
from __future__ import annotations

import logging
import math
import operator
import re
from typing import Any

import torch
import torch.fx as fx

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch < 2.12 (GPU images carry older torch): the same helper under its old name
    from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint

from .pass_manager import GraphPass, PassContext, node_site
from ..lowering.checks import CHECK_INDEX
from .op_semantics import RANDOM_OPS, arg, canonical, evaluate, example

Range = tuple[int, int]  # inclusive

log = logging.getLogger("grcompile")


def _tensor(value: Any) -> torch.Tensor | None:
    ex = example(value) if isinstance(value, fx.Node) else None
    return ex if isinstance(ex, torch.Tensor) else None


def _is_index(value: Any) -> bool:
    t = _tensor(value)
    return t is not None and not t.dtype.is_floating_point and not t.dtype.is_complex \
        and t.dtype not in (torch.bool, torch.uint8)


def _static(value: Any) -> int | None:
    return value if type(value) is int else None


def _source(node: fx.Node) -> str | None:
    """Dynamo's source name of a placeholder: ``L['ids']``, ``L['self']._modules['emb']._parameters['weight']``."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None) or getattr(node, "_dynamo_source", None)
    try:
        return source.name if source is not None else None
    except Exception:  # noqa: BLE001 - a source kind without a name
        return None


def _user_expr(source: str) -> str:
    """``L['ids']`` -> ``ids``, ``L['batch']['ids']`` -> ``batch['ids']``: as the user spelled it."""
    return re.sub(r"^L\['([^']+)'\]", r"\1", source)


def table_name(node: Any, strip_weight: bool) -> str:
    """Module path of a table (``item_embedding``, ``blocks.0.position_bias.weight``)."""
    if not isinstance(node, fx.Node):
        return "a constant table"
    if node.op == "get_attr":
        return str(node.target)
    source = _source(node) if node.op == "placeholder" else None
    if source:
        parts = re.findall(r"\['([^']+)'\]|\.(\w+)", source.split("]", 1)[-1])
        path = ".".join(p for a, b in parts if (p := a or b) not in ("_modules", "_parameters", "_buffers"))
        if path:
            return path[: -len(".weight")] if strip_weight and path.endswith(".weight") else path
    return node.name


def index_name(node: fx.Node) -> str:
    """``input 'ids'`` for a graph input, else the variable it was computed into and where."""
    if node.op == "placeholder":
        return f"input '{_user_expr(_source(node) or node.name)}'"
    names = ", ".join(sorted({f"'{_user_expr(_source(p) or p.name)}'" for p in _input_ancestors(node)}))
    return f"index '{node.name}' (computed at {node_site(node)}" + (f" from input {names})" if names else ")")


def _input_ancestors(node: fx.Node, limit: int = 200) -> list[fx.Node]:
    """Integer graph inputs the index is computed from (parameters excluded)."""
    seen, stack, found = {node}, [node], []
    while stack and len(seen) < limit:
        for a in stack.pop().all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            if a.op == "placeholder":
                if _is_index(a) and "_parameters[" not in (_source(a) or ""):
                    found.append(a)
            else:
                stack.append(a)
    return found


# --- compile-time ranges ----------------------------------------------------------------------

_SAME_RANGE = ("unsqueeze", "squeeze", "reshape", "transpose", "permute", "expand", "getitem", "split", "chunk")
_SAME_RANGE_METHODS = ("long", "int", "contiguous", "clone", "detach", "flatten", "repeat", "to", "type_as",
                       "expand_as", "view_as", "reshape_as")


def _add(a: Range, b: Range) -> Range:
    return a[0] + b[0], a[1] + b[1]


def _mul(a: Range, b: Range) -> Range:
    products = [x * y for x in a for y in b]
    return min(products), max(products)


def value_range(value: Any, memo: dict[fx.Node, Range | None] | None = None) -> Range | None:
    """Inclusive ``(lo, hi)`` of an integer value known at compile time (static ints only), else None."""
    if type(value) is int:
        return value, value
    if type(value) is bool:
        return int(value), int(value)
    if not isinstance(value, fx.Node):
        return None
    memo = {} if memo is None else memo
    if value in memo:
        return memo[value]
    memo[value] = None  # cycles cannot happen in a DAG; this also bounds the work
    memo[value] = result = _node_range(value, memo)
    return result


def _node_range(node: fx.Node, memo: dict[fx.Node, Range | None]) -> Range | None:
    op = canonical(node)
    t = _tensor(node)
    if t is not None and (t.dtype.is_floating_point or t.dtype.is_complex):
        return None
    r = lambda v: value_range(v, memo)  # noqa: E731
    a0 = node.args[0] if node.args else None
    if op == "arange":
        ints = [_static(a) for a in node.args if not isinstance(a, torch.dtype)]
        if not node.args or None in ints or any(isinstance(v, fx.Node) for v in node.kwargs.values()):
            return None
        start, end, step = (0, ints[0], 1) if len(ints) == 1 else (ints[0], ints[1], ints[2] if len(ints) > 2 else 1)
        step = _static(node.kwargs.get("step", step))
        if step is None or step == 0:
            return None
        count = max(0, math.ceil((end - start) / step))
        if count == 0:
            return 0, -1  # empty: nothing to look up
        last = start + (count - 1) * step
        return min(start, last), max(start, last)
    if op in ("add", "sub", "mul") and len(node.args) >= 2:
        a, b = r(node.args[0]), r(node.args[1])
        if a is None or b is None or node.kwargs.get("alpha", 1) != 1:
            return None
        if op == "add":
            return _add(a, b)
        if op == "sub":
            return _add(a, (-b[1], -b[0]))
        return _mul(a, b)
    if op == "neg" and a0 is not None:
        a = r(a0)
        return None if a is None else (-a[1], -a[0])
    if node.target in (operator.mod, torch.remainder) or (node.op == "call_method" and node.target == "remainder"):
        m = _static(node.args[1]) if len(node.args) > 1 else None
        return (0, m - 1) if m is not None and m > 0 else None
    if node.target in (torch.clamp, torch.clip, torch.clamp_min, torch.clamp_max) or \
            (node.op == "call_method" and node.target in ("clamp", "clip", "clamp_min", "clamp_max")):
        name = getattr(node.target, "__name__", node.target)
        lo_c = arg(node, 1, "min") if name != "clamp_max" else None
        hi_c = (arg(node, 2, "max") if name in ("clamp", "clip") else arg(node, 1, "max")) if name != "clamp_min" else None
        if (lo_c is not None and _static(lo_c) is None) or (hi_c is not None and _static(hi_c) is None):
            return None
        inner = r(a0)
        if inner is None:
            if lo_c is None or hi_c is None:
                return None
            inner = (lo_c, hi_c)
        # clamp(x) = min(max(x, lo_c), hi_c) is monotone: map the interval's ends
        lo, hi = inner
        if lo_c is not None:
            lo, hi = max(lo, lo_c), max(hi, lo_c)
        if hi_c is not None:
            lo, hi = min(lo, hi_c), min(hi, hi_c)
        return lo, hi
    if op == "where" and len(node.args) == 3:
        a, b = r(node.args[1]), r(node.args[2])
        return None if a is None or b is None else (min(a[0], b[0]), max(a[1], b[1]))
    if op == "cat":
        parts = [r(x) for x in (a0 or [])]
        if not parts or None in parts:
            return None
        return min(p[0] for p in parts), max(p[1] for p in parts)
    if op == "factory" and node.target in (torch.full, torch.full_like):
        return r(node.args[1]) if len(node.args) > 1 else None
    if op in ("factory",) and node.target in (torch.zeros, torch.zeros_like):
        return 0, 0
    if op in ("factory",) and node.target in (torch.ones, torch.ones_like):
        return 1, 1
    if node.target is torch.bucketize or (node.op == "call_method" and node.target == "bucketize"):
        boundaries = _tensor(arg(node, 1, "boundaries"))
        n = _static(boundaries.shape[0]) if boundaries is not None and boundaries.dim() == 1 else None
        return None if n is None else (0, n)
    if op in _SAME_RANGE or (op == "unary" and node.op == "call_method" and node.target in _SAME_RANGE_METHODS):
        # views, copies and selections of an integer tensor take their values from it
        return r(a0) if isinstance(a0, fx.Node) else None
    return None


_RANDOM = RANDOM_OPS


def constant_range(gm: fx.GraphModule, index: fx.Node, limit: int = 64) -> Range | None:
    """Range of an index computed from constants only (positions, buckets of relative positions,
    whatever the formula): evaluated now on real tensors, which is a proof for static shapes."""
    nodes, stack = {index}, [index]
    while stack:
        n = stack.pop()
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        if n.op not in ("call_function", "call_method", "get_attr") or name in _RANDOM or len(nodes) > limit:
            return None
        for a in n.all_input_nodes:
            if a not in nodes:
                nodes.add(a)
                stack.append(a)
    env: dict[fx.Node, Any] = {}
    try:
        for n in gm.graph.nodes:
            if n in nodes:
                env[n] = getattr(gm, n.target) if n.op == "get_attr" else evaluate(
                    n, fx.node.map_arg(n.args, env.get), fx.node.map_arg(n.kwargs, env.get))
    except Exception:  # noqa: BLE001 - no proof, then: the index gets its runtime check
        return None
    value = env[index]
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.dtype == torch.bool:
        return None
    if value.numel() == 0:
        return 0, -1
    lo, hi = torch.aminmax(value)
    return int(lo), int(hi)


# --- the lookups ------------------------------------------------------------------------------

def _getitem_lookups(node: fx.Node) -> list[tuple[fx.Node, int, int, int]]:
    """``(index, dim, low, high)`` for each integer tensor index of ``table[...]``."""
    table, index = node.args[0], node.args[1]
    t = _tensor(table)
    if t is None:
        return []
    entries = index if isinstance(index, tuple) else (index,)
    found, dim = [], 0
    for entry in entries:
        if entry is Ellipsis:
            break  # dims after an ellipsis count from the end; not worth the bookkeeping
        if entry is None:
            continue
        if isinstance(entry, fx.Node) and _tensor(entry) is not None:
            e = _tensor(entry)
            if e.dtype in (torch.bool, torch.uint8):
                dim += e.dim()  # a mask selects, it cannot be out of range in value
                continue
            if _is_index(entry) and dim < t.dim():
                size = _static(t.shape[dim])
                if size is not None:
                    found.append((entry, dim, -size, size))
            dim += 1
            continue
        dim += 1  # a slice or an int
    return found


def lookups(node: fx.Node) -> list[tuple[fx.Node, Any, int, int, str]]:
    """``(index, table, low, high, kind)`` for every bounded lookup ``node`` performs."""
    op = canonical(node)
    if op == "embedding":
        if node.target not in (torch.nn.functional.embedding, torch.embedding):
            return []  # embedding-like runtime ops check their own ids
        index, weight = (arg(node, 0, "input"), arg(node, 1, "weight")) if node.target is torch.nn.functional.embedding \
            else (arg(node, 1, "indices"), arg(node, 0, "weight"))
        w = _tensor(weight)
        if w is None or not _is_index(index) or _static(w.shape[0]) is None:
            return []
        return [(index, weight, 0, w.shape[0], "embedding")]
    if op == "getitem":
        return [(i, node.args[0], lo, hi, "gather") for i, _, lo, hi in _getitem_lookups(node)]
    is_method = node.op == "call_method"
    if node.target in (torch.index_select, torch.gather) or (is_method and node.target in ("index_select", "gather")):
        table, dim, index = node.args[0], arg(node, 1, "dim"), arg(node, 2, "index")
        t = _tensor(table)
        if t is None or _static(dim) is None or not _is_index(index) or not -t.dim() <= dim < max(t.dim(), 1):
            return []
        size = _static(t.shape[dim]) if t.dim() else 1
        return [] if size is None else [(index, table, 0, size, "gather")]
    return []


def _numel_hint(node: fx.Node) -> int:
    t = _tensor(node)
    return 0 if t is None else optimization_hint(t.numel(), fallback=2**62)


class GuardIndices(GraphPass):
    name = "guard_indices"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        graph = gm.graph
        inputs = [n for n in graph.nodes if n.op == "placeholder" and _is_index(n)
                  and "_parameters[" not in (_source(n) or "")]
        budget = max((_numel_hint(n) for n in inputs), default=0)
        memo: dict[fx.Node, Range | None] = {}
        done: set[tuple[fx.Node, int, int]] = set()
        for node in list(graph.nodes):
            for index, table, low, high, kind in lookups(node):
                if (index, low, high) in done:
                    continue
                done.add((index, low, high))
                proved = value_range(index, memo) or constant_range(gm, index)
                if proved is not None and (proved[0] > proved[1] or (low <= proved[0] and proved[1] < high)):
                    ctx.count("proved")
                    continue
                rows = f"{high} rows" if low == 0 else f"size {high}"
                what = (f"of {table_name(table, kind == 'embedding')} ({rows}) in {index_name(index)}, "
                        f"looked up at {node_site(node)}")
                if index.op != "placeholder" and _numel_hint(index) > budget:
                    # not an optimization given up (nothing is slower or different), so a counter
                    ctx.count("unchecked")
                    log.debug("guard_indices: index '%s' %s is larger than the inputs and not provable; "
                              "left to the lowering's bounds check", index.name, what)
                    continue
                with graph.inserting_before(node):
                    check = graph.call_function(CHECK_INDEX, (index, low, high, what))
                check.meta["stack_trace"] = node.meta.get("stack_trace")
                ctx.count("check_index")  # a guard, not a rewrite of the user's computation: counted only
