"""Ignored-target loss: a jagged exit for a mean / sum next-item loss over the padded positions.

Matches an outside consumer ``u`` of a jagged region value ``x``:
``F.cross_entropy`` / ``F.nll_loss(x, target, ..., ignore_index=p, reduction='mean' | 'sum')``
(``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` are the same call once Dynamo inlines them; any
``weight`` and ``label_smoothing``) where ``x`` is

* ``Flat(0, 2)``: the flattened tokens ``[B·N, C]`` (``logits.view(-1, C)``) and ``target`` has
  ``B·N`` class indices, row ``i`` paired with token ``(i // N, i % N)``; or
* ``Token(0, 2, 3)``: the K-dimensional form ``[B, C, N]`` (``logits.transpose(1, 2)``) and
  ``target`` is ``[B, N]``.

Emits the same call, with the same keyword arguments, on the jagged values ``[T, C]`` and the
targets gathered at the valid positions (``[T]``): no ``[B·N, C]`` unpack, a loss over T rows.

Invariant: exact when every padded position's target equals ``ignore_index``. torch gives a row
whose target is ``ignore_index`` no term in the sum and no share of the mean's denominator (the
sum of ``weight[target]``, or the count, over the rows not ignored), label smoothing included
(its term is masked at ignored rows), and a zero gradient; so dropping those rows changes neither
the value nor any gradient, whatever their logits hold. Valid positions whose target is
``ignore_index`` are kept and stay ignored, as in the dense loss. The condition is

* proved at compile time when the target's value at a padded position can be evaluated
  (``padded_target_value``: ``torch.where(valid, t, -100)``, ``t.masked_fill(ids == 0, -100)``,
  the ids themselves with ``ignore_index`` equal to the padding id, ``t * valid`` with
  ``ignore_index=0``), or
* checked on each call (``build_target_check``: a small graph over the captured graph's inputs
  recomputing the validity and the targets — shifted ids, ``torch.roll``, ``F.pad``, a targets
  input — then ``padded_targets_ignored``; in-place writes into targets the graph created, such
  as ``t[:, -1] = pad`` after a roll, are replayed on the check's copy); a call that fails it runs
  the graph as captured (``capture/guarded.py``). Shifted targets cannot be proved: the graph does
  not know the padding is on the right, and with left padding or holes a padded position's
  shifted target is a real item (eager counts it; the check fails and the call runs as written).
  A check that the call being compiled already fails is not installed (``decide``).

``fuse_attention`` relies on the same decision: the fused op's padded query rows (0, where eager
has a softmax) may reach such a loss (``padded_queries``).

Anything else leaves the loss as today (the region shrinks: ``jagged_rewrite._shrink``) and the
report says why, naming the loss's line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

from .attention_capture import ANY, _Any, _CASTS, _eval_abstract, _factory_fill
from .exit_checks import recompute_before
from .layout import Flat, Token
from .op_semantics import arg, canonical, describe_op, example, shape_of
from .pass_manager import node_site
from .symbolic import is_one, known_eq

__all__ = ["IgnoredLoss", "decide", "check_reason", "match_loss", "padded_target_value", "equals",
           "build_target_check", "padded_targets_ignored", "padding_ids", "evaluate_check"]


@dataclass
class IgnoredLoss:
    """A matched loss: its target, ``ignore_index``, the layout the target is read with (its rows
    paired with ``x``'s tokens), and what decides the exit: ``why`` (None: usable), ``check`` (a
    run-time check graph, or None when proved), ``how`` (``"proved"`` / ``"checked"``)."""
    target: fx.Node | None
    ignore_index: int
    aligned: Flat | Token
    why: str | None = None
    check: fx.GraphModule | None = None
    how: str = ""


def match_loss(u: fx.Node, x: fx.Node, layouts: dict, B: Any, N: Any) -> IgnoredLoss | str | None:
    """``u`` as an ignored-target loss of ``x`` (module docstring); a sentence when it is a mean
    or sum loss of ``x`` that cannot be one; None when it is not such a loss at all."""
    if canonical(u) != "class_loss" or u.op != "call_function" or arg(u, 0, "input") is not x:
        return None
    reduction = arg(u, 6, "reduction", "mean")
    if reduction not in ("mean", "sum"):
        return None  # reduction='none': the per-row loss stays in the region (layout.py)
    if arg(u, 3, "size_average") is not None or arg(u, 5, "reduce") is not None:
        return "it uses the deprecated size_average / reduce arguments"
    target = arg(u, 1, "target")
    ignore = arg(u, 4, "ignore_index", -100)
    if not isinstance(target, fx.Node) or not isinstance(example(target), torch.Tensor):
        return "its target is not a tensor of the graph"
    if example(target).dtype.is_floating_point or example(target).dtype == torch.bool:
        return "its target holds class probabilities, which ignore_index does not apply to"
    if isinstance(ignore, bool) or not isinstance(ignore, int):
        return f"its ignore_index ({ignore}) is not a constant"
    layout, xs, ts = layouts.get(x), shape_of(x), shape_of(target)
    if xs is None or ts is None:
        return "its shapes are unknown"
    if layout == Flat(0, 2) and len(ts) == 1 and known_eq(ts[0], xs[0]):
        aligned: Flat | Token = Flat(0, 1)
    elif layout == Token(0, 2, 3) and len(ts) == 2 and known_eq(ts[0], B) and known_eq(ts[1], N):
        aligned = Token(0, 1, 2)  # K-dimensional: input [B, C, N], target [B, N]
    else:
        return f"its input {x.name} {list(xs)} and target {list(ts)} are not the flattened tokens [B·N, C] and " \
               f"[B·N], nor the K-dimensional [B, C, N] and [B, N]"
    return IgnoredLoss(target, ignore, aligned)


def padding_ids(validity: Sequence[fx.Node], padding: Sequence[fx.Node]) -> dict[fx.Node, int]:
    """The inputs a validity or padding mask compares with one padding id (``ids != 0``,
    ``ids == 0``, ``~(ids == 0)``): at a padded position such an input holds that id."""
    found: dict[fx.Node, int] = {}

    def compared(m: fx.Node, ops: tuple[str, ...]) -> None:
        if canonical(m) in ops and len(m.args) >= 2 and isinstance(m.args[0], fx.Node) \
                and m.args[0].op == "placeholder" and isinstance(m.args[1], int) and not isinstance(m.args[1], bool):
            found[m.args[0]] = m.args[1]

    for m in validity:
        compared(m, ("ne",))
        if canonical(m) == "not" and isinstance(m.args[0], fx.Node):
            compared(m.args[0], ("eq",))
    for m in padding:
        compared(m, ("eq",))
    return found


_SHAPE = ("unsqueeze", "squeeze", "reshape", "expand", "transpose", "permute")
_POINTWISE = ("ne", "eq", "gt", "ge", "lt", "le", "and", "or", "not", "add", "sub", "mul", "div", "neg",
              "where", "masked_fill")


def padded_target_value(target: fx.Node, layouts: dict, validity: set, padding: set, ids: dict[fx.Node, int],
                        written: dict) -> Any:
    """The value every padded position of ``target`` holds, or ``ANY``. Follows only values
    whose layout lines their elements up with the tokens (a shift along the positions has none),
    broadcast constants, the masks (False / True at padding) and the inputs ``ids`` maps to their
    padding id; a node written in place anywhere gives ``ANY``."""

    def value(n: Any, depth: int) -> Any:
        if not isinstance(n, fx.Node):
            return n
        if n in written:
            return ANY
        if n in validity:
            return torch.tensor(False)
        if n in padding:
            return torch.tensor(True)
        if n in ids:
            return torch.tensor(ids[n])
        shape = shape_of(n)
        if depth == 0 or shape is None:
            return ANY
        op = canonical(n)
        if layouts.get(n) is None and not all(is_one(s) for s in shape):
            return ANY  # varies, and nothing says which element sits at which token
        if op == "factory":
            fill = _factory_fill(n)
            return ANY if fill is None else torch.tensor(fill)
        if layouts.get(n) is None:
            return ANY  # a broadcast value computed some other way
        if op in _SHAPE or (op == "unary" and n.target in _CASTS) or (
                op == "getitem" and not any(isinstance(i, fx.Node) for i in _leaves(n.args[1]))):
            return value(n.args[0], depth - 1)  # its layout says each token keeps its own element
        if op in _POINTWISE or op == "unary":
            look = lambda a: value(a, depth - 1)  # noqa: E731
            try:
                out = _eval_abstract(n, fx.node.map_arg(n.args, look), fx.node.map_arg(n.kwargs, look))
            except Exception:  # noqa: BLE001 - not evaluable on scalars: unknown
                return ANY
            return out if isinstance(out, (_Any, torch.Tensor)) else torch.as_tensor(out)
        return ANY

    return value(target, 24)


def equals(value: Any, ignore_index: int) -> bool | None:
    """Is the abstract ``value`` ``ignore_index`` (None: unknown)?"""
    if isinstance(value, _Any):
        return None
    return bool((torch.as_tensor(value) == ignore_index).all())


def padded_targets_ignored(mask: torch.Tensor, target: torch.Tensor, ignore_index: int, marks_padding: bool) -> bool:
    """Every padded position's target is ``ignore_index`` (``mask``: the ``[B, N]`` validity, or
    the padding when ``marks_padding``; ``target``: ``[B·N]`` or ``[B, N]``, row-major tokens)."""
    padded = mask.bool() if marks_padding else ~mask.bool()
    return bool((target.reshape(padded.shape)[padded] == ignore_index).all())


def build_target_check(gm: fx.GraphModule, x: fx.Node, u: fx.Node, loss: IgnoredLoss, mask: fx.Node,
                       marks_padding: bool, written: dict) -> fx.GraphModule | str:
    """A graph over ``gm``'s inputs returning True when the targets loss ``u`` reads on this call
    are ``ignore_index`` at every padded position, or why none can be built (a sentence). Writes
    into the targets before ``u`` (``t[:, -1] = pad`` after a roll) are replayed on the check's copy."""
    copied = recompute_before(gm, [mask, loss.target], x, written, read_at=u)
    if isinstance(copied, str):
        return copied
    g, env = copied
    g.output(g.call_function(padded_targets_ignored, (env[mask], env[loss.target], loss.ignore_index, marks_padding)))
    return fx.GraphModule(gm, g, class_name="IgnoredTargetCheck")


