"""Where the padded query rows of a fused attention go (a check of ``fuse_attention``).

The fused op gives 0 at padded queries; eager gives what the user's softmax gives there (an
average over the keys that position may see). The fusion is exact only where those rows reach no
valid output. Walks forward from the attention's output, tracking the values that may differ from
eager at padded tokens:

* ops that keep each token's values apart (their layout stays ``Token(b, n)`` / ``Flat``: linear,
  norms, point-wise math, feature reshapes, reductions over features) carry the difference;
* an op whose value at a padded token is a known constant whatever its inputs (``x * valid``,
  ``masked_fill(~valid, -inf)``, ``where(valid, x, 0)``) ends it;
* the scores of another attention and its ``weights @ v`` carry it too when that attention's
  proof holds (padded keys masked: a valid query reads them with weight 0);
* a selection of positions (``gather(1, lengths - 1)``, ``h[:, -1]``) ends it when its reads are
  proved valid (``jagged_exits.prove_reads_valid``) or checked on each call (``exit_checks``);
* the graph output ends it when the graph ends at the frame's return (padded positions of an
  output are not part of the contract);
* a mean / sum loss that ignores the padded positions (``ignored_loss``: their targets are its
  ``ignore_index``, proved or checked on each call) ends it: those rows add nothing to it.

Anything else that reads such a value (an unmasked mean over positions, a loss over every
position, a graph break) makes the fusion refuse, naming the op and the user's line.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .attention_capture import _SHAPE_ONLY, ANY, _Any, _eval_abstract, side_value
from .exit_checks import build_read_check
from . import ignored_loss
from .jagged_exits import confined_row_axes, prove_reads_valid, selection_kind
from .jagged_region import sequence_softmaxes, unaligned_value
from . import row_spellings
from .layout import Flat, Pair, Token, TupleOf, propagate
from .op_semantics import canonical, describe_op, example
from .pass_manager import graph_break, node_site

__all__ = ["padded_rows_reach"]


def padded_rows_reach(start: fx.Node, info, proved: set[fx.Node], outputs_free: bool, writes_to: dict,
                      replaced: set[fx.Node] = frozenset(), inputs=None
                      ) -> tuple[str | None, list[tuple[fx.Node, fx.GraphModule, str]]]:
    """``(None, checks)`` when the padded query rows of the attention ending at ``start`` reach no
    valid output (``checks``: run-time checks of the selections and losses it relies on, as
    ``(node, check, reason)``); else ``(why, [])``. ``proved``: the contractions of the
    attentions whose proof holds; ``replaced``: library calls whose spelled-out form stands in
    for them (dead once fused); ``inputs``: the call being compiled, when known."""
    g = start.graph
    validity, padding = set(info.validity), set(info.padding)
    env = dict(info.layouts)  # layouts, with the sequence softmaxes' (0 at padding) filled in
    seq_soft = sequence_softmaxes(g, env, validity, padding)
    tainted = {start}
    checks: list[tuple[fx.Node, fx.GraphModule, str]] = []
    after = False
    for n in g.nodes:
        if n is start:
            after = True
            continue
        if not after or not any(a in tainted for a in n.all_input_nodes):
            continue
        if n.op == "output":
            if outputs_free:
                continue
            gb = graph_break(g.owning_module)
            at = f" (the break at {gb[1]}: {gb[0].splitlines()[0][:160]})" if gb is not None else ""
            return (f"the graph returns it to code after a graph break{at}, which may read its padded positions "
                    "(eager's values there differ from the fused op's 0)", [])
        op = canonical(n)
        if n in replaced or op == "factory" or isinstance(example(n), (int, torch.SymInt)):
            continue  # a call being replaced; zeros_like(x), x.size(1): x's shape only
        if _known_at_padding(n, tainted, env, validity, padding, seq_soft):
            continue
        layout = env.get(n)
        if layout is None and row_spellings.pointwise_conv(n):  # Conv1d(k=1): per position
            layout = env.get(n.args[0])
        elif layout is None:
            layout = propagate(n, env)
        env[n] = layout
        if op in ("matmul", "einsum") and any(isinstance(env.get(a), Pair) for a in n.all_input_nodes):
            if n in proved:
                tainted.add(n)
                continue
        elif isinstance(layout, (Pair, Flat, TupleOf)) or (isinstance(layout, Token) and layout.batch is not None
                                                            and layout.seq is not None):
            tainted.add(n)
            continue
        else:
            x = next((a for a in n.all_input_nodes if a in tainted), None)
            loss = ignored_loss.decide(n, x, info, env, writes_to, inputs) if x is not None else None
            if loss is not None:
                if loss.why is not None:
                    return f"{_reads(n)} ({loss.why})", []
                if loss.check is not None:
                    checks.append((n, loss.check, ignored_loss.check_reason(
                        n, loss, "the fused attention (0 at padded queries)")))
                continue
            why = _selection(n, x, info, env, outputs_free, writes_to, checks)
            if why is None:
                continue
            return why, []
        return _reads(n), []
    return None, checks


def _reads(n: fx.Node) -> str:
    return (f"{describe_op(n)} ({node_site(n)}) reads the attention's output at padded positions, where eager's "
            f"value (the softmax over the keys that position may see) differs from the fused op's 0")


def _selection(n: fx.Node, x: fx.Node | None, info, layouts: dict, outputs_free: bool, writes_to: dict,
               checks: list) -> str | None:
    """None when ``n`` selects positions of ``x`` proved (or checked on each call) to be valid."""
    layout = layouts.get(x)
    if x is None or not isinstance(layout, Token) or layout.batch is None or layout.seq is None or \
            selection_kind(n, x, set()) is None or not info.validity:
        return _reads(n)
    valid = info.validity[0]
    rows = confined_row_axes(n, layouts, info.batch, outputs_free)
    why = prove_reads_valid(n, x, layout, valid, layouts, info.batch, info.seq_len, rows)
    if why is None:
        return None
    check = build_read_check(x.graph.owning_module, n, x, layout, valid, writes_to, rows)
    if isinstance(check, str):
        return f"{_reads(n)}: {why}; nor can it be checked on each call: {check}"
    checks.append((n, check, f"{describe_op(n)} ({node_site(n)}) may read a padded position of the attention's "
                             f"output ({why}): each call checks that it reads only valid positions"))
    return None


def _known_at_padding(n: fx.Node, tainted: set[fx.Node], layouts: dict, validity: set[fx.Node],
                      padding: set[fx.Node], seq_soft: set[fx.Node]) -> bool:
    """``n``'s value at a padded token is a constant whatever the tainted inputs hold."""
    if canonical(n) not in ("mul", "div", "where", "masked_fill", "add", "sub"):
        return False

    def value(a, depth: int = 8):
        if not isinstance(a, fx.Node):
            return a
        if a in tainted:
            return ANY
        if a in seq_soft:
            return torch.zeros(())  # exp(-inf) at a masked position
        unaligned = unaligned_value(a, layouts)
        if unaligned is not None:
            return unaligned
        if depth and a not in validity and a not in padding and canonical(a) in _SHAPE_ONLY and \
                isinstance(a.args[0], fx.Node):
            return value(a.args[0], depth - 1)  # one token's value: where it moves (to symbolic sizes) does not matter
        if depth and a not in validity and a not in padding and canonical(a) in _FOLLOW:
            try:  # the per-token math on the masks (nan_to_num of a sequence softmax, casts, views)
                return _eval_abstract(a, fx.node.map_arg(a.args, lambda b: value(b, depth - 1)),
                                      fx.node.map_arg(a.kwargs, lambda b: value(b, depth - 1)))
            except Exception:  # noqa: BLE001 - not evaluable on scalars: unknown
                return ANY
        return side_value(a, torch.tensor(False), validity, padding)

    try:
        result = _eval_abstract(n, fx.node.map_arg(n.args, value), fx.node.map_arg(n.kwargs, value))
    except Exception:  # noqa: BLE001 - not evaluable on scalars: unknown
        return False
    return not isinstance(result, _Any) and isinstance(result, (torch.Tensor, bool, int, float))


_FOLLOW = ("unary", "unsqueeze", "squeeze", "reshape", "expand", "transpose", "permute", "mul", "div", "add", "sub",
           "neg", "where", "masked_fill", "and", "or", "not", "ne", "eq", "gt", "ge", "lt", "le")
