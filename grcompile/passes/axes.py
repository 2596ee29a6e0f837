"""Axis unification: which axes of which tensors index the same thing.

Every tensor axis of the graph is a node of a union-find; each op unifies the axes its semantics
say are the same index — an output axis with the input axes it is computed along (broadcasting,
right-aligned, only where the input's size is not a broadcast 1), a kept axis through a view or
permutation, the operands' shared axes of a matmul / einsum (also the contracted ones), an index
tensor's axes with the gather's leading output axes. Nothing is unified because two sizes happen
to be equal: a ``[B, R]`` negatives tensor with ``R == N``, or ``B == N``, stays apart from the
positions unless an op combines it position-wise.

``detect_padding`` reads it to seed the layouts of graph inputs: an input is a token tensor only
when dataflow ties its axes to the validity's rows / positions (it is the tensor the validity is
computed from, or it is combined row- or position-wise with one).
Unknown ops unify nothing: fewer token inputs (less optimisation), never a wrong one.
"""
from __future__ import annotations

from typing import Any, Hashable

import torch
import torch.fx as fx

from .op_semantics import PARTIAL, arg, basic_index_axes, canonical, einsum_parts, example, reduce_options, shape_of
from .symbolic import is_one, known_eq

__all__ = ["AxisClasses"]

_POINTWISE = ("ne", "eq", "gt", "ge", "lt", "le", "and", "or", "not", "add", "sub", "mul", "div", "neg",
              "unary", "where", "masked_fill", "dropout")
_SAME_SHAPE = ("layer_norm", "rms_norm", "normalize", "softmax", "tril", "triu")

Key = tuple[fx.Node, int]


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _is_arange_over(index: fx.Node, size: Any) -> bool:
    """``arange(size)``: the identity index of an axis of that size."""
    return canonical(index) == "arange" and len(index.args) == 1 and not index.kwargs.get("step") and \
        known_eq(example(index.args[0]), size)


def _is_gather(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.gather) or \
        (node.op == "call_method" and node.target == "gather")


def _tensor_shape(value: Any) -> tuple | None:
    return shape_of(value) if isinstance(value, fx.Node) else None


