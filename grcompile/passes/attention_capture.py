"""Capture an attention score region as a FlexAttention-style ``score_mod`` and prove its mask.

The region of a contraction ``matmul(A, v)`` is every ``Pair`` node ``A`` depends on, down to its
leaves: the score ``q @ kᵀ``, query-side and key-side token values (``[.., N, 1]`` / ``[.., 1, N]``
broadcasts: timestamps, validity, ``arange(N)``), tables indexed by pair-valued integers (RAB),
and scalar constants. Each region value is re-expressed in one canonical frame ``[b, h, i, j]``
(broadcastable), so shape-only ops vanish, ``tril``/``triu`` become position comparisons, and the
result is a pointwise function

    score_mod(score, q_pos, k_pos, [head], *q_sides, *k_sides, *tables) -> value

that the fused op evaluates only on the pairs it visits. ``head`` (the head index, ``[1, H, 1, 1]``)
is an input only when the score_mod needs it: a per-head table ``[K, H]`` gathered by a bucketed
relative position (T5), or a per-head tensor. Tables are either gathered (``table[idx]``,
``F.embedding(idx, table)``, ``one_hot(idx) @ table``) or per-pair tensors without a padding
layout (a numpy-built causal mask, ``torch.eye(N)``, a learned ``[H, N, N]`` bias) indexed by
``[head, q_pos, k_pos]``; constant ones are evaluated at compile time for the proof. The
boundaries of a ``torch.bucketize`` of a pair value (a bucketed time gap or relative position)
are a table too, read whole by the op's ``bucketize``.
Exactness then needs two facts, which ``prove`` establishes by abstract evaluation (concrete where
the inputs are known, ``ANY`` elsewhere, ``x * 0 = 0`` for finite ``x``): for a valid query, a
padded key contributes exactly 0 (or, before a softmax, a logit ≤ −1e4); and for ``causal=True``,
every key after the query does. Softmax attention also needs a valid query to keep a live key
(its own position) — unless every key the op skips has a logit of exactly −inf and the user's
softmax gives 0 on a row without keys (SDPA does; so does a ``nan_to_num`` / ``where(isnan)``
guard after an explicit softmax), which is what the op gives.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .layout import Pair, Token
from .pass_manager import node_site
from .op_semantics import PARTIAL, arg, basic_index_axes, canonical, describe_op, evaluate, example, shape_of
from .symbolic import is_one, is_symbolic, known_eq, known_ge

MASKED_LOGIT = -1.0e4  # a softmax logit at or below this is treated as masked (exp underflows in fp32)

_IN_PLACE = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
             operator.itruediv: operator.truediv}
_SHAPE_ONLY = ("unsqueeze", "squeeze", "reshape", "expand", "transpose", "permute")
_POINTWISE = ("ne", "eq", "gt", "ge", "lt", "le", "and", "or", "not", "add", "sub", "mul", "div", "neg",
              "unary", "where", "masked_fill")


class Unsupported(Exception):
    """The region cannot be captured; the message is the user-facing reason."""

    def __init__(self, reason: str, node: fx.Node | None = None) -> None:
        super().__init__(reason)
        self.node = node


@dataclass
class Side:
    node: fx.Node  # a Token node of the user graph
    role: str  # "q" or "k"
    is_position: bool  # literally arange(N): the op's own positions


@dataclass
class Capture:
    score: fx.Node | None  # the q @ kᵀ node (None: the scores do not use q·k, e.g. FuXi's bias channels)
    q: fx.Node | None
    kT: fx.Node | None
    sides: list[Side] = field(default_factory=list)
    tables: list[fx.Node] = field(default_factory=list)
    normalize: str = "none"  # or "softmax"
    dropout_p: float = 0.0  # dropout on the attention weights (training)
    score_mod: fx.GraphModule | None = None
    heads: int = 1
    uses_head: bool = False  # the score_mod takes the head index (after k_pos)
    views: list = field(default_factory=list)  # per table: a TableView (per-pair tensor) or None (gathered)
    empty_rows_zero: bool = False  # the user's softmax gives 0 on a row whose logits are all -inf
    # per-token inputs (the user's names) that may mask a valid query's own key, which the proof
    # cannot evaluate: the fused softmax is exact only on calls where every valid query keeps it
    unknown_own_key: list[str] = field(default_factory=list)
    # the tables that are ``torch.bucketize`` boundaries (1-D, no gradient flows into them) ->
    # their value where it is a compile-time constant (the proof evaluates buckets with it), else None
    boundaries: dict = field(default_factory=dict)
    # (value, reader) for every value the score_mod is computed from and each of its readers in the
    # attention (the weights chain, the region, its leaves): a write in place between them is a
    # value the captured score_mod does not see (fuse_attention refuses it)
    reads: list = field(default_factory=list)


def is_qk_score(node: fx.Node, layouts: dict) -> bool:
    """``matmul(q, kᵀ)`` of two Token tensors (the Pair rule for matmul in layout.py)."""
    if canonical(node) != "matmul":
        return False
    a, b = node.args[0], node.args[1]
    return isinstance(layouts.get(a), Token) and isinstance(layouts.get(b), Token)


class _Any:
    """An unknown value in the abstract evaluation of a score_mod."""

    def __repr__(self) -> str:
        return "ANY"


ANY = _Any()


class _Masked(_Any):
    def __repr__(self) -> str:
        return "MASKED"


MASKED = _Masked()


class _Boundaries(_Any):
    """Unknown (sorted) ``torch.bucketize`` boundaries of ``size`` elements: a buffer or parameter
    whose value the proof may not assume."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __repr__(self) -> str:
        return f"BOUNDARIES[{self.size}]"


