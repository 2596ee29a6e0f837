"""``repeat`` / ``tile`` by a symbolic count, spelled as ``expand`` so autograd never guards on it.

Why: after a shape change the batch axis is an *unbacked* symbol ``u0`` (``capture/shapes.py``).
Code such as ``pe.unsqueeze(0).repeat(batch_size, 1, 1)`` then repeats by ``u0``, and AOTAutograd's
joint trace runs autograd's C++ ``repeat_backward``, which branches on the counts
(``repeats == 0`` -> zeros, ``repeat != 1`` -> a summed axis): ``Eq(u0, 0)`` / ``Ne(u0, 1)`` has no
answer for an unbacked symbol, ``GuardOnDataDependentSymNode`` is raised, and the graph cannot be
lowered at all (with backed symbols it would guard instead: one more specialisation). ``expand``'s
backward (``sum_to`` over the broadcast axes) is written guard-free for unbacked sizes.

Matches / emits (counter ``repeat_as_expand``): ``x.repeat(*r)``, ``torch.Tensor.repeat``,
``x.tile(r)`` / ``torch.tile(x, r)`` where some count ``r_i`` is a symbolic size (a graph value,
provably >= 0 — a negative count is an error for ``repeat`` but "keep" for ``expand``). With
``x`` of shape ``s`` (tile's counts left-padded with 1s; ``repeat``'s extra leading counts are new
axes):

* an axis with ``r_i`` the literal 1 is kept (``-1``);
* an axis of static size 1 is broadcast to ``r_i``;
* any other axis is tiled: ``unsqueeze`` before it, broadcast that axis to ``r_i``, and
  ``flatten`` the pair back (``r_i·s_i`` elements, copy ``i`` at ``i·s_i``, as ``repeat`` lays
  them out);
* then ``clone(memory_format=contiguous_format)``: ``repeat`` returns a fresh contiguous tensor,
  never a view of ``x`` (an in-place op on the result must not write ``x``, and ``view`` must work).

Invariant: the values are the same elements in the same layout, and the gradient is the same sum
over the repeated copies (``repeat_backward`` reshapes the gradient to ``[r_i, s_i]`` and sums the
``r_i`` axes; ``flatten``'s backward is that reshape and ``expand``'s is that sum). Counts that are
Python ints are left alone (their backward does not guard), so a static graph is unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .op_semantics import example, refresh_example_values, shape_of
from .pass_manager import GraphPass, PassContext
from .symbolic import is_one, is_symbolic, known_ge, static_int

__all__ = ["SymbolicRepeat", "repeat_counts"]

_REPEAT_TARGETS = {torch.Tensor.repeat: "repeat", torch.Tensor.tile: "tile", torch.tile: "tile"}


def _op(n: fx.Node) -> str | None:
    """``"repeat"`` / ``"tile"`` for the spellings of those ops, else None."""
    if n.op == "call_method" and n.target in ("repeat", "tile"):
        return n.target
    if n.op == "call_function":
        try:
            return _REPEAT_TARGETS.get(n.target)
        except TypeError:  # an unhashable target
            return None
    return None


def repeat_counts(n: fx.Node) -> tuple[str, fx.Node, list[Any]] | None:
    """``(op, x, counts)`` of a ``repeat`` / ``tile`` node (counts as written: ints or nodes), or
    None when ``n`` is neither or its arguments are spelled in a way not understood here."""
    op = _op(n)
    if op is None or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    x, rest = n.args[0], list(n.args[1:])
    keyword = "repeats" if op == "repeat" else "dims"
    if keyword in n.kwargs:
        if rest or len(n.kwargs) != 1:
            return None
        rest = [n.kwargs[keyword]]
    elif n.kwargs:
        return None
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        rest = list(rest[0])
    if not rest or not all(isinstance(r, (int, fx.Node)) and not isinstance(r, bool) for r in rest):
        return None
    return op, x, rest


def _count_value(r: Any) -> Any:
    """The count's value at trace time: an int, or a ``torch.SymInt`` (None when unknown)."""
    value = example(r) if isinstance(r, fx.Node) else r
    return value if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool) else None


