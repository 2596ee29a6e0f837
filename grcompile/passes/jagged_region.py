"""Where the jagged region may start and where it must stop (helpers of ``jagged_rewrite``).

* ``hoist_validity``: the pack needs the validity mask before the first row-wise op, but user
  code often computes the mask *after* the embedding lookup and the first row-wise ops (RecBole's
  ``get_attention_mask``, SASRec.pytorch's ``timeline_mask``). The mask depends only on the inputs,
  so its subgraph is moved, in order, in front of the region: dataflow decides, not program order.
* ``ZeroAtPadding``: is a region value provably 0 at every padded position (so the zeros of
  ``jagged_to_dense`` equal it)? Follows masks (``x * valid``, ``masked_fill(pad, 0)``,
  ``where(valid, x, 0)``) and the ops that keep zeros (views, bias-free linear maps, sums over
  features, ``x * y``).
* ``shrink``: a region value whose outside use needs its padded values stays dense — it is
  recomputed from dense inputs instead of giving up the whole graph — and so, recursively, do
  the region values that feed it, until every value that leaves the region is exact.

Invariant: nothing here changes what the graph computes; moving the validity subgraph only
reorders pure ops that read the inputs.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx

from .attention_capture import ANY, Unsupported, _Any, _eval_abstract, _factory_fill, is_masked, side_value
from .layout import Flat, Token, TupleOf, propagate, token_axes
from .op_semantics import arg, canonical, shape_of
from .symbolic import is_one

# ops whose position in the program matters (random draws, mutation): never moved
_RANDOM = {torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
           torch.bernoulli, torch.multinomial, torch.normal, torch.poisson, torch.randperm,
           torch.nn.functional.dropout, torch.dropout, torch.nn.functional.alpha_dropout,
           torch.nn.functional.feature_alpha_dropout, torch.nn.functional.dropout1d,
           torch.nn.functional.dropout2d, torch.nn.functional.dropout3d, operator.setitem}


def _movable(n: fx.Node) -> bool:
    if n.op == "call_method":
        return not n.target.endswith("_") and n.target not in ("bernoulli", "random_")
    if n.op == "call_function":
        try:
            if n.target in _RANDOM:
                return False
        except TypeError:  # unhashable target
            return False
        tags = getattr(n.target, "tags", ())
        return torch.Tag.nondeterministic_seeded not in tags and not getattr(
            getattr(n.target, "_schema", None), "is_mutable", False)
    return n.op in ("placeholder", "get_attr")


def hoist_validity(g: fx.Graph, mask: fx.Node, first: fx.Node, members: set[fx.Node]) -> int:
    """Move ``mask`` and the nodes it is computed from in front of ``first`` (keeping their order).
    Returns how many nodes moved; raises ``Unsupported`` when the mask depends on the region or on
    an op whose position matters."""
    order = {n: i for i, n in enumerate(g.nodes)}
    if order[mask] < order[first]:
        return 0
    closure: set[fx.Node] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in closure or n.op in ("placeholder", "get_attr") or order[n] < order[first]:
            continue
        if n in members:
            raise Unsupported(f"the validity mask {mask.name} is computed from the row-wise block itself", mask)
        if not _movable(n):
            raise Unsupported(f"the validity mask {mask.name} depends on {n.name}, an op whose place in the "
                              f"program matters (random or in-place), computed after the first row-wise op", n)
        closure.add(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(closure, key=order.__getitem__):
        first.prepend(n)
    return len(closure)


def unaligned_value(a: fx.Node, layouts: dict):
    """For a tensor that varies but has no layout — nothing says which of its elements sits at
    which token (``valid.t().reshape(-1)`` lined up with flattened tokens) — what is known of it
    at a padded token: the one value a factory fills it with, else ``ANY``. None when it has a
    layout or is a broadcast (then ``side_value`` reads it)."""
    if layouts.get(a) is not None or all(is_one(s) for s in (shape_of(a) or ())):
        return None
    fill = _factory_fill(a) if canonical(a) == "factory" else None
    return ANY if fill is None else torch.tensor(fill)


class ZeroAtPadding:
    """Memoised ``value is 0 at every padded position`` for the nodes of a region.

    Outside values enter as their abstract value at a padded token (``side_value``: the
    validity / padding masks and the math on them); region values as 0 when proved, else ANY.
    As in the attention proof, ``0 · x = 0`` assumes the padded values are finite."""

    _KEEP = ("unsqueeze", "squeeze", "reshape", "expand", "transpose", "permute", "dropout", "split", "chunk")
    _ARITH = ("mul", "div", "add", "sub", "neg", "where", "masked_fill", "unary", "and", "or", "not",
              "ne", "eq", "gt", "ge", "lt", "le")

    def __init__(self, members: set[fx.Node], layouts: dict, validity: set[fx.Node], padding: set[fx.Node],
                 seq_softmax: set[fx.Node] = frozenset()) -> None:
        self.members, self.layouts, self.seq_softmax = members, layouts, seq_softmax
        self.validity, self.padding = validity, padding
        self.memo: dict[fx.Node, bool] = {}

    def __call__(self, n: fx.Node) -> bool:
        if n not in self.memo:
            self.memo[n] = False  # cycles cannot occur in a DAG; this only guards re-entry
            self.memo[n] = self._prove(n)
        return self.memo[n]

    def _value(self, a):
        if not isinstance(a, fx.Node):
            return a
        if a in self.members:
            return torch.zeros(()) if self(a) else ANY
        unaligned = unaligned_value(a, self.layouts)
        if unaligned is not None:
            return unaligned
        return side_value(a, torch.tensor(False), self.validity, self.padding)

    def _prove(self, n: fx.Node) -> bool:
        op = canonical(n)
        x = n.args[0] if n.args else None
        if op == "fused_attention" or n in self.seq_softmax:
            return True  # 0 at padded queries / exp(-inf) = 0 (empty rows: the empty-row rule)
        if op in self._KEEP or (op == "getitem" and not isinstance(n.args[1], fx.Node)):
            if not isinstance(x, fx.Node):
                return False
            if x in self.members:
                return self(x)
            # a value from outside the region (the validity mask, a cast of it) reshaped or
            # expanded into it: 0 at padding where its value at a padded token is
            value = self._value(x)
            return (not isinstance(value, _Any) and isinstance(value, (torch.Tensor, bool, int, float))
                    and bool((torch.as_tensor(value) == 0).all()))
        if op == "linear":
            bias = arg(n, 2, "bias")
            return bias is None and x in self.members and self(x)
        if op == "matmul":
            return x in self.members and self(x)
        if op == "reduce":
            name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
            return name in ("sum", "mean", "var", "std") and x in self.members and self(x)
        if op == "cat":
            tensors = arg(n, 0, "tensors")
            return all(t in self.members and self(t) for t in tensors)
        if op in self._ARITH:
            # a pointwise op on (0 | ANY | the padded value of a mask): concrete where known
            try:
                value = _eval_abstract(n, fx.node.map_arg(n.args, self._value),
                                       fx.node.map_arg(n.kwargs, self._value))
            except Exception:  # noqa: BLE001 - an op we cannot evaluate on a scalar proves nothing
                return False
            if isinstance(value, _Any) or not isinstance(value, (torch.Tensor, bool, int, float)):
                return False
            return bool((torch.as_tensor(value) == 0).all())
        return False


_SHAPE = ("unsqueeze", "squeeze", "reshape", "expand", "transpose", "permute")


def _padded_logit(n, validity: set[fx.Node], padding: set[fx.Node], depth: int = 8):
    """Abstract value of ``n`` at a padded token: the mask math concretely, anything else ANY."""
    if not isinstance(n, fx.Node):
        return n
    if n in validity or n in padding:
        return side_value(n, torch.tensor(False), validity, padding)
    op = canonical(n)
    if depth and op in _SHAPE:
        return _padded_logit(n.args[0], validity, padding, depth - 1)
    if depth and op in ZeroAtPadding._ARITH:
        look = lambda a: _padded_logit(a, validity, padding, depth - 1)  # noqa: E731
        try:
            return _eval_abstract(n, fx.node.map_arg(n.args, look), fx.node.map_arg(n.kwargs, look))
        except Exception:  # noqa: BLE001 - not evaluable on scalars: unknown
            return ANY
    return side_value(n, torch.tensor(False), validity, padding)


def sequence_softmaxes(g: fx.Graph, layouts: dict, validity: set[fx.Node], padding: set[fx.Node]) -> set[fx.Node]:
    """``softmax(x, dim=seq)`` (also ``log_softmax``) of a padded ``Token`` tensor whose padded
    logits are masked out (−inf, or ≤ −1e4 as in the attention proof): a per-row segment softmax
    over the valid positions, row-wise again. Their layouts (and those computed from them) are
    set in ``layouts``, which ``layout.py`` leaves empty for any op along the sequence."""
    found: set[fx.Node] = set()
    for n in g.nodes:
        if canonical(n) != "softmax" or not isinstance(n.args[0], fx.Node):
            continue
        lx = layouts.get(n.args[0])
        dim = arg(n, 1, "dim")
        if not isinstance(lx, Token) or lx.batch is None or lx.seq is None or not isinstance(dim, int):
            continue
        if dim % lx.ndim != lx.seq or set(n.kwargs) - {"dim", "dtype"} or len(n.args) > 3:
            continue
        if not is_masked(_padded_logit(n.args[0], validity, padding), "softmax"):
            continue
        found.add(n)
    if found:
        after = False
        for n in g.nodes:
            if n in found:
                layouts[n] = layouts[n.args[0]]
                after = True
            elif after and n.op not in ("placeholder", "get_attr", "output") and canonical(n) != "arange":
                layouts[n] = propagate(n, layouts)
    return found


def shrink(region: list[fx.Node], make_check: Callable[[set[fx.Node]], Callable[[fx.Node, fx.Node], bool]],
           layouts: dict) -> tuple[list[fx.Node], dict[fx.Node, tuple[fx.Node, fx.Node]]]:
    """Drop from ``region`` every value with an outside user that ``make_check(members)(value, user)``
    rejects, and recursively what then becomes such a value. Returns the kept region (program
    order) and, for each dropped node, the (value, outside user) that started its cascade."""
    members = set(region)
    dropped: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}
    changed = True
    while changed:
        changed = False
        check = make_check(members)
        for n in reversed(region):  # consumers first: one pass settles a chain
            if n not in members:
                continue
            bad = next((u for u in n.users if u not in members and not check(n, u)), None)
            if bad is None:
                continue
            cause = dropped.get(bad, (n, bad))
            members.discard(n)
            dropped[n] = cause
            if isinstance(layouts.get(n), TupleOf):  # a dense split: its elements are dense too
                for e in n.users:
                    if e in members:
                        members.discard(e)
                        dropped[e] = cause
            changed = True
            break
    return [n for n in region if n in members], dropped


def feature_index(index, layout: Token | Flat, node: fx.Node):
    """A basic index (ints, slices, None, Ellipsis) of a ``Token`` tensor that leaves its token
    axes whole (``uvqk[..., :d]``, ``x[:, :, a:b]``), re-expressed on the jagged ``[T, *features]``
    form: the token axes' items are dropped and one ``:`` for T leads."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, fx.Node) for i in _leaves(items)):
        raise Unsupported(f"advanced indexing of {node.name} inside the jagged region", node)
    explicit = sum(1 for i in items if i is not None and i is not Ellipsis)
    expanded: list = []
    for i in items:
        if i is Ellipsis:
            expanded += [slice(None)] * (layout.ndim - explicit)
        else:
            expanded.append(i)
    expanded += [slice(None)] * (layout.ndim - sum(1 for i in expanded if i is not None))
    out: list = [slice(None)]
    axis = 0
    for i in expanded:
        if i is None:
            out.append(None)
            continue
        if axis in token_axes(layout):
            if i != slice(None):
                raise Unsupported(f"{node.name} indexes a token axis inside the jagged region", node)
        else:
            out.append(i)
        axis += 1
    return tuple(out)