class _Range(_Any):
    """An unknown integer tensor every element of which lies in ``[lo, hi]`` (a bucket index)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def __repr__(self) -> str:
        return f"RANGE[{self.lo}, {self.hi}]"


_MAX_RANGE_LOOKUPS = 4096  # table rows a lookup at a _Range index reads to find them all equal


def _all(value: Any, predicate) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(predicate(value).all())
    if isinstance(value, (bool, int, float)):
        return bool(predicate(torch.tensor(value)))
    return False


def abstract_eval(gm: fx.GraphModule, inputs: list[Any]) -> Any:
    """Evaluate ``gm`` where some inputs are ``ANY``: concrete ops run, and the absorbing rules
    ``0·x = 0``, ``False ∧ x = False``, ``True ∨ x = True``, ``where(c, a, b)`` with a known
    ``c``, ``masked_fill`` with a known mask decide the rest; anything else is ``ANY``."""
    env: dict[fx.Node, Any] = {}
    it = iter(inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(it)
            continue
        if node.op == "output":
            return env[node.args[0]]
        env[node] = _eval_abstract(node, fx.node.map_arg(node.args, env.__getitem__),
                                   fx.node.map_arg(node.kwargs, env.__getitem__))
    raise AssertionError("graph without output")


def _eval_abstract(node: fx.Node, args: Any, kwargs: Any) -> Any:
    """``node`` on evaluated arguments: concretely when none is ``ANY``, else by ``_apply``."""
    if not _has_any(list(args) + list(kwargs.values())):
        try:
            return evaluate(node, args, kwargs)
        except RuntimeError as e:
            # a stand-in of the default dtype (float32) filled with a float64 model's own fill value
            # (``masked_fill(m, torch.finfo(torch.float64).min)``): evaluate in the node's dtype
            # (float64 where the node carries none: a score_mod's own graph)
            dtype = getattr(example(node), "dtype", torch.float64)
            if "overflow" not in str(e) or not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise
            up = lambda a: a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a  # noqa: E731
            return evaluate(node, fx.node.map_aggregate(args, up), fx.node.map_aggregate(kwargs, up))
    return _apply(node, list(args), dict(kwargs))


def _has_any(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_has_any(v) for v in value)
    return isinstance(value, _Any)


def _apply(node: fx.Node, args: list, kwargs: dict) -> Any:
    """One op of the abstract evaluation, with at least one ``ANY`` among its inputs."""
    op = canonical(node)
    ranged = _apply_ranged(node, op, args)
    if ranged is not None:
        return ranged
    zero = lambda v: _all(v, lambda t: t == 0)  # noqa: E731
    result: Any = ANY
    masked = [a is MASKED for a in args[:2]]
    args = [ANY if isinstance(a, _Any) else a for a in args]
    if op == "add" and any(masked) and all(m or a is ANY or _finite(a) and _all(a, lambda t: t <= 0)
                                           for m, a in zip(masked, args[:2])):
        result = MASKED  # a masked logit plus a finite score (or another masked logit) stays masked
    elif op == "sub" and len(args) >= 2 and masked[0] and (args[1] is ANY and not masked[1] or
                                                           _finite(args[1]) and _all(args[1], lambda t: t >= 0)):
        result = MASKED
    elif op in ("mul", "div") and len(args) >= 2 and masked[0] and not isinstance(args[1], fx.Node) and \
            _all(args[1], lambda t: (t >= 1) if op == "mul" else (t > 0) & (t <= 1)):
        result = MASKED  # scaled away from 0 by a constant: still at or below the threshold
    elif op == "mul" and any(zero(v) for v in args[:2]):
        result = torch.zeros(())
    elif op == "and" and any(_all(v, lambda t: ~t.bool()) for v in args[:2]):
        result = torch.zeros((), dtype=torch.bool)
    elif op == "or" and any(_all(v, lambda t: t.bool()) for v in args[:2]):
        result = torch.ones((), dtype=torch.bool)
    elif op == "where" and len(args) == 3 and all(a is not ANY for a in args[1:]) and \
            torch.equal(*torch.broadcast_tensors(torch.as_tensor(args[1]), torch.as_tensor(args[2]))):
        result = args[1]  # both branches agree: the condition does not matter
    elif op == "where" and args[0] is not ANY:
        cond = args[0]
        if _all(cond, lambda t: t.bool()):
            result = args[1]
        elif _all(cond, lambda t: ~t.bool()):
            result = args[2]
    elif op == "masked_fill" and args[1] is not ANY:
        fill = args[2] if len(args) > 2 else kwargs.get("value")
        if _all(args[1], lambda t: t.bool()) and fill is not ANY:
            result = torch.as_tensor(fill)
        elif _all(args[1], lambda t: ~t.bool()):
            result = args[0]
    elif op == "div" and zero(args[0]):
        result = torch.zeros(())
    elif op in ("add", "sub") and len(args) >= 2 and any(a is ANY for a in args[:2]) and any(
            a is not ANY and _all(a, lambda t: t == (math.inf if op == "sub" and i == 1 else -math.inf))
            for i, a in enumerate(args[:2])):
        result = torch.tensor(-math.inf)  # x + (−inf) = −inf for a finite x (an additive −inf mask)
    elif op in ("add", "sub") and len(args) >= 2 and args[0] is ANY and args[1] is not ANY and \
            _all(args[1], lambda t: (t if op == "add" else -t) <= MASKED_LOGIT):
        result = MASKED  # an additive mask: x + (−1e4) is a masked logit for |x| well below 1e4
    elif op == "add" and len(args) >= 2 and args[1] is ANY and args[0] is not ANY and \
            _all(args[0], lambda t: t <= MASKED_LOGIT):
        result = MASKED
    elif op == "unary" and node.target in _CASTS and args[0] is not ANY:
        result = args[0]
    return result


def _apply_ranged(node: fx.Node, op: str | None, args: list) -> Any:
    """The rules for bucket indices: ``bucketize(x, boundaries)`` lies in ``[0, K]`` whatever ``x``
    is (NaN included: K) and whatever its K sorted boundaries are; an integer cast keeps that
    range; a lookup ``table[idx]`` (``table[idx, head]``) whose rows in the range are all equal
    is that row. None: no rule applies."""
    if op == "bucketize" and len(args) >= 2:
        bounds = args[1]
        size = bounds.size if isinstance(bounds, _Boundaries) else \
            bounds.numel() if isinstance(bounds, torch.Tensor) and bounds.dim() == 1 else None
        return _Range(0, size) if size is not None else None
    if op == "unary" and node.target in _CASTS and args and isinstance(args[0], _Range) and \
            node.target not in ("bool", "half", "bfloat16", "type_as") and \
            not (node.target == "to" and not _int_or_wide(node)):
        return args[0]
    if op == "getitem" and len(args) == 2 and isinstance(args[0], torch.Tensor):
        table, index = args
        items = index if isinstance(index, tuple) else (index,)
        ranged = [i for i, x in enumerate(items) if isinstance(x, _Range)]
        if len(ranged) != 1 or ranged[0] != 0 or any(isinstance(x, _Any) for x in items[1:]) or table.dim() == 0:
            return None
        r = items[0]
        if r.lo < -table.shape[0] or r.hi >= table.shape[0] or r.hi - r.lo + 1 > _MAX_RANGE_LOOKUPS:
            return None  # (an index out of range raises in eager and in the op alike)
        rows = [table[(row, *items[1:])] for row in range(r.lo, r.hi + 1)]
        first = rows[0]
        if all(torch.equal(first, x) for x in rows[1:]):
            return first
    return None


def _int_or_wide(node: fx.Node) -> bool:
    """``x.to(dtype)`` to an integer dtype or a float dtype that holds every bucket index exactly."""
    dtype = arg(node, 1, "dtype")
    return isinstance(dtype, torch.dtype) and dtype in (torch.int64, torch.int32, torch.float32, torch.float64)


def _finite(value: Any) -> bool:
    return not isinstance(value, _Any) and _all(value, lambda t: torch.isfinite(torch.as_tensor(t, dtype=torch.float64)))


def is_masked(value: Any, normalize: str) -> bool:
    """Does an abstract result mean "contributes nothing"?"""
    if normalize == "softmax":
        return value is MASKED or (not isinstance(value, _Any) and _all(value, lambda t: t <= MASKED_LOGIT))
    return not isinstance(value, _Any) and _all(value, lambda t: t == 0)


_CASTS = ("float", "to", "type_as", "long", "int", "bool", "half", "double", "contiguous", "clone")


def side_value(node: Any, valid: torch.Tensor, validity: set, padding: set, depth: int = 12) -> Any:
    """Abstract value of a per-token side input when the token's validity is ``valid``: follows
    the token-level math from the validity (``True`` = real) or padding mask down to ``node``
    (shape-only ops are identities on this scalar view); anything else is ``ANY``."""
    if not isinstance(node, fx.Node):
        return node
    if node in validity:
        return valid
    if node in padding:
        return ~valid
    if depth == 0:
        return ANY
    op = canonical(node)
    if op in _SHAPE_ONLY or op in ("repeat", "repeat_interleave") or (
            op == "getitem" and not isinstance(node.args[1], fx.Node)
                             and isinstance(node.args[0], fx.Node) and canonical(node.args[0]) != "split"):
        return side_value(node.args[0], valid, validity, padding, depth - 1)
    if op == "unary" and node.target in _CASTS:
        base = side_value(node.args[0], valid, validity, padding, depth - 1)
        if isinstance(base, _Any):
            return base
        dtype = example(node).dtype
        return base.to(dtype)
    if op in _POINTWISE:
        lookup = lambda a: side_value(a, valid, validity, padding, depth - 1)  # noqa: E731
        return _eval_abstract(node, fx.node.map_arg(node.args, lookup), fx.node.map_arg(node.kwargs, lookup))
    if op == "factory":  # zeros_like(mask, dtype=float) before a masked_fill: a known constant
        fill = _factory_fill(node)
        dtype = getattr(example(node), "dtype", None)
        if fill is not None and dtype is not None:
            return torch.tensor(fill, dtype=dtype)
    return ANY


def _factory_fill(node: fx.Node) -> Any:
    """The value every element of a ``zeros`` / ``ones`` / ``full`` (``_like``) node holds, or None."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name in _FACTORY_FILL:
        return _FACTORY_FILL[name]
    if name in ("full", "full_like"):
        fill = arg(node, 1, "fill_value")
        return fill if isinstance(fill, (bool, int, float)) else None
    return None