class SymbolicRepeat(GraphPass):
    """Rewrite ``repeat`` / ``tile`` by symbolic counts into ``expand`` (+ ``flatten``) + ``clone``."""

    name = "symbolic_repeat"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        rewritten, refreshed = 0, False
        for n in list(gm.graph.nodes):
            parsed = repeat_counts(n)
            if parsed is None:
                continue
            op, x, counts = parsed
            values = [_count_value(r) for r in counts]
            if not any(is_symbolic(v) for v in values if v is not None):
                continue  # int counts: autograd's backward needs no guard
            if shape_of(x) is None and not refreshed:  # a node an earlier pass inserted
                refresh_example_values(gm, strict=False)
                refreshed = True
            why = self._unsupported(op, x, counts, values)
            if why:
                ctx.fallback(n, f"{op} by a symbolic count kept as written ({why}): lowering may have to "
                                "guard on the count")
                continue
            self._rewrite(gm.graph, n, op, x, counts, values)
            ctx.rewrite("repeat_as_expand", n, written=op)
            rewritten += 1
        if rewritten:
            refresh_example_values(gm, strict=False)  # the inserted nodes' values, for the passes after

    @staticmethod
    def _unsupported(op: str, x: fx.Node, counts: list[Any], values: list[Any]) -> str:
        shape = shape_of(x)
        if shape is None:
            return "the input's shape is unknown"
        if any(v is None for v in values):
            return "a count's value is unknown"
        if op == "repeat" and len(counts) < len(shape):
            return "fewer counts than axes (an error in eager)"
        if not all(known_ge(v, 0) for v in values):
            return "a count is not provably >= 0"
        return ""

    @staticmethod
    def _rewrite(g: fx.Graph, n: fx.Node, op: str, x: fx.Node, counts: list[Any], values: list[Any]) -> None:
        shape = shape_of(x)
        assert shape is not None
        if op == "tile" and len(counts) < len(shape):
            pad = len(shape) - len(counts)
            counts, values = [1] * pad + counts, [1] * pad + values
        lead = len(counts) - len(shape)
        tiled = [i for i, (v, s) in enumerate(zip(values[lead:], shape)) if static_int(v) != 1 and not is_one(s)]
        with g.inserting_before(n):
            y = x
            for i in reversed(tiled):  # a unit axis before each tiled one: [.., 1, s_i, ..]
                y = g.call_method("unsqueeze", (y, i))
            sizes: list[Any] = list(counts[:lead])
            for i, (r, v, s) in enumerate(zip(counts[lead:], values[lead:], shape)):
                if i in tiled:
                    sizes += [r, -1]
                elif static_int(v) == 1:
                    sizes.append(-1)
                else:  # a size-1 axis broadcast to r
                    sizes.append(r)
            y = g.call_method("expand", (y, *sizes))
            for j in reversed([lead + i + k for k, i in enumerate(tiled)]):  # merge [r_i, s_i] -> r_i·s_i
                y = g.call_method("flatten", (y, j, j + 1))
            out = g.call_method("clone", (y,), {"memory_format": torch.contiguous_format})
        for new in _between(x, out):
            if "stack_trace" in n.meta:
                new.meta["stack_trace"] = n.meta["stack_trace"]
        out.meta = dict(n.meta)
        n.replace_all_uses_with(out)
        g.erase_node(n)


def _between(x: fx.Node, out: fx.Node) -> list[fx.Node]:
    """The chain of nodes from ``x`` (exclusive) to ``out`` (inclusive) just inserted."""
    chain = [out]
    while chain[-1].args and isinstance(chain[-1].args[0], fx.Node) and chain[-1].args[0] is not x:
        chain.append(chain[-1].args[0])
    return chain
