"""Value ranges of a score_mod graph: for every node a closed interval ``(lo, hi)`` its values are
proven to lie in, or ``None`` when nothing is proven.

What it proves is what the kernel generator (:mod:`.score_mod_codegen`) may drop: an int64 value
whose range fits int32 is computed in int32, a table index whose range lies inside the table needs
no wrap of negative indices and no bounds check (and the kernel no masked, out-of-range-flagging
gather). A ``log``-bucketed time gap ``clamp((log(max(|Δt|, 1)) / 0.301).long(), 0, 128)`` is
proven to be in ``[0, 128]`` whatever the timestamps are; a relative position ``k - q + N - 1`` is
in ``[0, 2N - 2]`` once the launch knows positions are below ``N``.

Semantics kept (a proof holds for the values the *kernel* computes, not only for exact math):

* integers follow their torch dtype: a result that may leave the dtype's range wraps, so its
  interval is the whole dtype; an unknown integer input is the whole range of its dtype;
* a float interval also proves the value is never NaN or infinite; every float result is widened
  outward by a relative 2⁻¹⁶ (and 2⁻¹²⁶ absolute) to cover float32 rounding and the few ulps of
  the kernel's transcendentals; any op that may produce NaN or overflow has no interval;
* ``where(x < c, a, x)`` (and ``masked_fill``, ``>``, ``<=``, ``>=``) refines ``x`` on the branch
  where the condition is false — the spelling of ``max(x, c)`` people write.

Hand-written rather than ``torch.utils._sympy.value_ranges``: that analysis tracks neither NaN nor
float rounding, and both decide whether a float→int cast can be narrowed soundly.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.fx as fx

Number = Union[int, float]
Interval = tuple[Number, Number]

# float rounding: arithmetic errs by a few ulps of its result (relative); transcendentals also by an
# absolute amount near zero (fast approximations), except at the points every libm gets exactly
_WIDEN_REL, _WIDEN_ABS = 2.0 ** -16, 2.0 ** -20
_EXACT_INT_FLOAT = 2 ** 24  # integers up to this convert to float32 exactly
_NO_ROUNDING = {"neg", "abs", "relu", "clamp", "clip", "clamp_min", "clamp_max", "minimum", "min", "maximum", "max",
                "where", "masked_fill", "floor", "ceil", "contiguous"}
_TRANSCENDENTAL_EXACT = {"log": {1: 0.0}, "log2": {1: 0.0}, "log1p": {0: 0.0}, "exp": {0: 1.0}, "exp2": {0: 1.0},
                         "sqrt": {0: 0.0, 1: 1.0}}
_FLOAT_MAX = {torch.float32: 3.4028234663852886e38, torch.float16: 65504.0, torch.bfloat16: 3.3895313892515355e38,
              torch.float64: 1.7976931348623157e308}


_CASTS = ("long", "int", "to", "type", "type_as", "contiguous", "float", "double", "half", "bfloat16")


def dtype_range(dtype: Optional[torch.dtype]) -> Optional[Interval]:
    """The whole range of an integer / bool dtype (None for floats)."""
    if dtype == torch.bool:
        return 0, 1
    if dtype is not None and not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        return info.min, info.max
    return None


def _op_name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", "")


def _dtype(meta: Any) -> Optional[torch.dtype]:
    return meta.dtype if isinstance(meta, torch.Tensor) else None


def _widen(lo: float, hi: float, dtype: Optional[torch.dtype], relative: tuple[bool, bool] = (True, True),
           absolute: tuple[bool, bool] = (False, False)) -> Optional[Interval]:
    """A float result's interval, each bound widened outward by the rounding its op may add; None
    if it may overflow (or is not finite)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    lo -= abs(lo) * _WIDEN_REL * relative[0] + _WIDEN_ABS * absolute[0]
    hi += abs(hi) * _WIDEN_REL * relative[1] + _WIDEN_ABS * absolute[1]
    limit = _FLOAT_MAX.get(dtype, _FLOAT_MAX[torch.float32])
    return (lo, hi) if -limit < lo and hi < limit else None


def _monotone(fn: Callable[[float], float], lo: Number, hi: Number) -> Optional[Interval]:
    try:
        return fn(lo), fn(hi)
    except (ValueError, OverflowError):
        return None


def _mul(a: Interval, b: Interval) -> Interval:
    products = [x * y for x in a for y in b]
    return min(products), max(products)


def _div(a: Interval, b: Interval) -> Optional[Interval]:
    if b[0] <= 0 <= b[1]:
        return None  # 0/0 is NaN, x/0 infinite
    quotients = [x / y for x in a for y in b]
    return min(quotients), max(quotients)


