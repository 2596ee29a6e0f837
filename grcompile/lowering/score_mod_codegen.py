"""Generate Triton code for a registered score_mod: its value per (query, key) tile, and its
reverse-mode derivative (the gradient of the raw score, of every floating side tensor and every
floating table), so one attention kernel template serves *any* bias a user wrote.

Input: a :class:`~.score_mod.ScoreMod` (a captured ``fx.GraphModule`` of the ``"score"`` kind, or a
plain ``"bias"`` function, traced here with ``torch.fx``). Each node's dtype and shape come from
running the graph on fake tensors whose broadcast axes have distinct sizes (heads 2, queries 3,
keys 5), so every value gets a *role*: varies along the queries, the keys, both or neither (the
head is a scalar inside one kernel program). A value that is not a broadcast of those (a table
lookup that leaves a trailing axis, a reduction, a matmul) is not pointwise: :class:`Unsupported`,
with a sentence naming the op, and the caller runs the reference instead.

Output (:class:`ScoreModCode`): lines of Triton source over the names the kernel template defines
(``s`` the raw score tile ``[BM, BN]``, ``q_pos [BM, 1]``, ``k_pos [1, BN]`` int64, ``head``,
``qs{i}`` / ``ks{i}`` loaded side values, ``tab{i}`` pointers with ``tab{i}_n{d}`` sizes and
``tab{i}_s{d}`` strides, ``PAIR`` the in-row pair mask):

* ``forward``: ends with ``s_mod = ...`` and ORs out-of-range table indices into ``oob``;
* ``backward``: from ``g_mod`` (the gradient of ``s_mod``) computes ``g_s`` (raw score), and
  emits ``tl.atomic_add`` into ``dtab{i}`` (float tables) and reductions into ``g_qs{i}`` /
  ``g_ks{i}`` (float sides, ``[BM, 1]`` / ``[1, BN]``).

Semantics kept: torch's dtypes (every result is cast to the dtype torch gives), negative table
indices wrap like torch indexing, an index out of range reads nothing and is reported (torch
raises). Transcendentals use Triton's (a few ulps from torch's; a bucket boundary computed by
``log`` can flip where torch and Triton round differently, as with any compiler).
"""
from __future__ import annotations

import ast
import math
import operator
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from .score_mod import ScoreMod
from .score_mod_ranges import constant_wraps, propagate, unmodelled_kwargs
from .source_site import node_site

_HEADS, _LQ, _LK = 2, 3, 5  # distinct example sizes: a node's shape names the axes it varies along


class Unsupported(Exception):
    """The score_mod cannot be generated into the kernel; the message is the user-facing reason."""


_TL_DTYPE = {torch.float32: "tl.float32", torch.float64: "tl.float64", torch.float16: "tl.float16",
             torch.bfloat16: "tl.bfloat16", torch.int64: "tl.int64", torch.int32: "tl.int32",
             torch.int16: "tl.int16", torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}


@dataclass
class Value:
    expr: str  # a Triton name or literal
    dtype: Optional[torch.dtype]  # None: a Python scalar constant
    roles: frozenset  # subset of {"q", "k"}
    node: Optional[fx.Node] = None
    interval: Optional[tuple[int, int]] = None  # integer values: a proven [lo, hi], else unknown
    narrow: bool = False  # an int64 (torch) value computed as int32 because its interval fits


POSITION_BOUND = 1 << 24  # positions (and max_len) the kernels accept: the launcher checks
HEAD_BOUND = 1 << 16
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass
class ScoreModCode:
    inputs: list[str]  # the graph's inputs, in order: score, q_pos, k_pos, [head], sides..., tables...
    n_q_side: int
    n_k_side: int
    n_tables: int
    uses_head: bool
    forward: list[str] = field(default_factory=list)
    backward: list[str] = field(default_factory=list)
    constants: list[torch.Tensor] = field(default_factory=list)  # get_attr tensors, passed as extra tables
    float_tables: list[int] = field(default_factory=list)  # indices of tables that receive gradients
    float_q_sides: list[int] = field(default_factory=list)
    float_k_sides: list[int] = field(default_factory=list)
    # table lookups whose index the generator could not prove in range: each dropped guard is a
    # bit of the kernels' constexpr GUARDS, set at launch by :meth:`guard_bits`
    guards: list["Guard"] = field(default_factory=list)
    runtime_ranges: Optional[Callable[[int, int], dict]] = None  # (max_len, heads) -> node intervals
    int32_sides: list[str] = field(default_factory=list)  # int64 sides ("qs0", "ks0") the kernel loads as int32
    # table slots that are ``torch.bucketize`` boundaries: the kernels count boundaries, which is
    # torch's binary search only on sorted boundaries, so the launcher checks each call's
    sorted_tables: list[int] = field(default_factory=list)
    _bits: dict = field(default_factory=dict)

    def guard_bits(self, max_len: int, heads: int) -> int:
        """The kernels' ``GUARDS`` for a launch with positions in ``[0, max_len)`` (the kernels
        clamp them there) and ``heads`` heads: the bits of the wraps and bounds checks the launch's
        ranges do not prove unnecessary."""
        key = (max_len, heads)
        if key not in self._bits:
            ranges = self.runtime_ranges(max_len, heads) if self.guards else {}
            self._bits[key] = sum(1 << g.bit for g in self.guards if not g.proven(ranges))
        return self._bits[key]


@dataclass(frozen=True)
class Guard:
    """One bit of ``GUARDS``: the wrap of negative indices along one table axis (``"wrap"``), or a
    lookup's bounds check with its out-of-range flag (``"check"``, over all its axes)."""
    bit: int
    kind: str
    index: tuple  # the index nodes, one per table axis the guard covers
    sizes: tuple  # the table's size along those axes

    def proven(self, ranges: dict) -> bool:
        intervals = [ranges.get(i) for i in self.index]
        if self.kind == "wrap":
            return all(iv is not None and iv[0] >= 0 for iv in intervals)
        return all(iv is not None and -n <= iv[0] and iv[1] < n for iv, n in zip(intervals, self.sizes))


# --------------------------------------------------------------------------------------------
# from a ScoreMod to a "score"-convention graph


def score_graph(mod: ScoreMod, n_q_side: int, n_k_side: int, n_tables: int) -> fx.GraphModule:
    """``mod`` as a GraphModule ``(score, q_pos, k_pos, [head], *q_sides, *k_sides, *tables)``."""
    if mod.kind == "score" and isinstance(mod.fn, fx.GraphModule):
        return mod.fn
    names = ["score", "q_pos", "k_pos"] + (["head"] if mod.head else []) + \
        [f"q_side_{i}" for i in range(n_q_side)] + [f"k_side_{i}" for i in range(n_k_side)] + \
        [f"table_{i}" for i in range(n_tables)]
    fn = mod.fn
    if mod.kind == "bias":
        src = (f"def wrapped({', '.join(names)}):\n"
               f"    return score + fn(q_pos, k_pos, ({''.join(f'q_side_{i}, ' for i in range(n_q_side))}), "
               f"({''.join(f'k_side_{i}, ' for i in range(n_k_side))}), "
               f"({''.join(f'table_{i}, ' for i in range(n_tables))}))\n")
    else:
        src = f"def wrapped({', '.join(names)}):\n    return fn({', '.join(names)})\n"
    scope: dict[str, Any] = {"fn": fn}
    exec(src, scope)  # noqa: S102 - a fixed template over our own argument names
    try:
        return fx.symbolic_trace(scope["wrapped"])
    except Exception as error:  # noqa: BLE001 - any tracing failure is a reason to run the reference
        raise Unsupported(f"the score_mod {getattr(fn, '__name__', fn)!r} cannot be traced by torch.fx "
                          f"({type(error).__name__}: {error})") from None


# --------------------------------------------------------------------------------------------
# shape / dtype propagation on fake tensors


