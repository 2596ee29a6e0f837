"""Layouts of padded tensors and how each canonical op moves them.

``Token(batch, seq, ndim)``: the tensor is indexed by (row, position) on axes ``batch`` and
``seq`` (``batch`` is ``None`` when it broadcasts over rows, e.g. a positional table
``[1, N, D]`` or ``arange(N)``); other axes are features. ``Flat(axis, ndim)``: the row and
position axes merged row-major into one axis of size ``B·N`` (``logits.flatten(0, 1)``,
``x.view(-1, C)`` before a per-position loss). ``Pair(batch, q, k, ndim)``: indexed by
(row, query position, key position) — attention scores, biases, masks. ``None``: no padded
structure we can vouch for (reductions or shifts along the sequence end a layout).

Rules follow op *semantics* (which axis goes where), never shape coincidences, so ``B == N``
cannot confuse them. An unknown op yields ``None``: the safe answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch.fx as fx

from .op_semantics import PARTIAL, arg, basic_index_axes, canonical, einsum_parts, example, reduce_options, shape_of
from .symbolic import is_one, known_eq, known_ge, prod


@dataclass(frozen=True)
class Token:
    batch: int | None
    seq: int | None  # None: a per-row value such as lengths [B]
    ndim: int

    def axes(self) -> dict[str, int]:
        return {**({"n": self.seq} if self.seq is not None else {}),
                **({"b": self.batch} if self.batch is not None else {})}


@dataclass(frozen=True)
class Flat:
    """Axis ``axis`` runs over the (row, position) pairs row-major: index ``b·N + n``. ``seq``
    is N (an int or SymInt, not part of equality): what unflattening back to rows checks."""
    axis: int
    ndim: int
    seq: Any = field(default=None, compare=False)

    def axes(self) -> dict[str, int]:
        return {"t": self.axis}


@dataclass(frozen=True)
class Pair:
    batch: int | None
    q: int
    k: int
    ndim: int

    def axes(self) -> dict[str, int]:
        return {"q": self.q, "k": self.k, **({"b": self.batch} if self.batch is not None else {})}


@dataclass(frozen=True)
class TupleOf:
    """Result of split/chunk along a feature axis: every element has ``element``."""
    element: Token | Flat | Pair


Layout = Token | Flat | Pair | TupleOf | None


def token_axes(layout: Token | Flat) -> list[int]:
    """The axes that index tokens, in the order of the jagged values' row (row, then position)."""
    if isinstance(layout, Flat):
        return [layout.axis]
    return [a for a in (layout.batch, layout.seq) if a is not None]


def feature_axes(layout: Token | Flat) -> list[int]:
    """The other axes, in order: the jagged values ``[T, *features]`` keep them as they are."""
    tokens = token_axes(layout)
    return [a for a in range(layout.ndim) if a not in tokens]


def _shift(layout: Token | Flat | Pair, mapping: Callable[[int], int | None], ndim: int) -> Layout:
    """Apply an axis mapping; a token axis that disappears ends the layout."""
    if isinstance(layout, Flat):
        new = mapping(layout.axis)
        return None if new is None else replace(layout, axis=new, ndim=ndim)
    fields = {"batch": layout.batch} | ({"seq": layout.seq} if isinstance(layout, Token) else
                                        {"q": layout.q, "k": layout.k})
    out = {}
    for name, axis in fields.items():
        if axis is None:
            out[name] = None
            continue
        new = mapping(axis)
        if new is None:
            if name == "batch" and "seq" in fields and fields["seq"] is not None:
                out[name] = None  # the row axis was size 1 (broadcast): dropping it is harmless
                continue
            return None
        out[name] = new
    return replace(layout, ndim=ndim, **out)


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _touches(layout: Token | Flat | Pair, dims: set[int]) -> bool:
    return any(a in dims for a in layout.axes().values())


def _layout(env: dict[fx.Node, Layout], value: Any) -> Layout:
    return env.get(value) if isinstance(value, fx.Node) else None


