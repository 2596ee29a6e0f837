"""One canonical name per torch-IR operation, whatever spelling the user's code used.

Dynamo records ``x != 0`` as ``operator.ne``, ``torch.ne`` as a function, ``x.ne(0)`` as a
method, ``F.linear`` as ``torch._C._nn.linear``… Passes match on ``canonical(node)`` and read the
node's arguments through ``arg(node, i, name)``, so one rule covers every spelling. grcompile's own
ops declare their canonical name where they register (``grcompile.lowering.semantics``).
"""
from __future__ import annotations

import operator
import re
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from ..lowering.semantics import declared
from .symbolic import static_int

_FUNCTIONS: dict[Any, str] = {}
_METHODS: dict[str, str] = {}


def _register(name: str, *targets: Any, methods: tuple[str, ...] = ()) -> None:
    for t in targets:
        _FUNCTIONS[t] = name
    for m in methods:
        _METHODS[m] = name


# comparisons and logic
_register("ne", operator.ne, torch.ne, torch.not_equal, methods=("ne", "__ne__", "not_equal"))
_register("eq", operator.eq, torch.eq, methods=("eq", "__eq__"))
_register("gt", operator.gt, torch.gt, methods=("gt", "__gt__", "greater"))
_register("ge", operator.ge, torch.ge, methods=("ge", "__ge__"))
_register("lt", operator.lt, torch.lt, methods=("lt", "__lt__", "less"))
_register("le", operator.le, torch.le, methods=("le", "__le__"))
_register("and", operator.and_, torch.logical_and, torch.bitwise_and,
          methods=("logical_and", "bitwise_and", "__and__"))
_register("or", operator.or_, torch.logical_or, torch.bitwise_or, methods=("logical_or", "bitwise_or", "__or__"))
_register("not", operator.invert, torch.logical_not, torch.bitwise_not,
          methods=("logical_not", "bitwise_not", "__invert__"))
# arithmetic
_register("add", operator.add, torch.add, operator.iadd, methods=("add", "__add__", "__radd__"))
_register("sub", operator.sub, torch.sub, torch.subtract, methods=("sub", "__sub__", "__rsub__"))
_register("mul", operator.mul, torch.mul, torch.multiply, operator.imul, methods=("mul", "__mul__", "__rmul__"))
_register("div", operator.truediv, torch.div, torch.true_divide, methods=("div", "__truediv__", "true_divide"))
_register("neg", operator.neg, torch.neg, methods=("neg", "__neg__"))
_register("matmul", operator.matmul, torch.matmul, torch.bmm, torch.mm, methods=("matmul", "bmm", "mm", "__matmul__"))
_register("einsum", torch.einsum)
# unary pointwise (layout-preserving, value-wise)
_UNARY = ("silu", "relu", "gelu", "sigmoid", "tanh", "exp", "log", "abs", "sqrt", "rsqrt", "clamp", "pow",
          "float", "long", "int", "bool", "half", "bfloat16", "to", "type_as", "contiguous", "clone",
          "log1p", "floor", "ceil", "round", "sign", "square", "elu", "leaky_relu", "softplus", "detach",
          "nan_to_num", "isnan", "isinf", "isfinite")
for _name in _UNARY:
    targets = [getattr(mod, _name) for mod in (torch, F) if hasattr(mod, _name)]
    _register("unary", *targets, methods=(_name,))
_register("unary", torch.clamp_min, torch.clamp_max, torch.clip, methods=("clamp_min", "clamp_max", "clip"))
_register("unary", operator.pow, methods=("__pow__",))  # x ** 2 (pointwise in both operands)
for _name in ("erf", "erfc", "expm1", "reciprocal", "sin", "cos", "mish", "hardswish", "hardsigmoid", "selu", "celu",
              "logsigmoid", "softsign", "relu6", "silu_", "exp2"):  # more pointwise math (erf GELU, Mish, ...)
    _register("unary", *[getattr(mod, _name) for mod in (torch, F) if hasattr(mod, _name)], methods=(_name,))