def _example_inputs(gm: fx.GraphModule, uses_head: bool, q_sides, k_sides, tables, mode: FakeTensorMode):
    def fake(shape, dtype):
        return mode.from_tensor(torch.empty(shape, dtype=dtype))
    args = [fake((1, _HEADS, _LQ, _LK), torch.float32), fake((1, 1, _LQ, 1), torch.int64),
            fake((1, 1, 1, _LK), torch.int64)]
    if uses_head:
        args.append(fake((1, _HEADS, 1, 1), torch.int64))
    args += [fake((1, 1, _LQ, 1), t.dtype) for t in q_sides]
    args += [fake((1, 1, 1, _LK), t.dtype) for t in k_sides]
    args += [fake(tuple(t.shape), t.dtype) for t in tables]
    return args


def _propagate(gm: fx.GraphModule, args) -> dict[fx.Node, Any]:
    metas: dict[fx.Node, Any] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            metas[n] = result
            return result

    _Recorder(gm).run(*args)
    return metas


def _canonical_lookups(gm: fx.GraphModule) -> None:
    """``x.__getitem__(i)`` as ``operator.getitem(x, i)`` (the same op): torch.fx records indexing
    a constant tensor captured from the enclosing scope (``BUCKETS[gap]``) as the method call, a
    proxy as the function; the generator and the ranges know lookups by the latter."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target == "__getitem__" and len(node.args) == 2 and not node.kwargs:
            node.op, node.target = "call_function", operator.getitem
            changed = True
    if changed:
        gm.recompile()


def graph_with_metas(mod: ScoreMod, q_sides, k_sides, tables) -> tuple[fx.GraphModule, dict[fx.Node, Any]]:
    """``mod``'s graph (:func:`score_graph`) and each node's example value, a fake tensor of the
    dtype torch computes (:class:`Unsupported` if it cannot be traced or evaluated)."""
    gm = score_graph(mod, len(q_sides), len(k_sides), len(tables))
    _canonical_lookups(gm)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        try:
            return gm, _propagate(gm, _example_inputs(gm, mod.head, q_sides, k_sides, tables, mode))
        except Unsupported:
            raise
        except Exception as error:  # noqa: BLE001
            raise Unsupported(f"the score_mod could not be evaluated on example shapes "
                              f"({type(error).__name__}: {str(error)[:200]})") from None


def _roles(node: fx.Node, meta: Any) -> frozenset:
    if not isinstance(meta, torch.Tensor):
        return frozenset()
    shape = tuple(meta.shape)
    if len(shape) > 4:
        raise Unsupported(f"{_where(node)} has {len(shape)} axes: only values that broadcast to "
                          "[rows, heads, queries, keys] can be computed per pair")
    shape = (1,) * (4 - len(shape)) + shape
    if shape[0] != 1 or shape[1] not in (1, _HEADS) or shape[2] not in (1, _LQ) or shape[3] not in (1, _LK):
        raise Unsupported(f"{_where(node)} is not a per-(query, key) value (a lookup that keeps a table "
                          "axis, or a reduction)")
    return frozenset(r for r, size, full in (("q", shape[2], _LQ), ("k", shape[3], _LK)) if size == full)


def _where(node: fx.Node) -> str:
    """The op and where the user wrote it (a captured graph keeps Dynamo's stack trace), else its node."""
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", repr(target))
    return f"`{name}` ({node_site(node) if node.meta.get('stack_trace') else node.name})"


# --------------------------------------------------------------------------------------------
# the generator


class _Gen:
    def __init__(self, gm: fx.GraphModule, metas: dict, code: ScoreModCode, q_sides, k_sides, tables,
                 side_ranges: tuple = ()):
        self.gm, self.metas, self.code = gm, metas, code
        self.side_ranges = side_ranges
        self.values: dict[fx.Node, Value] = {}
        self.lines = code.forward
        self.tables: dict[fx.Node, int] = {}  # table placeholder / get_attr -> table slot
        self.scalars: dict[fx.Node, Any] = {}  # 0-d get_attr constants -> their Python number
        self.n_tab = len(tables)
        self.tmp = 0
        self.interval: Optional[tuple[int, int]] = None  # of the node being generated
        self.wide = False
        self.comp: Optional[torch.dtype] = None  # the dtype torch computes the node being generated in
        self.side_dtypes = ([t.dtype for t in q_sides], [t.dtype for t in k_sides])
        self.table_meta = [(tuple(t.shape), t.dtype) for t in tables]

    def table_rank(self, slot: int) -> int:
        return len(self.table_meta[slot][0]) if slot < self.n_tab else self.code.constants[slot - self.n_tab].dim()

    def fresh(self, prefix="v") -> str:
        self.tmp += 1
        return f"{prefix}{self.tmp}"

    def emit(self, expr: str, node: fx.Node, roles: frozenset) -> Value:
        meta = self.metas[node]
        dtype = meta.dtype if isinstance(meta, torch.Tensor) else None
        name = self.fresh()
        interval = self.interval if dtype in _INTS else None
        narrow = dtype == torch.int64 and interval is not None and _INT32[0] <= interval[0] and interval[1] <= _INT32[1]
        tl_dtype = "tl.int32" if narrow else _TL_DTYPE.get(dtype)
        constant = not any(self.values[a].dtype is not None for a in node.all_input_nodes if a in self.values)
        if constant and tl_dtype:  # all inputs are Python scalars: a 0-d tensor of torch's dtype
            self.lines.append(f"{name} = tl.full([], {expr}, {tl_dtype})")
        elif dtype == torch.bool:  # torch's .bool() of a number is "!= 0"; a comparison stays as it is
            self.lines.append(f"{name} = ({expr}) != 0")
        else:
            cast = f".to({tl_dtype})" if tl_dtype else ""
            self.lines.append(f"{name} = ({expr}){cast}")
        return Value(name, dtype, roles, node, interval, narrow)

    # -- inputs --------------------------------------------------------------------------------
    def placeholders(self) -> None:
        c = self.code
        ph = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        expected = 3 + c.uses_head + c.n_q_side + c.n_k_side + c.n_tables
        if len(ph) != expected:
            raise Unsupported(f"the score_mod takes {len(ph)} inputs, the attention op passes {expected}")
        fixed = [("s", torch.float32, {"q", "k"}), ("q_pos", torch.int64, {"q"}), ("k_pos", torch.int64, {"k"})]
        if c.uses_head:
            fixed.append(("head", torch.int64, set()))
        fixed += [(f"qs{i}", d, {"q"}) for i, d in enumerate(self.side_dtypes[0])]
        fixed += [(f"ks{i}", d, {"k"}) for i, d in enumerate(self.side_dtypes[1])]
        bounds = {"q_pos": (0, POSITION_BOUND), "k_pos": (0, POSITION_BOUND), "head": (0, HEAD_BOUND)}
        self.bounded = {expr: node for node, (expr, _, _) in zip(ph, fixed) if expr in bounds}
        # int64 sides whose values the launch measured within an int32 class: loaded as int32
        measured = dict(zip([f"qs{i}" for i in range(c.n_q_side)] + [f"ks{i}" for i in range(c.n_k_side)],
                            self.side_ranges))
        self.side_given = {node: measured[expr] for node, (expr, dtype, _) in zip(ph, fixed)
                           if measured.get(expr) is not None and dtype == torch.int64}
        c.int32_sides = sorted(expr for node, (expr, _, _) in zip(ph, fixed) if node in self.side_given)
        for node, (expr, dtype, roles) in zip(ph, fixed):
            narrow = expr in bounds or node in self.side_given  # the template loads these as int32
            if dtype == torch.bool:  # bool tensors reach the kernel as uint8
                expr = f"({expr} != 0)"
            interval = bounds.get(expr, self.side_given.get(node, (0, 1) if dtype == torch.bool else None))
            self.values[node] = Value(expr, dtype, frozenset(roles), node, interval, narrow=narrow)
        for i, node in enumerate(ph[len(fixed):]):
            shape, dtype = self.table_meta[i]
            if shape == ():  # a 0-d tensor used as a number (e.g. the padded length held in a tensor)
                value = Value(f"tl.load(tab{i})" + (" != 0" if dtype == torch.bool else ""), dtype, frozenset(), node)
                value.lookup = (i, "0", "(1 == 1)")  # type: ignore[attr-defined]
                self.values[node] = value
            else:
                self.tables[node] = i

    # -- nodes ---------------------------------------------------------------------------------
    def arg(self, a: Any, condition: bool = False) -> Value:
        """``a`` as the node being generated computes with it (converted to ``self.comp``; a bool
        too, as torch promotes it, unless it is a ``condition``: where's, masked_fill's mask)."""
        if isinstance(a, fx.Node):
            if a in self.tables:
                raise Unsupported(f"the table {a.name} is used other than by an index lookup")
            if a in self.scalars:  # converted where it is used, as a Python number is
                return self.arg(self.scalars[a])
            value = self.values[a]
            comp = self.comp
            if comp is not None and value.dtype not in (None, comp) and not (condition and value.dtype == torch.bool):
                # torch's promotion, not Triton's: int8 - uint8 is int16 in torch, uint8 in Triton;
                # an int64 divided by a float64 is float64 in torch, float32 in Triton
                target = "tl.int32" if comp == torch.int64 and not self.wide else _TL_DTYPE[comp]
                return Value(f"({value.expr}).to({target})", comp, value.roles, value.node, value.interval,
                             narrow=target == "tl.int32" and comp == torch.int64)
            if value.narrow and self.wide:  # an int32-held operand of an op computed in int64
                return Value(f"{value.expr}.to(tl.int64)", value.dtype, value.roles, value.node, value.interval)
            return value
        if isinstance(a, bool):
            return Value("True" if a else "False", None, frozenset())
        if isinstance(a, (int, float)):
            if isinstance(a, float) and not math.isfinite(a):
                if self.comp is not None and not self.comp.is_floating_point:
                    raise Unsupported(f"a non-finite constant {a} converted to {self.comp} inside the score_mod")
                return Value("float('inf')" if a > 0 else ("float('-inf')" if a < 0 else "float('nan')"),
                             None, frozenset())
            if isinstance(a, float) and self.comp is not None and not self.comp.is_floating_point:
                return Value(repr(math.trunc(a)), None, frozenset())  # masked_fill(int, 0.5): torch truncates
            if isinstance(a, int) and not _INT32[0] <= a <= _INT32[1]:
                # a Python int Triton would have to fit into an int32-held operand: int64 explicitly
                return Value(f"tl.full([], {a}, tl.int64)", None, frozenset())
            return Value(repr(a), None, frozenset())
        raise Unsupported(f"an argument of type {type(a).__name__} inside the score_mod")

    def input_ranges(self, positions: tuple[int, int], heads: tuple[int, int]) -> dict:
        """Every node's interval with positions and the head index in these ranges (the score and
        float sides unknown, integer sides the launch's measured class or their dtype's whole range)."""
        given = {"q_pos": positions, "k_pos": positions, "head": heads}
        return propagate(self.gm, self.metas, {**self.side_given,
                                               **{node: given[expr] for expr, node in self.bounded.items()}})

    def run(self) -> Value:
        self.placeholders()
        self.ranges = self.input_ranges((0, POSITION_BOUND), (0, HEAD_BOUND))
        self.code.runtime_ranges = lambda max_len, heads: self.input_ranges((0, max_len - 1), (0, heads - 1))
        out = None
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                out = node.args[0]
                break
            if node.op == "get_attr":
                self.constant_table(node)
                continue
            self.values[node] = self.node(node)
        if not isinstance(out, fx.Node) or out not in self.values:
            raise Unsupported("the score_mod does not return one tensor")
        return self.values[out]

    def constant_table(self, node: fx.Node) -> None:
        value = self.gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        if not isinstance(value, torch.Tensor):
            raise Unsupported(f"the constant {node.target} is not a tensor")
        if value.dim() == 0:  # a number: written as a Python constant is (arg), e.g. -inf as float('-inf')
            self.scalars[node] = value.item()
            self.comp, self.wide = None, False  # (not the previous node's)
            self.values[node] = Value(self.arg(value.item()).expr, None, frozenset(), node)
            return
        self.tables[node] = self.n_tab + len(self.code.constants)
        self.code.constants.append(value.detach())

    def node(self, node: fx.Node) -> Value:
        target = node.target
        if node.op == "call_method":
            handler = _METHODS.get(target)
        elif node.op == "call_function":
            handler = _FUNCTIONS.get(target)
        else:
            handler = None
        if handler is None:
            raise Unsupported(f"{_where(node)} is not an op the Triton score_mod generator knows")
        unknown = unmodelled_kwargs(node)
        if unknown:  # e.g. add(x, y, alpha=2): generating it without would change the value
            raise Unsupported(f"{_where(node)} has keyword arguments the generator does not model: {unknown}")
        if constant_wraps(list(node.args) + list(node.kwargs.values()), lambda a: self.metas[a].dtype if isinstance(self.metas.get(a), torch.Tensor)
                          else None):
            raise Unsupported(f"{_where(node)} uses an integer constant outside its tensor's dtype, which torch "
                              "wraps into it")
        meta = self.metas[node]
        roles = _roles(node, meta)
        self.interval = self.ranges.get(node)
        # an int op whose result is not proven to fit int32 computes in int64 (operands widened)
        self.wide = isinstance(meta, torch.Tensor) and meta.dtype == torch.int64 and not (
            self.interval is not None and _INT32[0] <= self.interval[0] and self.interval[1] <= _INT32[1])
        self.comp = _computation_dtype(node, meta, self.metas)
        return handler(self, node, roles)

    def guarded(self, guard: Guard, roles: frozenset, lines: list[str], otherwise: list[str] = ()) -> None:
        """Emit ``lines`` (a wrap or a bounds check) unless this graph's static ranges prove them
        unnecessary (then ``otherwise``). A per-program lookup (no roles) keeps them: they cost one
        scalar, and its mask must stay a tensor. Else, unless proven, they run under a bit of the
        constexpr ``GUARDS``, which the launch clears where its own ranges prove them unnecessary."""
        if roles and guard.proven(self.ranges):
            self.lines.extend(otherwise)
            return
        if not roles:
            self.lines.extend(lines)
            return
        guard = Guard(len(self.code.guards), guard.kind, guard.index, guard.sizes)
        self.code.guards.append(guard)
        self.lines.append(f"if (GUARDS >> {guard.bit}) & 1:")
        self.lines.extend("    " + line for line in lines)
        if otherwise:
            self.lines.append("else:")
            self.lines.extend("    " + line for line in otherwise)

    def lookup(self, node: fx.Node, roles: frozenset) -> Value:
        table, index = node.args
        if table not in self.tables:
            raise Unsupported(f"{_where(node)} indexes a computed tensor; only table[index] lookups")
        slot = self.tables[table]
        index = index if isinstance(index, tuple) else (index,)
        shape, _ = self.table_meta[slot] if slot < self.n_tab else \
            (tuple(self.code.constants[slot - self.n_tab].shape), None)
        if len(index) != len(shape) or not all(isinstance(i, fx.Node) for i in index):
            raise Unsupported(f"{_where(node)} must index every axis of its table with a tensor "
                              f"(table shape {list(shape)}, {len(index)} index(es))")
        offset, ok = [], []
        for d, i in enumerate(index):
            v = self.values[i]
            if v.dtype not in _INTS:
                raise Unsupported(f"{_where(node)} indexes with a {v.dtype} tensor")
            w = self.fresh("ix")
            # int32 offsets when the index is proven small (the launcher checks every table has < 2**31 entries)
            fits = v.interval is not None and -(1 << 30) <= v.interval[0] and v.interval[1] < (1 << 30)
            self.lines.append(f"{w} = {v.expr}.to({'tl.int32' if fits else 'tl.int64'})")
            self.guarded(Guard(0, "wrap", (i,), (shape[d],)), roles, [f"{w} = tl.where({w} < 0, {w} + tab{slot}_n{d}, {w})"])
            ok.append(f"({w} >= 0) & ({w} < tab{slot}_n{d})")
            offset.append(f"{w} * tab{slot}_s{d}")
        off, inb = self.fresh("off"), self.fresh("inb")
        self.lines.append(f"{off} = {' + '.join(offset)}")
        # flags per pair, or per query row under OOB_ROWS; the kernel reduces them after its loop
        bad = f"({role_mask(roles, f'{inb} == 0')}).to(tl.int32)"
        # "!= 0": the interpreter turns a 0-d bool ANDed with a bool tile into int64
        self.guarded(Guard(0, "check", index, shape), roles, [
            f"{inb} = {' & '.join(ok)}",
            f"oob = oob | (tl.max({bad} + tl.zeros([BLOCK_M, BLOCK_N], tl.int32), 1) if OOB_ROWS else {bad})",
            f"{inb} = ({role_mask(roles, inb)}) != 0"], otherwise=[f"{inb} = {role_mask(roles)}"])
        load = f"tl.load(tab{slot} + {off}, mask={inb}, other=0)"
        value = self.emit(f"{load} != 0" if self.metas[node].dtype == torch.bool else load, node, roles)
        value.lookup = (slot, off, inb)  # type: ignore[attr-defined]
        return value


# Table gradients are scatter-adds of the pair gradient into few addresses (a time-bucket table
# has ~100 entries, and one tile's pairs mostly share a handful of buckets): atomics from one
# warp to one address serialize. So each tile first sums the pairs of its HOT_ROUNDS smallest
# indices with tile reductions (one scalar atomic each), then scatters the rest; and programs add
# into NREP replicas of the gradient (``rep`` picks one; the host sums them), so different
# programs rarely meet on an address. Relaxed atomics: the sums are only read after the launch.
HOT_ROUNDS = int(os.environ.get("GRCOMPILE_TABLE_GRAD_ROUNDS", "4"))  # the variable: for tuning runs
_NO_INDEX = 2147483647


def table_grad_lines(slot: int, off: str, inb: str, g: str, rank: int, fresh: Callable[[str], str],
                     tile: bool = True) -> list[str]:
    """Triton lines adding ``g`` (the gradient of ``tab{slot}[off]`` where ``inb``) into replica
    ``rep`` of ``dtab{slot}`` (``[NREP, *table shape]``, contiguous like the table). ``tile``:
    the lookup varies along the queries or keys; else ``g``, ``off`` are scalars (``table[head]``)."""
    numel = " * ".join(f"tab{slot}_n{d}" for d in range(rank)) or "1"
    base = f"dtab{slot} + rep * ({numel})"
    if off == "0":  # a 0-d table: g is this tile's sum already
        return [f"tl.atomic_add({base}, {g}, sem='relaxed')"]
    if not tile:  # one index per program: one atomic (compiled Triton cannot reduce a 0-d tensor)
        return [f"tl.atomic_add({base} + {off}, tl.where({inb}, {g}, 0.0), mask={inb}, sem='relaxed')"]
    tg, ti, hot, sel = fresh("tg"), fresh("ti"), fresh("hot"), fresh("sel")
    lines = [f"{tg} = tl.where({inb}, {g}, 0.0)", f"{ti} = tl.where({inb}, {off}, {_NO_INDEX})"]
    for _ in range(HOT_ROUNDS):
        lines += [f"{hot} = tl.min({ti})",
                  f"{sel} = {ti} == {hot}",
                  f"tl.atomic_add({base} + {hot}, tl.sum(tl.where({sel}, {tg}, 0.0)), mask={hot} != {_NO_INDEX}, "
                  "sem='relaxed')",
                  f"{ti} = tl.where({sel}, {_NO_INDEX}, {ti})"]
    lines.append(f"tl.atomic_add({base} + {ti}, {tg}, mask={ti} != {_NO_INDEX}, sem='relaxed')")
    return lines


def _op_name(node: fx.Node) -> str:
    """``add``, ``clamp``, ... for a method call or a function target alike."""
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", "")


def _clamp_bounds(node: fx.Node) -> tuple[Any, Any]:
    """``(min, max)`` of a clamp / clip / clamp_min / clamp_max call (None where absent)."""
    if _op_name(node) == "clamp_max":
        return None, node.args[1]
    lo = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    hi = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    return lo, hi


_NO_PROMOTION = {"long", "int", "float", "double", "half", "bfloat16", "bool", "to", "type", "type_as", "contiguous",
                 "getitem", "full", "zeros_like", "ones_like", "full_like"}


def _computation_dtype(node: fx.Node, meta: Any, metas: dict) -> Optional[torch.dtype]:
    """The dtype torch computes ``node`` in (its operands are converted to it), or None where the
    generator takes them as they are (casts, lookups, fills, logical ops on bools)."""
    name = _op_name(node)
    if name in _NO_PROMOTION:
        return None
    if name in ("lt", "le", "gt", "ge", "eq", "ne"):
        operands = [metas[a] if isinstance(a, fx.Node) else a for a in node.args[:2]]
        try:
            return torch.result_type(*operands)
        except (TypeError, RuntimeError):
            return None
    dtype = meta.dtype if isinstance(meta, torch.Tensor) else None
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32  # torch's opmath: half arithmetic in float32, with the scalar exact, rounded once
    return None if dtype == torch.bool else dtype


def role_mask(roles: frozenset, condition: str = "") -> str:
    """The in-row mask of a value with these roles (its own shape: a per-key value is ``[1, BN]``),
    ANDed with ``condition``."""
    mask = {frozenset({"q", "k"}): "PAIR", frozenset({"q"}): "QOK", frozenset({"k"}): "KOK"}.get(roles)
    parts = [p for p in (mask, f"({condition})" if condition else "") if p]
    return " & ".join(parts) if parts else "(1 == 1)"


def _binary(op: str) -> Callable:
    def handler(gen: _Gen, node: fx.Node, roles):
        a, b = (gen.arg(x) for x in node.args[:2])
        meta = gen.metas[node]
        if isinstance(meta, torch.Tensor) and meta.dtype == torch.bool and op in ("+", "*"):
            return gen.emit(f"{a.expr} {'|' if op == '+' else '&'} {b.expr}", node, roles)  # True + True is True
        return gen.emit(f"{a.expr} {op} {b.expr}", node, roles)
    return handler


def _reflected(op: str) -> Callable:
    def handler(gen: _Gen, node: fx.Node, roles):
        a, b = (gen.arg(x) for x in node.args[:2])
        return gen.emit(f"{b.expr} {op} {a.expr}", node, roles)
    return handler


def _unary(template: str) -> Callable:
    def handler(gen: _Gen, node: fx.Node, roles):
        x = gen.arg(node.args[0])  # converted as torch computes: torch.log(int) in float32
        if _op_name(node) in ("floor", "ceil") and x.dtype is not None and not x.dtype.is_floating_point:
            return gen.emit(x.expr, node, roles)  # an integer's floor is itself (no float32 round trip)
        return gen.emit(template.format(x=x.expr), node, roles)
    return handler


def _cast(gen: _Gen, node: fx.Node, roles):
    return gen.emit(gen.arg(node.args[0]).expr, node, roles)


def _where_fn(gen: _Gen, node: fx.Node, roles):
    c, a, b = gen.arg(node.args[0], condition=True), gen.arg(node.args[1]), gen.arg(node.args[2])
    return gen.emit(f"tl.where({c.expr}, {a.expr}, {b.expr})", node, roles)


def _masked_fill(gen: _Gen, node: fx.Node, roles):
    x, m = gen.arg(node.args[0]), gen.arg(node.args[1], condition=True)
    val = gen.arg(node.args[2] if len(node.args) > 2 else node.kwargs["value"])
    return gen.emit(f"tl.where({m.expr}, {val.expr}, {x.expr})", node, roles)


def _clamp(gen: _Gen, node: fx.Node, roles):
    x = gen.arg(node.args[0])
    lo, hi = _clamp_bounds(node)
    expr = x.expr
    # a NaN x stays NaN (its comparisons fail); a NaN bound gives NaN, as in torch
    for bound, cmp in ((lo, "<"), (hi, ">")):
        if bound is None:
            continue
        b = gen.arg(bound).expr
        if isinstance(bound, float) and math.isnan(bound):
            expr = f"{expr} + {b}"
        else:
            nan = f" | ({b} != {b})" if isinstance(bound, fx.Node) and not _proven_finite(gen, bound) else ""
            expr = f"tl.where(({expr} {cmp} {b}){nan}, {b}, {expr})"
    return gen.emit(expr, node, roles)


def _minmax(kind: str) -> Callable:
    def handler(gen: _Gen, node: fx.Node, roles):
        if len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
            raise Unsupported(f"{_where(node)}: only the two-tensor form of {kind} is supported")
        a, b = (gen.arg(x) for x in node.args)
        cmp = "<" if kind == "min" else ">"
        # torch propagates a NaN of either operand (b's is taken when a's comparison fails), which
        # an operand the value ranges prove finite cannot be
        nan_a = "" if _proven_finite(gen, node.args[0]) else f" | ({a.expr} != {a.expr})"
        return gen.emit(f"tl.where(({a.expr} {cmp} {b.expr}){nan_a}, {a.expr}, {b.expr})", node, roles)
    return handler


def _full(gen: _Gen, node: fx.Node, roles):
    size = node.args[0]
    if tuple(size) != ():
        raise Unsupported(f"{_where(node)} builds a tensor of shape {list(size)} inside the score_mod")
    return gen.emit(gen.arg(node.args[1]).expr, node, roles)


def _full_like(value: Optional[float]) -> Callable:
    def handler(gen: _Gen, node: fx.Node, roles):
        x = gen.arg(node.args[0])
        fill = gen.arg(value if value is not None else node.args[1])  # float('-inf'), not a bare -inf
        return gen.emit(f"tl.zeros_like({x.expr}) + {fill.expr}", node, roles)
    return handler


def _getitem(gen: _Gen, node: fx.Node, roles):
    return gen.lookup(node, roles)


# at most this many boundaries are compared one by one (a scalar load and a compare each); more
# are found by a binary search (a gather per halving step)
LINEAR_BUCKETS = int(os.environ.get("GRCOMPILE_LINEAR_BUCKETS", "16"))


def _bucketize(gen: _Gen, node: fx.Node, roles):
    """``torch.bucketize(x, boundaries, out_int32=, right=)``: the number of boundaries ``b`` with
    ``not (b >= x)`` (``right=True``: ``not (b > x)``), compared in the dtype torch promotes the
    two to. On sorted boundaries that is torch's binary search exactly — ``boundaries[i-1] < x <=
    boundaries[i]``, ties to the left bucket (right) — and a NaN ``x`` gets K, as there; the
    launcher checks the boundaries are sorted (torch defines nothing else)."""
    x_node, bounds = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("boundaries")
    if len(node.args) > 2 or set(node.kwargs) - {"boundaries", "out_int32", "right"}:
        raise Unsupported(f"{_where(node)}: only bucketize(x, boundaries, out_int32=, right=)")
    right = node.kwargs.get("right", False)
    if not isinstance(right, bool) or not isinstance(node.kwargs.get("out_int32", False), bool):
        raise Unsupported(f"{_where(node)}: right= / out_int32= must be constant booleans")
    if not isinstance(bounds, fx.Node) or bounds not in gen.tables:
        raise Unsupported(f"{_where(node)}: the boundaries must be a table input of the op")
    slot = gen.tables[bounds]
    shape, b_dtype = gen.table_meta[slot] if slot < gen.n_tab else \
        (tuple(gen.code.constants[slot - gen.n_tab].shape), gen.code.constants[slot - gen.n_tab].dtype)
    if len(shape) != 1:
        raise Unsupported(f"{_where(node)}: boundaries of shape {list(shape)}, not [K]")
    x_meta = gen.metas[x_node] if isinstance(x_node, fx.Node) else None
    if not isinstance(x_meta, torch.Tensor) or b_dtype in (torch.bool,) or b_dtype.is_complex:
        raise Unsupported(f"{_where(node)}: bucketize of a {type(x_meta).__name__} by {b_dtype} boundaries")
    comp = torch.result_type(x_meta, gen.metas[bounds])  # torch compares in the promoted dtype
    if comp in (torch.float16, torch.bfloat16):
        comp = torch.float32  # exact for both operands, the same order
    if comp not in _TL_DTYPE or comp == torch.bool:
        raise Unsupported(f"{_where(node)}: bucketize compared in {comp}")
    gen.comp, gen.wide = comp, False
    x = gen.arg(x_node)
    tl_comp = _TL_DTYPE[comp]
    if x.dtype == torch.bool and comp != torch.bool:
        x = Value(f"({x.expr}).to({tl_comp})", comp, x.roles, x.node, x.interval)
    K = shape[0]
    cmp = ">" if right else ">="
    bx, count = gen.fresh("bx"), gen.fresh("bc")
    gen.lines.append(f"{bx} = {x.expr}")
    if slot not in gen.code.sorted_tables:
        gen.code.sorted_tables.append(slot)
    if K == 0:
        gen.lines.append(f"{count} = tl.where({bx} == {bx}, 0, 0)")
    elif K <= LINEAR_BUCKETS:
        for i in range(K):
            b = f"tl.load(tab{slot} + {i} * tab{slot}_s0).to({tl_comp})"
            term = f"tl.where({b} {cmp} {bx}, 0, 1)"
            gen.lines.append(f"{count} = {term}" if i == 0 else f"{count} = {count} + {term}")
    else:  # binary lifting: the largest count c with "not (b[c-1] cmp x)", one halving per step
        step = 1 << (K.bit_length() - 1)  # the largest power of two <= K: the steps sum to >= K
        gen.lines.append(f"{count} = tl.where({bx} == {bx}, 0, 0)")
        while step:
            idx, ok, b = gen.fresh("bi"), gen.fresh("bok"), gen.fresh("bb")
            gen.lines.append(f"{idx} = {count} + {step - 1}")
            gen.lines.append(f"{ok} = {idx} < {K}")
            gen.lines.append(f"{b} = tl.load(tab{slot} + {idx} * tab{slot}_s0, mask={ok}, other=0).to({tl_comp})")
            gen.lines.append(f"{count} = tl.where({ok} & (({b} {cmp} {bx}) == 0), {count} + {step}, {count})")
            step >>= 1
    gen.comp = None  # the count is int32 in [0, K]: stored in the dtype torch returns
    return gen.emit(count, node, roles)


def _pow(gen: _Gen, node: fx.Node, roles):
    x, e = node.args[:2]
    if isinstance(e, fx.Node) or e not in (2, 2.0, 3, 0.5, -1, -0.5, 1):
        raise Unsupported(f"{_where(node)}: only x ** 2, 3, 0.5, -0.5, -1 are supported")
    xv = gen.arg(x).expr
    expr = {2: f"{xv} * {xv}", 3: f"{xv} * {xv} * {xv}", 0.5: f"tl.sqrt({xv})", -0.5: f"tl.rsqrt({xv})",
            -1: f"1.0 / {xv}", 1: xv}[e]
    return gen.emit(expr, node, roles)


def _div(gen: _Gen, node: fx.Node, roles):
    rounding = node.kwargs.get("rounding_mode")
    if rounding == "floor":
        return _floordiv(gen, node, roles)
    if rounding == "trunc":
        return _truncdiv(gen, node, roles)
    if rounding is not None:
        raise Unsupported(f"{_where(node)}: division with rounding_mode={rounding!r}")
    a, b = (gen.arg(x) for x in node.args[:2])
    return gen.emit(f"{a.expr} / {b.expr}", node, roles)  # operands in the float dtype torch divides in


def _is_float(gen: _Gen, *values: Value) -> bool:
    """Whether torch computes the node in a float dtype (the operands are converted to it); a
    Python constant's text would mislead: ``tl.full([], 2147483648, tl.int64)`` has a dot."""
    if gen.comp is not None:
        return gen.comp.is_floating_point
    return any(v.dtype.is_floating_point if v.dtype is not None else isinstance(_literal(v.expr), float)
               for v in values)


def _literal(expr: str) -> Any:
    try:
        return ast.literal_eval(expr)
    except (ValueError, SyntaxError):
        return float(expr.split("'")[1]) if expr.startswith("float('") else None


def _int_floor_parts(gen: _Gen, a: Value, b: Value) -> tuple[str, str]:
    """``(floor quotient, remainder with b's sign)`` of integers, whatever Triton's ``//`` rounds
    to (C truncation compiled, numpy's floor in the interpreter): the remainder decides."""
    q, r = gen.fresh("q"), gen.fresh("r")
    gen.lines.append(f"{q} = {a.expr} // {b.expr}")
    gen.lines.append(f"{r} = {a.expr} - {q} * {b.expr}")
    fix = gen.fresh("fix")
    gen.lines.append(f"{fix} = ({r} != 0) & (({r} < 0) != ({b.expr} < 0))")
    return f"tl.where({fix}, {q} - 1, {q})", f"tl.where({fix}, {r} + {b.expr}, {r})"


def _float_remainder(gen: _Gen, a: Value, b: Value) -> tuple[str, str]:
    """``(fmod(a, b), torch's remainder)`` of floats: Triton's float ``%`` is C's fmod (exact);
    torch's remainder moves it to the divisor's sign."""
    m, fix = gen.fresh("m"), gen.fresh("fix")
    gen.lines.append(f"{m} = {a.expr} % {b.expr}")
    gen.lines.append(f"{fix} = ({m} != 0) & (({m} < 0) != ({b.expr} < 0))")
    return m, f"tl.where({fix}, {m} + {b.expr}, {m})"


def _floordiv(gen: _Gen, node: fx.Node, roles):
    a, b = (gen.arg(x) for x in node.args[:2])
    if _is_float(gen, a, b):
        # torch's div_floor_floating (Python's float //), not floor(a / b): 1.0 // 0.1 is 9, while
        # the rounded 1.0 / 0.1 is 10. The quotient of a minus its fmod is an integer up to
        # rounding, one less where the remainder's sign differs from b's, then rounded to nearest
        m, _ = _float_remainder(gen, a, b)
        d, f = gen.fresh("d"), gen.fresh("f")
        gen.lines.append(f"{d} = ({a.expr} - {m}) / {b.expr}")
        gen.lines.append(f"{d} = tl.where(({m} != 0) & (({m} < 0) != ({b.expr} < 0)), {d} - 1.0, {d})")
        gen.lines.append(f"{f} = tl.floor({d})")
        gen.lines.append(f"{f} = tl.where({d} - {f} > 0.5, {f} + 1.0, {f})")
        # a zero quotient takes the sign of a / b; division by zero is IEEE's a / b
        q = f"{a.expr} / {b.expr}"
        return gen.emit(f"tl.where({b.expr} == 0, {q}, tl.where({d} != 0, {f}, ({q}) * 0.0))", node, roles)
    return gen.emit(_int_floor_parts(gen, a, b)[0], node, roles)


def _truncdiv(gen: _Gen, node: fx.Node, roles):
    a, b = (gen.arg(x) for x in node.args[:2])
    if _is_float(gen, a, b):
        x = gen.fresh("x")
        gen.lines.append(f"{x} = {a.expr} / {b.expr}")
        return gen.emit(f"tl.where({x} < 0, tl.ceil({x}), tl.floor({x}))", node, roles)
    floor, rem = _int_floor_parts(gen, a, b)
    return gen.emit(f"tl.where(({rem} != 0) & (({a.expr} < 0) != ({b.expr} < 0)), {floor} + 1, {floor})",
                    node, roles)


def _mod(gen: _Gen, node: fx.Node, roles):
    """torch.remainder / ``%``: the sign of the divisor (Python's), not C's fmod."""
    a, b = (gen.arg(x) for x in node.args[:2])
    if _is_float(gen, a, b):  # torch's: fmod (Triton's float %, exact), moved to the divisor's sign
        return gen.emit(_float_remainder(gen, a, b)[1], node, roles)
    return gen.emit(_int_floor_parts(gen, a, b)[1], node, roles)


def _log1p(gen: _Gen, node: fx.Node, roles):
    x = gen.arg(node.args[0])
    xv = x.expr  # an integer arrives converted to the float dtype torch computes log1p in
    u = gen.fresh("u")
    gen.lines.append(f"{u} = 1.0 + {xv}")
    # log(u) * x / (u - 1): accurate for small x (Goldberg), exact when u == 1; an infinite (or
    # NaN) u is its own log1p (inf / inf would make NaN of log1p(inf)) — unless x is proven finite
    accurate = f"tl.log({u}) * ({xv} / ({u} - 1.0))"
    if not _proven_finite(gen, node.args[0]):
        accurate = f"tl.where({u} - {u} != 0.0, {u}, {accurate})"
    return gen.emit(f"tl.where({u} == 1.0, {xv}, {accurate})", node, roles)


def _proven_finite(gen: _Gen, a: Any) -> bool:
    """Whether the value ranges prove ``a`` is never NaN or infinite (a float interval says so)."""
    return not isinstance(a, fx.Node) or gen.ranges.get(a) is not None


def _silu(gen: _Gen, node: fx.Node, roles):
    x = gen.arg(node.args[0]).expr
    return gen.emit(f"{x} / (1.0 + tl.exp(-{x}))", node, roles)


def _invert(gen: _Gen, node: fx.Node, roles):
    x = gen.arg(node.args[0])
    return gen.emit(f"{x.expr} == 0" if x.dtype == torch.bool else f"~{x.expr}", node, roles)


def _neg(gen: _Gen, node: fx.Node, roles):
    return gen.emit(f"-{gen.arg(node.args[0]).expr}", node, roles)


_FLOAT_UNARY = {"exp": "tl.exp({x})", "log": "tl.log({x})", "log2": "tl.log2({x})", "exp2": "tl.exp2({x})", "sqrt": "tl.sqrt({x})", "rsqrt": "tl.rsqrt({x})",
                "sigmoid": "1.0 / (1.0 + tl.exp(-{x}))", "tanh": "2.0 / (1.0 + tl.exp(-2.0 * {x})) - 1.0",
                "floor": "tl.floor({x})", "ceil": "tl.ceil({x})"}
_ANY_UNARY = {"abs": "tl.abs({x})", "relu": "tl.where(({x} > 0) | ({x} != {x}), {x}, 0)"}  # relu(NaN) is NaN

_FUNCTIONS: dict[Any, Callable] = {
    operator.add: _binary("+"), operator.sub: _binary("-"), operator.mul: _binary("*"),
    operator.truediv: _div, operator.floordiv: _floordiv, operator.neg: _neg, operator.invert: _invert,
    operator.lt: _binary("<"), operator.le: _binary("<="), operator.gt: _binary(">"), operator.ge: _binary(">="),
    operator.eq: _binary("=="), operator.ne: _binary("!="),
    operator.and_: _binary("&"), operator.or_: _binary("|"), operator.xor: _binary("^"),
    operator.mod: _mod, torch.remainder: _mod, torch.floor_divide: _floordiv,
    operator.getitem: _getitem, operator.pow: _pow, operator.abs: _unary("tl.abs({x})"),
    torch.add: _binary("+"), torch.sub: _binary("-"), torch.mul: _binary("*"), torch.div: _div,
    torch.true_divide: _div, torch.neg: _neg, torch.where: _where_fn, torch.clamp: _clamp, torch.clip: _clamp,
    torch.clamp_min: _clamp, torch.clamp_max: _clamp, torch.minimum: _minmax("min"), torch.maximum: _minmax("max"),
    torch.min: _minmax("min"), torch.max: _minmax("max"), torch.full: _full,
    torch.zeros_like: _full_like(0), torch.ones_like: _full_like(1), torch.full_like: _full_like(None),
    torch.log1p: _log1p, F.silu: _silu, torch.nn.functional.relu: _unary(_ANY_UNARY["relu"]),
    torch.pow: _pow, torch.masked_fill: _masked_fill, torch.lt: _binary("<"), torch.le: _binary("<="),
    torch.gt: _binary(">"), torch.ge: _binary(">="), torch.eq: _binary("=="), torch.ne: _binary("!="),
    torch.logical_and: _binary("&"), torch.logical_or: _binary("|"), torch.logical_not: _invert,
    torch.abs: _unary(_ANY_UNARY["abs"]), torch.relu: _unary(_ANY_UNARY["relu"]),
    torch.bucketize: _bucketize,
}
for _name, _tpl in _FLOAT_UNARY.items():
    _FUNCTIONS[getattr(torch, _name)] = _unary(_tpl)
_FUNCTIONS[torch.sigmoid] = _unary(_FLOAT_UNARY["sigmoid"])

_METHODS: dict[str, Callable] = {
    "add": _binary("+"), "sub": _binary("-"), "mul": _binary("*"), "div": _div, "true_divide": _div,
    "__radd__": _reflected("+"), "__rsub__": _reflected("-"), "__rmul__": _reflected("*"),
    "neg": _neg, "abs": _unary(_ANY_UNARY["abs"]), "relu": _unary(_ANY_UNARY["relu"]),
    "float": _cast, "double": _cast, "long": _cast, "int": _cast, "half": _cast, "bfloat16": _cast,
    "bool": _cast, "to": _cast, "type": _cast, "type_as": _cast, "masked_fill": _masked_fill, "clamp": _clamp,
    "clamp_min": _clamp, "clamp_max": _clamp, "clip": _clamp, "log1p": _log1p, "pow": _pow,
    "lt": _binary("<"), "le": _binary("<="), "gt": _binary(">"), "ge": _binary(">="), "eq": _binary("=="),
    "ne": _binary("!="), "logical_not": _invert, "minimum": _minmax("min"), "maximum": _minmax("max"),
    "contiguous": _cast, "remainder": _mod, "floor_divide": _floordiv, "__floordiv__": _floordiv,
    "__mod__": _mod,
}
for _name, _tpl in _FLOAT_UNARY.items():
    _METHODS[_name] = _unary(_tpl)


# --------------------------------------------------------------------------------------------
# reverse mode


# d(y = f(x)) for pointwise f: the adjoint g times f'(x), written with x and y
_UNARY_GRAD = {
    "exp": "{g} * {y}", "log": "{g} / {x}", "log1p": "{g} / (1.0 + {x})",
    "log2": "{g} / ({x} * 0.6931471805599453)", "exp2": "{g} * {y} * 0.6931471805599453",
    "sqrt": "{g} * 0.5 / {y}", "rsqrt": "{g} * -0.5 * {y} * {y} * {y}",
    "sigmoid": "{g} * {y} * (1.0 - {y})", "tanh": "{g} * (1.0 - {y} * {y})",
}


class _Backward:
    """Adjoints of the float values that depend on a differentiable input, in reverse order."""

    def __init__(self, gen: _Gen, out: Value, grad_tables: list[int], grad_q: list[int], grad_k: list[int]):
        self.gen, self.out, self.lines = gen, out, gen.code.backward
        self.adj: dict[fx.Node, str] = {}
        self.grad_tables, self.grad_q, self.grad_k = set(grad_tables), set(grad_q), set(grad_k)
        self.needs = self._needs_grad()

    def _needs_grad(self) -> set:
        gen, needs = self.gen, set()
        for node, value in gen.values.items():
            if node.op == "placeholder":
                e = value.expr
                lookup = getattr(value, "lookup", None)
                if e == "s" or (e.startswith("qs") and int(e[2:]) in self.grad_q) or \
                        (e.startswith("ks") and int(e[2:]) in self.grad_k) or \
                        (lookup is not None and lookup[0] in self.grad_tables):
                    needs.add(node)
                continue
            if value.dtype is None or not value.dtype.is_floating_point:
                continue
            lookup = getattr(value, "lookup", None)
            if lookup is not None and lookup[0] in self.grad_tables:
                needs.add(node)
            elif any(isinstance(a, fx.Node) and a in needs for a in node.all_input_nodes):
                needs.add(node)
        return needs

    def add(self, node: Any, contribution: str, roles_from: frozenset) -> None:
        if not isinstance(node, fx.Node) or node not in self.needs:
            return
        target = self.gen.values[node].roles
        c = contribution
        if roles_from - target:  # an un-broadcast: garbage lanes (out of the row) must not enter the sum
            c = f"tl.where({role_mask(roles_from)}, {c}, 0.0)"
            if "k" in roles_from and "k" not in target:
                c = f"tl.sum({c}, axis=1, keep_dims=True)"
            if "q" in roles_from and "q" not in target:
                c = f"tl.sum({c}, axis=0, keep_dims=True)"
            if not target:
                c = f"tl.sum(tl.sum({c}, axis=1), axis=0)" if roles_from else c
        name = self.gen.fresh("g")
        prev = self.adj.get(node)
        self.lines.append(f"{name} = {c}" if prev is None else f"{name} = {prev} + {c}")
        self.adj[node] = name

    def run(self) -> None:
        gen = self.gen
        gen.comp, gen.wide = None, False  # the derivatives combine forward values as they are
        if self.out.node is not None and self.out.node in self.needs:
            # g_mod is a [BM, BN] tile: a result along the keys only, the queries only or neither
            # (broadcast to the tile by the forward) gets its in-row pairs' sum, in its own shape
            self.add(self.out.node, "g_mod", frozenset({"q", "k"}))
        for node in reversed(list(gen.values)):
            g = self.adj.get(node)
            if g is None or (node.op == "placeholder" and not hasattr(gen.values[node], "lookup")):
                continue
            self.rule(node, g)
        for node, value in gen.values.items():
            if node.op != "placeholder":
                continue
            g = self.adj.get(node)
            e = value.expr
            if e == "s":
                self.lines.append(f"g_s = {g}" if g else "g_s = tl.zeros_like(s)")
            elif e.startswith("qs") and int(e[2:]) in self.grad_q:  # [BM, 1]: summed over this tile's keys
                self.lines.append(f"g_qs{e[2:]} = tl.where(QOK, {g}, 0.0)" if g else
                                  f"g_qs{e[2:]} = tl.zeros([BLOCK_M, 1], tl.float32)")
            elif e.startswith("ks") and int(e[2:]) in self.grad_k:  # [1, BN]: summed over this tile's queries
                self.lines.append(f"g_ks{e[2:]} = tl.where(KOK, {g}, 0.0)" if g else
                                  f"g_ks{e[2:]} = tl.zeros([1, BLOCK_N], tl.float32)")

    def rule(self, node: fx.Node, g: str) -> None:
        gen, v = self.gen, self.gen.values[node]
        roles = v.roles
        args = node.args
        t = node.target
        name = _op_name(node)
        lookup = getattr(v, "lookup", None)
        if lookup is not None:
            slot, off, inb = lookup
            if slot in self.grad_tables:  # g, off and inb all have the lookup's own shape
                self.lines += table_grad_lines(slot, off, inb, g, self.gen.table_rank(slot), self.gen.fresh,
                                               tile=bool(roles))
            return

        def x(i):
            return gen.arg(args[i]).expr

        if name in ("add", "__radd__") or t is torch.add:
            self.add(args[0], g, roles)
            self.add(args[1], g, roles)
        elif name in ("sub",) or t is torch.sub:
            self.add(args[0], g, roles)
            self.add(args[1], f"-{g}", roles)
        elif name == "__rsub__":
            self.add(args[0], f"-{g}", roles)
        elif name in ("mul", "__rmul__") or t is torch.mul:
            self.add(args[0], f"{g} * {x(1)}", roles)
            self.add(args[1], f"{g} * {x(0)}", roles)
        elif node.kwargs.get("rounding_mode"):
            return  # floor / trunc division: zero derivative almost everywhere, as torch
        elif name in ("truediv", "div", "true_divide") or t is torch.div:
            self.add(args[0], f"{g} / {x(1)}", roles)
            self.add(args[1], f"-{g} * {v.expr} / {x(1)}", roles)
        elif name == "neg":
            self.add(args[0], f"-{g}", roles)
        elif name in ("float", "double", "half", "bfloat16", "to", "type", "type_as", "contiguous"):
            self.add(args[0], g, roles)
        elif name == "where":
            self.add(args[1], f"tl.where({x(0)}, {g}, 0.0)", roles)
            self.add(args[2], f"tl.where({x(0)}, 0.0, {g})", roles)
        elif name == "masked_fill":  # the value (a 0-d tensor: a table, a computed scalar) gets the filled pairs' sum
            value = args[2] if len(args) > 2 else node.kwargs.get("value")
            self.add(args[0], f"tl.where({x(1)}, 0.0, {g})", roles)
            self.add(value, f"tl.where({x(1)}, {g}, 0.0)", roles)
        elif name in ("clamp", "clip", "clamp_min", "clamp_max"):
            lo, hi = _clamp_bounds(node)
            keep = ["(1 == 1)"]
            if lo is not None:
                keep.append(f"({x(0)} >= {gen.arg(lo).expr})")
            if hi is not None:
                keep.append(f"({x(0)} <= {gen.arg(hi).expr})")
            self.add(args[0], f"tl.where({' & '.join(keep)}, {g}, 0.0)", roles)
            # tensor bounds, as torch: min(max(x, lo), hi) takes hi where max(x, lo) > hi, else lo where x < lo
            lo_v = gen.arg(lo).expr if lo is not None else None
            hi_v = gen.arg(hi).expr if hi is not None else None
            if isinstance(lo, fx.Node):
                self.add(lo, f"tl.where(({x(0)} < {lo_v})" + (f" & ({lo_v} <= {hi_v})" if hi_v else "") +
                         f", {g}, 0.0)", roles)
            if isinstance(hi, fx.Node):
                above = f"tl.where({x(0)} > {lo_v}, {x(0)}, {lo_v})" if lo_v else x(0)
                self.add(hi, f"tl.where({above} > {hi_v}, {g}, 0.0)", roles)
        elif name in ("minimum", "maximum", "min", "max"):
            a, b = x(0), x(1)
            win, lose = ("<", ">") if name in ("minimum", "min") else (">", "<")
            # torch's: each operand's gradient unless it loses (both get it where one is NaN), halves on ties
            self.add(args[0], f"tl.where({a} == {b}, {g} * 0.5, tl.where({a} {lose} {b}, 0.0, {g}))", roles)
            self.add(args[1], f"tl.where({a} == {b}, {g} * 0.5, tl.where({a} {win} {b}, 0.0, {g}))", roles)
        elif name == "abs":
            self.add(args[0], f"tl.where({x(0)} > 0, {g}, tl.where({x(0)} < 0, -{g}, 0.0))", roles)
        elif name in _UNARY_GRAD:
            self.add(args[0], _UNARY_GRAD[name].format(g=g, x=x(0), y=v.expr), roles)
        elif name == "silu":
            sg = gen.fresh("sg")
            self.lines.append(f"{sg} = 1.0 / (1.0 + tl.exp(-{x(0)}))")
            self.add(args[0], f"{g} * {sg} * (1.0 + {x(0)} * (1.0 - {sg}))", roles)
        elif name == "relu":
            self.add(args[0], f"tl.where({x(0)} > 0, {g}, 0.0)", roles)
        elif name == "pow":
            e = args[1]
            xv = x(0)
            d = {2: f"2.0 * {xv}", 3: f"3.0 * {xv} * {xv}", 0.5: f"0.5 / {v.expr}",
                 -0.5: f"-0.5 * {v.expr} / {xv}", -1: f"-{v.expr} * {v.expr}", 1: "1.0"}[e]
            self.add(args[0], f"{g} * {d}", roles)
        elif name in ("mod", "remainder", "__mod__"):  # a - floor(a / b) * b
            self.add(args[0], g, roles)
            # the quotient the forward's remainder left: (a - r) / b is an integer up to rounding
            self.add(args[1], f"-{g} * tl.floor(({x(0)} - {v.expr}) / {x(1)} + 0.5)", roles)
        elif name in ("floor", "ceil", "full", "zeros_like", "ones_like", "full_like", "floordiv",
                      "floor_divide", "__floordiv__") or (name in ("div",) and node.kwargs.get("rounding_mode")):
            return  # zero derivative (floor/ceil almost everywhere, as torch)
        else:
            raise Unsupported(f"{_where(node)} has no derivative rule in the Triton score_mod generator")


def generate(mod: ScoreMod, q_sides, k_sides, tables, *, backward: bool, side_ranges: tuple = ()) -> ScoreModCode:
    """Triton source for ``mod`` on sides/tables with these dtypes and shapes (see the module
    docstring); ``side_ranges``: per side (query sides first), an interval within int32 its int64
    values lie in (measured by the launch), or None."""
    gm, metas = graph_with_metas(mod, q_sides, k_sides, tables)
    code = ScoreModCode([n.name for n in gm.graph.nodes if n.op == "placeholder"], len(q_sides), len(k_sides),
                        len(tables), mod.head)
    gen = _Gen(gm, metas, code, q_sides, k_sides, tables, tuple(side_ranges))
    try:
        out = gen.run()
    except Unsupported:
        raise
    except Exception as error:  # noqa: BLE001 - a spelling the generator mishandles runs the reference
        raise Unsupported(f"the Triton score_mod generator failed ({type(error).__name__}: {str(error)[:200]})") \
            from None
    if out.dtype is not None and not out.dtype.is_floating_point:
        raise Unsupported(f"the score_mod returns {out.dtype}, not a floating score")
    expr = out.expr if out.roles == frozenset({"q", "k"}) else f"{out.expr} + tl.zeros_like(s)"
    code.forward.append(f"s_mod = ({expr}).to(tl.float32)")
    looked_up = {gen.tables[n.args[0]] for n in gm.graph.nodes
                 if n.op == "call_function" and n.target is operator.getitem and n.args and n.args[0] in gen.tables}
    # a float table only compared with (bucketize boundaries) gets no gradient, as in torch
    code.float_tables = [i for i, t in enumerate(tables) if t.is_floating_point()
                         and (i not in code.sorted_tables or i in looked_up)]
    code.float_q_sides = [i for i, t in enumerate(q_sides) if t.is_floating_point()]
    code.float_k_sides = [i for i, t in enumerate(k_sides) if t.is_floating_point()]
    if backward:
        _Backward(gen, out, code.float_tables, code.float_q_sides, code.float_k_sides).run()
    return code


__all__ = ["Unsupported", "ScoreModCode", "generate", "graph_with_metas", "score_graph"]
