"""Value ranges of a score_mod graph: for every node a closed interval ``(lo, hi)`` its values are
proven to lie in, or ``None`` when nothing is proven.

What it proves is what the kernel generator (:mod:`.score_mod_codegen`) may drop: an int64 value
whose range fits int32 is computed in int32, a table index whose range lies inside the table needs
no wrap of negative indices and no bounds check (and the kernel no masked, out-of-range-flagging
gather). A ``log``-bucketed time gap ``clamp((log(max(|Δt|, 1)) / 0.301).long(), 0, 128)`` is
proven to be in ``[0, 128]`` whatever the timestamps are; a relative position ``k - q + N - 1`` is
in ``[0, 2N - 2]`` once the launch knows positions are below ``N``.

A proof must hold for the values the *kernel* computes, not only for exact math:

* integers follow their torch dtype: a result that may leave the dtype's range wraps, so its
  interval is the whole dtype (``|x|`` of an unknown int64 may be negative); an unknown integer
  input is the whole range of its dtype;
* a float interval also proves the value is never NaN or infinite. Every float value is bounded
  as its dtype rounds it: an operand converted to the op's dtype (an integer beyond the dtype's
  exact integers, a Python float constant) is widened by one ulp of that dtype, and every rounding
  op's result by its error — correctly rounded arithmetic one ulp, division four (``div.full``),
  transcendentals eight ulps plus 2⁻²⁰ absolute (fast approximations near zero) — each plus the
  dtype's smallest normal (underflow, flush to zero). Only integer → float conversions within the
  dtype's exact integers and the ops that do not round (negation, ``abs``, ``clamp``, ``min`` /
  ``max``, ``where``, ``floor``, ``ceil``) are exact;
* ``where(x < c, a, x)`` (and ``masked_fill``, ``>``, ``<=``, ``>=``) refines ``x`` on the branch
  where the condition is false — the spelling of ``max(x, c)`` people write — with ``c`` as the
  comparison rounds it (an integer ``x`` against a float ``c`` only within float32's exact
  integers).

Hand-written rather than ``torch.utils._sympy.value_ranges``: that analysis tracks neither NaN nor
float rounding, and both decide whether a float→int cast or a dropped bounds check is sound.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.fx as fx

Number = Union[int, float]
Interval = tuple[Number, Number]

# keyword arguments the ranges and the kernel generator model (clamp bounds, a division's
# rounding, masked_fill's value, a cast's dtype) or that change no value (where a tensor lives,
# how it is laid out); any other keyword (add's alpha, ...) is not modelled
MODELLED_KWARGS = frozenset({"min", "max", "rounding_mode", "value", "dtype", "device", "layout", "memory_format",
                             "copy", "non_blocking", "requires_grad", "pin_memory", "right", "out_int32"})


def unmodelled_kwargs(node: fx.Node) -> list[str]:
    """The keyword arguments of ``node`` outside :data:`MODELLED_KWARGS`, except ``inplace=False``
    (``F.silu(x)`` traced by ``torch.fx`` records it: the value it computes is the same)."""
    return sorted(k for k, v in node.kwargs.items() if k not in MODELLED_KWARGS and not (k == "inplace" and v is False))

_MANTISSA = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}
_ULPS = {"div": 4, "transcendental": 8}
_APPROX_ABS = 2.0 ** -20  # fast transcendental approximations err absolutely near zero
_CASTS = ("long", "int", "to", "type", "type_as", "contiguous", "float", "double", "half", "bfloat16")
_TRANSCENDENTAL = {"log": math.log, "log2": math.log2, "log1p": math.log1p, "exp": math.exp,
                   "exp2": lambda x: 2.0 ** x, "sqrt": math.sqrt}
_DOMAIN = {"log": 0.0, "log2": 0.0, "log1p": -1.0}  # the argument must exceed this


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


def _is_int(iv: Interval) -> bool:
    return isinstance(iv[0], int) and isinstance(iv[1], int)


def _rounded(iv: Interval, dtype: torch.dtype, ulps: float = 1, absolute: float = 0.0) -> Optional[Interval]:
    """``iv`` widened by what rounding to ``dtype`` may add (``ulps`` ulps, ``absolute``, and the
    smallest normal for underflow); None if a bound is not finite or may overflow the dtype."""
    lo, hi = float(iv[0]), float(iv[1])
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    eps, info = 2.0 ** (1 - _MANTISSA.get(dtype, 24)), torch.finfo(dtype if dtype in _MANTISSA else torch.float32)
    lo -= abs(lo) * eps * ulps + absolute + info.tiny
    hi += abs(hi) * eps * ulps + absolute + info.tiny
    return (lo, hi) if -info.max < lo and hi < info.max else None


def _in_float(iv: Optional[Interval], dtype: torch.dtype) -> Optional[Interval]:
    """An operand's interval once converted to the float ``dtype`` of the op that uses it:
    integers within the dtype's exact integers stay exact, anything else rounds."""
    if iv is None:
        return None
    limit = 2 ** _MANTISSA.get(dtype, 24)
    if _is_int(iv) and -limit <= iv[0] and iv[1] <= limit:
        return float(iv[0]), float(iv[1])
    return _rounded(iv, dtype)


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