def _role(leaf: fx.Node, consumer_roles: list[str | None], layouts: dict, consumer: fx.Node) -> str:
    """``"q"`` / ``"k"``: which side of the pair a per-token value ``leaf`` is broadcast along."""
    t = layouts[leaf]
    if t.seq is None:
        return "q"  # a per-row value (e.g. lengths): the same for every pair of the row
    axis = t.seq + len(consumer_roles) - t.ndim
    role = consumer_roles[axis] if 0 <= axis < len(consumer_roles) else None
    if role in ("i", "j"):
        return "q" if role == "i" else "k"
    raise Unsupported(f"{leaf.name} is broadcast along neither the query nor the key axis", consumer)


def _side_source(leaf: fx.Node, layouts: dict) -> fx.Node:
    """The per-token scalar under broadcasts of it (``valid[:, None, None, :].repeat(1, H, N, 1)``
    → ``valid``): what the op receives as a ``[B, N]`` side input."""
    while True:
        op = canonical(leaf)
        if not (op in _SHAPE_ONLY or op in ("repeat", "repeat_interleave") or
                (op == "getitem" and _is_broadcast_index(leaf.args[1]))):
            return leaf
        x = leaf.args[0]
        lx = layouts.get(x) if isinstance(x, fx.Node) else None
        if not isinstance(lx, Token) or lx.seq is None:
            return leaf
        leaf = x