class AxisClasses:
    """``same((a, i), (b, j))``: axis ``i`` of node ``a`` and axis ``j`` of node ``b`` index the
    same thing, as far as the graph's ops say."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.parent: dict[Hashable, Hashable] = {}
        for node in gm.graph.nodes:
            try:
                self._visit(node)
            except (TypeError, ValueError, IndexError, KeyError):  # odd arguments: unify nothing there
                continue

    # ---------------------------------------------------------------- union-find
    def find(self, key: Hashable) -> Hashable:
        root = key
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while key != root:  # path compression
            self.parent[key], key = root, self.parent.get(key, key)
        return root

    def union(self, a: Key, b: Key) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb

    def same(self, a: Key, b: Key) -> bool:
        return self.find(a) == self.find(b)

    def axes_in(self, node: fx.Node, cls: Hashable) -> list[int]:
        """The axes of ``node`` in class ``cls``."""
        shape = shape_of(node) or ()
        return [d for d in range(len(shape)) if self.find((node, d)) == cls]

    def spread(self, cls: Hashable) -> int:
        """How many (node, axis) pairs are in class ``cls`` (how widely it is used)."""
        return sum(1 for k in list(self.parent) if self.find(k) == cls)

    # ---------------------------------------------------------------- op rules
    def _aligned(self, node: fx.Node, src: fx.Node, out: tuple) -> None:
        """Right-aligned broadcasting: an output axis and the input axis it is computed along
        (an input axis of size 1 under a larger output axis is broadcast: not the same index)."""
        shape = _tensor_shape(src)
        if shape is None:
            return
        offset = len(out) - len(shape)
        for i, size in enumerate(shape):
            if i + offset >= 0 and known_eq(size, out[i + offset]):
                self.union((src, i), (node, i + offset))

    def _mapped(self, node: fx.Node, src: Any, mapping: dict[int, int]) -> None:
        if isinstance(src, fx.Node):
            for i, d in mapping.items():
                self.union((src, i), (node, d))

    def _visit(self, node: fx.Node) -> None:
        op = canonical(node)
        if _is_gather(node):
            self._gather(node)
            return
        if op is None:
            return
        out = shape_of(node)
        x = node.args[0] if node.args else None
        xs = _tensor_shape(x)
        if op == "getitem" and isinstance(x, fx.Node) and canonical(x) in ("split", "chunk"):
            self._split_element(node, x)
            return
        if out is None:
            return
        nd = len(out)
        if op in _POINTWISE or op in _SAME_SHAPE:
            for a in list(node.args) + list(node.kwargs.values()):
                if isinstance(a, fx.Node) and isinstance(example(a), torch.Tensor):
                    self._aligned(node, a, out)
            return
        if op == "bucketize" and isinstance(x, fx.Node) and xs is not None and len(xs) == nd:
            self._mapped(node, x, {i: i for i in range(nd)})  # pointwise in x; the boundaries are no axis of it
            return
        if op == "factory" and isinstance(x, fx.Node) and xs is not None and len(xs) == nd:  # zeros_like(x)
            self._mapped(node, x, {i: i for i in range(nd)})
            return
        if xs is None:
            return
        if op == "unsqueeze":
            d = _norm(arg(node, 1, "dim"), nd)
            self._mapped(node, x, {i: i + (i >= d) for i in range(len(xs))})
        elif op == "squeeze":
            dims = arg(node, 1, "dim")
            dims = [dims] if isinstance(dims, int) else list(dims) if isinstance(dims, (list, tuple)) else \
                [i for i in range(len(xs)) if is_one(xs[i])]
            gone = {_norm(d, len(xs)) for d in dims if is_one(xs[_norm(d, len(xs))])}
            kept = [i for i in range(len(xs)) if i not in gone]
            self._mapped(node, x, {i: j for j, i in enumerate(kept)})
        elif op == "reshape":
            from .layout import _reshape_map
            mapping = _reshape_map(xs, out)
            self._mapped(node, x, {i: d for i in range(len(xs)) if (d := mapping(i)) is not None})
        elif op == "expand":
            other = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], fx.Node) else None
            self._aligned(node, x, out)
            if other is not None and isinstance(example(other), torch.Tensor):  # expand_as(other)
                self._aligned(node, other, out)
        elif op == "transpose":
            d0, d1 = _norm(arg(node, 1, "dim0"), nd), _norm(arg(node, 2, "dim1"), nd)
            self._mapped(node, x, {i: d1 if i == d0 else d0 if i == d1 else i for i in range(nd)})
        elif op == "permute":
            dims = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
            order = [_norm(d, nd) for d in dims]
            self._mapped(node, x, {src: dst for dst, src in enumerate(order)})
        elif op == "getitem":
            self._getitem(node, x, xs, out)
        elif op == "cat":
            tensors = arg(node, 0, "tensors")
            d = _norm(arg(node, 1, "dim", 0), nd)
            for t in tensors:
                if isinstance(t, fx.Node) and len(_tensor_shape(t) or ()) == nd:
                    self._mapped(node, t, {i: i for i in range(nd) if i != d})
        elif op in ("linear",):
            self._mapped(node, x, {i: i for i in range(nd - 1)})
        elif op == "addmm" and isinstance(node.args[1], fx.Node):  # addmm(bias, x, w): x's rows
            self._mapped(node, node.args[1], {0: 0})
        elif op in ("embedding", "one_hot"):
            self._mapped(node, x, {i: i for i in range(len(xs))})
        elif op == "reduce":
            self._reduce(node, x, xs, nd)
        elif op == "matmul":
            self._matmul(node, x, node.args[1], out)
        elif op == "einsum":
            self._einsum(node)
        elif op in ("repeat", "repeat_interleave"):
            self._aligned(node, x, out)  # tiled axes change size: only equal-size axes unify
        elif op == "fused_attention":
            v, valid = node.args[2], node.args[3]
            self._mapped(node, v, {i: i for i in range(nd)})
            sides = [*(node.args[4] or ()), *(node.args[5] or ())]
            for t in [*node.args[:3], *sides]:  # q, k, v [B, N, H, d], sides [B, N] and valid [B, N]
                if isinstance(t, fx.Node):
                    self._mapped(t, valid, {0: 0, 1: 1})

    def _split_element(self, node: fx.Node, split: fx.Node) -> None:
        src = split.args[0]
        xs, out = _tensor_shape(src), shape_of(node)
        if xs is None or out is None or len(xs) != len(out):
            return
        d = _norm(arg(split, 2, "dim", 0), len(xs))
        self._mapped(node, src, {i: i for i in range(len(xs)) if i != d})

    def _getitem(self, node: fx.Node, x: fx.Node, xs: tuple, out: tuple) -> None:
        index = node.args[1]
        if isinstance(index, fx.Node):  # table[idx]: the gather is indexed by idx's axes
            idx = _tensor_shape(index)
            if idx is not None and example(index).dtype != torch.bool:
                self._mapped(node, index, {i: i for i in range(len(idx))})
                self._mapped(node, x, {1 + i: len(idx) + i for i in range(len(xs) - 1)})
            return
        items = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, fx.Node) for i in items):
            self._advanced(node, x, xs, out, items)
            return

        def keeps_axis(item: slice, src: int, dst: int) -> bool:
            # a full slice; a partial one shifts positions: not the same index
            return item == slice(None) or (item.start in (None, 0) and item.step in (None, 1)
                                           and known_eq(out[dst], xs[src]))

        axes = basic_index_axes(items, len(xs), keeps_axis)
        if axes is None:
            return
        mapping = {s: d for s, d in axes.items() if d is not None and d != PARTIAL}
        self._mapped(node, x, mapping)

    def _advanced(self, node: fx.Node, x: fx.Node, xs: tuple, out: tuple, items: tuple) -> None:
        """``x[i0, i1, ...]`` with leading tensor indices (``out[arange(B), lengths - 1]``): the
        broadcast index tensors index the leading output axes; the sliced axes of ``x`` follow."""
        m = 0
        while m < len(items) and isinstance(items[m], fx.Node):
            m += 1
        rest = items[m:]
        if m == 0 or any(not (i == slice(None) or i is Ellipsis) for i in rest):
            return
        shapes = [_tensor_shape(i) for i in items[:m]]
        if any(sh is None or example(i).dtype == torch.bool for sh, i in zip(shapes, items[:m])):
            return
        r = max(len(sh) for sh in shapes)
        for k, (index, sh) in enumerate(zip(items[:m], shapes)):
            self._aligned_to(node, index, sh, out[:r])
            if len(sh) == 1 and _is_arange_over(index, xs[k]):
                self.union((x, k), (node, r - 1))  # x[arange(len), ...]: element b comes from x's b
        self._mapped(node, x, {m + k: r + k for k in range(len(xs) - m)})

    def _aligned_to(self, node: fx.Node, src: fx.Node, shape: tuple, out: tuple) -> None:
        offset = len(out) - len(shape)
        for i, size in enumerate(shape):
            if i + offset >= 0 and known_eq(size, out[i + offset]):
                self.union((src, i), (node, i + offset))

    def _gather(self, node: fx.Node) -> None:
        """``torch.gather(x, dim, index)``: the output is indexed like ``index``; ``x``'s other axes
        line up with ``index``'s."""
        x, dim, index = node.args[0], arg(node, 1, "dim"), arg(node, 2, "index")
        xs, idx = _tensor_shape(x), _tensor_shape(index)
        if xs is None or idx is None or len(xs) != len(idx) or not isinstance(dim, int):
            return
        d = _norm(dim, len(xs))
        self._mapped(node, index, {i: i for i in range(len(idx))})
        for i in range(len(xs)):
            if i != d and known_eq(xs[i], idx[i]):
                self.union((x, i), (index, i))

    def _reduce(self, node: fx.Node, x: fx.Node, xs: tuple, nd: int) -> None:
        dims, keep = reduce_options(node)
        if dims is None:
            return
        dims = {_norm(d, len(xs)) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
        mapping, j = {}, 0
        for i in range(len(xs)):
            if i in dims:
                j += keep
                continue
            mapping[i] = j
            j += 1
        self._mapped(node, x, mapping)

    def _matmul(self, node: fx.Node, a: Any, b: Any, out: tuple) -> None:
        sa, sb = _tensor_shape(a), _tensor_shape(b)
        if sa is None or sb is None or len(sa) < 2 or len(sb) < 2:
            return
        nd = len(out)
        self.union((a, len(sa) - 2), (node, nd - 2))
        self.union((b, len(sb) - 1), (node, nd - 1))
        self.union((a, len(sa) - 1), (b, len(sb) - 2))  # the contracted index
        for src, shape in ((a, sa), (b, sb)):  # batch axes broadcast like a pointwise op
            offset = nd - len(shape)
            for i in range(len(shape) - 2):
                if i + offset >= 0 and known_eq(shape[i], out[i + offset]) and not is_one(shape[i]):
                    self.union((src, i), (node, i + offset))

    def _einsum(self, node: fx.Node) -> None:
        parts = einsum_parts(node)
        if parts is None:
            return
        specs, out_spec, operands = parts
        first: dict[str, Key] = {}
        for spec, operand in zip((*specs, out_spec), (*operands, node)):
            if not isinstance(operand, fx.Node):
                continue
            shape = _tensor_shape(operand)
            if shape is None or len(shape) != len(spec):
                return
            for axis, letter in enumerate(spec):
                if is_one(shape[axis]) and operand is not node:
                    continue  # a broadcast axis of an operand
                if letter in first:
                    self.union(first[letter], (operand, axis))
                else:
                    first[letter] = (operand, axis)

