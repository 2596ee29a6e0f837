"""Jagged exits: how a value of the jagged region reaches an outside consumer without a dense unpack.

Matches, for a region value ``x`` (layout ``Token(b, n)``, jagged values ``[T, *F]``) and an
outside user ``u``:

* **segment sum** — ``x.sum(n)`` / ``x.mean(n)`` over the sequence axis alone (pooling:
  ``(h * m).sum(1) / m.sum(1)``): ``zeros(B, *F).index_add(0, rows, values)`` (``/ N`` for the
  mean). Exact when ``x`` is 0 at padding (the dense sum adds those zeros).
* **row selection** — ``x.gather(n, index)``, ``x[arange(B), lengths - 1]``, ``x[:, -1]``,
  ``x.select(n, k)``, ``index_select`` / ``narrow`` / ``take_along_dim``: any op that only copies
  elements of ``x``. The same op runs on the (stride-0, expanded) map ``b, n -> rank of (b, n) in the
  values`` and on the feature coordinates, so it reads exactly the positions the user's op reads,
  raises where it raises and wraps negative indices as it does; the result is a gather from the
  values with a zero row for padded reads. Exact when ``x`` is 0 at padding, or when every read
  of a non-empty row is proved to land on a valid position (``prove_reads_valid``).

**Empty-row rule.** A row without valid positions has no valid output: whatever an exit reads
from it (``lengths - 1 = -1`` reads position ``N - 1``, padding) is a value at an invalid
position, like the padded positions of a ``[B, N, D]`` output. The jagged exit gives 0 there.

Anything else leaves through ``jagged_to_dense`` (zeros at padding), which ``jagged_region``
only allows for values that are 0 at padding.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from .layout import Token, feature_axes, propagate
from .op_semantics import arg, canonical, describe_op, evaluate, example, shape_of
from .symbolic import is_symbolic, known_eq

_SELECT_METHODS = ("gather", "select", "index_select", "narrow", "take_along_dim")
_SELECT_FUNCTIONS = {torch.gather: "gather", torch.select: "select", torch.index_select: "index_select",
                     torch.narrow: "narrow", torch.take_along_dim: "take_along_dim", operator.getitem: "getitem"}


def selection_kind(u: fx.Node, x: fx.Node, members: set[fx.Node]) -> str | None:
    """The selection op ``u`` reads elements of ``x`` (its first argument) and nothing else from
    the region; its name, else None."""
    if not u.args or u.args[0] is not x:
        return None
    if u.op == "call_method" and u.target in _SELECT_METHODS:
        name = u.target
    elif u.op == "call_function":
        try:
            name = _SELECT_FUNCTIONS.get(u.target)
        except TypeError:
            return None
    else:
        return None
    if name is None:
        return None
    if any(a is x for a in _flat(list(u.args[1:]) + list(u.kwargs.values()))):
        return None  # x is also the index
    if any(a in members for a in u.all_input_nodes if a is not x):
        return None
    return name


def _flat(value) -> list:
    out: list = []
    fx.node.map_aggregate(value, lambda a: out.append(a) or a)
    return out


def segment_kind(u: fx.Node, x: fx.Node, layout: Token) -> str | None:
    """``"sum"`` / ``"mean"`` when ``u`` reduces ``x`` over its sequence axis alone."""
    if canonical(u) != "reduce" or not u.args or u.args[0] is not x:
        return None
    name = u.target if u.op == "call_method" else getattr(u.target, "__name__", "")
    if name not in ("sum", "mean") or set(u.kwargs) - {"dim", "keepdim"} or len(u.args) > 3:
        return None
    dims = arg(u, 1, "dim")
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    if len(dims) != 1 or not isinstance(dims[0], int) or dims[0] % layout.ndim != layout.seq:
        return None
    if not isinstance(arg(u, 2, "keepdim", False), bool):
        return None
    return name


class ExitEmitter:
    """Emits jagged exits for one rewrite (shares the rank map and row index between exits)."""

    def __init__(self, g: fx.Graph, valid: fx.Node, index: fx.Node, rows: fx.Node, B: int, N: int,
                 after: fx.Node, size: Callable[[Any], Any] = lambda s: s) -> None:
        # B, N: graph arguments (ints or nodes); size: a (maybe symbolic) size -> graph argument
        self.g, self.valid, self.index, self.rows, self.B, self.N = g, valid, index, rows, B, N
        self.size = size
        self.after = after  # where shared helpers go (right after the pack)
        self._rank: fx.Node | None = None

    def _emit(self, target, *args, method: bool = False, **kwargs) -> fx.Node:
        return self.g.call_method(target, args, kwargs) if method else self.g.call_function(target, args, kwargs)

    def rank(self) -> fx.Node:
        """``[B, N]`` int64: 1 + the value index of each valid position, 0 at padding."""
        if self._rank is None:
            with self.g.inserting_before(self.after.next):  # in order, right after the pack
                flat = self._emit("reshape", self.valid, -1, method=True)
                count = self._emit(torch.cumsum, flat, 0)
                count = self._emit("reshape", count, self.B, self.N, method=True)
                self._rank = self._emit(torch.where, self.valid, count, 0)
        return self._rank

    def segment(self, u: fx.Node, values: fx.Node, layout: Token, kind: str) -> fx.Node:
        """``values [T, *F]`` summed per row, in ``u``'s axis order."""
        shape = shape_of(u.args[0])
        feats = feature_axes(layout)
        out = self._emit(torch.zeros, self.B, *[self.size(shape[a]) for a in feats], dtype=example(u).dtype,
                         device=example(u).device)
        out = self._emit("index_add", out, 0, self.rows, values, method=True)
        if kind == "mean":
            out = self._emit(operator.truediv, out, self.N)
        kept = [a for a in range(layout.ndim) if a != layout.seq]  # u's axes without keepdim
        have = [layout.batch, *feats]
        if have != kept:
            out = self._emit("permute", out, *[have.index(a) for a in kept], method=True)
        if arg(u, 2, "keepdim", False):
            out = self._emit("unsqueeze", out, layout.seq, method=True)
        return out

    def select(self, u: fx.Node, x: fx.Node, values: fx.Node, layout: Token) -> fx.Node:
        """The elements ``u`` reads from ``x``, taken from ``values`` (0 for padded reads)."""
        shape = shape_of(x)
        feats = feature_axes(layout)
        fsizes = [self.size(shape[a]) for a in feats]
        P = self.size(math.prod([shape[a] for a in feats]))
        g = self.g
        zero = self._emit(torch.zeros, 1, *fsizes, dtype=example(x).dtype, device=example(x).device)
        ext = self._emit(torch.cat, [zero, values])
        ext = self._emit("reshape", ext, -1, method=True)
        # rank map in x's axes: B on the batch axis, N on the sequence axis, 1 on features
        rank = self.rank()
        if layout.batch > layout.seq:
            rank = self._emit("transpose", rank, 0, 1, method=True)
        full = [self.size(s) for s in shape]  # x's sizes as graph arguments (x itself stays unused)
        for a in feats:  # [b, n] -> x's rank with 1 on the feature axes
            rank = self._emit("unsqueeze", rank, a, method=True)
        rank = self._emit("expand", rank, *full, method=True)
        coord = self._emit(torch.arange, P, device=example(x).device)
        fshape = [self.size(shape[a]) if a in feats else 1 for a in range(layout.ndim)]
        coord = self._emit("expand", self._emit("reshape", coord, *fshape, method=True), *full, method=True)
        picked_rank = g.node_copy(u, lambda a: rank if a is x else a)
        picked_coord = g.node_copy(u, lambda a: coord if a is x else a)
        for picked in (picked_rank, picked_coord):  # integer maps: not u's (float) example value
            picked.meta.pop("example_value", None)
            picked.meta.pop("val", None)
        address = self._emit(operator.add, self._emit(operator.mul, picked_rank, P), picked_coord)
        return self._emit(operator.getitem, ext, address)