def _is_broadcast_index(index: Any) -> bool:
    """An index made of ``None`` / ``:`` / ``...`` only: adds or keeps axes, selects nothing."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in items)


def _is_view_index(n: fx.Node) -> bool:
    """``x[index]`` that selects nothing: ``None`` / ``...`` / slices that keep their whole axis
    (``mask[:, :, :, :N]`` of a mask with N keys, HF's ``attention_mask[..., :key_len]``)."""
    return whole_view_index(n.args[0], n.args[1])


def whole_view_index(x: Any, index: Any) -> bool:
    """``x[index]`` reads every element of ``x`` (``None``, ``...``, whole slices only)."""
    if _is_broadcast_index(index):
        return True
    items = index if isinstance(index, tuple) else (index,)
    shape = shape_of(x)
    if shape is None or not all(i is None or i is Ellipsis or isinstance(i, slice) for i in items):
        return False

    def whole(item: slice, src: int, dst: int) -> bool:
        if item.step not in (None, 1) or item.start not in (None, 0):
            return False
        stop = example(item.stop)
        return item.stop is None or (isinstance(stop, (int, torch.SymInt)) and known_ge(stop, shape[src]))

    mapping = basic_index_axes(items, len(shape), whole)
    return mapping is not None and all(d is not None and d != PARTIAL for d in mapping.values())


def _is_arange(node: fx.Node, N: int) -> bool:
    while canonical(node) in _SHAPE_ONLY or (canonical(node) == "getitem" and _is_broadcast_index(node.args[1])):
        node = node.args[0]
    from .detect_padding import _is_positions  # arange(N), arange(0, N), arange(0, N, 1)

    return canonical(node) == "arange" and _is_positions(node, N)


_FACTORY_FILL = {"ones": 1, "zeros": 0, "ones_like": 1, "zeros_like": 0}
_RANDOM = ("rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli",
           "normal", "multinomial", "dropout", "empty", "empty_like", "empty_strided")


def spelled(node: Any) -> str:
    """How the user wrote ``node``'s op (``torch.where``, ``F.embedding``, ``Tensor.masked_fill``, ``*``)."""
    return describe_op(node)


def _is_zero(value: Any) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if isinstance(value, fx.Node) and canonical(value) == "factory":
        name = getattr(value.target, "__name__", "")
        return name in ("zeros", "zeros_like") or (name in ("full", "full_like") and arg(value, 1, "fill_value") == 0)
    return False


def _is_nan_test(cond: Any, x: fx.Node) -> bool:
    """``isnan(x)`` or ``x != x``."""
    if not isinstance(cond, fx.Node):
        return False
    if canonical(cond) == "unary" and getattr(cond.target, "__name__", cond.target) == "isnan":
        return cond.args[0] is x
    return canonical(cond) == "ne" and len(cond.args) == 2 and cond.args[0] is x and cond.args[1] is x


def nan_guarded(node: fx.Node) -> fx.Node | None:
    """``x`` if ``node`` only replaces NaN by 0 in ``x`` — ``nan_to_num(x)``, ``where(isnan(x), 0, x)``,
    ``x.masked_fill(isnan(x), 0)`` — on attention weights (which hold no ±inf), else None."""
    op = canonical(node)
    if op == "unary" and getattr(node.target, "__name__", node.target) == "nan_to_num":
        x = node.args[0]
        return x if isinstance(x, fx.Node) and arg(node, 1, "nan", 0.0) in (0, 0.0, None) else None
    if op == "where" and len(node.args) == 3:
        cond, a, b = node.args
        return b if isinstance(b, fx.Node) and _is_zero(a) and _is_nan_test(cond, b) else None
    if op == "masked_fill":
        x, m = node.args[0], arg(node, 1, "mask")
        return x if isinstance(x, fx.Node) and _is_nan_test(m, x) and _is_zero(arg(node, 2, "value")) else None
    return None


class _NotStatic(Exception):
    pass


def static_value(node: Any, memo: dict | None = None) -> tuple[Any, list[fx.Node]]:
    """The value of ``node`` computed at compile time from constants, factories and the current
    value of inputs that take no gradient (buffers, tensor attributes); returns ``(value, those
    inputs)``. Raises ``_NotStatic`` for random ops, parameters and unreadable inputs."""
    memo = {} if memo is None else memo
    inputs: list[fx.Node] = []

    def run(n: Any) -> Any:
        if not isinstance(n, fx.Node):
            return n
        if n in memo:
            return memo[n]
        if n.op == "placeholder":
            ex = example(n)
            if not isinstance(ex, torch.Tensor) or ex.requires_grad:
                raise _NotStatic(n)
            grapharg = n.meta.get("grapharg")
            value = getattr(grapharg, "example", None)
            if not isinstance(value, torch.Tensor):
                raise _NotStatic(n)
            inputs.append(n)
            value = value.detach()
        elif n.op == "get_attr":
            value = n.graph.owning_module
            for part in str(n.target).split("."):
                value = getattr(value, part)
        elif n.op in ("call_function", "call_method"):
            if getattr(n.target, "__name__", str(n.target)) in _RANDOM or n.target in _RANDOM:
                raise _NotStatic(n)
            args = fx.node.map_arg(n.args, run)
            kwargs = fx.node.map_arg(n.kwargs, run)
            value = evaluate(n, args, kwargs)
        else:
            raise _NotStatic(n)
        memo[n] = value
        return value

    with torch.no_grad():
        value = run(node)
    return value, inputs


@dataclass
class TableView:
    """A per-pair (or per-head) tensor given to the op as a table: ``node`` permuted by ``order``
    and reshaped to ``sizes`` (its varying axes, canonical order), indexed by ``roles``
    (``h`` -> head, ``i`` -> q_pos, ``j`` -> k_pos) inside the score_mod."""
    order: list[int]
    sizes: list[int]
    roles: list[str]
    static: Any = None  # its compile-time value (compacted), or None (learned: unknown to the proof)
    checked: bool = False  # the value comes from inputs: the op gets it through a runtime equality check


def _heads_of(v: fx.Node, layout: Token) -> int:
    shape = shape_of(v)
    nd = len(shape)
    heads = [shape[a] for a in range(nd) if a not in (layout.batch, layout.seq, nd - 1) and not is_one(shape[a])]
    if len(heads) > 1:
        raise Unsupported(f"the values {v.name} {shape} have more than one head axis", v)
    return heads[0] if heads else 1


def _one_hot_index(node: Any) -> fx.Node | None:
    """``idx`` if ``node`` is ``one_hot(idx, K)`` (through dtype casts)."""
    while isinstance(node, fx.Node) and canonical(node) == "unary" and node.target in _CASTS:
        node = node.args[0]
    if isinstance(node, fx.Node) and canonical(node) == "one_hot":
        return node.args[0]
    return None


def _gather_index(n: fx.Node, base: fx.Node) -> Any:
    """The index with which region node ``n`` gathers rows of table ``base`` (``base[idx]``,
    ``F.embedding(idx, base)``, ``one_hot(idx) @ base``), or None."""
    op = canonical(n)
    if op == "getitem" and n.args[0] is base and isinstance(n.args[1], fx.Node):
        return n.args[1]
    if op == "embedding" and n.target is F.embedding and arg(n, 1, "weight") is base:
        return n.args[0]
    if op == "matmul" and n.args[1] is base:
        return _one_hot_index(n.args[0])
    return None


def capture(contraction: fx.Node, layouts: dict, validity: set[fx.Node], N: int) -> Capture:
    """Build the score_mod of ``contraction = matmul(A, v)`` and decide normalize / causal inputs.
    Raises ``Unsupported`` with the reason when the region is not a pointwise score function."""
    top = contraction.args[0]
    chain = [top]  # the weights' nodes from the contraction's operand down to the scores
    normalize, dropout_p, guarded, seen_dropout = "none", 0.0, False, False
    while True:  # attention dropout, a NaN→0 guard and casts that keep the dtype, in any order
        chain.append(top)
        if canonical(top) == "unary" and top.target in _CASTS and isinstance(top.args[0], fx.Node) and \
                getattr(example(top), "dtype", None) == getattr(example(top.args[0]), "dtype", 0):
            top = top.args[0]
        elif canonical(top) == "dropout" and not seen_dropout:
            p, training = arg(top, 1, "p", 0.5), arg(top, 2, "training", True)
            if not isinstance(p, (int, float)) or not isinstance(training, bool):
                raise Unsupported("attention dropout with a non-constant p or training flag", top)
            if training and p > 0:
                if p >= 1:
                    raise Unsupported(f"attention dropout p = {p} >= 1", top)
                dropout_p = float(p)
            seen_dropout, top = True, top.args[0]
        elif not guarded and (inner := nan_guarded(top)) is not None:
            guarded, top = True, inner
        else:
            break
    if canonical(top) == "softmax":
        if getattr(top.target, "__name__", top.target) in ("log_softmax",):
            raise Unsupported("log_softmax attention weights", top)
        normalize = "softmax"
        top = top.args[0]
    elif guarded:
        raise Unsupported("a NaN guard on attention weights that are not a softmax", top)
    chain.append(top)
    region, leaves = collect_from(top, layouts)
    if not region and leaves.get(top) != "score":
        raise Unsupported("the attention weights are not computed from pairwise scores", top)
    inside = set(chain) | set(region)
    reads = [(n, u) for n in inside | set(leaves) for u in n.users if u in inside or u is contraction]

    v = contraction.args[1]
    H = _heads_of(v, layouts[v])
    g = fx.Graph()
    cap = Capture(score=None, q=None, kT=None, normalize=normalize, dropout_p=dropout_p, heads=H,
                  empty_rows_zero=guarded, reads=reads)
    score_ph = g.placeholder("score")
    q_pos, k_pos = g.placeholder("q_pos"), g.placeholder("k_pos")
    head_ph: list[fx.Node] = []

    def head() -> fx.Node:
        if not head_ph:
            with g.inserting_after(k_pos):
                head_ph.append(g.placeholder("head"))
            cap.uses_head = True
        return head_ph[0]

    region_set = set(region)
    # one_hot(idx) (and its casts) feeding ``@ table``: absorbed into the gather, never a value
    absorbed = {n for n in region if _one_hot_index(n) is not None and all(
        _one_hot_index(u) is not None or (canonical(u) == "matmul" and u.args[0] is n) for u in n.users)}
    roles_memo: dict[fx.Node, list[str | None]] = {}

    def roles(n: fx.Node) -> list[str | None]:
        """Which axis of region node ``n`` is b / h / i / j (None: size 1, a broadcast)."""
        if n in roles_memo:
            return roles_memo[n]
        layout, shape = layouts[n], shape_of(n)
        r: list[str | None] = [None] * len(shape)
        if isinstance(layout, Token):  # a per-token value broadcast over pairs: roles from its consumers
            for user in n.users:
                if user not in region_set:
                    continue
                ur = roles(user)
                offset = len(ur) - len(shape)
                mine = [ur[a + offset] if not is_one(shape[a]) else None for a in range(len(shape))]
                if layout.seq is not None and not is_one(shape[layout.seq]) and mine[layout.seq] not in ("i", "j"):
                    raise Unsupported(f"{n.name} is broadcast along neither the query nor the key axis", user)
                if r != [None] * len(shape) and mine != r:
                    raise Unsupported(f"{n.name} is broadcast differently by two of its users", user)
                r = mine
            roles_memo[n] = r
            return r
        for axis, name in ((layout.batch, "b"), (layout.q, "i"), (layout.k, "j")):
            if axis is not None and not is_one(shape[axis]):
                r[axis] = name
        others = [a for a in range(len(shape)) if a not in (layout.batch, layout.q, layout.k) and not is_one(shape[a])]
        if len(others) > 1 or (others and not known_eq(shape[others[0]], H)):
            raise Unsupported(f"{spelled(n)} ({n.name}) gives a score tensor of shape {shape} with an axis that "
                              f"is neither the {H} head(s) nor a position", n)
        if others:
            r[others[0]] = "h"
        roles_memo[n] = r
        return r

    # inputs in the op's order: (score, q_pos, k_pos, [head], *q_sides, *k_sides, *tables)
    sides: list[tuple[fx.Node, str]] = []
    tables: list[fx.Node] = []
    views: dict[fx.Node, TableView | None] = {}
    for n in region:
        for a in n.all_input_nodes:
            kind = leaves.get(a)
            if canonical(n) == "bucketize" and a is arg(n, 1, "boundaries") and a is not n.args[0]:
                if a not in views:
                    cap.boundaries[a] = _check_boundaries(a, n, kind)
                    views[a] = None
                    tables.append(a)
                continue
            if kind == "side":
                role = _role(a, roles(n), layouts, n)
                if (a, role) not in sides:
                    sides.append((a, role))
            elif kind == "free" and a not in views:
                if is_size_scalar(a):  # a symbolic size (``/ N`` of a dynamic graph): a 0-d input of the op
                    views[a] = None
                    tables.append(a)
                elif _gather_index(n, a) is not None:
                    _check_table(a, n, H)
                    views[a] = None
                    tables.append(a)
                elif not _scalar_factory(a) and _identity_of(a, N) is None:
                    views[a] = _table_view(a, n, roles(n), N)
                    tables.append(a)
    sides.sort(key=lambda side: side[1] != "q")
    side_ph = {}
    for leaf, role in sides:
        if _is_arange(leaf, N):
            side_ph[(leaf, role)] = q_pos if role == "q" else k_pos
        else:
            side_ph[(leaf, role)] = g.placeholder(f"{role}_side_{len(cap.sides)}")  # by index: same math, same key
            cap.sides.append(Side(_side_source(leaf, layouts), role, False))
    table_ph = {t: g.placeholder(f"table_{i}") for i, t in enumerate(tables)}
    cap.tables, cap.views = tables, [views[t] for t in tables]

    def value_of(a: Any, consumer: fx.Node) -> Any:
        if not isinstance(a, fx.Node):
            return a
        if a in frame_env:
            return frame_env[a]
        kind = leaves.get(a)
        if kind == "score":
            if cap.score is not None and cap.score is not a:
                raise Unsupported("two different q·k products in one attention", a)
            cap.score, cap.q, cap.kT = a, a.args[0], a.args[1]
            return score_ph
        if kind == "side":
            return side_ph[(a, _role(a, roles(consumer), layouts, consumer))]
        if kind == "free":
            view = views.get(a)
            if view is not None:  # a per-pair / per-head tensor, indexed by the op's coordinates
                index = [{"h": head, "i": lambda: q_pos, "j": lambda: k_pos}[r]() for r in view.roles]
                ph = table_ph[a]
                return g.call_function(operator.getitem, (ph, tuple(index))) if index else ph
            if a in table_ph and is_size_scalar(a):
                return table_ph[a]
            if a in table_ph:
                raise Unsupported(f"bias table {a.name} enters the attention scores other than by a lookup", consumer)
            if _identity_of(a, N) is not None:
                r = roles(consumer)
                shape = shape_of(a)
                axes = [r[i + len(r) - len(shape)] for i, s in enumerate(shape) if not is_one(s)]
                if sorted(axes) != ["i", "j"]:
                    raise Unsupported(f"torch.eye ({a.name}) on axes that are not (query, key)", consumer)
                same = g.call_function(operator.eq, (q_pos, k_pos))
                dtype = example(a).dtype
                return same if dtype == torch.bool else g.call_method("to", (same, dtype))
            name = getattr(a.target, "__name__", str(a.target))
            if name in _FACTORY_FILL:
                return g.call_function(torch.full, ((), _FACTORY_FILL[name]), {"dtype": example(a).dtype})
            if name in ("full", "full_like"):
                return g.call_function(torch.full, ((), arg(a, 1, "fill_value")), {"dtype": example(a).dtype})
            raise Unsupported(f"{spelled(a)} ({a.name}) enters the attention scores but is not a per-pair value", a)
        raise Unsupported(f"unexpected input {a.name} of the attention scores", consumer)

    def gather(n: fx.Node, base: fx.Node, index: Any) -> fx.Node:
        idx = value_of(index, n)
        table = table_ph[base]
        if len(shape_of(base)) == 1:
            return g.call_function(operator.getitem, (table, idx))
        width = shape_of(base)[1]  # [K, H]: one column per head; [K, 1]: shared by the heads
        return g.call_function(operator.getitem, (table, (idx, head() if not is_one(width) else 0)))

    frame_env: dict[fx.Node, Any] = {}
    for n in region:
        op = canonical(n)
        if n in absorbed:
            continue
        if op not in ("getitem", "embedding", "matmul"):
            roles(n)  # an axis that is neither heads nor positions cannot be captured
        if op in _SHAPE_ONLY or (op == "unary" and n.target in ("contiguous", "clone")):
            frame_env[n] = value_of(n.args[0], n)
        elif op in ("repeat", "repeat_interleave"):
            if shape_of(n.args[0]) is None or not _tiles_broadcast_axes_only(n):
                raise Unsupported(f"{spelled(n)} ({n.name}) tiles an axis of size > 1 inside the attention scores", n)
            frame_env[n] = value_of(n.args[0], n)
        elif op in ("tril", "triu"):
            r = roles(n)
            if r[-2:] != ["i", "j"] and not is_one(N):
                raise Unsupported(f"{spelled(n)} ({n.name}) on axes that are not (query, key)", n)
            x = value_of(n.args[0], n)
            diagonal = arg(n, 1, "diagonal", 0)
            rel = g.call_function(operator.sub, (k_pos, q_pos))
            keep = g.call_function(operator.le if op == "tril" else operator.ge, (rel, diagonal))
            zero = False if example(n).dtype == torch.bool else 0
            frame_env[n] = g.call_function(torch.where, (keep, x, zero))
        elif op == "getitem" and _is_view_index(n):  # x[None, :], x[:, None], x[..., :N]: a view
            frame_env[n] = value_of(n.args[0], n)
        elif op in ("getitem", "embedding", "matmul") and any(
                _gather_index(n, b) is not None for b in n.all_input_nodes if b in table_ph and views.get(b) is None):
            base = next(b for b in n.all_input_nodes if b in table_ph and views.get(b) is None
                        and _gather_index(n, b) is not None)
            if op == "embedding" and any(arg(n, i, name, d) != d for i, name, d in (
                    (2, "padding_idx", None), (3, "max_norm", None), (5, "scale_grad_by_freq", False),
                    (6, "sparse", False))):
                raise Unsupported("F.embedding with padding_idx / max_norm / scale_grad_by_freq / sparse in a "
                                  "bias lookup", n)
            frame_env[n] = gather(n, base, _gather_index(n, base))
        elif op == "getitem":
            raise Unsupported(f"indexing {n.name} inside the attention scores (only table[index] lookups)", n)
        elif op == "bucketize":
            boundaries = arg(n, 1, "boundaries")
            options = {k: n.kwargs[k] for k in ("out_int32", "right") if k in n.kwargs}
            if set(n.kwargs) - {"boundaries", "out_int32", "right"} or len(n.args) > 2 or \
                    not all(isinstance(v, bool) for v in options.values()):
                raise Unsupported(f"{spelled(n)} ({n.name}) with arguments other than out_int32= / right= "
                                  f"(constant booleans) inside the attention scores", n)
            frame_env[n] = g.call_function(torch.bucketize, (value_of(n.args[0], n), table_ph[boundaries]), options)
        elif op in _POINTWISE:
            _check_heads_line_up(n, roles, leaves)
            args = fx.node.map_arg(n.args, lambda a: value_of(a, n))
            kwargs = fx.node.map_arg(n.kwargs, lambda a: value_of(a, n))
            if n.op == "call_method":
                frame_env[n] = g.call_method(n.target, args, kwargs)
            elif n.target in _IN_PLACE:
                # `mask *= keep` (HF's causal mask): the written value has no later reader in the
                # scores (fuse_attention refuses one), so the product, in the written tensor's dtype
                dtype = getattr(example(n), "dtype", None)
                frame_env[n] = g.call_function(_IN_PLACE[n.target], args, kwargs)
                if dtype is not None:
                    frame_env[n] = g.call_method("to", (frame_env[n], dtype))
            else:
                frame_env[n] = g.call_function(n.target, args, kwargs)
        elif op == "softmax":
            after = sorted({spelled(u) for u in n.users if u in region_set}) or ["an op"]
            raise Unsupported(f"the attention weights are changed after their softmax ({n.name}, by "
                              f"{', '.join(after)}): only dropout or a NaN→0 guard may follow it", n)
        else:
            raise Unsupported(f"{spelled(n)} ({n.name}) inside the attention scores is not a pointwise op", n)
    result = frame_env[top] if top in frame_env else value_of(top, contraction)
    for n in region:  # what the op computes points at the user's line (kernel fallback reasons name it)
        emitted = frame_env.get(n)
        if isinstance(emitted, fx.Node) and emitted.op != "placeholder" and n.meta.get("stack_trace") \
                and not emitted.meta.get("stack_trace"):
            emitted.meta["stack_trace"] = n.meta["stack_trace"]
    g.output(result)
    if cap.score is None and leaves.get(top) == "score":
        cap.score, cap.q, cap.kT = top, top.args[0], top.args[1]
    cap.score_mod = fx.GraphModule(torch.nn.Module(), g, class_name="ScoreMod")
    return cap


def is_size_scalar(a: fx.Node) -> bool:
    """A SymInt / SymFloat node (a size of a dynamic graph, or arithmetic on one): the op receives
    it as a 0-d tensor, so the score_mod is the same for every N (a baked int would not be)."""
    return isinstance(example(a), (torch.SymInt, torch.SymFloat))


def _identity_of(a: fx.Node, N: Any) -> fx.Node | None:
    """The ``torch.eye(N)`` under broadcasting views and dtype casts of ``a`` (``eye(N)[None]``,
    ``eye(N, dtype=torch.bool)``), or None. Being symmetric it reads the same along (query, key)
    or (key, query): the op computes it as ``q_pos == k_pos`` for every N."""
    shape = shape_of(a)
    varying = [s for s in shape if not is_one(s)] if shape is not None else []
    if len(varying) != 2 or not all(known_eq(s, N) for s in varying):
        return None
    node = a
    while True:
        op = canonical(node)
        if op in _SHAPE_ONLY or (op == "getitem" and _is_broadcast_index(node.args[1])) or (
                op == "unary" and node.target in _CASTS and node.target not in ("long", "int")):
            node = node.args[0]
            continue
        break
    if getattr(node.target, "__name__", node.target) != "eye" or node.op not in ("call_function",):
        return None
    sizes = [a for a in node.args]
    if not sizes or len(sizes) > 2 or not all(known_eq(example(x) if isinstance(x, fx.Node) else x, N)
                                              for x in sizes):
        return None
    if set(node.kwargs) - {"dtype", "device", "layout", "requires_grad", "pin_memory"}:
        return None
    return node


def _scalar_factory(a: fx.Node) -> bool:
    return canonical(a) == "factory" and getattr(a.target, "__name__", "") in (*_FACTORY_FILL, "full", "full_like")


def _check_table(table: fx.Node, user: fx.Node, H: int) -> None:
    shape = shape_of(table)
    if table.op != "placeholder":
        raise Unsupported(f"the bias table of {spelled(user)} ({table.name}) is computed in the graph; only "
                          f"parameters and buffers are looked up inside the fused op", user)
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] not in (1, H)):
        raise Unsupported(f"bias table {table.name} has shape {shape}: a lookup table is [K] or [K, heads] "
                          f"(heads = {H}) here", user)