def _floor_div_int(a: Interval, b: Interval) -> Optional[Interval]:
    if b[0] <= 0 <= b[1]:
        return None
    quotients = [x // y for x in a for y in b]
    return min(quotients), max(quotients)


def _const(a: Any) -> Optional[Interval]:
    if isinstance(a, bool):
        return int(a), int(a)
    if isinstance(a, (int, float)) and math.isfinite(a):
        return a, a
    return None


def _compare_refinement(cond: Any, x: fx.Node) -> Optional[tuple[str, Number]]:
    """``(op, c)`` when ``cond`` is ``x op c`` (or ``c op x``, flipped) for a constant ``c``."""
    if not isinstance(cond, fx.Node) or len(cond.args) != 2:
        return None
    flip = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}
    name = _op_name(cond).strip("_")
    if name not in flip:
        return None
    a, b = cond.args
    if a is x and _const(b) is not None:
        return name, b
    if b is x and _const(a) is not None:
        return flip[name], a
    return None


def _refine(interval: Optional[Interval], relation: Optional[tuple[str, Number]], holds: bool,
            is_int: bool) -> Optional[Interval]:
    """``interval`` narrowed by knowing ``x op c`` is ``holds`` (True / False)."""
    if interval is None or relation is None:
        return interval
    op, c = relation
    if not holds:
        op = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}[op]
    lo, hi = interval
    if op == "lt":
        hi = min(hi, math.ceil(c) - 1 if is_int else c)
    elif op == "le":
        hi = min(hi, math.floor(c) if is_int else c)
    elif op == "gt":
        lo = max(lo, math.floor(c) + 1 if is_int else c)
    else:
        lo = max(lo, math.ceil(c) if is_int else c)
    return (lo, hi) if lo <= hi else interval


