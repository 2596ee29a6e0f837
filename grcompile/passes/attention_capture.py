"""Capture an attention score region as a FlexAttention-style ``score_mod`` and prove its mask.

The region of a contraction ``matmul(A, v)`` is every ``Pair`` node ``A`` depends on, down to its
leaves: the score ``q @ kᵀ``, query-side and key-side token values (``[.., N, 1]`` / ``[.., 1, N]``
broadcasts: timestamps, validity, ``arange(N)``), tables indexed by pair-valued integers (RAB),
and scalar constants. Each region value is re-expressed in one canonical frame ``[b, h, i, j]``
(broadcastable), so shape-only ops vanish, ``tril``/``triu`` become position comparisons, and the
result is a pointwise function

    score_mod(score, q_pos, k_pos, *q_sides, *k_sides, *tables) -> value

that the fused op evaluates only on the pairs it visits. Exactness then needs two facts, which
``prove_mask`` establishes by abstract evaluation (concrete where the inputs are known, ``ANY``
elsewhere, ``x * 0 = 0`` for finite ``x``): for a valid query, a padded key contributes exactly 0
(or, before a softmax, a logit ≤ −1e4); and for ``causal=True``, every key after the query does.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .layout import Pair, Token
from .op_semantics import arg, canonical, evaluate, example, shape_of
from .symbolic import is_one, is_symbolic, known_eq

MASKED_LOGIT = -1.0e4  # a softmax logit at or below this is treated as masked (exp underflows in fp32)

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


def _frame_axes(node: fx.Node, layout: Pair) -> dict[str, int | None]:
    """Which axis of ``node`` plays b / h / i / j (h: the one other axis of size > 1)."""
    shape = shape_of(node)
    others = [a for a in range(layout.ndim) if a not in (layout.batch, layout.q, layout.k) and not is_one(shape[a])]
    if len(others) > 1:
        raise Unsupported(f"score tensor {node.name} has more than one head-like axis {shape}", node)
    return {"b": layout.batch, "h": others[0] if others else None, "i": layout.q, "j": layout.k}


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
    if not any(isinstance(v, _Any) for v in list(args) + list(kwargs.values())):
        return evaluate(node, args, kwargs)
    return _apply(node, list(args), dict(kwargs))


def _apply(node: fx.Node, args: list, kwargs: dict) -> Any:
    """One op of the abstract evaluation, with at least one ``ANY`` among its inputs."""
    op = canonical(node)
    zero = lambda v: _all(v, lambda t: t == 0)  # noqa: E731
    result: Any = ANY
    args = [ANY if isinstance(a, _Any) else a for a in args]
    if op == "mul" and any(zero(v) for v in args[:2]):
        result = torch.zeros(())
    elif op == "and" and any(_all(v, lambda t: ~t.bool()) for v in args[:2]):
        result = torch.zeros((), dtype=torch.bool)
    elif op == "or" and any(_all(v, lambda t: t.bool()) for v in args[:2]):
        result = torch.ones((), dtype=torch.bool)
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
    elif op in ("add", "sub") and len(args) >= 2 and args[0] is ANY and args[1] is not ANY and \
            _all(args[1], lambda t: (t if op == "add" else -t) <= MASKED_LOGIT):
        result = MASKED  # an additive mask: x + (−1e4) is a masked logit for |x| well below 1e4
    elif op == "add" and len(args) >= 2 and args[1] is ANY and args[0] is not ANY and \
            _all(args[0], lambda t: t <= MASKED_LOGIT):
        result = MASKED
    elif op == "unary" and node.target in _CASTS and args[0] is not ANY:
        result = args[0]
    return result


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
    if op in _SHAPE_ONLY or (op == "getitem" and not isinstance(node.args[1], fx.Node)
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
    return ANY


def _role(leaf: fx.Node, consumer: fx.Node, layouts: dict) -> str:
    t, c = layouts[leaf], layouts[consumer]
    if t.seq is None:
        return "q"  # a per-row value (e.g. lengths): the same for every pair of the row
    axis = t.seq + c.ndim - t.ndim
    if axis == c.q:
        return "q"
    if axis == c.k:
        return "k"
    raise Unsupported(f"{leaf.name} is broadcast along neither the query nor the key axis", consumer)


def _is_broadcast_index(index: Any) -> bool:
    """An index made of ``None`` / ``:`` / ``...`` only: adds or keeps axes, selects nothing."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in items)