def _check_boundaries(boundaries: fx.Node, user: fx.Node, kind: str | None) -> torch.Tensor | None:
    """The boundaries of a ``torch.bucketize`` inside the scores become a table input of the op:
    they must be one tensor for the whole call (a constant, a buffer or parameter, or computed
    from those), 1-D, and sorted where their value is known now. torch requires sorted
    boundaries and documents no result otherwise (its binary search gives one, which no other
    implementation need repeat): boundaries whose value now (a constant, a buffer) is unsorted
    are refused here, and the Triton kernels check the boundaries of every call. Returns their
    value when it is a compile-time constant (read from no input), else None."""
    if kind != "free":
        raise Unsupported(f"the boundaries of {spelled(user)} ({boundaries.name}) vary per token or per pair: only "
                          f"one boundaries tensor for the whole batch (a constant, a buffer or a parameter) enters "
                          f"the fused op", user)
    shape = shape_of(boundaries)
    if shape is None or len(shape) != 1:
        raise Unsupported(f"the boundaries of {spelled(user)} ({boundaries.name}) have shape {shape}, not [K]", user)
    try:
        value, inputs = static_value(boundaries)
    except Exception:  # noqa: BLE001 - learned, or read from inputs: known at run time only
        return None
    if not isinstance(value, torch.Tensor):
        return None
    if value.numel() > 1 and not bool((value[1:] >= value[:-1]).all()):
        raise Unsupported(f"the boundaries of {spelled(user)} ({boundaries.name}) are not sorted "
                          f"({_preview(value)}): torch requires sorted boundaries and its result is otherwise "
                          f"implementation-defined, so the fused op cannot promise the same buckets", user)
    return None if inputs else value