def _trunc_div_int(a: Interval, b: Interval) -> Optional[Interval]:
    if b[0] <= 0 <= b[1]:
        return None
    quotients = [_trunc_exact(x, y) for x in a for y in b]
    return min(quotients), max(quotients)


def _trunc_exact(x: int, y: int) -> int:
    q = abs(x) // abs(y)
    return q if (x >= 0) == (y > 0) else -q


def _const(a: Any) -> Optional[Interval]:
    if isinstance(a, bool):
        return int(a), int(a)
    if isinstance(a, (int, float)) and math.isfinite(a):
        return a, a
    return None


def _compare_refinement(cond: Any, x: fx.Node, get: Callable, dtype_of: Callable) -> Optional[tuple[str, Interval]]:
    """``(op, c)`` when ``cond`` is ``x op c`` (or ``c op x``, flipped) for a constant ``c``; ``c``
    as an interval of what the comparison compares ``x`` with (rounded to its dtype); None when
    ``x`` itself may be rounded by the comparison."""
    if not isinstance(cond, fx.Node) or len(cond.args) != 2 or cond.kwargs:
        return None
    flip = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}
    name = _op_name(cond).strip("_")
    if name not in flip:
        return None
    a, b = cond.args
    if a is x and _const(b) is not None:
        op, c = name, b
    elif b is x and _const(a) is not None:
        op, c = flip[name], a
    else:
        return None
    x_dtype = dtype_of(x)
    if x_dtype is None:
        return None
    if dtype_range(x_dtype) is not None:  # an integer x
        if not isinstance(c, float):
            return op, (c, c)  # compared exactly as integers
        # compared in float32: exact only for integers within its exact range
        x_iv = get(x)
        if x_iv is None or x_iv[0] < -(2 ** 24) or x_iv[1] > 2 ** 24 or abs(c) > 2 ** 24:
            return None
        return op, _rounded((c, c), torch.float32)
    c_iv = _in_float((c, c), x_dtype)
    return (op, c_iv) if c_iv is not None else None


def _refine(interval: Optional[Interval], relation: Optional[tuple[str, Interval]], holds: bool,
            is_int: bool) -> Optional[Interval]:
    """``interval`` narrowed by knowing ``x op c`` is ``holds`` (True / False), ``c`` in ``[c_lo, c_hi]``."""
    if interval is None or relation is None:
        return interval
    op, (c_lo, c_hi) = relation
    if not holds:
        op = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}[op]
    lo, hi = interval
    if op == "lt":  # x < c <= c_hi
        hi = min(hi, math.ceil(c_hi) - 1 if is_int else c_hi)
    elif op == "le":
        hi = min(hi, math.floor(c_hi) if is_int else c_hi)
    elif op == "gt":  # x > c >= c_lo
        lo = max(lo, math.floor(c_lo) + 1 if is_int else c_lo)
    else:
        lo = max(lo, math.ceil(c_lo) if is_int else c_lo)
    return (lo, hi) if lo <= hi else interval


