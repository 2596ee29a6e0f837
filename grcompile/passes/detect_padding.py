"""Pass ``detect_padding``: where validity comes from and which tensors are padded.

Matches: a boolean ``[B, N]`` validity mask built from the inputs — ``ids != pad`` for any pad id
(also ``~(ids == pad)``, ``ids > pad``, their float casts) or ``arange(N) < lengths[:, None]`` (and
its mirror forms); the mask must be computed position-wise (no shift or reduction along N).
Emits: nothing in the graph. It annotates ``node.meta["grcompile_layout"]`` with a
``Token`` / ``Pair`` / ``None`` layout (see ``layout.py``) for every node, and
``gm.meta["grcompile_padding"]`` with a ``PaddingInfo``. Counters: ``validity_sources``,
``token_tensors``, ``pair_tensors``.
Invariant: the graph is unchanged. Later passes trust a layout only as far as its rules go: a
layout says which axes index (row, position), never what the padded positions contain.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..capture.pass_manager import GraphPass, PassContext, node_site
from .layout import Layout, Pair, Token, propagate
from .op_semantics import arg, canonical, example, refresh_example_values, shape_of

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


def _is_int_tensor(node: object) -> bool:
    ex = example(node)
    return isinstance(ex, torch.Tensor) and not ex.dtype.is_floating_point and ex.dtype != torch.bool


def _describe(node: fx.Node, negated: bool = False) -> str | None:
    """``'ids != 0'``-style description if ``node`` is a validity comparison, else None."""
    op = canonical(node)
    if op == "not" and isinstance(node.args[0], fx.Node) and canonical(node.args[0]) == "eq":
        inner = _describe(node.args[0], negated=True)
        return None if inner is None else f"~({inner})"
    if op not in _COMPARE or len(node.args) < 2:
        return None
    a, b = node.args[0], node.args[1]
    symbol = {"ne": "!=", "eq": "==", "gt": ">", "ge": ">=", "lt": "<", "le": "<="}[op]

    if isinstance(a, fx.Node) and a.op == "placeholder" and _is_int_tensor(a) and isinstance(b, (int, float)):
        return f"{a.name} {symbol} {b}"
    if isinstance(a, fx.Node) and isinstance(b, fx.Node) and (_involves_arange(a) or _involves_arange(b)):
        return f"{_origin(a)} {symbol} {_origin(b)}"
    return None


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
                               "input): the model is left dense")
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
    # (B, N) from the first validity found in program order; others must agree.
    B, N = shape_of(candidates[0][0])
    layouts: dict[fx.Node, Layout] = {}
    for node in gm.graph.nodes:
        shape = shape_of(node)
        if node.op == "placeholder":
            if shape is not None and len(shape) >= 2 and shape[:2] == (B, N):
                layouts[node] = Token(0, 1, len(shape))
            elif shape == (B,) and _is_int_tensor(node):
                layouts[node] = Token(0, None, 1)  # per-row lengths
            else:
                layouts[node] = None
        elif canonical(node) == "arange" and shape == (N,) and arg(node, 0, "end") == N and len(node.args) <= 1:
            layouts[node] = Token(None, 0, 1)
        else:
            layouts[node] = propagate(node, layouts)
    masks = [n for n, _ in candidates if layouts.get(n) == Token(0, 1, 2) and shape_of(n) == (B, N)]
    validity = sorted((n for n in masks if n not in is_padding), key=lambda n: -len(n.users))
    padding = sorted((n for n in masks if n in is_padding), key=lambda n: -len(n.users))
    if not masks:
        return None
    first = (validity or padding)[0]
    description = dict(candidates)[first] + (" (marks padding)" if first in is_padding else "")
    return PaddingInfo(B, N, validity, f"{description} at {node_site(first)}", layouts, padding)