def _preview(value: torch.Tensor, limit: int = 8) -> str:
    items = value.flatten().tolist()
    text = ", ".join(f"{x:g}" if isinstance(x, float) else str(x) for x in items[:limit])
    return f"[{text}{', ...' if len(items) > limit else ''}]"


def _unknown_boundaries(t: fx.Node) -> Any:
    """What the proof knows of boundaries read from a buffer or parameter: their size, if static."""
    shape = shape_of(t)
    return _Boundaries(shape[0]) if shape is not None and len(shape) == 1 and isinstance(shape[0], int) else ANY


def _tiles_broadcast_axes_only(n: fx.Node) -> bool:
    shape = shape_of(n.args[0])
    if canonical(n) == "repeat":
        reps = n.args[1:] if len(n.args) > 2 else arg(n, 1, "repeats")
        reps = list(reps) if isinstance(reps, (list, tuple)) else [reps]
        reps = reps[len(reps) - len(shape):]
        return all(r == 1 or is_one(s) for r, s in zip(reps, shape))
    repeats, dim = arg(n, 1, "repeats"), arg(n, 2, "dim")
    return isinstance(dim, int) and (repeats == 1 or is_one(shape[dim]))


def _check_heads_line_up(n: fx.Node, roles, leaves: dict) -> None:
    """Broadcasting must line up the head axes of a pointwise op's operands (b / i / j are
    checked by the layouts)."""
    out = roles(n)
    want = next((a - len(out) for a, r in enumerate(out) if r == "h"), None)
    for a in n.all_input_nodes:
        if leaves.get(a) is not None or shape_of(a) is None:
            continue  # a leaf: sides carry no head axis, tables are aligned by _table_view
        r = roles(a)
        h = next((x - len(r) for x, y in enumerate(r) if y == "h"), None)
        if h is not None and h != want:
            raise Unsupported(f"{spelled(n)} ({n.name}) combines score tensors whose head axes do not line up", n)


def _table_view(leaf: fx.Node, consumer: fx.Node, consumer_roles: list[str | None], N: int) -> TableView:
    """How a per-pair / per-head tensor (a constant mask, a learned [H, N, N] bias) enters the op."""
    shape = shape_of(leaf)
    if shape is None:
        raise Unsupported(f"{spelled(leaf)} ({leaf.name}) enters the attention scores with an unknown shape", leaf)
    offset = len(consumer_roles) - len(shape)
    if offset < 0:
        raise Unsupported(f"{spelled(leaf)} ({leaf.name}) {shape} has more axes than the scores", consumer)
    varying = []
    for axis, size in enumerate(shape):
        if is_one(size):
            continue
        role = consumer_roles[axis + offset]
        if role not in ("h", "i", "j"):
            raise Unsupported(f"{spelled(leaf)} ({leaf.name}) {shape} varies along the "
                              f"{'batch' if role == 'b' else 'unknown'} axis of the scores: only per-position "
                              f"or per-head tensors without a padding layout enter the fused op", consumer)
        varying.append((role, axis))
    varying.sort(key=lambda ra: "hij".index(ra[0]))
    order = [a for _, a in varying] + [a for a in range(len(shape)) if a not in {a for _, a in varying}]
    view = TableView(order, [shape[a] for _, a in varying], [r for r, _ in varying])
    ex = example(leaf)
    if isinstance(ex, torch.Tensor) and not ex.requires_grad:
        try:
            value, inputs = static_value(leaf)
        except _NotStatic:
            # computed from what changes between calls (a parameter under no_grad, an input): the op
            # gets it at run time, unknown to the proof — as a learned bias is in training
            return view
        except Exception as e:  # noqa: BLE001 - a constant we cannot evaluate: no proof
            raise Unsupported(f"{spelled(leaf)} ({leaf.name}) enters the attention scores and cannot be evaluated "
                              f"at compile time ({type(e).__name__})", leaf) from None
        view.static = value.permute(*order).reshape(view.sizes) if view.sizes else value.reshape(())
        view.checked = bool(inputs)
    return view


def collect_from(top: fx.Node, layouts: dict) -> tuple[list[fx.Node], dict[fx.Node, str]]:
    """The region under ``top`` (Pair nodes, and per-token values that carry a pair axis of a
    constant, e.g. ``valid[:, None, None, :] | eye``) and its leaves: ``score`` (q·kᵀ), ``side``
    (a per-token value), ``free`` (everything without a padding layout)."""
    region: set[fx.Node] = set()
    leaves: dict[fx.Node, str] = {}
    stack = [top]
    while stack:
        n = stack.pop()
        if n in region or n in leaves:
            continue
        layout = layouts.get(n)
        if isinstance(layout, Pair):
            if is_qk_score(n, layouts):
                leaves[n] = "score"
                continue
            region.add(n)
            stack.extend(n.all_input_nodes)
        elif isinstance(layout, Token) and _varies_beyond_tokens(n, layout) and (
                canonical(n) in _POINTWISE or canonical(n) in _SHAPE_ONLY
                or canonical(n) in ("repeat", "repeat_interleave", "bucketize")
                or (canonical(n) == "getitem" and _is_broadcast_index(n.args[1]))):
            region.add(n)  # a per-token value combined with a per-pair constant: computed per pair
            stack.extend(n.all_input_nodes)
        elif isinstance(layout, Token):
            leaves[n] = "side"
        else:
            leaves[n] = "free"
    order = {n: i for i, n in enumerate(top.graph.nodes)}
    return sorted(region, key=order.__getitem__), leaves