def combine_pointwise(inputs: list[tuple[Layout, tuple[int, ...] | None]], out_ndim: int) -> Layout:
    """Broadcasting combination. Token axes of the inputs (right-aligned) must agree; two
    distinct sequence axes make a Pair (query axis first). A flattened token axis combines only
    with the same flattened axis (a per-row or per-position value cannot be aligned with it)."""
    if any(isinstance(layout, Flat) for layout, _ in inputs):
        flat = [layout for layout, _ in inputs if isinstance(layout, Flat)]
        axes = {layout.axis + out_ndim - layout.ndim if isinstance(layout, Flat) else None
                for layout, _ in inputs if layout is not None}
        return replace(flat[0], axis=axes.pop(), ndim=out_ndim) if len(axes) == 1 and None not in axes else None
    batch: set[int] = set()
    seqs: set[int] = set()
    pair: Pair | None = None
    for layout, shape in inputs:
        if layout is None:
            continue
        if isinstance(layout, TupleOf):
            return None
        offset = out_ndim - layout.ndim
        if layout.batch is not None and shape is not None and not is_one(shape[layout.batch]):
            batch.add(layout.batch + offset)
        if isinstance(layout, Token):
            if layout.seq is not None:
                seqs.add(layout.seq + offset)
        else:
            q, k = layout.q + offset, layout.k + offset
            if pair is not None and (pair.q, pair.k) != (q, k):
                return None
            pair = Pair(None, q, k, out_ndim)
    if len(batch) > 1:
        return None
    b = next(iter(batch), None)
    if pair is not None:
        if not seqs <= {pair.q, pair.k} or b in (pair.q, pair.k):
            return None
        return replace(pair, batch=b)
    if len(seqs) == 1:
        (n,) = seqs
        return None if b == n else Token(b, n, out_ndim)
    if len(seqs) == 2:
        q, k = sorted(seqs)
        return None if b in (q, k) else Pair(b, q, k, out_ndim)
    return Token(b, None, out_ndim) if b is not None and not seqs else None


def _reshape_map(src: tuple[int, ...], dst: tuple[int, ...]) -> Callable[[int], int | None]:
    """Axis ``a`` of ``src`` survives a reshape to ``dst`` iff some ``dst`` axis has the same size
    and the same number of elements before it (so no merge or split touches it)."""
    def mapping(a: int) -> int | None:
        before, size = prod(src[:a]), src[a]
        for b in range(len(dst)):
            if known_eq(dst[b], size) and known_eq(prod(dst[:b]), before):
                return b
        return None
    return mapping


def _merged_axis(src: tuple[int, ...], dst: tuple[int, ...], batch: int) -> int | None:
    """The ``dst`` axis holding ``src`` axes ``batch`` and ``batch + 1`` merged row-major (same
    element count before it, their product as its size), else None."""
    before, size = prod(src[:batch]), src[batch] * src[batch + 1]
    for b in range(len(dst)):
        if known_eq(dst[b], size) and known_eq(prod(dst[:b]), before):
            return b
    return None


def _split_axis(src: tuple[int, ...], dst: tuple[int, ...], axis: int, seq: Any) -> int | None:
    """The ``dst`` axis ``m`` such that ``dst[m], dst[m + 1]`` are (rows, positions) split back
    out of the flattened ``src`` axis ``axis`` (``loss.view(B, N)``), else None."""
    before = prod(src[:axis])
    for m in range(len(dst) - 1):
        if known_eq(dst[m + 1], seq) and known_eq(dst[m] * dst[m + 1], src[axis]) and known_eq(prod(dst[:m]), before):
            return m
    return None


def _getitem(layout: Token | Flat | Pair, index: Any, in_shape: tuple[int, ...], out_ndim: int) -> Layout:
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, fx.Node) for i in items):
        return None  # advanced indexing of a padded tensor: a gather along unknown axes

    def keeps_axis(item: slice, src: int, dst: int) -> bool:
        stop = example(item.stop)  # an int, or the SymInt of a node (x[:, :N] with symbolic N)
        return item.step in (None, 1) and item.start in (None, 0) and (
            item.stop is None or known_ge(stop, in_shape[src]))

    mapping = basic_index_axes(items, len(in_shape), keeps_axis)
    if mapping is None:
        return None
    if any(mapping.get(a) == PARTIAL for a in layout.axes().values()):
        return None  # a token axis sliced: a sequence shift
    return _shift(layout, lambda a: mapping.get(a), out_ndim)