def constant_wraps(args: list, dtype_of: Callable[[Any], Optional[torch.dtype]]) -> bool:
    """Whether a Python integer among ``args`` lies outside the integer dtype of a tensor among
    them: torch wraps it into that dtype (``int32_tensor // 2**31`` divides by ``-2**31``)."""
    ranges = [dtype_range(dtype_of(a)) for a in args if isinstance(a, fx.Node)]
    ranges = [r for r in ranges if r is not None and r != (0, 1)]
    constants = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    return any(not lo <= c <= hi for c in constants for lo, hi in ranges)


def node_interval(node: fx.Node, meta: Any, get: Callable[[Any], Optional[Interval]],
                  dtype_of: Callable[[Any], Optional[torch.dtype]],
                  size_of: Optional[Callable[[Any], Optional[int]]] = None) -> Optional[Interval]:
    """The interval of ``node``'s result (``meta``: its example value, for the dtype), given
    ``get(arg)`` (an argument's interval: a constant's own value, a node's proven interval or None),
    ``dtype_of(arg)`` (a node's dtype) and ``size_of(arg)`` (a 1-D tensor's length, or None)."""
    dtype = _dtype(meta)
    whole = dtype_range(dtype)
    if dtype is None:  # a Python number computed from constants, or not a tensor
        return _const(meta) if isinstance(meta, (int, float)) else None
    is_int = whole is not None
    name = _op_name(node)
    if dtype == torch.bool or name in ("lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "xor", "logical_and",
                                       "logical_or", "logical_not", "bool", "isnan", "isinf", "isfinite"):
        return whole
    if name == "getitem":  # a table lookup: anything the table holds
        return whole
    if name == "bucketize":  # a count of boundaries: [0, K] whatever x is (NaN: K)
        bounds = node.args[1] if len(node.args) > 1 else node.kwargs.get("boundaries")
        size = size_of(bounds) if size_of is not None and isinstance(bounds, fx.Node) else None
        return (0, size) if size is not None and whole is not None and size <= whole[1] else whole
    if unmodelled_kwargs(node):
        return whole  # e.g. add(x, y, alpha=...): not modelled
    args = list(node.args)
    if constant_wraps(args + list(node.kwargs.values()), dtype_of):  # clamp(x, min=-5): keywords too
        return whole

    def operand(i: int) -> Optional[Interval]:
        """Argument ``i``'s interval as the op computes with it (converted to a float result's dtype)."""
        iv = get(args[i]) if i < len(args) else None
        if iv is not None and not is_int:
            iv = _in_float(iv, dtype)
        return iv

    a, b = operand(0), operand(1)
    math_iv: Optional[Interval] = None
    rounding: tuple[float, float] = (1, 0.0)  # (ulps, absolute) the op's own rounding adds to a float result
    exact = False
    if name in ("add", "__radd__") and a and b:
        math_iv = (a[0] + b[0], a[1] + b[1])
    elif name == "sub" and a and b:
        math_iv = (a[0] - b[1], a[1] - b[0])
    elif name == "__rsub__" and a and b:
        math_iv = (b[0] - a[1], b[1] - a[0])
    elif name in ("mul", "__rmul__") and a and b:
        math_iv = _mul(a, b)
    elif name in ("truediv", "div", "true_divide", "floordiv", "floor_divide", "__floordiv__") and a and b:
        mode = node.kwargs.get("rounding_mode") if name in ("div", "true_divide") else \
            (None if name == "truediv" else "floor")
        if is_int:
            math_iv = _floor_div_int(a, b) if mode == "floor" else _trunc_div_int(a, b) if mode == "trunc" else None
        else:
            q = _div(a, b)
            q = q and _rounded(q, dtype, _ULPS["div"])  # the quotient the kernel floors / truncates
            if mode is None or q is None:
                math_iv, rounding = q, (0, 0.0)
            else:
                f = math.floor if mode == "floor" else math.trunc
                math_iv, exact = (f(q[0]), f(q[1])), True
    elif name in ("remainder", "mod", "__mod__") and is_int and a and b and not b[0] <= 0 <= b[1]:
        # torch's integer remainder takes the divisor's sign: [0, b) for b > 0, (b, 0] for b < 0
        math_iv, exact = ((0, b[1] - 1) if b[0] > 0 else (b[0] + 1, 0)), True
    elif name == "neg" and a:
        math_iv, exact = (-a[1], -a[0]), True
    elif name == "abs" and a:
        math_iv = (0 if a[0] <= 0 <= a[1] else min(abs(a[0]), abs(a[1])), max(abs(a[0]), abs(a[1])))
        exact = True
    elif name == "relu" and a:
        math_iv, exact = (max(a[0], 0), max(a[1], 0)), True
    elif name in ("clamp", "clip", "clamp_min", "clamp_max"):
        if name == "clamp_max":
            lo_c, hi_c = None, args[1] if len(args) > 1 else node.kwargs.get("max")
        else:
            lo_c = args[1] if len(args) > 1 else node.kwargs.get("min")
            hi_c = args[2] if len(args) > 2 else node.kwargs.get("max")

        def bound(c: Any) -> Optional[Interval]:
            iv = get(c)
            return _in_float(iv, dtype) if iv is not None and not is_int else iv
        lo_v, hi_v = bound(lo_c) if lo_c is not None else None, bound(hi_c) if hi_c is not None else None
        if (lo_c is not None and lo_v is None) or (hi_c is not None and hi_v is None):
            return whole  # a bound that may be NaN
        base = a if a is not None else whole  # floats: NaN clamps to NaN, so no interval without the input's
        if base is not None:
            lo, hi = base
            if lo_v is not None:
                lo, hi = max(lo, lo_v[0]), max(hi, lo_v[1])
            if hi_v is not None:
                lo, hi = min(lo, hi_v[0]), min(hi, hi_v[1])
            math_iv, exact = (lo, hi), True
    elif name in ("minimum", "min", "maximum", "max") and len(args) == 2 and a and b:
        pick = min if name.startswith("min") else max
        math_iv, exact = (pick(a[0], b[0]), pick(a[1], b[1])), True
    elif name in ("where", "masked_fill"):
        if name == "where" and len(args) == 3:
            cond, on_true, on_false = args
        elif name == "masked_fill" and len(args) + ("value" in node.kwargs) == 3:
            on_false, cond, on_true = args[0], args[1], args[2] if len(args) > 2 else node.kwargs["value"]
        else:
            return whole
        branches = []
        for branch, holds in ((on_true, True), (on_false, False)):
            iv = get(branch)
            if isinstance(branch, fx.Node):
                if iv is None and dtype_range(dtype_of(branch)) is not None:
                    iv = dtype_range(dtype_of(branch))
                iv = _refine(iv, _compare_refinement(cond, branch, get, dtype_of), holds, _is_int(iv) if iv else False)
            if iv is not None and not is_int:
                iv = _in_float(iv, dtype)
            branches.append(iv)
        if branches[0] is None or branches[1] is None:
            return whole
        math_iv, exact = (min(branches[0][0], branches[1][0]), max(branches[0][1], branches[1][1])), True
    elif name in _CASTS:
        source = get(args[0]) if args else None
        if source is None:
            return whole
        if is_int:  # to an integer: a float truncates toward zero, an integer keeps its value
            math_iv = (math.trunc(source[0]), math.trunc(source[1])) if all(map(math.isfinite, source)) else None
        else:  # to a float: exact within the dtype's exact integers (``operand``), else rounded once
            math_iv, exact = a, True
    elif name in _TRANSCENDENTAL and a:
        if name not in _DOMAIN or a[0] > _DOMAIN[name]:
            if name != "sqrt" or a[0] >= 0:
                try:
                    math_iv = (_TRANSCENDENTAL[name](a[0]), _TRANSCENDENTAL[name](a[1]))
                except (ValueError, OverflowError):
                    math_iv = None
                # exp(x) is ex2(x * log2(e)): the product's rounding is |x| ulps of the result
                ulps = _ULPS["transcendental"] + (max(abs(a[0]), abs(a[1])) if name == "exp" else 0)
                rounding = (ulps, _APPROX_ABS)
    elif name in ("floor", "ceil") and a:
        f = math.floor if name == "floor" else math.ceil
        math_iv, exact = (f(a[0]), f(a[1])), True
    elif name == "sigmoid" and a:
        math_iv = (0.0, 1.0)
    elif name == "tanh" and a:
        math_iv = (-1.0, 1.0)
    if math_iv is None:
        return whole
    if is_int:
        lo, hi = math.floor(math_iv[0]), math.ceil(math_iv[1])
        return (int(lo), int(hi)) if whole[0] <= lo and hi <= whole[1] else whole
    if exact:
        return _rounded(math_iv, dtype, 0)  # only the dtype's range (and the tiny underflow margin)
    return _rounded(math_iv, dtype, *rounding)