# shape / layout
_register("unsqueeze", torch.unsqueeze, methods=("unsqueeze",))
_register("squeeze", torch.squeeze, methods=("squeeze",))
_register("reshape", torch.reshape, torch.flatten, torch.unflatten, methods=("view", "reshape", "flatten", "unflatten"))
_register("transpose", torch.transpose, torch.swapaxes, methods=("transpose", "swapaxes"))
_register("permute", torch.permute, methods=("permute",))
_register("expand", methods=("expand", "expand_as"))
# tiling: a layout survives where only size-1 (broadcast) axes or feature axes are tiled
_register("repeat", methods=("repeat",))
_register("repeat_interleave", torch.repeat_interleave, methods=("repeat_interleave",))
_register("one_hot", F.one_hot)
_register("split", torch.split, torch.functional.split, methods=("split",))
_register("chunk", torch.chunk, methods=("chunk",))
_register("unbind", torch.unbind, methods=("unbind",))
_register("cat", torch.cat, torch.concat, torch.concatenate)
_register("getitem", operator.getitem)
# row-wise library ops
_register("linear", F.linear, torch._C._nn.linear)
# addmm(bias, x, w, beta=, alpha=) = beta·bias + alpha·(x @ w): a linear map of x's rows (HF's Conv1D)
_register("addmm", torch.addmm, methods=("addmm",))
_register("layer_norm", F.layer_norm, torch.layer_norm)
_register("rms_norm", F.rms_norm, *([torch.rms_norm] if hasattr(torch, "rms_norm") else []))
_register("normalize", F.normalize)
_register("dropout", F.dropout, torch.dropout)
_register("embedding", F.embedding, torch.embedding)
_register("class_loss", F.cross_entropy, F.nll_loss)  # (input [M, C], target [M]): one loss per row
_register("softmax", F.softmax, torch.softmax, F.log_softmax, torch.log_softmax, methods=("softmax", "log_softmax"))
_register("reduce", torch.sum, torch.mean, torch.amax, torch.amin, torch.var, torch.std,
          methods=("sum", "mean", "amax", "amin", "var", "std"))  # var/std: keyword unbiased/correction
_register("where", torch.where, methods=("where",))
_register("masked_fill", torch.masked_fill, methods=("masked_fill",))
_register("tril", torch.tril, methods=("tril",))
_register("triu", torch.triu, methods=("triu",))
_register("factory", torch.ones, torch.zeros, torch.full, torch.empty, torch.ones_like, torch.zeros_like,
          torch.full_like, torch.empty_like)
_register("arange", torch.arange)
# torch.bucketize(x, boundaries): pointwise in x (same shape), boundaries a 1-D sorted tensor
# (there is no Tensor.bucketize method)
_register("bucketize", torch.bucketize)


# ops that draw random numbers, by name (functions and methods)
RANDOM_OPS = frozenset({"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
                        "multinomial", "normal", "poisson", "dropout", "uniform_", "normal_"})


def target_name(node: fx.Node) -> str:
    """The name ``node`` calls: a method's name, a function's or op's ``__name__``."""
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def is_random(node: fx.Node) -> bool:
    """``node`` draws random numbers (by name, or an aten op tagged nondeterministic_seeded)."""
    return target_name(node) in RANDOM_OPS or torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


_RANDOM_NAME_PARTS = ("dropout", "rand", "bernoulli", "gumbel", "rrelu", "normal", "uniform", "exponential",
                      "multinomial", "poisson", "geometric", "cauchy")


def may_draw_random(node: fx.Node) -> bool:
    """``node`` may draw random numbers: ``is_random``, or any op whose name says so
    (``alpha_dropout``, ``rrelu``, ``gumbel_softmax``, ``bernoulli_`` ...) — the cautious test, for
    deciding what must never be recomputed."""
    return is_random(node) or any(part in target_name(node).lower() for part in _RANDOM_NAME_PARTS)


