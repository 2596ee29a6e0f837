"""Row-wise spellings rewritten into the forms the jagged rewrite knows (run by ``jagged_rewrite``
before it analyses the graph; undone with it when it falls back).

Matches / emits:
* ``conv1d(x [B, C, L], w [C', C, 1], b)`` with stride 1, no padding, dilation 1, groups 1 — the
  point-wise feed-forward of SASRec-style code, ``conv(x.transpose(1, 2)).transpose(1, 2)`` —
  becomes ``linear(x.transpose(-1, -2), w.squeeze(-1), b).transpose(-1, -2)``: the same sums
  over C, on the feature axis (counter ``conv1x1_as_linear``).
* ``torch.addmm(b, x [M, C], w [C, C'])`` with ``beta = alpha = 1`` and a bias ``[C']`` — HF's
  ``Conv1D`` on ``x.view(-1, C)`` — becomes ``linear(x, w.t(), b)``, which is what ``F.linear``
  itself runs (counter ``addmm_as_linear``).
* ``x.var(dim, unbiased, keepdim)`` / ``x.std(...)`` with positional options: the options as
  keywords, so every pass reads ``keepdim`` at one place (counter ``moments_keywords``).
Invariant: values are unchanged (a 1×1 convolution is a matrix product over channels;
``linear(x, w.t(), b)`` calls ``addmm(b, x, w)``).
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from .op_semantics import arg, shape_of

_CONV1D = {torch.conv1d, F.conv1d}
_MOMENTS = {"var", "std"}


def _ones(value, one: int) -> bool:
    if isinstance(value, (tuple, list)):
        return len(value) == 1 and value[0] == one
    return value == one


def pointwise_conv(n: fx.Node) -> bool:
    """``conv1d`` with a kernel of 1, stride 1, no padding, one group: a linear map per position."""
    try:
        if n.op != "call_function" or n.target not in _CONV1D:
            return False
    except TypeError:
        return False
    x, w = n.args[0], arg(n, 1, "weight")
    xs, ws = shape_of(x), shape_of(w)
    if xs is None or ws is None or len(xs) != 3 or len(ws) != 3 or ws[2] != 1:
        return False
    padding = arg(n, 4, "padding", 0)
    return (_ones(arg(n, 3, "stride", 1), 1) and (_ones(padding, 0) or padding in ("valid", "same"))
            and _ones(arg(n, 5, "dilation", 1), 1) and arg(n, 6, "groups", 1) == 1)


def linear_addmm(n: fx.Node) -> bool:
    """``addmm(b, x, w)`` that is ``linear(x, w.t(), b)``: no scaling, a 2-D ``x`` and ``w``, a bias
    of one value per output feature."""
    if not ((n.op == "call_function" and n.target is torch.addmm) or (n.op == "call_method" and n.target == "addmm")):
        return False
    if len(n.args) != 3 or any(n.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) or set(n.kwargs) - {"beta", "alpha"}:
        return False
    b, x, w = (shape_of(a) for a in n.args)
    return (b is not None and x is not None and w is not None and len(x) == 2 and len(w) == 2 and len(b) == 1
            and b[0] == w[1])


def _is_moment(n: fx.Node) -> bool:
    if n.op == "call_method":
        return n.target in _MOMENTS
    return n.op == "call_function" and n.target in (torch.var, torch.std)


WRITTEN_AS = "grcompile_written_as"  # node.meta key: the user's op a rewritten node stands for


def normalise(gm: fx.GraphModule) -> dict[str, int]:
    """Rewrite the spellings above in place; returns counts per rewrite."""
    g = gm.graph
    counts = {"conv1x1_as_linear": 0, "addmm_as_linear": 0, "moments_keywords": 0}
    for n in list(g.nodes):
        if pointwise_conv(n):
            x, w, b = n.args[0], arg(n, 1, "weight"), arg(n, 2, "bias")
            with g.inserting_before(n):
                xt = g.call_method("transpose", (x, -1, -2))
                w2 = g.call_method("squeeze", (w, -1))
                y = g.call_function(F.linear, (xt, w2, b))
                out = g.call_method("transpose", (y, -1, -2))
            for new in (xt, w2, y, out):
                if n.meta.get("stack_trace"):
                    new.meta["stack_trace"] = n.meta["stack_trace"]
            y.meta[WRITTEN_AS] = "conv1d"  # a convolution to later passes (fp8_linear leaves those alone)
            n.replace_all_uses_with(out)
            g.erase_node(n)
            counts["conv1x1_as_linear"] += 1
        elif linear_addmm(n):
            b, x, w = n.args
            with g.inserting_before(n):
                wt = g.call_method("t", (w,))
                y = g.call_function(F.linear, (x, wt, b))
            for new in (wt, y):
                if n.meta.get("stack_trace"):
                    new.meta["stack_trace"] = n.meta["stack_trace"]
            y.meta[WRITTEN_AS] = "addmm"  # not an nn.Linear to later passes (fp8_linear leaves those alone)
            n.replace_all_uses_with(y)
            g.erase_node(n)
            counts["addmm_as_linear"] += 1
        elif _is_moment(n) and len(n.args) > 2 and not isinstance(n.args[1], bool):
            # x.var(dim, unbiased[, keepdim]) / torch.var(x, dim, unbiased[, keepdim]): options by keyword
            names = ("unbiased", "keepdim")
            extra = dict(zip(names, n.args[2:]))
            if len(n.args) > 4 or not all(isinstance(v, bool) for v in extra.values()):
                continue
            n.args = n.args[:2]
            n.kwargs = {**n.kwargs, **extra}
            counts["moments_keywords"] += 1
    return {k: v for k, v in counts.items() if v}