def propagate(gm: fx.GraphModule, metas: Mapping[fx.Node, Any],
              inputs: Mapping[fx.Node, Optional[Interval]]) -> dict[fx.Node, Optional[Interval]]:
    """Every node's interval, from the placeholders' (``inputs``; a missing integer placeholder is
    its dtype's whole range) forward through the graph in order."""
    ranges: dict[fx.Node, Optional[Interval]] = {}

    def get(a: Any) -> Optional[Interval]:
        return ranges.get(a) if isinstance(a, fx.Node) else _const(a)

    def dtype_of(a: Any) -> Optional[torch.dtype]:
        return _dtype(metas.get(a)) if isinstance(a, fx.Node) else None

    def size_of(a: Any) -> Optional[int]:
        meta = metas.get(a) if isinstance(a, fx.Node) else None
        if isinstance(meta, torch.Tensor) and meta.dim() == 1 and isinstance(meta.shape[0], int):
            return int(meta.shape[0])
        return None

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            ranges[node] = inputs[node] if node in inputs else dtype_range(_dtype(metas.get(node)))
        elif node.op == "get_attr":
            value = gm
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            ranges[node] = _const(value.item()) if isinstance(value, torch.Tensor) and value.dim() == 0 else None
        elif node.op in ("call_function", "call_method"):
            ranges[node] = node_interval(node, metas.get(node), get, dtype_of, size_of)
    return ranges