def _is_arange(node: fx.Node, N: int) -> bool:
    while canonical(node) in _SHAPE_ONLY or (canonical(node) == "getitem" and _is_broadcast_index(node.args[1])):
        node = node.args[0]
    return canonical(node) == "arange" and len(node.args) == 1 and known_eq(example(node.args[0]), N) and not (
        set(node.kwargs) - {"device", "dtype", "layout", "pin_memory", "requires_grad"})


_FACTORY_FILL = {"ones": 1, "zeros": 0, "ones_like": 1, "zeros_like": 0}


def is_size_scalar(a: fx.Node) -> bool:
    """A SymInt / SymFloat node (a size of a dynamic graph, or arithmetic on one): the op receives
    it as a 0-d tensor, so the score_mod is the same for every N (a baked int would not be)."""
    return isinstance(example(a), (torch.SymInt, torch.SymFloat))


def capture(contraction: fx.Node, layouts: dict, validity: set[fx.Node], N: int) -> Capture:
    """Build the score_mod of ``contraction = matmul(A, v)`` and decide normalize / causal inputs.
    Raises ``Unsupported`` with the reason when the region is not a pointwise score function."""
    top = contraction.args[0]
    normalize, dropout_p = "none", 0.0
    if canonical(top) == "dropout":
        p, training = arg(top, 1, "p", 0.5), arg(top, 2, "training", True)
        if not isinstance(p, (int, float)) or not isinstance(training, bool):
            raise Unsupported("attention dropout with a non-constant p or training flag", top)
        if training and p > 0:
            if p >= 1:
                raise Unsupported(f"attention dropout p = {p} >= 1", top)
            dropout_p = float(p)
        top = top.args[0]
    if canonical(top) == "softmax":
        layout = layouts.get(top)
        if getattr(top.target, "__name__", top.target) in ("log_softmax",):
            raise Unsupported("log_softmax attention weights", top)
        normalize = "softmax"
        top = top.args[0]
    region, leaves = collect_from(top, layouts)
    if not region and leaves.get(top) != "score":
        raise Unsupported("the attention weights are not computed from pairwise scores", top)

    g = fx.Graph()
    frame: dict[tuple[fx.Node, str | None], fx.Node] = {}
    cap = Capture(score=None, q=None, kT=None, normalize=normalize, dropout_p=dropout_p)
    score_ph = g.placeholder("score")
    q_pos, k_pos = g.placeholder("q_pos"), g.placeholder("k_pos")
    consumers = region if region else []
    # sides: (leaf, role) in first-use order; tables: free placeholder leaves used as gather bases
    sides: list[tuple[fx.Node, str]] = []
    tables: list[fx.Node] = []
    for n in consumers:
        for a in n.all_input_nodes:
            kind = leaves.get(a)
            if kind == "side":
                role = _role(a, n, layouts)
                if (a, role) not in sides:
                    sides.append((a, role))
            elif kind == "free" and is_size_scalar(a):  # a symbolic size (``/ N`` of a dynamic graph)
                if a not in tables:
                    tables.append(a)
            elif kind == "free" and a.op == "placeholder":
                if not (canonical(n) == "getitem" and n.args[0] is a):
                    raise Unsupported(f"{a.name} enters the attention scores other than as a bias table", n)
                if len(shape_of(a)) != 1:
                    raise Unsupported(f"bias table {a.name} has shape {shape_of(a)}; only 1-D tables are fused", n)
                if a not in tables:
                    tables.append(a)
    # placeholders read (score, q_pos, k_pos, *q_sides, *k_sides, *tables): the op's argument order
    sides.sort(key=lambda side: side[1] != "q")
    side_ph = {}
    for leaf, role in sides:
        if _is_arange(leaf, N):
            side_ph[(leaf, role)] = q_pos if role == "q" else k_pos
        else:
            side_ph[(leaf, role)] = g.placeholder(f"{role}_side_{len(cap.sides)}")  # by index: same math, same key
            cap.sides.append(Side(leaf, role, False))
    table_ph = {t: g.placeholder(f"table_{i}") for i, t in enumerate(tables)}
    cap.tables = tables

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
            return side_ph[(a, _role(a, consumer, layouts))]
        if kind == "free":
            if a in table_ph:
                return table_ph[a]
            name = canonical(a) == "factory" and getattr(a.target, "__name__", str(a.target))
            if name in _FACTORY_FILL:
                dtype = example(a).dtype
                return g.call_function(torch.full, ((), _FACTORY_FILL[name]), {"dtype": dtype})
            if name in ("full", "full_like"):
                return g.call_function(torch.full, ((), arg(a, 1, "fill_value")), {"dtype": example(a).dtype})
            raise Unsupported(f"{a.name} ({a.target}) enters the attention scores but is not per-pair", a)
        raise Unsupported(f"unexpected input {a.name} of the attention scores", consumer)

    frame_env: dict[fx.Node, Any] = {}
    for n in region:
        op = canonical(n)
        if op in _SHAPE_ONLY or (op == "unary" and n.target in ("contiguous", "clone")):
            frame_env[n] = value_of(n.args[0], n)
        elif op in ("tril", "triu"):
            x = value_of(n.args[0], n)
            diagonal = arg(n, 1, "diagonal", 0)
            rel = g.call_function(operator.sub, (k_pos, q_pos))
            keep = g.call_function(operator.le if op == "tril" else operator.ge, (rel, diagonal))
            zero = False if example(n).dtype == torch.bool else 0
            frame_env[n] = g.call_function(torch.where, (keep, x, zero))
        elif op == "getitem" and _is_broadcast_index(n.args[1]):  # x[None, :], x[:, None]: a view
            frame_env[n] = value_of(n.args[0], n)
        elif op == "getitem":
            base, index = n.args[0], n.args[1]
            if base not in table_ph or not isinstance(index, fx.Node):
                raise Unsupported(f"indexing {n.name} inside the attention scores", n)
            frame_env[n] = g.call_function(operator.getitem, (table_ph[base], value_of(index, n)))
        elif op == "embedding":
            raise Unsupported("embedding-style bias lookups are not fused yet (use table[index])", n)
        elif op in _POINTWISE:
            args = fx.node.map_arg(n.args, lambda a: value_of(a, n))
            kwargs = fx.node.map_arg(n.kwargs, lambda a: value_of(a, n))
            if n.op == "call_method":
                frame_env[n] = g.call_method(n.target, args, kwargs)
            else:
                frame_env[n] = g.call_function(n.target, args, kwargs)
        else:
            raise Unsupported(f"{op or n.target} inside the attention scores", n)
    result = frame_env[top] if top in frame_env else value_of(top, contraction)
    g.output(result)
    if cap.score is None and leaves.get(top) == "score":
        cap.score, cap.q, cap.kT = top, top.args[0], top.args[1]
    cap.score_mod = fx.GraphModule(torch.nn.Module(), g, class_name="ScoreMod")
    return cap


