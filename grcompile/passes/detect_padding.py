"""Pass ``detect_padding``: where validity comes from and which tensors are padded.

Matches: a boolean ``[B, N]`` validity mask built from the inputs — ``ids != pad`` for any pad id
(also ``~(ids == pad)``, ``ids > pad``, their float casts, ``ids.bool()`` for pad 0) or ``arange(N) < lengths[:, None]`` (and
its mirror forms); the mask must be computed position-wise (no shift or reduction along N).
Emits: nothing in the graph. It annotates ``node.meta["grcompile_layout"]`` with a
``Token`` / ``Pair`` / ``None`` layout (see ``layout.py``) for every node, and
``gm.meta["grcompile_padding"]`` with a ``PaddingInfo``. Counters: ``validity_sources``,
``token_tensors``, ``pair_tensors``.
Invariant: the graph is unchanged. Later passes trust a layout only as far as its rules go: a
layout says which axes index (row, position), never what the padded positions contain.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from .pass_manager import GraphPass, PassContext, node_site
from .axes import AxisClasses
from .layout import Layout, Pair, Token, propagate
from .op_semantics import arg, canonical, example, refresh_example_values, shape_of
from .symbolic import known_eq

LAYOUT = "grcompile_layout"
PADDING = "grcompile_padding"

_COMPARE = ("ne", "eq", "gt", "ge", "lt", "le")


@dataclass
class PaddingInfo:
    batch: int
    seq_len: int
    validity: list[fx.Node]  # boolean [B, N] masks (True = real item), most used first
    description: str  # how validity is computed, in the user's terms
    layouts: dict[fx.Node, Layout] = field(default_factory=dict)
    padding: list[fx.Node] = field(default_factory=list)  # boolean [B, N] masks (True = padding)
    # set by analyse_unpadded only: the [B, N] integer input whose axes the layouts follow, when the
    # graph has no padding mask at all (every position is a real one to the model's math)
    unpadded: fx.Node | None = None


def _is_int_tensor(node: object) -> bool:
    ex = example(node)
    return isinstance(ex, torch.Tensor) and not ex.dtype.is_floating_point and ex.dtype != torch.bool


def _describe(node: fx.Node, negated: bool = False) -> str | None:
    """``'ids != 0'``-style description if ``node`` is a validity comparison, else None."""
    op = canonical(node)
    if op == "not" and isinstance(node.args[0], fx.Node) and canonical(node.args[0]) == "eq":
        inner = _describe(node.args[0], negated=True)
        return None if inner is None else f"~({inner})"
    if op == "unary" and _is_bool_cast(node):  # ids.bool(), ids.to(torch.bool): ids != 0
        a = node.args[0]
        if isinstance(a, fx.Node) and a.op == "placeholder" and _is_int_tensor(a):
            return f"{a.name} != 0"
        return None
    if op not in _COMPARE or len(node.args) < 2:
        return None
    a, b = node.args[0], node.args[1]
    symbol = {"ne": "!=", "eq": "==", "gt": ">", "ge": ">=", "lt": "<", "le": "<="}[op]

    if isinstance(a, fx.Node) and a.op == "placeholder" and _is_int_tensor(a) and isinstance(b, (int, float)):
        return f"{a.name} {symbol} {b}"
    if isinstance(a, fx.Node) and isinstance(b, fx.Node) and (_involves_arange(a) or _involves_arange(b)):
        return f"{_origin(a)} {symbol} {_origin(b)}"
    return None


def _is_bool_cast(node: fx.Node) -> bool:
    """``x.bool()`` or ``x.to(torch.bool)`` / ``x.to(dtype=torch.bool)`` (true where ``x != 0``)."""
    if node.op != "call_method" or not node.args:
        return False
    if node.target == "bool":
        return len(node.args) == 1 and not node.kwargs
    if node.target == "to":
        dtypes = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, torch.dtype)]
        return dtypes == [torch.bool] and all(isinstance(a, (torch.dtype, bool)) for a in node.args[1:])
    return False


def _as_validity(description: str) -> str:
    """One spelling for a comparison and its negation: ``ids == 0`` and ``~(ids == 0)`` both read
    ``ids != 0`` (the first marks padding, the second validity: the same information)."""
    if description.startswith("~(") and description.endswith(")"):
        description = description[2:-1]
    return description.replace(" == ", " != ")


def _involves_arange(node: fx.Node, depth: int = 3) -> bool:
    if canonical(node) == "arange":
        return True
    return depth > 0 and any(isinstance(a, fx.Node) and _involves_arange(a, depth - 1) for a in node.args)


def _origin(node: fx.Node) -> str:
    while canonical(node) in ("unsqueeze", "reshape", "expand", "getitem", "unary") and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return "arange(N)" if canonical(node) == "arange" else node.name


class DetectPadding(GraphPass):
    name = "detect_padding"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        info = analyse(gm)
        gm.meta[PADDING] = info
        if info is None:
            ctx.fallback(None, "no padding mask found (no `ids != pad` or `arange(N) < lengths` over a [B, N] "
                               "input): nothing is packed (a causal attention may still be fused over every "
                               "position, see fuse_attention)")
            return
        for node, layout in info.layouts.items():
            node.meta[LAYOUT] = layout
        ctx.count("validity_sources", len(info.validity) + len(info.padding))
        ctx.count("token_tensors", sum(isinstance(l, Token) for l in info.layouts.values()))
        ctx.count("pair_tensors", sum(isinstance(l, Pair) for l in info.layouts.values()))


def analyse(gm: fx.GraphModule) -> PaddingInfo | None:
    """Find the validity mask and propagate layouts; ``None`` when there is no padding mask."""
    refresh_example_values(gm)
    candidates = [(n, d) for n in gm.graph.nodes if (d := _describe(n)) is not None]
    # `ids == pad` marks padding (validity negated); everything else marks validity
    is_padding = {n for n, _ in candidates if canonical(n) == "eq"}
    candidates = [(n, d) for n, d in candidates if (s := shape_of(n)) is not None and len(s) == 2
                  and example(n).dtype == torch.bool]
    if not candidates:
        return None
    # Rows and positions are axis classes (axes.py), not sizes: B == N, or a [B, R] input with
    # R == N, cannot confuse them. The validity is the candidate whose position axis is the most
    # widely used one (attention pairs it with itself); others must share its classes.
    classes = AxisClasses(gm)
    first = max(candidates, key=lambda c: classes.spread(classes.find((c[0], 1))))[0]
    rows, positions = classes.find((first, 0)), classes.find((first, 1))
    if rows == positions:
        return None  # some op mixes rows and positions: no layout can be trusted
    B, N = shape_of(first)
    layouts = _layouts(gm, classes, rows, positions, N)
    # only spellings of the same comparison are the validity (or its negation, the padding): a
    # second mask over the batch (`keep != 0`, `attention_mask == 0`) is per-token data like any other
    described = dict(candidates)
    masks = [n for n, d in candidates if layouts.get(n) == Token(0, 1, 2) and _as_validity(d) == _as_validity(
             described[first]) and classes.find((n, 0)) == rows and classes.find((n, 1)) == positions]
    validity = sorted((n for n in masks if n not in is_padding), key=lambda n: -len(n.users))
    padding = sorted((n for n in masks if n in is_padding), key=lambda n: -len(n.users))
    if not masks:
        return None
    first = (validity or padding)[0]
    description = dict(candidates)[first] + (" (marks padding)" if first in is_padding else "")
    return PaddingInfo(B, N, validity, f"{description} at {node_site(first)}", layouts, padding)


def analyse_unpadded(gm: fx.GraphModule) -> PaddingInfo | None:
    """Layouts for a graph with no padding mask, rooted at its ``[B, N]`` integer input (the ids:
    the one whose position axis the most ops share), or ``None`` when there is none. Every
    position counts as valid (``validity`` and ``padding`` are empty, ``unpadded`` is that input):
    what a pass may do with it is what is exact when nothing is padded — fuse a causal attention
    as written, never drop a position."""
    refresh_example_values(gm)
    ids = [n for n in gm.graph.nodes if n.op == "placeholder" and _is_int_tensor(n)
           and (s := shape_of(n)) is not None and len(s) == 2]
    if not ids:
        return None
    classes = AxisClasses(gm)
    first = max(ids, key=lambda n: classes.spread(classes.find((n, 1))))
    rows, positions = classes.find((first, 0)), classes.find((first, 1))
    if rows == positions:
        return None
    B, N = shape_of(first)
    return PaddingInfo(B, N, [], f"no padding mask: every position of {first.name} counts as valid",
                       _layouts(gm, classes, rows, positions, N), [], unpadded=first)


def _layouts(gm: fx.GraphModule, classes: AxisClasses, rows, positions, N) -> dict[fx.Node, Layout]:
    layouts: dict[fx.Node, Layout] = {}
    from_tables: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            layouts[node] = _input_layout(node, classes, rows, positions)
        elif canonical(node) == "arange" and _is_positions(node, N) and classes.axes_in(node, positions) == [0]:
            layouts[node] = Token(None, 0, 1)
        elif canonical(node) == "jagged_to_padded_dense" and _pads_the_rows(node, classes, rows, N):
            layouts[node] = Token(0, 1, len(shape_of(node)))
        else:
            layout = _with_rows(propagate(node, layouts), node, classes, rows)
            layouts[node] = layout if layout is not None else _unpadded_token(node, layouts, classes, rows, positions,
                                                                             from_tables)
    return layouts


def _unpadded_token(node: fx.Node, layouts: dict, classes: AxisClasses, rows, positions,
                    memo: dict[fx.Node, bool]) -> Layout:
    """A value computed only from the model's parameters and buffers, constants and sizes — no
    data input reaches it, so it holds nothing of a padded position — whose axes dataflow ties to
    one position axis (and at most one row axis), as a graph input's are: BERT's
    ``position_ids[:, :N]`` buffer slice or ``pos.weight[:N]`` where N is below the tables'
    length. The layout only says how to pack it."""
    if node.op not in ("call_function", "call_method") or not isinstance(example(node), torch.Tensor):
        return None
    if not _from_tables(node, memo):
        return None
    b, n = classes.axes_in(node, rows), classes.axes_in(node, positions)
    if len(n) != 1 or len(b) > 1:
        return None
    return Token(b[0] if b else None, n[0], len(shape_of(node)))


def _from_tables(node: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """No data input of the graph reaches ``node`` other than through its size (parameters,
    buffers, attributes, constants and symbolic sizes only)."""
    stack, seen = [node], []
    while stack:
        n = stack.pop()
        if n in memo:
            if not memo[n]:
                memo[node] = False
                return False
            continue
        value = example(n)
        if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
            memo[n] = True  # a size: no values of its tensor
            continue
        if n.op == "get_attr":
            memo[n] = True
            continue
        if n.op == "placeholder":
            source = _source_name(n)
            memo[n] = source is not None and ("._parameters[" in source or "._buffers[" in source)
            if not memo[n]:
                memo[node] = False
                return False
            continue
        if n.op not in ("call_function", "call_method"):
            memo[n] = False
            memo[node] = False
            return False
        seen.append(n)
        stack.extend(n.all_input_nodes)
    for n in seen:
        memo[n] = True
    return True


def _source_name(node: fx.Node) -> str | None:
    """Dynamo's source of a placeholder (``L['self']._modules['pos']._parameters['weight']``)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    try:
        return source.name if source is not None else None
    except Exception:  # noqa: BLE001 - a source kind without a name
        return None