# library ops matched by their qualified name, so that nothing here imports the library
_LIBRARY: dict[str, str] = {
    "fbgemm::jagged_to_padded_dense": "jagged_to_padded_dense",  # (values, [offsets], [max_len], pad)
    "fbgemm::asynchronous_complete_cumsum": "complete_cumsum",     # lengths [B] -> offsets [B + 1]
    "fbgemm::complete_cumsum": "complete_cumsum",
}


def _qualified_name(target: Any) -> str | None:
    name = getattr(target, "_qualified_op_name", None)  # an OpOverloadPacket
    if name is None and isinstance(target, torch._ops.OpOverload):
        name = target._schema.name
    return name


def canonical(node: fx.Node) -> str | None:
    """Canonical op name of ``node`` or ``None`` (placeholders, outputs, unknown ops)."""
    if node.op == "call_function":
        try:
            return _FUNCTIONS.get(node.target) or declared(node.target) or _LIBRARY.get(_qualified_name(node.target))
        except TypeError:  # unhashable target
            return None
    if node.op == "call_method":
        return _METHODS.get(node.target)
    return None


def dropout_is_identity(node: fx.Node) -> bool:
    """A ``"dropout"`` node that returns its input: ``p == 0`` or not training (an ``nn.Dropout``
    in eval mode, or ``dropout=0.0``, stays in Dynamo's graph as such a node)."""
    if canonical(node) != "dropout":
        return False
    p = arg(node, 1, "p", 0.5)
    training = arg(node, 2, "training", node.kwargs.get("train", True))
    return (isinstance(p, (int, float)) and p == 0) or training is False


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """The argument at position ``index`` or keyword ``name`` (``self`` of a method is index 0)."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def reduce_options(node: fx.Node) -> tuple[Any, bool]:
    """``(dim, keepdim)`` of a ``"reduce"`` node, ``dim`` as written (``None``: all axes).

    ``var`` / ``std`` take ``unbiased`` before ``keepdim`` (``x.var(dim, unbiased, keepdim)``) and
    accept ``x.var(unbiased)``; the other reductions take ``keepdim`` third."""
    moment = node.target in ("var", "std") if node.op == "call_method" else node.target in (torch.var, torch.std)
    dim = arg(node, 1, "dim")
    if moment and isinstance(dim, bool):  # x.var(unbiased)
        return None, bool(node.kwargs.get("keepdim", False))
    return dim, bool(arg(node, 3 if moment else 2, "keepdim", False))


def example(value: Any) -> Any:
    """The example value Dynamo recorded for a node (a FakeTensor), or the value itself."""
    if isinstance(value, fx.Node):
        return value.meta.get("example_value", value.meta.get("val"))
    return value


def example_tensor(node: Any) -> torch.Tensor | None:
    """A node's example tensor (None for constants, missing values and non-tensors)."""
    value = example(node) if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def einsum_parts(node: fx.Node) -> tuple[list[str], str, tuple] | None:
    """``(input specs, output spec, operands)`` of an explicit ``einsum(eq, *operands)`` node
    (operands passed separately or as one list), or None for an implicit output, an ellipsis, or
    specs that do not match the operands."""
    equation, operands = node.args[0], tuple(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str) or "." in equation or "->" not in equation:
        return None
    lhs, out = equation.replace(" ", "").split("->")
    specs = lhs.split(",")
    if len(specs) != len(operands) or not all(re.fullmatch(r"[a-zA-Z]*", x) for x in (*specs, out)):
        return None
    return specs, out, operands


PARTIAL = -1  # basic_index_axes: a slice that keeps only part of its axis