def _repeat(node: fx.Node, op: str, layout: Layout, in_shape: tuple[int, ...], nd: int) -> Layout:
    """``x.repeat(*reps)`` / ``repeat_interleave(x, r, dim)``: tiling a size-1 (broadcast) axis or a
    feature axis keeps the layout (``mask[:, None].repeat(1, H, 1, 1)``); tiling a token axis of
    size > 1 mixes rows or positions and ends it."""
    if not isinstance(layout, (Token, Pair)):
        return None
    if op == "repeat":
        reps = node.args[1:] if len(node.args) > 2 else arg(node, 1, "repeats")
        reps = list(reps) if isinstance(reps, (list, tuple)) else [reps]
        if not all(isinstance(r, (int, fx.Node)) for r in reps) or len(reps) < len(in_shape):
            return None
        # a count that is a graph value (a symbolic size: the batch after a shape change) may be
        # anything but is only allowed on a size-1 axis, as a count other than 1 is
        tiled = {a for a in range(len(in_shape)) if not is_one(example(reps[a + len(reps) - len(in_shape)]))}
    else:
        repeats, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
        if not isinstance(repeats, int) or not isinstance(dim, int):
            return None  # per-element repeats, or a flattening repeat_interleave
        tiled = {_norm_dim(dim, len(in_shape))} if repeats != 1 else set()
    if any(not is_one(in_shape[a]) for a in layout.axes().values() if a in tiled):
        return None
    return _shift(layout, lambda a: a + nd - len(in_shape), nd)


def _einsum(node: fx.Node, env: dict[fx.Node, Layout]) -> Layout:
    parts = einsum_parts(node)
    if parts is None:
        return None
    specs, out, operands = parts
    roles: dict[str, str] = {}
    seq_letters: list[str] = []
    for spec, operand in zip(specs, operands):
        layout = _layout(env, operand)
        if layout is None:
            continue
        if not isinstance(layout, (Token, Pair)):
            return None
        for role, axis in layout.axes().items():
            letter = spec[axis]
            role = "n" if role in ("q", "k", "n") else role
            if roles.setdefault(letter, role) != role:
                return None
            if role == "n" and letter not in seq_letters:
                seq_letters.append(letter)
    if sum(r == "b" for r in roles.values()) > 1:
        return None  # two operands' rows on different letters: one row reads another's
    batch = [out.index(l) for l, r in roles.items() if r == "b" and l in out]
    b = batch[0] if batch else None
    kept = [l for l in seq_letters if l in out]
    contracted = [l for l in seq_letters if l not in out]
    if len(kept) == 1 and len(contracted) <= 1:
        # a contraction over a sequence axis is only a valid token op for score @ v
        if contracted and not any(isinstance(_layout(env, o), Pair) for o in operands):
            return None
        return Token(b, out.index(kept[0]), len(out))
    if len(kept) == 2 and not contracted:
        q, k = sorted(out.index(l) for l in kept)
        return Pair(b, q, k, len(out))
    return None


def _addmm(node: fx.Node, env: dict[fx.Node, Layout]) -> Layout:
    """``addmm(bias, x, w)`` = ``beta·bias + alpha·(x @ w)`` on a 2-D ``x``: each row of ``x`` is
    mapped on its own (a linear over the feature axis, HF's ``Conv1D``), whatever alpha and beta,
    as long as neither ``bias`` nor ``w`` is a padded tensor."""
    bias, x, w = arg(node, 0, "input"), arg(node, 1, "mat1"), arg(node, 2, "mat2")
    lx = _layout(env, x)
    if not isinstance(lx, (Token, Flat)) or lx.ndim != 2 or _touches(lx, {1}):
        return None
    if _layout(env, bias) is not None or _layout(env, w) is not None:
        return None
    return lx


