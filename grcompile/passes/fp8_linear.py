"""Pass ``fp8_linear`` (``optimize(model, precision="fp8")``): linear layers → FP8 GEMMs with
row-wise scales, the quantisation fused into the norm before them and the residual after them
fused into the GEMM's epilogue (ULTRA-HSTU's FP8 stack; ``grcompile.lowering.fp8``).

Matches: ``linear(a, weight, bias)`` on float32 / bfloat16 / float16 values whose weight is a 2-D
float tensor with ``K`` and ``N`` multiples of 16 (what FP8 tensor-core GEMMs take; torchao's
float8 conversion skips the same layers), on dense and jagged values alike.
Emits: ``fp8_linear(x, u, weight, bias, residual, norm=, eps=, out_dtype=)``, where

* ``a = gated_norm(x, u)`` used only by this linear (through identity dropouts: eval mode, p = 0)
  → ``norm`` = its kind: one kernel normalises and quantises (the normed tensor is never written);
  else ``norm="none"`` quantises ``a`` (a training-mode dropout between the norm and the GEMM
  keeps its place and its random stream);
* the linear's only user is ``r + linear(...)`` (either order, ``r`` of the output's shape) →
  ``residual=r``, summed in the GEMM's float32 epilogue, ``out_dtype`` the add's result dtype
  (under autocast: float32 for a float32 residual stream, as eager's add promotes) and
  ``gemm_dtype`` the linear's own (bf16 there: rounded before the add, as eager rounds it).

Neither fusion reaches across a node with an effect (an in-place write, a ``no_grad`` / autocast
switch, a call_module): the fused op runs where the add (or the linear) was and would read what
the write left, or run in the other mode. The graphs of higher-order ops (checkpoint bodies,
``torch.cond`` branches) are converted as well, as copies.

Skips (counted; the layer stays in the model's precision): float64 or integer values, unaligned
``K`` / ``N`` (reported: the user asked for FP8), non-2-D weights, missing shapes, and 1×1
convolutions the jagged rewrite spelled as linears (FP8 covers linear layers, as torchao's float8
training does: whether a Conv1d ran in FP8 must not depend on whether its block went jagged).
Reported: an ``F.multi_head_attention_forward`` left whole (its attention not fused) keeps its
projections in the model's precision — they are not separate linears in the graph.
Invariant: not exact — FP8 rounds the GEMM's inputs (e4m3: 3 mantissa bits), which is what
``precision="fp8"`` asks for; the rest of the graph is untouched, and values stay within e4m3
rounding of the unquantised GEMM (tests/compiler/test_fp8.py; loss parity in docs/precision-memory.md).
Runs after ``fuse_norm_gate`` (it reads the fused norms).
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from .effects import writes
from .pass_manager import GraphPass, PassContext, copy_graph, substitute
from ..lowering.fp8 import FP8_LINEAR
from ..lowering.norm import GATED_NORM
from .row_spellings import WRITTEN_AS
from .op_semantics import arg, canonical, dropout_is_identity, example_tensor, refresh_example_values
from .symbolic import known_eq

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALIGN = 16
def _has_effect(node: fx.Node) -> bool:
    """Whether an op moved past ``node`` could notice it: a write (``effects.writes``) or a mode
    switch (a ``torch.no_grad()`` / autocast block is ``_set_grad_enabled`` / ``_enter_autocast``
    nodes that nothing reads: a node without users is in the graph for its effect)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    return not node.users or writes(node)


def _nothing_happens_between(first: fx.Node, last: fx.Node) -> bool:
    """No node strictly between ``first`` and ``last`` (graph order) has an effect: the fused op,
    which runs at ``last`` and reads what ``first`` read, sees the same values in the same modes."""
    node = first.next
    while node is not last:
        if node.op == "root" or _has_effect(node):
            return False
        node = node.next
    return True


def _norm_of(a: fx.Node, linear: fx.Node) -> tuple[list[fx.Node], fx.Node, fx.Node | None, str, float] | None:
    """``(nodes the fusion replaces, x, u, kind, eps)`` when ``a`` is a fused norm — or an identity
    dropout of one (eval mode, p = 0) — that only this linear reads."""
    chain, reader = [], linear
    while isinstance(a, fx.Node) and dropout_is_identity(a) and set(a.users) == {reader}:
        chain.append(a)
        a, reader = a.args[0], a
    if not isinstance(a, fx.Node) or a.op != "call_function" or a.target is not GATED_NORM or set(a.users) != {reader}:
        return None
    if not _nothing_happens_between(a, linear):  # the fused op normalises at the linear, not at the norm
        return None
    x, u = a.args
    return chain + [a], x, u, a.kwargs["kind"], float(a.kwargs["eps"])


def _residual_of(linear: fx.Node, out: torch.Tensor) -> tuple[fx.Node, fx.Node, torch.dtype] | None:
    """``(add node, r, result dtype)`` when the linear's only user is an out-of-place ``r + linear``."""
    if len(linear.users) != 1:
        return None
    add = next(iter(linear.users))
    if canonical(add) != "add" or add.target is operator.iadd or len(add.args) != 2 or add.kwargs:
        return None
    a, b = add.args
    r = b if a is linear else a if b is linear else None
    rv, sv = example_tensor(r), example_tensor(add)
    if r is None or r is linear or rv is None or sv is None or rv.dtype not in _DTYPES or sv.dtype not in _DTYPES:
        return None
    if rv.dim() != out.dim() or not all(known_eq(p, q) for p, q in zip(rv.shape, out.shape)):
        return None  # a broadcast residual (a 1-D bias) is the linear's own bias, not a residual
    if not _nothing_happens_between(linear, add):  # the fused op multiplies at the add, not at the linear
        return None
    return add, r, sv.dtype