def confined_row_axes(u: fx.Node, layouts: dict, B, outputs_free: bool) -> set[int]:
    """The axes ``a`` of selection ``u`` (size B) such that, were ``a`` the rows, every value
    computed from ``u`` keeps it as its own row axis up to the graph output (per-row ops: linear,
    norms, point-wise math with per-row or per-token values, reductions over other axes). Only then
    can the empty-row rule give a row without valid positions 0: that value reaches no other row's
    output (a loss summed over the batch, an einsum across rows would carry it there). A graph that
    does not end at the frame's return (``outputs_free`` false: a graph break) hands its outputs
    to code that may mix rows: then none."""
    shape = shape_of(u)
    if shape is None:
        return set()
    order = {n: i for i, n in enumerate(u.graph.nodes)}
    downstream: set[fx.Node] = set()
    stack = [u]
    while stack:
        n = stack.pop()
        for user in n.users:
            if user.op == "output" and not outputs_free:
                return set()
            if user not in downstream and user.op != "output":
                downstream.add(user)
                stack.append(user)
    axes = set()
    for a, size in enumerate(shape):
        if not (known_eq(size, B) or is_symbolic(size)):
            continue
        env = dict(layouts)
        env[u] = Token(a, None, len(shape))
        carriers = downstream | {u}
        for n in sorted(downstream, key=order.__getitem__):
            layout = _concatenated_rows(n, env, carriers) or propagate(n, env)
            if not (isinstance(layout, Token) and layout.batch is not None):
                break
            env[n] = layout
        else:
            axes.add(a)
    return axes