def evaluate_check(check: fx.GraphModule, inputs: Sequence[Any] | None) -> bool | None:
    """``check`` on the inputs of the call being compiled (real tensors; a size symbol as its
    value); None when they are not available (fake tensors, an unbacked size) or the check raises."""
    if inputs is None:
        return None
    from torch._subclasses.fake_tensor import is_fake

    values = []
    for a in inputs:
        if isinstance(a, torch.SymInt):
            a = getattr(a.node, "hint", None)
            if not isinstance(a, int):
                return None
        elif isinstance(a, torch.Tensor) and is_fake(a):
            return None
        values.append(a)
    try:
        with torch.no_grad():
            return bool(check(*values))
    except Exception:  # noqa: BLE001 - undecided: the per-call check decides
        return None


def decide(u: fx.Node, x: fx.Node, info, layouts: dict, written: dict, inputs: Sequence[Any] | None
           ) -> IgnoredLoss | None:
    """``u`` as an ignored-target loss of ``x`` (``info``: the ``PaddingInfo``; ``written``:
    ``effects.written_aliases``; ``inputs``: the call being compiled, when known), None when it is
    not a mean / sum loss of ``x``. Its ``why`` (a sentence) says why the padded positions may not
    be dropped; when it is None they may: proved (``how = "proved"``) or checked on each call
    (``check``). A check that the call being compiled fails is not installed: that call shows the
    padded positions count (an unmasked mean, another ``ignore_index``), and every call would
    then run as captured instead of dense and compiled."""
    match = match_loss(u, x, layouts, info.batch, info.seq_len)
    if match is None:
        return None
    if isinstance(match, str):
        return IgnoredLoss(None, 0, Flat(0, 1), why=f"the loss cannot drop them: {match}")
    p = match.ignore_index
    value = padded_target_value(match.target, layouts, set(info.validity), set(info.padding),
                                padding_ids(info.validity, info.padding), written)
    known = equals(value, p)
    if known:
        match.how = "proved"
        return match
    if known is False:
        v = torch.as_tensor(value).item()
        match.why = f"the loss counts them: their target is {int(v) if float(v).is_integer() else v}, not its ignore_index={p}"
        return match
    mask = info.validity[0] if info.validity else info.padding[0]
    check = build_target_check(x.graph.owning_module, x, u, match, mask, not info.validity, written)
    if isinstance(check, str):
        match.why = (f"the loss ignores target {p}, but that the padded positions' targets are {p} is neither proved "
                     f"nor can it be checked on each call: {check}")
    elif evaluate_check(check, inputs) is False:
        match.why = (f"the loss counts them in the call this graph was compiled for: a target at a padded position "
                     f"is not its ignore_index={p}, so a check on each call would fail")
    else:
        match.check, match.how = check, "checked"
    return match


def check_reason(u: fx.Node, loss: IgnoredLoss, what: str) -> str:
    """The report's sentence for a run-time check of ``loss`` (``what``: what relies on it)."""
    p = loss.ignore_index
    return (f"{describe_op(u)} ({node_site(u)}) has ignore_index={p}: {what} is exact when every padded "
            f"position's target is {p}, which each call checks")


def _leaves(value: Any) -> list:
    out: list = []
    fx.node.map_aggregate(value, lambda a: out.append(a) or a)
    return out
