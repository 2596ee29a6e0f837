"""Registry of attention score modifiers (FlexAttention's ``score_mod``, keyed by a string).

Custom ops cannot take callables, so a pass registers the function here and passes the returned
key (a ``str``) to ``grcompile::jagged_attention``, which evaluates it per pair *inside* the op, in
the coordinates of the block it is computing — never as a ``B×N×N`` tensor.

Two calling conventions (``kind``; inferred when omitted: ``"score"`` iff the first input is named
``score``):

* ``"bias"`` (default): ``fn(q_pos, k_pos, q_side, k_side, tables) -> bias``; the op uses
  ``score + bias``. ``q_pos``/``k_pos`` are int64 padded-row positions broadcast as ``[.., Lq, 1]``
  and ``[.., 1, Lk]``; ``q_side``/``k_side`` are tuples of per-token values broadcast the same way
  (e.g. the query-side "next timestamp" and the key-side timestamp); ``tables`` is the tuple of
  learned tables (Toeplitz position table ``[2·max_len − 1]``, time-bucket table ``[129]``) that
  ``fn`` indexes.
* ``"score"``: ``fn(score, q_pos, k_pos, *q_side, *k_side, *tables) -> value`` — the flattened
  FlexAttention form the attention-capture pass produces (an ``fx.GraphModule`` holding the
  whole pointwise region); the op uses ``value`` as the score (``score`` is ``scale·q·k`` or 0).
  A function whose fourth input is named ``head`` (a GraphModule placeholder or a parameter) gets
  the head index there, ``[1, H, 1, 1]`` int64: ``fn(score, q_pos, k_pos, head, *q_side, ...)``
  (per-head bias tables).

Both must be pointwise and broadcastable (the result broadcasts to ``[.., H, Lq, Lk]``; it may
omit the head axis). Keys are stable across processes for plain functions and GraphModules with
only constant captures (name + hash of code and constants), so dumps and caches can name them;
a function capturing an unhashable object (a tensor, a module) gets an id-based hash instead.
Registering the same function (or an identical one) again returns the same key.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import re
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx


@dataclass(frozen=True)
class ScoreMod:
    key: str
    fn: Callable
    kind: str  # "bias" | "score"
    head: bool = False  # a "score" function that takes the head index (4th input)

    def __call__(self, score, q_pos, k_pos, q_side: tuple, k_side: tuple, tables: tuple, heads: int = 1):
        """The modified score (``score`` may be a 0-d zero when the op does not use q·k); ``heads``
        is the number of heads of the block (for functions that take the head index)."""
        if self.kind == "bias":
            return score + self.fn(q_pos, k_pos, q_side, k_side, tables)
        if self.head:
            head = torch.arange(heads, device=q_pos.device).view(1, heads, 1, 1)
            return self.fn(score, q_pos, k_pos, head, *q_side, *k_side, *tables)
        return self.fn(score, q_pos, k_pos, *q_side, *k_side, *tables)


_REGISTRY: dict[str, ScoreMod] = {}
_BY_ID: dict[int, str] = {}  # id(fn) -> key; the registry keeps fn alive, so ids are not reused
_KINDS = ("bias", "score")
_PLAIN = (int, float, str, bool, bytes, type(None), complex)


def _fingerprint(obj: Any, depth: int = 0) -> str:
    """A deterministic description of ``obj`` for hashing; falls back to ``id`` when none exists."""
    if depth > 8:
        return f"id:{id(obj)}"
    if isinstance(obj, _PLAIN):
        return repr(obj)
    if isinstance(obj, torch.dtype):
        return str(obj)
    if isinstance(obj, (tuple, list, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, frozenset) else obj
        return type(obj).__name__ + "(" + ",".join(_fingerprint(o, depth + 1) for o in items) + ")"
    if isinstance(obj, types.CodeType):
        consts = ",".join(_fingerprint(c, depth + 1) for c in obj.co_consts)
        return f"code({obj.co_name};{obj.co_code.hex()};{consts};{obj.co_names};{obj.co_varnames})"
    explicit = getattr(obj, "__grcompile_fingerprint__", None)
    if isinstance(explicit, str):
        return "fp:" + explicit
    if isinstance(obj, fx.GraphModule):
        constants = []
        for node in obj.graph.nodes:
            if node.op == "get_attr":
                value = obj
                for part in str(node.target).split("."):
                    value = getattr(value, part, None)
                constants.append(f"{node.target}={_tensor_fingerprint(value)}")
        return f"gm({obj.code};{','.join(constants)})"
    if isinstance(obj, functools.partial):
        return (f"partial({_fingerprint(obj.func, depth + 1)};{_fingerprint(obj.args, depth + 1)};"
                f"{_fingerprint(sorted(obj.keywords.items()), depth + 1)})")
    if isinstance(obj, types.FunctionType):
        cells = tuple(c.cell_contents for c in (obj.__closure__ or ()))
        return (f"fn({obj.__module__}.{obj.__qualname__};{_fingerprint(obj.__code__, depth + 1)};"
                f"{_fingerprint(obj.__defaults__, depth + 1)};{_fingerprint(cells, depth + 1)};"
                f"{_fingerprint(sorted((obj.__kwdefaults__ or {}).items()), depth + 1)})")
    if isinstance(obj, types.BuiltinFunctionType) or getattr(obj, "__module__", None) == "torch":
        return f"builtin:{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"
    return f"id:{id(obj)}"


def _tensor_fingerprint(value: Any) -> str:
    """Small constant tensors hash by content (stable keys); large ones or non-tensors by id."""
    if isinstance(value, torch.Tensor) and value.numel() <= 4096 and value.device.type == "cpu" \
            and not value.requires_grad:
        data = value.detach().contiguous().view(-1)
        digest = hashlib.sha256(data.to(torch.float64 if data.is_floating_point() else torch.int64)
                                .numpy().tobytes()).hexdigest()[:16]
        return f"tensor({value.dtype};{tuple(value.shape)};{digest})"
    if isinstance(value, _PLAIN):
        return repr(value)
    return f"id:{id(value)}"


def _default_name(fn: Callable) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    name = re.sub(r"[^A-Za-z0-9_]+", "_", name).strip("_") or "score_mod"
    return name[:48]


def _input_names(fn: Callable) -> list[str]:
    if isinstance(fn, fx.GraphModule):
        return [n.name for n in fn.graph.nodes if n.op == "placeholder"]
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _infer_kind(fn: Callable) -> str:
    """``"score"`` if the first input is named ``score`` (a GraphModule placeholder or a parameter)."""
    if isinstance(fn, fx.GraphModule):
        first = next((n.name for n in fn.graph.nodes if n.op == "placeholder"), None)
    else:
        try:
            first = next(iter(inspect.signature(fn).parameters), None)
        except (TypeError, ValueError):
            first = None
    return "score" if first == "score" else "bias"


def register_score_mod(fn: Callable, *, name: str | None = None, kind: str | None = None) -> str:
    """Register ``fn`` and return its key (``"<name>-<12 hex>"``); see the module docstring for
    the two conventions (``kind=None``: ``"score"`` when ``fn``'s first input is named ``score``,
    else ``"bias"``). The same (or an identical) function gets the same key again."""
    if not callable(fn):
        raise TypeError(f"register_score_mod: fn must be callable, got {type(fn).__name__}")
    kind = _infer_kind(fn) if kind is None else kind
    if kind not in _KINDS:
        raise ValueError(f"register_score_mod: kind must be one of {_KINDS}, got {kind!r}")
    known = _BY_ID.get(id(fn))
    if known is not None and _REGISTRY[known].fn is fn and _REGISTRY[known].kind == kind and name is None:
        return known
    label = re.sub(r"[^A-Za-z0-9_]+", "_", name) if name else _default_name(fn)
    digest = hashlib.sha256(f"{kind}|{_fingerprint(fn)}".encode()).hexdigest()[:12]
    key = f"{label}-{digest}"
    if key not in _REGISTRY:
        names = _input_names(fn)
        _REGISTRY[key] = ScoreMod(key, fn, kind, head=kind == "score" and names[3:4] == ["head"])
    _BY_ID.setdefault(id(fn), key)
    return key


def get_score_mod(key: str) -> ScoreMod:
    """The registered modifier for ``key`` (``""`` is not a key: it means no modifier)."""
    try:
        return _REGISTRY[key]
    except KeyError:
        raise KeyError(f"score_mod {key!r} is not registered in this process (register_score_mod first); "
                       f"known: {sorted(_REGISTRY)[:20]}") from None


def registered_score_mods() -> list[str]:
    return sorted(_REGISTRY)


def live_state(key: str) -> tuple:
    """What score_mod ``key`` reads besides its inputs that may change after it was registered:
    the module globals its code names and its closure cells (through the functions they hold),
    numbers by value, anything else by identity — a tensor also by version. Tracing a plain
    function bakes these into the graph (``DECAY * gap`` keeps the ``DECAY`` of the trace), so
    whatever is generated from a trace is valid only while this stays the same: it is part of
    the key of every such cache. Small lists, tuples and dicts count by content (``slope[0]``
    read at trace time). A GraphModule holds its constants itself: ``()``."""
    return _live(get_score_mod(key).fn, 0) if key else ()


def _live_value(value: Any, depth: int) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version if not value.is_inference() else 0)
    if isinstance(value, (types.FunctionType, functools.partial)):
        return ("fn", id(value), _live(value, depth + 1))
    if isinstance(value, (list, tuple, dict)) and len(value) <= 64 and depth < 4:  # read by index at trace time
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return (type(value).__name__, id(value), tuple((k, _live_value(v, depth + 1)) for k, v in items))
    return ("id", id(value))


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _live(fn: Any, depth: int) -> tuple:
    if depth > 4:
        return ()
    if isinstance(fn, functools.partial):
        return (_live(fn.func, depth + 1), tuple(_live_value(a, depth + 1) for a in fn.args),
                tuple((k, _live_value(v, depth + 1)) for k, v in sorted(fn.keywords.items())))
    if not isinstance(fn, types.FunctionType):
        return ()
    scope = fn.__globals__
    named = tuple((name, _live_value(scope[name], depth)) for name in sorted(_code_names(fn.__code__))
                  if name in scope and not isinstance(scope[name], types.ModuleType))
    cells = tuple(_live_value(c.cell_contents, depth) for c in (fn.__closure__ or ()) if _filled(c))
    return named + cells


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a name bound later in the enclosing function)
        return False
    return True


# ---------------------------------------------------------------------------------------------
# The biases of models/common.py, written exactly as there (same ops, same dtypes), so that the
# fused op reproduces the padded models bit-for-bit up to the matmul reduction order.

_FACTORY_KEYS: dict[tuple, str] = {}


@torch._dynamo.assume_constant_result
def _factory_key(kind: str, *args: int) -> str:
    """The key of a built-in bias, built once per arguments. Dynamo runs this at trace time and
    uses the string as a constant (instead of tracing the hashing), so the named wrappers
    compile without a graph break."""
    cache_key = (kind, *args)
    key = _FACTORY_KEYS.get(cache_key)
    if key is None:
        if kind == "position":
            fn, name = _relative_position(*args), f"relative_position_bias_{args[0]}"
        elif kind == "time":
            fn, name = _relative_time(*args), f"relative_time_bias_{args[0]}"
        else:
            fn, name = _hstu_rab(*args), f"hstu_rab_{args[0]}_{args[1]}"
        key = _FACTORY_KEYS[cache_key] = register_score_mod(fn, name=name)
    return key


def _relative_position(max_len: int, table_index: int):
    def relative_position_bias(q_pos, k_pos, q_side, k_side, tables):
        return tables[table_index][k_pos - q_pos + (max_len - 1)]  # β[j − i]
    return relative_position_bias


def _relative_time(num_buckets: int, side_index: int, table_index: int):
    def relative_time_bias(q_pos, k_pos, q_side, k_side, tables):
        delta = (q_side[side_index] - k_side[side_index]).abs().clamp(min=1)
        buckets = (torch.log(delta.float()) / 0.301).long().clamp(0, num_buckets)
        return tables[table_index][buckets]
    return relative_time_bias


def _hstu_rab(max_len: int, num_buckets: int):
    position = _relative_position(max_len, 0)
    time = _relative_time(num_buckets, 0, 1)

    def hstu_rab(q_pos, k_pos, q_side, k_side, tables):  # position + time, added in that order
        return position(q_pos, k_pos, q_side, k_side, tables) + time(q_pos, k_pos, q_side, k_side, tables)
    return hstu_rab


def relative_position_bias_key(max_len: int, table_index: int = 0) -> str:
    """``tables[table_index][k_pos − q_pos + max_len − 1]`` (``RelativePositionBias``)."""
    return _factory_key("position", int(max_len), int(table_index))


def relative_time_bias_key(num_buckets: int, side_index: int = 0, table_index: int = 0) -> str:
    """``tables[t][bucket(|q_side[s] − k_side[s]|)]`` with the log bucketing of ``RelativeTimeBias``."""
    return _factory_key("time", int(num_buckets), int(side_index), int(table_index))


def hstu_rab_key(max_len: int, num_buckets: int) -> str:
    """Position table (``tables[0]``) + time table (``tables[1]``, sides ``q_side[0]``/``k_side[0]``)."""
    return _factory_key("hstu_rab", int(max_len), int(num_buckets))


__all__ = ["ScoreMod", "register_score_mod", "get_score_mod", "registered_score_mods", "live_state",
           "relative_position_bias_key", "relative_time_bias_key", "hstu_rab_key"]