def _concatenated_rows(n: fx.Node, env: dict, carriers: set[fx.Node]) -> Token | None:
    """``cat`` along an axis other than the rows of the inputs computed from the selection: row
    ``r`` of those lands in row ``r`` of the result, whatever the other inputs hold (``cat`` takes
    equal shapes, nothing broadcasts). The layout analysis asks more of a ``cat`` — one layout
    for every input, as the jagged rewrite needs — and a per-row value concatenated with a
    pooled one (no token axis left) would end the proof there."""
    if canonical(n) != "cat" or shape_of(n) is None:
        return None
    tensors = arg(n, 0, "tensors")
    if not isinstance(tensors, (list, tuple)):
        return None
    nd = len(shape_of(n))
    dim = arg(n, 1, "dim", 0)
    if not isinstance(dim, int):
        return None
    dim %= nd
    rows = {env.get(t).batch if isinstance(env.get(t), Token) and env.get(t).ndim == nd else None
            for t in tensors if t in carriers}
    if len(rows) != 1 or None in rows or dim in rows:
        return None
    return Token(rows.pop(), None, nd)


# ------------------------------------------------------------------ proof of valid reads

_ROW_LOCAL_OPS = ("ne", "eq", "gt", "ge", "lt", "le", "and", "or", "not", "add", "sub", "mul", "div", "neg",
                  "unary", "where", "masked_fill", "unsqueeze", "squeeze", "reshape", "expand", "transpose",
                  "permute", "arange", "factory")