def _varies_beyond_tokens(n: fx.Node, layout: Token) -> bool:
    """A per-token tensor with an axis of size > 1 besides its row and position axes (a broadcast
    over the other side of the pair, or a per-pair constant combined into it)."""
    shape = shape_of(n)
    return shape is not None and any(not is_one(s) for a, s in enumerate(shape) if a not in (layout.batch, layout.seq))


def _keeps_own_key(cap: Capture, mod: fx.GraphModule, N: int, heads: list) -> bool:
    """Whether every query provably keeps its own key, whatever the per-token inputs: the
    score_mod on the diagonal, for a finite score (0) and zero learned tables, is a known finite
    logit above the masked threshold. A per-token side value (a mask input), a per-pair tensor
    or anything else unknown makes it unprovable."""
    if cap.sides or any(view is not None and view.static is None for view in cap.views):
        return False
    tables = _table_stand_ins(cap)
    if any(t is ANY for t in tables):
        return False  # a symbolic-size table: no concrete stand-in
    return _diagonal_kept(mod, N, heads, [], tables)


def _table_stand_ins(cap: Capture) -> list[Any]:
    """What the diagonal proofs feed for each table: a per-pair tensor's compile-time value, zeros
    for a learned table (a finite stand-in), ``ANY`` where neither is known."""
    tables: list[Any] = []
    for t, view in zip(cap.tables, cap.views):
        if t in cap.boundaries:  # buckets may decide a mask: their constant value, or unknown
            tables.append(cap.boundaries[t] if cap.boundaries[t] is not None else _unknown_boundaries(t))
            continue
        if view is not None:
            tables.append(view.static if view.static is not None else ANY)
            continue
        ex = example(t)
        concrete = isinstance(ex, torch.Tensor) and all(isinstance(n, int) for n in ex.shape)
        tables.append(torch.zeros(tuple(ex.shape), dtype=ex.dtype) if concrete else ANY)
    return tables


def _diagonal_kept(mod: fx.GraphModule, N: int, heads: list, sides: list, tables: list) -> bool:
    """The score_mod on every (i, i), for a finite score (0) and these side values and tables, is
    a known finite logit above the masked threshold."""
    diag = torch.arange(N)[None]
    try:
        value = abstract_eval(mod, [torch.zeros(()), diag, diag, *heads, *sides, *tables])
    except (IndexError, RuntimeError):  # a lookup outside a zero table's range: not provable here
        return False
    return _finite(value) and not is_masked(value, "softmax")


def _neg_inf(value: Any) -> bool:
    return not isinstance(value, _Any) and _all(value, lambda t: t == -math.inf)


def _opaque(_value: Any) -> Any:
    """A position-derived value the proof does not follow (see ``_proof_frame``)."""
    return ANY


_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")


_MAX_FRAME_CONSTANT = 1 << 12  # a bucketize threshold beyond this keeps its positions opaque (enumeration cost)


def _bucket_thresholds(n: fx.Node, boundaries: torch.Tensor) -> list[int] | None:
    """The integer constants ``c`` such that ``bucketize(f, boundaries)`` of an integer ``f`` is
    the number of thresholds with ``f >= c`` (``right=False``: ``b < f`` iff ``f >= floor(b) + 1``;
    ``right=True``: ``b <= f`` iff ``f >= ceil(b)``); None if a boundary is not a finite number
    within reach. With sorted boundaries this is torch's result: a function of comparisons of
    ``f`` with constants, which the frame's twins keep."""
    if boundaries.dim() != 1 or boundaries.dtype == torch.bool or boundaries.is_complex():
        return None
    right = bool(n.kwargs.get("right", False))
    out = []
    for b in boundaries.tolist():
        if not math.isfinite(b):
            if isinstance(b, float) and math.isnan(b):
                return None
            continue  # -inf < f always, +inf < f never: no constant
        c = math.ceil(b) if right else math.floor(b) + 1
        if abs(c) > _MAX_FRAME_CONSTANT:
            return None
        out.append(int(c))
    return out


def _proof_frame(mod: fx.GraphModule, N: Any, for_every_n: bool = False,
                 constants: dict[str, torch.Tensor] | None = None) -> tuple[fx.GraphModule, int]:
    """The score_mod to prove on, and the N to enumerate positions on.

    A static N: ``mod`` itself on every (i, j) of ``[0, N)²`` — exhaustive, so a proof.
    A symbolic N (the graph serves every N): the mask is pointwise in (i, j, valid_i, valid_j)
    and built from ``arange`` / ``tril`` of N, so what a pair sees does not depend on N itself —
    only on predicates of the positions. Where positions enter only *linear forms*
    ``a·i + b·j + c`` (a, b in {-1, 0, 1}, an int c: ``k_pos - q_pos``, ``tril(diagonal=d)``) that
    are compared with each other or with int constants, or index a table (whose values the proof
    never reads), every pair of any N has a twin in ``[0, 2K + 5)²`` with the same truth value of
    every predicate (K: the largest |c|): i' = min(i, K + 2), then j' = i' + min(j - i, K + 2)
    keeps i, j, j - i and i + j on the same side of every constant (and equal below it). So
    enumerating ``[0, 2K + 5)`` proves the obligations for every N. Any other use of a position
    (a cast, a product: an ALiBi slope, a comparison with N) is replaced by ANY in the copy
    proved on: sound, and nothing is concluded from it. ``for_every_n``: that frame for a static N
    too (a proof for every N holds for this one; a few positions instead of N²).

    ``bucketize(form, boundaries)`` with constant (``constants``: table placeholder name -> value),
    sorted boundaries counts the thresholds ``c`` (:func:`_bucket_thresholds`) with ``form >= c``:
    it is monotone in the form, a function of comparisons with constants, and as free to use as
    they are (its thresholds join K)."""
    if not is_symbolic(N) and not for_every_n:
        return mod, N
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    g.output(g.graph_copy(mod.graph, env))
    forms: dict[fx.Node, tuple[int, int, int]] = {}
    for n in g.nodes:
        if n.op == "placeholder" and n.name in ("q_pos", "k_pos"):
            forms[n] = (1, 0, 0) if n.name == "q_pos" else (0, 1, 0)
    tables = {n for n in g.nodes if n.op == "placeholder" and n.name.startswith("table_")}
    K = 0

    def form(a: Any) -> tuple[int, int, int] | None:
        if isinstance(a, fx.Node):
            return forms.get(a)
        return (0, 0, a) if isinstance(a, int) and not isinstance(a, bool) else None

    def linear(op: str, args: tuple) -> tuple[int, int, int] | None:
        parts = [form(a) for a in args[:2]]
        if op == "neg" and parts[0] is not None:
            f = tuple(-x for x in parts[0])
        elif op in ("add", "sub", *_COMPARE) and len(args) >= 2 and None not in parts:
            sign = 1 if op == "add" else -1
            f = tuple(x + sign * y for x, y in zip(*parts))
        else:
            return None
        return f if f[0] in (-1, 0, 1) and f[1] in (-1, 0, 1) else None

    for n in list(g.nodes):
        if n.op not in ("call_function", "call_method"):
            continue
        positional = [a for a in n.all_input_nodes if a in forms]
        if not positional:
            continue
        op = canonical(n)
        f = linear(op, n.args) if not n.kwargs else None
        if f is not None:
            K = max(K, abs(f[2]))
            if op not in _COMPARE:
                forms[n] = f  # a position form; a comparison of forms is a predicate: free to use
            continue
        if op == "getitem" and n.args[0] in tables:
            continue  # a table lookup at a position: the proof reads no table value
        if op == "bucketize" and n.args[0] in forms and len(positional) == 1 and isinstance(n.args[1], fx.Node) \
                and (constants or {}).get(n.args[1].name) is not None:
            thresholds = _bucket_thresholds(n, constants[n.args[1].name])
            if thresholds is not None:
                offset = forms[n.args[0]][2]  # form >= c  iff  a·i + b·j >= c - offset
                K = max([K, *(abs(c - offset) for c in thresholds)])
                continue
        for a in positional:
            with g.inserting_before(n):
                hidden = g.call_function(_opaque, (a,))
            n.replace_input_with(a, hidden)
    return fx.GraphModule(torch.nn.Module(), g, class_name="ProofMod"), 2 * K + 5