def _match(node: fx.Node) -> str | None:
    """The reason ``node`` (a linear) is skipped, or None."""
    if node.meta.get(WRITTEN_AS) == "conv1d":
        return "convolution"
    if node.meta.get(WRITTEN_AS) == "addmm":
        return "addmm"  # the user's torch.addmm (HF Conv1D), not an F.linear
    x, w, out = example_tensor(arg(node, 0, "input")), example_tensor(arg(node, 1, "weight")), example_tensor(node)
    if x is None or w is None or out is None:
        return "no_shape"
    if x.dtype not in _DTYPES or w.dtype not in _DTYPES or out.dtype not in _DTYPES:
        return "dtype"
    if w.dim() != 2:
        return "weight_not_2d"
    if not all(isinstance(d, int) and d % ALIGN == 0 for d in w.shape):
        return "unaligned"
    return None


def _attribute(gm: fx.GraphModule, target: str) -> object:
    """``gm``'s attribute at the dotted path ``target`` (a get_attr node's), or None."""
    value: object = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def module_path(node: fx.Node) -> str:
    """The dotted path of the module whose forward called ``node`` (``blocks.0.output``; ``""`` for
    a call outside any submodule), from Dynamo's ``nn_module_stack``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    return path.removeprefix("L['self']").removeprefix("L['self_']").lstrip(".")


class Fp8Linear(GraphPass):
    """``layer_filter(path) -> bool``: which linears may go FP8, by the path of the module that
    calls them (``module_path``; torchao's ``module_filter_fn`` idea); None: all."""

    name = "fp8_linear"

    def __init__(self, layer_filter: Callable[[str], bool] | None = None) -> None:
        self.layer_filter = layer_filter

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        refresh_example_values(gm, strict=False)
        self._convert(gm, ctx)

    def _convert(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Converts ``gm``'s linears and those of the graphs its higher-order ops run
        (``torch.utils.checkpoint``'s body, ``torch.cond``'s branches: Dynamo keeps them as
        submodules, and their linears are the user's linears as much as the top graph's)."""
        g = gm.graph
        for node in list(g.nodes):
            if node.op == "get_attr":
                sub = _attribute(gm, node.target)
                if isinstance(sub, fx.GraphModule) and sub is not gm:
                    # a converted copy: the pass manager's rollback restores gm's module table,
                    # not the insides of the submodules it holds
                    body = fx.GraphModule(sub, copy_graph(sub.graph), type(sub).__name__)
                    self._convert(body, ctx)
                    body.graph.lint()
                    body.recompile()
                    owner, _, leaf = node.target.rpartition(".")
                    setattr(_attribute(gm, owner) if owner else gm, leaf, body)
                continue
            if node.op == "call_function" and node.target is F.multi_head_attention_forward:
                query = example_tensor(arg(node, 0, "query"))
                ctx.count("skipped_whole_attention_module")
                ctx.fallback(node, f"this attention's input and output projections stay in "
                                   f"{query.dtype if query is not None else 'the model precision'}: the attention "
                                   "was not fused (see its own entry), so its projections are not separate linears "
                                   "FP8 could take")
                continue
            if node.op != "call_function" or canonical(node) != "linear":
                continue
            skip = _match(node)
            if skip is None and self.layer_filter is not None and not self.layer_filter(module_path(node)):
                skip = "filtered"
            if skip is not None:
                ctx.count(f"skipped_{skip}")
                if skip == "unaligned":
                    n, k = example_tensor(arg(node, 1, "weight")).shape
                    ctx.fallback(node, f"this linear stays in {example_tensor(node).dtype}: FP8 GEMMs need both of its "
                                       f"dims to be multiples of {ALIGN} (weight is [{n}, {k}])")
                continue
            a, weight, bias = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
            norm = _norm_of(a, node)
            absorbed, x, u, kind, eps = norm if norm is not None else ([], a, None, "none", 0.0)
            residual = _residual_of(node, example_tensor(node))
            replaced, r, out_dtype = residual if residual is not None else (node, None, example_tensor(node).dtype)
            with g.inserting_before(replaced):
                # gemm_dtype: where the user's linear rounds its result before their residual add
                options = {"norm": kind, "eps": eps, "out_dtype": out_dtype}
                if r is not None and example_tensor(node).dtype != torch.float32:
                    options["gemm_dtype"] = example_tensor(node).dtype
                fused = g.call_function(FP8_LINEAR, (x, u, weight, bias, r), options)
            substitute(g, fused, replaced, node)  # reports name the user's linear line
            for gone in absorbed:  # the identity dropouts, then the norm
                g.erase_node(gone)
            ctx.rewrite("fp8_linear", fused, norm=kind, residual=r is not None)
            ctx.count(f"norm_{kind}" if norm is not None else "quantised_apart")
            if r is not None:
                ctx.count("residual_epilogue")


__all__ = ["Fp8Linear", "ALIGN", "module_path"]