def basic_index_axes(items: tuple, ndim: int,
                     keeps_axis: Callable[[slice, int, int], bool]) -> dict[int, int | None] | None:
    """Axis map of basic indexing ``x[items]`` (ints, slices, ``None``, ``Ellipsis``; no tensors):
    input axis -> output axis; ``None`` where an int index removes the axis, ``PARTIAL`` where a
    slice keeps only part of it (``keeps_axis(item, src_axis, dst_axis)`` is false). ``None`` for any
    other index item."""
    explicit = sum(1 for i in items if i is not None and i is not Ellipsis)
    mapping: dict[int, int | None] = {}
    src = dst = 0
    for item in items:
        if item is Ellipsis:
            for _ in range(ndim - explicit):
                mapping[src] = dst
                src, dst = src + 1, dst + 1
        elif item is None:
            dst += 1
        elif isinstance(item, int):
            mapping[src] = None
            src += 1
        elif isinstance(item, slice):
            mapping[src] = dst if keeps_axis(item, src, dst) else PARTIAL
            src, dst = src + 1, dst + 1
        else:
            return None
    while src < ndim:
        mapping[src] = dst
        src, dst = src + 1, dst + 1
    return mapping


def shape_of(value: Any) -> tuple[int | torch.SymInt, ...] | None:
    """The example tensor's sizes: ints where static, ``torch.SymInt`` where Dynamo traced a symbol
    (batch / sequence axes after a shape change). Compare them with ``symbolic.known_eq`` /
    ``is_one`` (never ``==``, ``int()`` or ``bool()``: those guard, and the graph would specialise)."""
    ex = example(value)
    if isinstance(ex, torch.Tensor):
        return tuple(s if (v := static_int(s)) is None else v for s in ex.shape)
    return None


def evaluate(node: fx.Node, args: Any, kwargs: Any) -> Any:
    """Run ``node``'s operation on already-evaluated arguments (None for non-call nodes)."""
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return None


def _shape_preserving_value(node: fx.Node, args: Any) -> Any:
    """A stand-in value for a dropout whose evaluation failed: ``F.dropout`` guards on
    ``numel() == 0``, which a jagged ``[T, D]`` (T data-dependent) cannot answer, and without a
    value every node after a training-mode dropout would go unanalysed (no norm fusion)."""
    first = args[0] if args else None
    if canonical(node) == "dropout" and isinstance(first, torch.Tensor):
        return torch.empty_like(first)
    return None