def node_interval(node: fx.Node, meta: Any, get: Callable[[Any], Optional[Interval]]) -> Optional[Interval]:
    """The interval of ``node``'s result (``meta``: its example value, for the dtype), given
    ``get(arg)`` for its arguments' intervals (a constant's own value, a node's proven interval or
    None)."""
    dtype = _dtype(meta)
    whole = dtype_range(dtype)
    if dtype is None and not isinstance(meta, (int, float)):
        return None
    if dtype is None:  # a Python number computed from constants
        return _const(meta)
    is_int = whole is not None
    name = _op_name(node)
    args = [*node.args, *node.kwargs.values()]
    a = get(args[0]) if args else None
    b = get(args[1]) if len(args) > 1 else None
    math_iv: Optional[Interval] = None
    if dtype == torch.bool or name in ("lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "xor", "logical_and",
                                       "logical_or", "logical_not", "bool", "isnan", "isinf", "isfinite"):
        return dtype_range(dtype) if is_int else None
    if name == "getitem":  # a table lookup: anything the table holds
        return whole
    if name in ("add", "__radd__") and a and b:
        math_iv = (a[0] + b[0], a[1] + b[1])
    elif name == "sub" and a and b:
        math_iv = (a[0] - b[1], a[1] - b[0])
    elif name == "__rsub__" and a and b:
        math_iv = (b[0] - a[1], b[1] - a[0])
    elif name in ("mul", "__rmul__") and a and b:
        math_iv = _mul(a, b)
    elif name in ("truediv", "div", "true_divide") and a and b:
        rounding = node.kwargs.get("rounding_mode")
        if rounding is None:
            math_iv = _div(a, b)
        elif is_int:
            math_iv = _floor_div_int(a, b) if rounding == "floor" else None
        else:
            q = _div(a, b)
            math_iv = None if q is None else (math.floor(q[0]), math.floor(q[1])) if rounding == "floor" else \
                (math.trunc(q[0]), math.trunc(q[1]))
    elif name in ("floordiv", "floor_divide", "__floordiv__") and a and b:
        if is_int:
            math_iv = _floor_div_int(a, b)
        else:
            q = _div(a, b)
            math_iv = None if q is None else (math.floor(q[0]), math.floor(q[1]))
    elif name == "neg" and a:
        math_iv = (-a[1], -a[0])
    elif name == "abs" and a:
        math_iv = (0 if a[0] <= 0 <= a[1] else min(abs(a[0]), abs(a[1])), max(abs(a[0]), abs(a[1])))
    elif name == "relu" and a:
        math_iv = (max(a[0], 0), max(a[1], 0))
    elif name in ("clamp", "clip", "clamp_min", "clamp_max"):
        if name == "clamp_max":
            lo_c, hi_c = None, node.args[1] if len(node.args) > 1 else node.kwargs.get("max")
        else:
            lo_c = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
            hi_c = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
        lo_v, hi_v = get(lo_c) if lo_c is not None else None, get(hi_c) if hi_c is not None else None
        if (lo_c is not None and lo_v is None) or (hi_c is not None and hi_v is None):
            return whole  # a bound that may be NaN
        base = get(node.args[0]) or (whole if is_int else None)
        if base is None:
            if lo_v is None or hi_v is None:
                return whole
            math_iv = (lo_v[0], hi_v[1])  # NaN clamps to NaN for floats: no interval without the input's
            if not is_int:
                return None
        else:
            lo, hi = base
            if lo_v is not None:
                lo, hi = max(lo, lo_v[0]), max(hi, lo_v[1])
            if hi_v is not None:
                lo, hi = min(lo, hi_v[0]), min(hi, hi_v[1])
            math_iv = (lo, hi)
    elif name in ("minimum", "min", "maximum", "max") and len(node.args) == 2 and a and b:
        pick = min if name.startswith("min") else max
        math_iv = (pick(a[0], b[0]), pick(a[1], b[1]))
    elif name in ("where", "masked_fill") and len(node.args) >= 3:
        if name == "where":
            cond, on_true, on_false = node.args[:3]
        else:
            on_false, cond, on_true = node.args[:3]
        branches = []
        for branch, holds in ((on_true, True), (on_false, False)):
            iv = get(branch)
            if isinstance(branch, fx.Node):
                iv = _refine(iv if iv is not None else (whole if is_int else None),
                             _compare_refinement(cond, branch), holds, is_int)
            branches.append(iv)
        if branches[0] is None or branches[1] is None:
            return whole
        math_iv = (min(branches[0][0], branches[1][0]), max(branches[0][1], branches[1][1]))
    elif name in _CASTS:
        if a is None:
            return whole
        if is_int:  # to an integer: a float truncates toward zero, an integer keeps its value
            math_iv = (math.trunc(a[0]), math.trunc(a[1])) if all(math.isfinite(x) for x in a) else None
        else:  # to a float: exact up to rounding (widened below)
            math_iv = (float(a[0]), float(a[1]))
    elif name in ("log", "log2", "log1p") and a:
        if (a[0] > 0) if name != "log1p" else (a[0] > -1):
            math_iv = _monotone({"log": math.log, "log2": math.log2, "log1p": math.log1p}[name], a[0], a[1])
    elif name in ("exp", "exp2") and a:
        math_iv = _monotone(math.exp if name == "exp" else lambda x: 2.0 ** x, a[0], a[1])
    elif name == "sqrt" and a and a[0] >= 0:
        math_iv = (math.sqrt(a[0]), math.sqrt(a[1]))
    elif name in ("floor", "ceil") and a:
        f = math.floor if name == "floor" else math.ceil
        math_iv = (f(a[0]), f(a[1])) if all(math.isfinite(x) for x in a) else None
    elif name == "sigmoid" and a:
        math_iv = (0.0, 1.0)
    elif name == "tanh" and a:
        math_iv = (-1.0, 1.0)
    if math_iv is None:
        return whole
    if is_int:
        lo, hi = (math.floor(math_iv[0]), math.ceil(math_iv[1]))
        return (int(lo), int(hi)) if whole[0] <= lo and hi <= whole[1] else whole
    lo, hi = float(math_iv[0]), float(math_iv[1])
    if name in _NO_ROUNDING:
        return _widen(lo, hi, dtype, (False, False))
    if name in _CASTS and isinstance(a[0], int):  # from an integer: exact up to 2**24
        return _widen(lo, hi, dtype, (abs(lo) > _EXACT_INT_FLOAT, abs(hi) > _EXACT_INT_FLOAT))
    exact = _TRANSCENDENTAL_EXACT.get(name)
    if exact is not None:
        inexact = tuple(not (x in exact and exact[x] == y) for x, y in zip(a, (lo, hi)))
        return _widen(lo, hi, dtype, inexact, inexact)
    return _widen(lo, hi, dtype)


def propagate(gm: fx.GraphModule, metas: Mapping[fx.Node, Any],
              inputs: Mapping[fx.Node, Optional[Interval]]) -> dict[fx.Node, Optional[Interval]]:
    """Every node's interval, from the placeholders' (``inputs``; a missing integer placeholder is
    its dtype's whole range) forward through the graph in order."""
    ranges: dict[fx.Node, Optional[Interval]] = {}

    def get(a: Any) -> Optional[Interval]:
        return ranges.get(a) if isinstance(a, fx.Node) else _const(a)

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            ranges[node] = inputs[node] if node in inputs else dtype_range(_dtype(metas.get(node)))
        elif node.op == "get_attr":
            value = gm
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            ranges[node] = _const(value.item()) if isinstance(value, torch.Tensor) and value.dim() == 0 else None
        elif node.op in ("call_function", "call_method"):
            ranges[node] = node_interval(node, metas.get(node), get)
    return ranges


__all__ = ["Interval", "dtype_range", "node_interval", "propagate"]