# integer ops whose result can leave its dtype (and then wraps in eager PyTorch): arithmetic,
# shifts and casts; comparisons, min / max, clamp, where, lookups and bit masks cannot
_MAY_LEAVE_DTYPE = frozenset({"add", "__radd__", "sub", "__rsub__", "mul", "__rmul__", "neg", "abs", "pow", "__pow__",
                              "__rpow__", "floordiv", "floor_divide", "__floordiv__", "__rfloordiv__", "div",
                              "true_divide", "lshift", "__lshift__", "bitwise_left_shift", "sum", "cumsum", *_CASTS})


def may_wrap(gm: fx.GraphModule, metas: Mapping[fx.Node, Any],
             ranges: Mapping[fx.Node, Optional[Interval]]) -> list[fx.Node]:
    """The integer nodes of ``gm`` whose result is not proven to stay within its dtype (``ranges``:
    :func:`propagate`'s): where eager PyTorch wraps around, and a compiler that assumes signed
    overflow never happens (C++) may compute something else. Casts from a float or a wider
    integer count; an integer op this analysis does not model counts if it can overflow at all."""
    found = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        whole = dtype_range(_dtype(metas.get(node)))
        if whole is None or whole == (0, 1) or _op_name(node) not in _MAY_LEAVE_DTYPE:
            continue
        if _op_name(node) in _CASTS and node.args:
            source = dtype_range(_dtype(metas.get(node.args[0]))) if isinstance(node.args[0], fx.Node) else None
            if source is not None and whole[0] <= source[0] and source[1] <= whole[1]:
                continue  # from a narrower integer or bool: exact
        if ranges.get(node) in (None, whole):
            found.append(node)
    return found


__all__ = ["Interval", "MODELLED_KWARGS", "constant_wraps", "unmodelled_kwargs", "dtype_range", "may_wrap",
           "node_interval", "propagate"]