def refresh_example_values(gm: fx.GraphModule, strict: bool = True) -> None:
    """Give nodes that earlier passes inserted an ``example_value`` (fake tensors computed from
    their inputs' example values), so layout analysis can run on a rewritten graph. With
    ``strict=False`` a node that cannot be evaluated keeps no value, and neither do the nodes
    computed from it. A guard on a data-dependent size (the jagged block's T, an unbacked batch)
    never raises, strict or not: a dropout gets a value of its input's shape, another op none."""
    values = [example(n) for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = next((v.fake_mode for v in values if hasattr(v, "fake_mode")), None)
    if fake_mode is None:
        return
    env: dict[fx.Node, object] = {}
    undecided: set[fx.Node] = set()
    # An op with a data-dependent size (pack_index) mints an unbacked symbol here, outside any
    # trace; left pending, AOTAutograd would later fail to find it bound. These values are
    # analysis-only, so the ShapeEnv's pending list is restored afterwards.
    shape_env = fake_mode.shape_env
    pending = list(shape_env.pending_fresh_unbacked_symbols) if shape_env is not None else None
    try:
        with fake_mode:
            for n in gm.graph.nodes:
                known = n.meta.get("example_value")
                if known is not None or n.op in ("placeholder", "output", "get_attr"):
                    env[n] = known
                    continue
                if any(a in undecided for a in n.all_input_nodes):
                    undecided.add(n)  # computed from a value a data-dependent guard left unknown
                    env[n] = None
                    continue
                args = fx.node.map_arg(n.args, env.get)
                try:
                    value = evaluate(n, args, fx.node.map_arg(n.kwargs, env.get))
                except Exception as e:  # noqa: BLE001 - analysis-only values
                    # a guard on a data-dependent size (an unbacked batch or T: dropout's
                    # ``numel() == 0``) is no fault of the graph, strict or not
                    if strict and not isinstance(e, GuardOnDataDependentSymNode):
                        raise
                    value = _shape_preserving_value(n, args)
                    if value is None:
                        undecided.add(n)
                if value is not None:
                    n.meta["example_value"] = value
                env[n] = value
    finally:
        if pending is not None:
            shape_env.pending_fresh_unbacked_symbols[:] = pending


# --------------------------------------------------------------------------------------------
# naming an op for a reader (fallback reasons, reports)

_SYMBOLS = {"add": "+", "iadd": "+=", "sub": "-", "isub": "-=", "mul": "*", "imul": "*=", "truediv": "/",
            "itruediv": "/=", "floordiv": "//", "mod": "%", "pow": "**", "matmul": "@", "imatmul": "@=",
            "neg": "unary -", "pos": "unary +", "invert": "~", "and_": "&", "or_": "|", "xor": "^",
            "lshift": "<<", "rshift": ">>", "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">",
            "ge": ">=", "getitem": "indexing", "setitem": "indexed assignment", "not_": "not"}
# where a target's __module__ says it lives -> how user code imports it (``F`` for torch.nn.functional)
_MODULE_SPELLING = {"torch.nn.functional": "F.", "torch._C._nn": "F.", "torch.functional": "torch.",
                    "torch": "torch.", "torch._C._VariableFunctions": "torch.", "torch._C._linalg": "torch.linalg.",
                    "torch._C._special": "torch.special.", "torch._C._fft": "torch.fft.", "builtins": ""}


def _dunder(name: str) -> str | None:
    """``__add__`` / ``__radd__`` / ``__iadd__`` -> ``+`` / ``+`` / ``+=``; ``__getitem__`` -> indexing."""
    if not (name.startswith("__") and name.endswith("__")):
        return None
    core = name[2:-2]
    for key in (core, core + "_", core[1:] if core[:1] == "r" else None):
        if key in _SYMBOLS:
            return _SYMBOLS[key]
    return None


def describe_target(target: Any) -> str:
    """A call target as the user wrote it: ``torch.where``, ``F.softmax``, ``Tensor.masked_fill``,
    ``+``, ``torch.ops.grcompile.gated_norm`` — never an object repr."""
    if isinstance(target, str):  # a method name (call_method) or an attribute path (get_attr)
        return _dunder(target) or (f"Tensor.{target}" if target.isidentifier() else target)
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = target.name() if callable(getattr(target, "name", None)) else str(target)
        return "torch.ops." + name.replace("::", ".").split(".default")[0]
    name = getattr(target, "__name__", None)
    if not isinstance(name, str):
        return type(target).__name__
    module = getattr(target, "__module__", None) or ""
    if module in ("_operator", "operator"):
        return _SYMBOLS.get(name, f"operator.{name}")
    qualname = getattr(target, "__qualname__", "") or ""
    if qualname.startswith(("TensorBase.", "Tensor.")):  # torch.Tensor.masked_fill called as a function
        return _dunder(name) or f"Tensor.{name}"
    if module in _MODULE_SPELLING:
        for kind in ("linalg", "special", "fft"):  # torch._C._linalg.linalg_norm is torch.linalg.norm
            if module.endswith("._" + kind):
                name = name.removeprefix(kind + "_")
        return _MODULE_SPELLING[module] + name
    if module.startswith("torch._"):  # a private home of a public function: the user called torch.<name>
        return f"torch.{name}"
    return f"{module}.{name}" if module else name


def describe_op(node: Any) -> str:
    """How the user wrote ``node``'s op, for a sentence: ``torch.where``, ``F.softmax``,
    ``Tensor.masked_fill``, ``+``, ``the module encoder.norm``, ``an input``, ``the constant mask``;
    for a non-node argument, a short description of its value."""
    if not isinstance(node, fx.Node):
        if isinstance(node, (bool, int, float, str, type(None))):
            return repr(node)
        if isinstance(node, torch.Tensor):
            return f"a constant {str(node.dtype).replace('torch.', '')} tensor {list(node.shape)}"
        return f"a {type(node).__name__}"
    if node.op in ("call_function", "call_method"):
        return describe_target(node.target)
    if node.op == "call_module":
        return f"the module {node.target}"
    if node.op == "placeholder":
        return "an input"
    if node.op == "get_attr":
        return f"the constant {node.target}"
    return "the graph output"