def prove_reads_valid(u: fx.Node, x: fx.Node, layout: Token, valid: fx.Node, layouts: dict,
                      B: int, N: int, row_axes: set[int]) -> str | None:
    """None when every element ``u`` reads from ``x`` lies at a valid position of a non-empty row,
    for every per-row ``lengths`` value; else the reason (a sentence) why that is not proved.

    Proof by exhaustive evaluation: the validity and ``u``'s index arguments must be computed
    row-locally (pointwise ops, shape ops, reductions over positions) from constants, positions
    and one ``[B]`` integer input (lengths); then each row's reads depend on its own lengths value
    only, and trying every value in a range that covers every threshold of the expressions
    (their integer constants and ±N) decides it. A row's reads must also come from that row."""
    if is_symbolic(B) or is_symbolic(N):
        # the proof enumerates concrete rows and positions; for every B and N it would need more
        return (f"which positions {u.name} reads is only proved for a fixed batch and sequence size, and this "
                f"graph is compiled for any (B = {B}, N = {N})")
    leaves: list[fx.Node] = []
    sub: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [valid, *[a for a in u.all_input_nodes if a is not x]]
    constants = [N]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            shape = shape_of(n)
            ex = example(n)
            if shape != (B,) or ex.dtype.is_floating_point or ex.dtype == torch.bool:
                return (f"the validity or the index of {u.name} reads {n.name} {list(shape or [])}, whose values the "
                        f"graph does not bound (only a [B] lengths input can be reasoned about)")
            leaves.append(n)
            continue
        if n.op == "get_attr":
            return f"the index of {u.name} depends on the constant {n.name}"
        op = canonical(n)
        row_local_reduce = op == "reduce" and _keeps_rows(n, layouts)
        if op not in _ROW_LOCAL_OPS and not row_local_reduce and not (
                op == "getitem" and not any(isinstance(i, fx.Node) for i in _flat(n.args[1]))):
            return f"the index of {u.name} is computed with {describe_op(n)}, " \
                   f"not row by row from the lengths"
        constants += [abs(int(c)) for c in _flat(list(n.args) + list(n.kwargs.values()))
                      if isinstance(c, int) and not isinstance(c, bool)]
        sub.append(n)
        stack.extend(n.all_input_nodes)
    if len(leaves) > 1:
        return f"the index of {u.name} depends on two inputs ({leaves[0].name}, {leaves[1].name})"
    order = {n: i for i, n in enumerate(valid.graph.nodes)}
    sub.sort(key=order.__getitem__)
    span = min(max(constants) + N + 2, 4 * N + 64)

    shape = shape_of(x)
    sizes = [shape[a] if a in (layout.batch, layout.seq) else 1 for a in range(layout.ndim)]

    def in_x_axes(t: torch.Tensor) -> torch.Tensor:
        t = t.transpose(0, 1) if layout.batch > layout.seq else t
        return t.reshape(sizes).expand(shape)

    rows = torch.arange(B).reshape(B, 1).expand(B, N)
    expected_rows = None
    values = range(-span, span + 1) if leaves else [0]
    for v in values:
        env: dict[fx.Node, object] = {}
        if leaves:
            env[leaves[0]] = torch.full((B,), v, dtype=example(leaves[0]).dtype)
        try:
            for n in sub:
                env[n] = evaluate(n, fx.node.map_arg(n.args, env.get), fx.node.map_arg(n.kwargs, env.get))
            ok = env[valid].bool()
            read_valid = evaluate(u, *_with(u, x, in_x_axes(ok), env))
            read_rows = evaluate(u, *_with(u, x, in_x_axes(rows), env))
        except (IndexError, RuntimeError):
            continue  # eager raises for this lengths value, and so does the jagged exit
        if expected_rows is None:
            expected_rows = read_rows
        nonempty = ok.any(dim=1)
        if not torch.equal(read_rows, expected_rows):
            return f"{u.name} reads rows that depend on the lengths"
        if bool((~read_valid & nonempty[read_rows]).any()):
            return (f"{u.name} can read a padded position of a non-empty row (lengths = {v}), whose value "
                    f"the jagged form does not keep")
    if expected_rows is None:
        return f"{u.name} raises for every lengths value"
    # a row's reads must come from that row: rows read per output element equal along u's batch axis
    if not _rows_follow_output(expected_rows, B, range(expected_rows.dim())):
        return f"{u.name} reads one row's positions for another row's output"
    if not _rows_follow_output(expected_rows, B, row_axes):
        return (f"{u.name} reads padding in rows without valid positions, and what it gives such a row reaches "
                f"other rows' values downstream (an op across rows)")
    return None


def _keeps_rows(n: fx.Node, layouts: dict) -> bool:
    """A reduction of a Token tensor that keeps its batch axis (e.g. ``valid.sum(1)``)."""
    layout = layouts.get(n.args[0])
    dims = arg(n, 1, "dim")
    if not isinstance(layout, Token) or layout.batch is None or dims is None:
        return False
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return all(isinstance(d, int) for d in dims) and layout.batch not in {d % layout.ndim for d in dims}


def _with(u: fx.Node, x: fx.Node, replacement: torch.Tensor, env: dict) -> tuple:
    args = fx.node.map_arg(u.args, lambda a: replacement if a is x else env.get(a))
    kwargs = fx.node.map_arg(u.kwargs, lambda a: replacement if a is x else env.get(a))
    return args, kwargs


def _rows_follow_output(read_rows: torch.Tensor, B: int, axes) -> bool:
    """One of ``axes`` of ``read_rows`` is the row axis: the read row equals the coordinate on it."""
    for axis, size in enumerate(read_rows.shape):
        if size != B or axis not in axes:
            continue
        coord = torch.arange(B).reshape([B if a == axis else 1 for a in range(read_rows.dim())])
        if torch.equal(read_rows, coord.expand_as(read_rows)):
            return True
    return False