def _with_rows(layout: Layout, node: fx.Node, classes: AxisClasses, rows) -> Layout:
    """A size-1 row axis reads as a broadcast to the layout rules (a ``[1, N, D]`` table); when the
    batch really has one row (a static B = 1), dataflow says which axis is the rows'."""
    if not isinstance(layout, (Token, Pair)) or layout.batch is not None:
        return layout
    axes = [a for a in classes.axes_in(node, rows) if a not in layout.axes().values()]
    return replace(layout, batch=axes[0]) if len(axes) == 1 else layout


def _input_layout(node: fx.Node, classes: AxisClasses, rows, positions) -> Layout:
    """A graph input is a token tensor when its axes are tied to the validity's rows / positions
    by dataflow: exactly one row axis (``Token(b, n)`` with one position axis, ``Token(b, None)``
    per-row values such as lengths) or one position axis (``Token(None, n)``)."""
    shape = shape_of(node)
    if shape is None:
        return None
    b, n = classes.axes_in(node, rows), classes.axes_in(node, positions)
    if len(b) > 1 or len(n) > 1 or not (b or n):
        return None
    return Token(b[0] if b else None, n[0] if n else None, len(shape))


def _pads_the_rows(node: fx.Node, classes: AxisClasses, rows, N) -> bool:
    """fbgemm's ``jagged_to_padded_dense(values, [offsets], [N], pad)`` with ``offsets`` the
    cumulative sum of a per-row value of the batch (``valid.sum(1)``): row ``b`` of its output is
    the batch's row ``b`` and its axis 1 the ``N`` positions, whatever the values (user code that
    runs part of the block jagged by hand and pads back)."""
    offsets, max_lengths = arg(node, 1, "offsets"), arg(node, 2, "max_lengths")
    if not (isinstance(offsets, (list, tuple)) and len(offsets) == 1 and isinstance(max_lengths, (list, tuple))
            and len(max_lengths) == 1):
        return False
    (cumsum,), (max_len,) = offsets, max_lengths
    if not isinstance(cumsum, fx.Node) or canonical(cumsum) != "complete_cumsum" or len(cumsum.args) != 1:
        return False
    lengths, shape = cumsum.args[0], shape_of(node)
    return (isinstance(lengths, fx.Node) and len(shape_of(lengths) or ()) == 1
            and classes.axes_in(lengths, rows) == [0] and known_eq(example(max_len), N)
            and shape is not None and len(shape) >= 2)


_RANGE = ("start", "end", "step")


def _is_positions(node: fx.Node, N) -> bool:
    """``arange(N)`` — also spelled ``arange(0, N)``, ``arange(0, N, 1)`` or with ``start`` /
    ``end`` / ``step`` keywords — with N the validity's N: the padded positions."""
    if set(node.kwargs) - {"device", "dtype", "layout", "pin_memory", "requires_grad", *_RANGE}:
        return False
    if len(node.args) > 3 or any(k in node.kwargs for k in _RANGE[:len(node.args)]):
        return False
    given = dict(zip(_RANGE, node.args)) if len(node.args) != 1 else {"end": node.args[0]}
    given.update({k: node.kwargs[k] for k in _RANGE if k in node.kwargs})
    if "end" not in given:
        return False
    start, step = given.get("start", 0), given.get("step", 1)
    return (type(start) is int and start == 0 and type(step) is int and step == 1
            and known_eq(example(given["end"]), N))