def propagate(node: fx.Node, env: dict[fx.Node, Layout]) -> Layout:
    """The layout of ``node``'s output given its inputs' layouts in ``env``."""
    op = canonical(node)
    out_shape = shape_of(node)
    x = node.args[0] if node.args else None
    lx = _layout(env, x)
    in_shape = shape_of(x)
    if op in ("split", "chunk") and isinstance(lx, (Token, Flat, Pair)):
        d = _norm_dim(arg(node, 2, "dim", 0), len(in_shape))
        return None if _touches(lx, {d}) else TupleOf(lx)
    if op is None or out_shape is None:
        return None
    nd = len(out_shape)

    if op in ("ne", "eq", "gt", "ge", "lt", "le", "and", "or", "not", "add", "sub", "mul", "div", "neg",
              "unary", "where", "masked_fill"):
        tensors = [a for a in list(node.args) + list(node.kwargs.values()) if isinstance(a, fx.Node)]
        return combine_pointwise([(env.get(a), shape_of(a)) for a in tensors], nd)
    if op == "dropout":
        return lx if isinstance(lx, (Token, Flat, Pair)) else None
    if op == "bucketize":  # pointwise in x; the boundaries (1-D) do not broadcast with it
        return lx if isinstance(lx, (Token, Flat, Pair)) and in_shape is not None and len(in_shape) == nd else None
    if op == "addmm":
        return _addmm(node, env)
    if not isinstance(lx, (Token, Flat, Pair, TupleOf)) and op not in ("matmul", "einsum", "embedding", "getitem",
                                                                  "tril", "triu", "cat", "arange", "fused_attention"):
        return None
    if op == "factory":  # zeros_like(ids), full_like(x, v): a constant laid out like x
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        same = in_shape is not None and len(in_shape) == nd and all(known_eq(a, b) for a, b in zip(in_shape, out_shape))
        return lx if name.endswith("_like") and same and isinstance(lx, (Token, Flat)) else None
    if op == "unsqueeze":
        d = _norm_dim(arg(node, 1, "dim"), nd)
        return _shift(lx, lambda a: a + (a >= d), nd)
    if op == "squeeze":
        d = arg(node, 1, "dim")
        if d is None or not isinstance(d, int):
            return None
        d = _norm_dim(d, len(in_shape))
        return None if _touches(lx, {d}) and not is_one(in_shape[d]) else _shift(lx, lambda a: None if a == d else a - (a > d), nd)
    if op == "reshape":
        if isinstance(lx, Token) and lx.batch is not None and lx.seq == lx.batch + 1:
            merged = _merged_axis(in_shape, out_shape, lx.batch)
            if merged is not None:
                return Flat(merged, nd, in_shape[lx.seq])
        if isinstance(lx, Flat) and lx.seq is not None:
            split = _split_axis(in_shape, out_shape, lx.axis, lx.seq)
            if split is not None:
                return Token(split, split + 1, nd)
        return _shift(lx, _reshape_map(in_shape, out_shape), nd)
    if op == "expand":
        return _shift(lx, lambda a: a + nd - len(in_shape), nd)
    if op in ("repeat", "repeat_interleave"):
        return _repeat(node, op, lx, in_shape, nd)
    if op == "transpose":
        d0, d1 = (_norm_dim(arg(node, i, n), nd) for i, n in ((1, "dim0"), (2, "dim1")))
        swapped = _shift(lx, lambda a: d1 if a == d0 else d0 if a == d1 else a, nd)
        if isinstance(swapped, Pair) and swapped.q > swapped.k:
            return None  # transposed scores (k, q): not an attention layout we rewrite
        return swapped
    if op == "permute":
        dims = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
        order = [_norm_dim(d, nd) for d in dims]
        moved = _shift(lx, lambda a: order.index(a), nd)
        return None if isinstance(moved, Pair) and moved.q > moved.k else moved
    if op == "getitem":
        if isinstance(lx, TupleOf):
            return lx.element
        idx = node.args[1]
        if isinstance(idx, fx.Node) and lx is None:
            # table[index]: a gather from an unpadded table by padded indices (RAB tables)
            li = _layout(env, idx)
            if isinstance(li, (Token, Flat, Pair)):
                return replace(li, ndim=nd)
            return None
        if isinstance(lx, (Token, Flat, Pair)):
            return _getitem(lx, idx, in_shape, nd)
        return None
    if op in ("embedding", "one_hot"):  # one_hot(idx, K): a new trailing feature axis
        li = _layout(env, x)
        return replace(li, ndim=nd) if isinstance(li, (Token, Flat, Pair)) else None
    if op in ("linear",):
        return lx if not _touches(lx, {len(in_shape) - 1}) else None
    if op in ("layer_norm", "rms_norm"):
        shape = arg(node, 1, "normalized_shape")
        k = len(shape) if isinstance(shape, (list, tuple)) else 1
        return lx if not _touches(lx, set(range(nd - k, nd))) else None
    if op == "normalize":
        d = _norm_dim(arg(node, 2, "dim", 1), nd)
        return lx if not _touches(lx, {d}) else None
    if op == "softmax":
        d = _norm_dim(arg(node, 1, "dim"), nd)
        if isinstance(lx, Pair):
            return lx if d == lx.k else None
        return lx if not _touches(lx, {d}) else None
    if op == "reduce":
        dims, keep = reduce_options(node)
        if dims is None:
            return None
        dims = {_norm_dim(d, len(in_shape)) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
        if _touches(lx, dims):
            return None
        return _shift(lx, lambda a: a if keep else a - sum(d < a for d in dims), nd)
    if op == "cat":
        tensors = arg(node, 0, "tensors")
        d = _norm_dim(arg(node, 1, "dim", 0), nd)
        layouts = {env.get(t) for t in tensors}
        if len(layouts) == 1:
            (only,) = layouts
            if isinstance(only, (Token, Flat, Pair)) and not _touches(only, {d}):
                return only
        return None
    if op in ("tril", "triu"):
        if isinstance(lx, Pair):
            return lx
        if isinstance(lx, Token) and lx.seq in (nd - 2, nd - 1) and lx.batch not in (nd - 2, nd - 1) and \
                known_eq(in_shape[-2], in_shape[-1]):
            return Pair(lx.batch, nd - 2, nd - 1, nd)  # a per-token mask expanded over queries, then triangular
        # tril(ones(N, N)): a positional mask; its two trailing axes are (query, key)
        return Pair(None, nd - 2, nd - 1, nd) if lx is None and nd >= 2 else None
    if op == "matmul":
        a, b = node.args[0], node.args[1]
        la, lb = _layout(env, a), _layout(env, b)
        na, nb = len(shape_of(a)), len(shape_of(b))
        batch = next((l.batch + nd - l.ndim for l in (la, lb)
                      if isinstance(l, (Token, Pair)) and l.batch is not None), None)
        if isinstance(la, Token) and la.seq == na - 2 and isinstance(lb, Token) and lb.seq == nb - 1:
            return Pair(batch, nd - 2, nd - 1, nd)  # q @ kᵀ
        if isinstance(la, Pair) and la.k == na - 1 and isinstance(lb, Token) and lb.seq == nb - 2:
            return Token(batch, nd - 2, nd)  # scores @ v: contraction over keys
        if isinstance(la, (Token, Flat, Pair)) and lb is None and nb <= 2 and not _touches(la, {na - 1}):
            return replace(la, ndim=nd)  # x @ W over a feature axis (one_hot(idx) @ table): axes stay
        return None
    if op == "einsum":
        return _einsum(node, env)
    if op == "class_loss":  # cross_entropy / nll_loss(input [M, C], target [M]) per row
        legacy = arg(node, 3, "size_average") is not None or arg(node, 5, "reduce") is not None
        none = arg(node, 6, "reduction", "mean") == "none" and not legacy
        return replace(lx, ndim=1) if none and lx == Flat(0, 2) and nd == 1 else None
    if op == "fused_attention":
        return Token(0, 1, 4)  # [B, N, H, dv] like its v
    if op == "arange":
        return None  # positions get their layout from the padding analysis (it knows N)
    return None