def collect_from(top: fx.Node, layouts: dict) -> tuple[list[fx.Node], dict[fx.Node, str]]:
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
        elif isinstance(layout, Token):
            leaves[n] = "side"
        else:
            leaves[n] = "free"
    order = {n: i for i, n in enumerate(top.graph.nodes)}
    return sorted(region, key=order.__getitem__), leaves


def _opaque(_value: Any) -> Any:
    """A position-derived value the proof does not follow (see ``_proof_frame``)."""
    return ANY


_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")


def _proof_frame(mod: fx.GraphModule, N: Any) -> tuple[fx.GraphModule, int]:
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
    proved on: sound, and nothing is concluded from it."""
    if not is_symbolic(N):
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
        for a in positional:
            with g.inserting_before(n):
                hidden = g.call_function(_opaque, (a,))
            n.replace_input_with(a, hidden)
    return fx.GraphModule(torch.nn.Module(), g, class_name="ProofMod"), 2 * K + 5


def prove(cap: Capture, validity: set[fx.Node], N: int, padding: set[fx.Node] = frozenset()) -> bool:
    """Check the exactness obligations; returns whether ``causal=True`` is proved.

    Raises ``Unsupported`` if a padded key may contribute (then the fused op would differ).
    With a symbolic N the positions are enumerated on ``_proof_frame``'s range (a proof for
    every N)."""
    padding = set(padding)
    mod, N = _proof_frame(cap.score_mod, N)

    def inputs(q_pos, k_pos, q_valid, k_valid):
        sides = [side_value(s.node, q_valid if s.role == "q" else k_valid, validity, padding) for s in cap.sides]
        return [ANY, q_pos, k_pos, *sides, *[ANY] * len(cap.tables)]

    true, false = torch.tensor(True), torch.tensor(False)
    padded_key = abstract_eval(mod, inputs(ANY, ANY, true, false))
    if not is_masked(padded_key, cap.normalize):
        raise Unsupported("cannot prove that padded keys are masked out of the attention (mask the scores "
                          "with the validity of the keys)", cap.score)
    i, j = torch.triu_indices(N, N, offset=1)
    future = abstract_eval(mod, inputs(i, j, true, true))
    causal = is_masked(future, cap.normalize)
    if cap.normalize == "softmax":
        diag = torch.arange(N)
        if is_masked(abstract_eval(mod, inputs(diag, diag, true, true)), "softmax"):
            raise Unsupported("a valid query may have every key masked (softmax over an empty set)", cap.score)
    return causal