def _leaves(items: list) -> list:
    out: list = []
    fx.node.map_aggregate(items, lambda a: out.append(a) or a)
    return out


def tiled_along(n, axis: int, depth: int = 16) -> bool:
    """Is ``n`` provably the same at every index of ``axis`` (a size-1 axis broadcast by
    ``expand`` / ``repeat``, and what embeddings and pointwise ops compute from such tensors)?
    A layout without a batch axis says "the same for every row" only as far as its operands'
    layouts go; this checks the values' provenance before one row stands for all."""
    if not isinstance(n, fx.Node):
        return True  # a Python scalar
    shape = shape_of(n)
    if shape is None or axis < 0 or axis >= len(shape):
        return False
    if is_one(shape[axis]):
        return True
    if depth == 0:
        return False
    op = canonical(n)
    x = n.args[0] if n.args else None
    in_shape = shape_of(x) if isinstance(x, fx.Node) else None
    if op in ("expand", "repeat") and in_shape is not None:
        source = axis - (len(shape) - len(in_shape))  # leading axes are new: tiled
        if source < 0:
            return True
        if op == "repeat" or is_one(in_shape[source]):
            return is_one(in_shape[source]) or tiled_along(x, source, depth - 1)
        return tiled_along(x, source, depth - 1)
    if op == "embedding":
        return tiled_along(x, axis, depth - 1) if in_shape is not None and axis < len(in_shape) else False
    if op == "unsqueeze":
        d = arg(n, 1, "dim")
        d = d % len(shape) if isinstance(d, int) else None
        if d is None:
            return False
        return True if d == axis else tiled_along(x, axis - (axis > d), depth - 1)
    if op in ZeroAtPadding._ARITH or op == "dropout":
        if op == "dropout" and arg(n, 2, "training", True) and arg(n, 1, "p", 0.5):
            return False  # independent draws per element
        for a in n.all_input_nodes:
            s = shape_of(a)
            if s is None:
                return False
            k = axis - (len(shape) - len(s))
            if k >= 0 and not tiled_along(a, k, depth - 1):
                return False
        return True
    return False