def prove(cap: Capture, validity: set[fx.Node], N: int, padding: set[fx.Node] = frozenset(),
          all_valid: bool = False) -> bool:
    """Check the exactness obligations; returns whether ``causal=True`` is proved.

    Raises ``Unsupported`` if a padded key may contribute (then the fused op would differ);
    ``all_valid``: the graph has no padding (every key is valid), so there is none to exclude.
    With a symbolic N the positions are enumerated on ``_proof_frame``'s range (a proof for
    every N)."""
    padding = set(padding)
    if is_symbolic(N) and any(view is not None and view.static is not None and {"i", "j"} & set(view.roles)
                              for view in cap.views):  # a per-head constant (ALiBi's slopes) is one for every N
        raise Unsupported("a constant per-pair tensor enters the attention scores of a graph compiled for any "
                          "sequence length: its values are only known for one N", cap.score)
    constants = {f"table_{i}": cap.boundaries[t] for i, t in enumerate(cap.tables)
                 if cap.boundaries.get(t) is not None}
    mod, N = _proof_frame(cap.score_mod, N, constants=constants)
    heads = [torch.arange(cap.heads).view(cap.heads, 1)] if cap.uses_head else []
    tables = [view.static if view is not None and view.static is not None else
              (cap.boundaries[t] if cap.boundaries[t] is not None else _unknown_boundaries(t))
              if t in cap.boundaries else ANY
              for t, view in zip(cap.tables, cap.views)]

    def inputs(q_pos, k_pos, q_valid, k_valid):
        sides = [side_value(s.node, q_valid if s.role == "q" else k_valid, validity, padding) for s in cap.sides]
        return [ANY, q_pos, k_pos, *heads, *sides, *tables]

    true, false = torch.tensor(True), torch.tensor(False)
    if any(view is not None and view.static is not None for view in cap.views):
        # a constant per-pair tensor is known at every (i, j): evaluate it there; a valid query
        # and a padded key are never at the same position
        i, j = torch.meshgrid(torch.arange(N), torch.arange(N), indexing="ij")
        off = i != j
        padded_key = abstract_eval(mod, inputs(i[off][None], j[off][None], true, false))
    else:
        padded_key = abstract_eval(mod, inputs(ANY, ANY, true, false))
    if not all_valid and not is_masked(padded_key, cap.normalize) and not any(
            view is not None and view.static is not None for view in cap.views):
        # a valid query and a padded key are never the same token: a mask that lets a query see
        # its own position (``| torch.eye(N)``, computed as ``q_pos == k_pos``) masks every padded
        # key if it does at every i != j — enumerated on the frame that proves it for every N
        frame, n = _proof_frame(cap.score_mod, N, for_every_n=True, constants=constants)
        fi, fj = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        apart = fi != fj
        padded_key = abstract_eval(frame, inputs(fi[apart][None], fj[apart][None], true, false))
    if not all_valid and not is_masked(padded_key, cap.normalize):
        raise Unsupported("cannot prove that padded keys are masked out of the attention (mask the scores "
                          "with the validity of the keys)", cap.score)
    i, j = torch.triu_indices(N, N, offset=1)
    future = abstract_eval(mod, inputs(i[None], j[None], true, true))
    causal = is_masked(future, cap.normalize)
    if cap.normalize == "softmax" and all_valid and not _keeps_own_key(cap, mod, N, heads) and \
            not (cap.empty_rows_zero and (not causal or _neg_inf(future))):
        # With no padding mask the user's own mask (an attention_mask input, left padding) may
        # mask every key of a row: eager's softmax then spreads over all of them (finite masks) or
        # gives NaN (-inf), where the op skips the future keys and gives 0.
        raise Unsupported("no padding mask was found, and the model's own mask may mask every key of a query "
                          "(left padding, an attention_mask input): a fused softmax would differ on such rows",
                          cap.score)
    if cap.normalize == "softmax":
        # Keys the op skips (padded; later ones when causal) at exactly -inf are skipped by the
        # user's softmax too; if it also gives 0 on a row without keys, no row can differ.
        skipped_inf = (all_valid or _neg_inf(padded_key)) and (not causal or _neg_inf(future))
        diag = torch.arange(N)[None]
        if not (cap.empty_rows_zero and skipped_inf) and \
                is_masked(abstract_eval(mod, inputs(diag, diag, true, true)), "softmax"):
            raise Unsupported("a valid query may have every key masked (softmax over an empty set)", cap.score)
        if not (cap.empty_rows_zero and skipped_inf):
            condition = _score_decides_mask(cap.score_mod)
            if condition is not None:
                raise Unsupported(f"the attention mask depends on the scores themselves ({condition}): a valid query "
                                  f"may lose every key, where eager's softmax spreads over every position, padded "
                                  f"ones too, and a fused one cannot", cap.score)
        if not all_valid and not (cap.empty_rows_zero and skipped_inf):
            # per-token data other than the validity may mask a valid query's every key: the
            # fusion then needs a run-time check of its own key (fuse_attention builds it)
            cap.unknown_own_key = _unknown_sides_on_diagonal(cap, mod, N, heads, validity, padding)
    return causal


def _score_decides_mask(mod: fx.GraphModule) -> str | None:
    """How the raw score reaches a mask decision inside the score_mod (a comparison, the condition
    of ``where`` / ``masked_fill``: ``where(s > t, s, -1e9)``), or None. The proof's stand-ins for
    the score say nothing about such masks."""
    score = next((n for n in mod.graph.nodes if n.op == "placeholder"), None)
    if score is None or score.name != "score":
        return None
    reached = _computed_from(score)
    for n in mod.graph.nodes:
        if n not in reached:
            continue
        op = canonical(n)
        decides = (op in _COMPARE or (op == "where" and n.args and n.args[0] in reached | {score})
                   or (op == "masked_fill" and len(n.args) > 1 and n.args[1] in reached | {score}))
        if decides:
            return f"{describe_op(n)} on a value computed from q·k"
    return None


def _unknown_sides_on_diagonal(cap: Capture, mod: fx.GraphModule, N: int, heads: list, validity: set[fx.Node],
                               padding: set[fx.Node]) -> list[str]:
    """The per-token inputs, other than the validity and what is computed from it, that can decide
    whether a valid query keeps its own key: empty when none reaches the score_mod's result, or
    when the diagonal, for a finite score and zero learned tables, is a known unmasked logit
    whatever they are. Their names (the user's), else []."""
    true = torch.tensor(True)
    values = [side_value(s.node, true, validity, padding) for s in cap.sides]
    placeholders = [n for n in mod.graph.nodes if n.op == "placeholder"]
    first_side = 3 + len(heads)
    unknown = [i for i, v in enumerate(values) if isinstance(v, _Any)]
    reaching = [i for i in unknown if any(n.op == "output" for n in _computed_from(placeholders[first_side + i]))]
    if not reaching:
        return []
    if _diagonal_kept(mod, N, heads, values, _table_stand_ins(cap)):
        return []
    return sorted({_user_name(cap.sides[i].node) for i in reaching})


def _user_name(node: fx.Node) -> str:
    """``the input keep`` for Dynamo's ``l_keep_``; ``name (file.py:line)`` for a computed value."""
    if node.op == "placeholder":
        match = re.fullmatch(r"l_(.+)_", node.name)
        return f"the input {match.group(1) if match else node.name}"
    return f"{node.name} ({node_site(node)})"


def _computed_from(node: fx.Node) -> set[fx.Node]:
    """Every node that reads ``node``, directly or through others (the output node included)."""
    reached: set[fx.Node] = set()
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user not in reached:
                reached.add(user)
                stack.append(user)
    return reached
