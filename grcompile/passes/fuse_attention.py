"""Pass ``fuse_attention``: dense masked attention → one padding-free fused op.

Matches: ``matmul(A, v)`` (or its spellings) where ``A`` is a Pair-layout tensor contracted over
its key axis with a Token-layout ``v`` — the end of an attention. ``attention_capture`` turns the
region under ``A`` into a score_mod (the user's bias / activation / scaling / mask math, pointwise)
and proves that padded keys contribute nothing and whether the mask is causal.
Emits: ``torch.ops.grcompile.score_mod_attention(q, k, v, valid, q_sides, k_sides, tables, seed,
score_mod=key, normalize=..., causal=..., dropout_p=p)`` (``seed = randint(..)`` when p > 0) on ``[B, N, H, d]``
views of the user's q, k, v, with bias tables and per-token side values (timestamps, ...) as
inputs: no B×N×N tensor remains when the region has no other users. Training-mode dropout on the
attention weights moves into the op (a hashed mask from a per-call seed: same distribution,
other random draws than the eager dropout). Falls back (report: site + reason) when capture or proof fails.
Invariant: values at every valid query position are unchanged (with attention dropout: in
distribution, and exactly given the op's mask); padded query positions give 0.
Attention written with ``einsum`` (a score ``bid,bjd->bij`` or a contraction ``bij,bjd->bid``,
any letters and batch axes) is first rewritten as permute + matmul (counter ``einsum_as_matmul``);
``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention`` (``F.multi_head_attention_forward``,
also inside ``nn.TransformerEncoderLayer``) are first spelled out (``decompose_attention``) and put
back as written when the spelled-out form does not fuse (counters ``sdpa_expanded``,
``mha_expanded``; the fallback names the library call and why).
With no padding mask in the graph (``detect_padding`` found none), the layouts come from the
``[B, N]`` integer input alone (``analyse_unpadded``) and every position counts as valid: a causal
attention is fused where that pays (a written-out attention, or a learned bias), the rest stays as
written with a reason; nothing is recorded for the later passes, so nothing is packed.
Requires ``detect_padding`` to have run.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .effects import WriteOrder, remove_dead_code
from .pass_manager import GraphPass, PassContext, carry_checkpoint_tags, ends_at_return, node_site
from ..lowering.constant_check import CHECK_UNCHANGED, digest
from ..lowering.score_mod import register_score_mod
from ..lowering.score_mod_attention import SCORE_MOD_ATTENTION
from .attention_capture import TableView, Unsupported, capture, is_size_scalar, prove
from .decompose_attention import (expand_library_attention, functionalise_masked_fill, functionalise_whole_setitem,
                                  refill_in_place, restore, unbind_as_chunks)
from .detect_padding import PADDING, PaddingInfo, analyse, analyse_unpadded
from .layout import Pair, Token
from .op_semantics import canonical, describe_op, einsum_parts, example, shape_of
from .own_key_check import build_own_key_check
from .padded_queries import padded_rows_reach
from .symbolic import hoist_sizes, is_one


def _to_bnhd(g: fx.Graph, x: fx.Node, layout: Token, seq: int, feature: int) -> fx.Node:
    """Emit ``x`` permuted to ``[B, N, H, d]`` (a head axis of 1 is added when there is none).
    No size is written into the graph (B and N may be symbolic): size-1 axes are squeezed."""
    shape = shape_of(x)
    nd = len(shape)
    if layout.batch is None:
        raise Unsupported(f"{x.name} is not batched")
    heads = [a for a in range(nd) if a not in (layout.batch, seq, feature)]
    if len(heads) > 1:
        if sum(not is_one(shape[a]) for a in heads) > 1:
            raise Unsupported(f"{x.name} {shape} has more than one head axis")
        heads = [a for a in heads if not is_one(shape[a])][:1] or heads[:1]
        # the other size-1 axes are squeezed after the permute
    order = [layout.batch, seq, *heads, feature]
    rest = [a for a in range(nd) if a not in order]
    y = g.call_method("permute", (x, *order, *rest))
    for d in reversed(range(len(order), nd)):
        y = g.call_method("squeeze", (y, d))
    if not heads:
        y = g.call_method("unsqueeze", (y, 2))
    return y


def _side_dense(g: fx.Graph, leaf: fx.Node, layout: Token, valid: fx.Node) -> fx.Node:
    """A per-token side value as a dense ``[B, N]`` tensor (its other axes are size 1), expanded
    like ``valid`` (no size written into the graph)."""
    shape = shape_of(leaf)
    if any(not is_one(s) for a, s in enumerate(shape) if a not in (layout.batch, layout.seq)):
        raise Unsupported(f"{leaf.name} {shape} carries features; only per-token scalars enter the scores")
    axes = [a for a in (layout.batch, layout.seq) if a is not None]
    rest = [a for a in range(len(shape)) if a not in axes]
    y = g.call_method("permute", (leaf, *axes, *rest)) if axes != list(range(len(axes))) or rest else leaf
    for d in reversed(range(len(axes), len(shape))):
        y = g.call_method("squeeze", (y, d))
    if layout.batch is None:
        y = g.call_method("unsqueeze", (y, 0))
    if layout.seq is None:
        y = g.call_method("unsqueeze", (y, 1))
    return g.call_method("expand_as", (y, valid))


def _einsum_as_matmul(g: fx.Graph, node: fx.Node) -> fx.Node | None:
    """Emit ``einsum(eq, a, b)`` as permute + ``matmul`` when it is one: two operands, one
    contracted letter, at most one free letter per operand, every other letter a shared batch
    letter kept in the output (``bid,bjd->bij`` = ``q @ kᵀ``, ``bhij,bhjd->bhid`` = ``A @ v``).
    Returns the node computing the same tensor, or None (left as einsum)."""
    parts = einsum_parts(node)
    if parts is None or len(parts[2]) != 2:
        return None
    specs, out, operands = parts
    if any(len(set(x)) != len(x) for x in (*specs, out)):
        return None
    a, b = specs
    batch = [c for c in out if c in a and c in b]
    contract = [c for c in a if c in b and c not in out]
    free_a, free_b = [c for c in a if c not in b], [c for c in b if c not in a]
    if len(contract) != 1 or len(free_a) > 1 or len(free_b) > 1 or sorted(out) != sorted(batch + free_a + free_b):
        return None
    x, y = operands
    order_a = [a.index(c) for c in batch + free_a + contract]
    order_b = [b.index(c) for c in batch + contract + free_b]
    if order_a != list(range(len(a))):
        x = g.call_function(torch.permute, (x, order_a))
    if order_b != list(range(len(b))):
        y = g.call_function(torch.permute, (y, order_b))
    if not free_a:
        x = g.call_method("unsqueeze", (x, -2))
    if not free_b:
        y = g.call_method("unsqueeze", (y, -1))
    m = g.call_function(torch.matmul, (x, y))
    if not free_b:
        m = g.call_method("squeeze", (m, -1))
    if not free_a:
        m = g.call_method("squeeze", (m, -2))
    produced = batch + free_a + free_b
    if produced != list(out):
        m = g.call_function(torch.permute, (m, [produced.index(c) for c in out]))
    return m


def _normalise_einsums(gm: fx.GraphModule, layouts: dict) -> int:
    """Rewrite the einsums that build or contract a Pair (scores, ``A @ v``) as matmuls, so
    attention written with einsum is matched like attention written with ``@``."""
    count = 0
    for node in list(gm.graph.nodes):
        if canonical(node) != "einsum" or not (isinstance(layouts.get(node), Pair) or any(
                isinstance(layouts.get(a), Pair) for a in node.all_input_nodes)):
            continue
        before = set(gm.graph.nodes)
        with gm.graph.inserting_before(node):
            new = _einsum_as_matmul(gm.graph, node)
        if new is None:
            continue
        for n in set(gm.graph.nodes) - before:  # the new nodes point at the user's einsum line
            if "stack_trace" in node.meta:
                n.meta["stack_trace"] = node.meta["stack_trace"]
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    return count



def _check_no_write_before(order: WriteOrder, node: fx.Node, cap, validity: set[fx.Node]) -> None:
    """The fused op runs at ``node`` (the ``weights @ v`` matmul) and reads q, k, v, the side values,
    tables and the validity mask there: refuse if the user's code writes into one of them between
    its definition and that point (the unfused ops read it before the write)."""
    operands = [cap.q, cap.kT, node.args[1], *(s.node for s in cap.sides), *cap.tables, *validity]
    for value in operands:
        if isinstance(value, fx.Node) and (write := order.between(value, node)) is not None:
            raise Unsupported(f"{value.name} is written in place by {describe_op(write)} at {node_site(write)} "
                              f"inside the attention: the fused op would read it after the write", node)
    # the scores, mask and bias math the score_mod replays: each value as its readers saw it
    for value, reader in cap.reads:
        if (write := order.between(value, reader)) is not None:
            raise Unsupported(f"{value.name} ({node_site(value)}) is written in place by {describe_op(write)} at "
                              f"{node_site(write)} before the attention reads it: the captured score_mod computes "
                              f"it as defined, without the write", write)

class FuseAttention(GraphPass):
    name = "fuse_attention"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        try:
            self._fuse(gm, ctx)
        finally:  # in-place score fills the pass made out-of-place and did not fuse away
            if refill_in_place(gm):
                gm.graph.lint()

    def _fuse(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        info = gm.meta.get(PADDING)
        # No padding mask: a causal attention over the padded rows is still fused as written (every
        # position counts as valid); the layouts of this analysis stay local to this pass, so no
        # later pass drops a position.
        reanalyse = analyse if info is not None else analyse_unpadded
        if info is None and (info := analyse_unpadded(gm)) is None:
            return

        def keep(new_info: PaddingInfo) -> None:
            if new_info.unpadded is None:
                gm.meta[PADDING] = new_info
        if hoist_sizes(gm):  # a dynamic graph's scores.size(-1) would keep the B×N×N scores alive
            info = reanalyse(gm)
            if info is None:
                return
            keep(info)
        filled = functionalise_masked_fill(gm)
        if filled:
            ctx.count("masked_fill_functionalised", filled)
        assigned = functionalise_whole_setitem(gm)
        if assigned:
            ctx.count("setitem_functionalised", assigned)
            filled += assigned
        unbound = unbind_as_chunks(gm)
        if unbound:
            ctx.count("unbind_as_chunks", unbound)
            info = reanalyse(gm)  # layouts for the new nodes
            if info is None:
                return
        rewritten = _normalise_einsums(gm, info.layouts)
        if rewritten:
            ctx.count("einsum_as_matmul", rewritten)
        if rewritten or filled or unbound:
            info = reanalyse(gm)  # layouts for the new nodes
            if info is None:
                return
            keep(info)
        expansions, refused = expand_library_attention(gm, info.layouts)
        for node, reason in refused:
            ctx.fallback(node, reason)
        if expansions:
            info = reanalyse(gm)
            if info is None:  # cannot happen (the expansions add no validity source), but stay safe
                for e in expansions:
                    restore(gm, e)
                remove_dead_code(gm.graph)
                return
            keep(info)
        by_contraction = {e.contraction: e for e in expansions}
        fused: set[fx.Node] = set()
        layouts, validity, N, B = info.layouts, set(info.validity), info.seq_len, info.batch
        write_order = WriteOrder(gm.graph)  # the fused op reads its operands where the last matmul was
        planned = []  # every attention is proved before any is emitted: where the padded query rows
        for node in list(gm.graph.nodes):  # of one go depends on which others hold
            if canonical(node) != "matmul" or not isinstance(layouts.get(node), Token) or \
                    not isinstance(layouts.get(node.args[0]), Pair):
                continue
            expansion = by_contraction.get(node)
            try:
                cap = capture(node, layouts, validity, N)
                cap.empty_rows_zero |= expansion is not None and expansion.empty_rows_zero
                _check_no_write_before(write_order, node, cap, validity)  # the proof reads the values as defined
                causal = prove(cap, validity, N, set(info.padding), all_valid=info.unpadded is not None)
                if info.unpadded is not None:
                    _worth_fusing_unpadded(cap, causal, expansion, node)
                check = _own_key_check(gm, node, cap, info, write_order) if cap.unknown_own_key else None
            except Unsupported as e:
                _refused(ctx, expansion, node, e)
                continue
            planned.append((node, expansion, cap, causal, check))
        proved = {p[0] for p in planned}
        replaced = {e.original for e in expansions if e.contraction in proved}  # dead once fused
        outputs_free = ends_at_return(gm)
        for node, expansion, cap, causal, check in planned:
            reads = []
            if info.unpadded is None:  # with nothing padded there are no padded query rows
                why, reads = padded_rows_reach(node, info, proved, outputs_free, write_order.writes_to, replaced,
                                               ctx.example_inputs)
                if why is not None:
                    _refused(ctx, expansion, node, Unsupported(f"the fused op gives 0 at padded queries, and {why}", node))
                    continue
            key = self._emit(gm, node, cap, causal, info)
            fused.add(node)
            for selection, read_check, reason in reads:
                ctx.precondition(read_check, selection, reason)
            if check is not None:
                ctx.precondition(check, node, (
                    f"each call checks that every valid query keeps its own key under the attention mask, which also "
                    f"reads {' and '.join(cap.unknown_own_key)}: where one does not, eager's softmax spreads over "
                    f"every position and the call runs as written"))
            extra = {"spelling": expansion.label} if expansion is not None else {}
            if info.unpadded is not None:
                extra["padding"] = "none found: every position counts as valid"
            ctx.rewrite("score_mod_attention", node, normalize=cap.normalize, causal=causal, dropout_p=cap.dropout_p,
                        bias_tables=len(cap.tables), side_inputs=len(cap.sides), score_mod=key,
                        head_index=cap.uses_head, **extra)
        for e in expansions:
            if e.contraction in fused:
                ctx.count(f"{e.kind}_expanded")
            else:  # never leave the slower spelled-out form behind
                restore(gm, e)
                ctx.fallback(e.original, f"{e.label} kept as written: {e.reason}")
        remove_dead_code(gm.graph)

    @staticmethod
    def _emit(gm: fx.GraphModule, node: fx.Node, cap, causal: bool, info) -> str:
        layouts, B, N = info.layouts, info.batch, info.seq_len
        g = gm.graph
        v = node.args[1]
        lv, lout = layouts[v], layouts[node]
        nd_v = len(shape_of(v))
        key = register_score_mod(cap.score_mod, name="captured", kind="score")
        with g.inserting_before(node):
            if cap.score is not None:
                lq, lk = layouts[cap.q], layouts[cap.kT]
                q = _to_bnhd(g, cap.q, lq, lq.seq, len(shape_of(cap.q)) - 1)
                k = _to_bnhd(g, cap.kT, lk, lk.seq, len(shape_of(cap.kT)) - 2)
                # the operands in the dtype the user's q @ kᵀ ran in (autocast casts a float32 q,
                # e.g. after a float32 rotary embedding, to bfloat16 there): what eager multiplies
                q, k = _as_dtype(g, q, cap.q, cap.score), _as_dtype(g, k, cap.kT, cap.score)
            else:
                q = k = None
            vv = _as_dtype(g, _to_bnhd(g, v, lv, lv.seq, nd_v - 1), v, node)  # weights @ v's dtype, likewise
            valid = _valid_before(g, node, info)
            q_sides = [_side_dense(g, s.node, layouts[s.node], valid) for s in cap.sides if s.role == "q"]
            k_sides = [_side_dense(g, s.node, layouts[s.node], valid) for s in cap.sides if s.role == "k"]
            seed = None
            if cap.dropout_p > 0:  # a fresh mask seed per call, from the default generator
                device = getattr(v.meta.get("example_value"), "device", None)
                seed = g.call_function(torch.randint, (0, 2**31 - 1, (1,)), {"dtype": torch.int64, "device": device})
            tables = [_boundaries_input(g, cap, t, _table_input(g, t, view, example(v).device))
                      for t, view in zip(cap.tables, cap.views)]
            out = g.call_function(SCORE_MOD_ATTENTION,
                                  (q, k, vv, valid, q_sides, k_sides, tables, seed),
                                  {"score_mod": key, "normalize": cap.normalize, "causal": causal,
                                   "dropout_p": cap.dropout_p})
            if node.meta.get("stack_trace"):
                out.meta["stack_trace"] = node.meta["stack_trace"]  # reports point at the user's line
            carry_checkpoint_tags(node, out)
            if seed is not None:
                carry_checkpoint_tags(node, seed, save=True)  # recomputed, it would draw another mask
            out = _from_bnhd(g, out, node, lout)
        node.replace_all_uses_with(out)
        g.erase_node(node)
        return key


def _as_dtype(g: fx.Graph, x: fx.Node, operand: fx.Node, product: fx.Node) -> fx.Node:
    """``x`` (the op's view of ``operand``) cast to the dtype of the user's ``product`` of it,
    where they differ (only under autocast: a plain matmul needs equal dtypes)."""
    have, want = getattr(example(operand), "dtype", None), getattr(example(product), "dtype", None)
    if have is None or want is None or have == want or not want.is_floating_point:
        return x
    return g.call_method("to", (x, want))


def _refused(ctx: PassContext, expansion, node: fx.Node, e: Unsupported) -> None:
    """A library call that does not fuse is put back with the reason; a written-out one reports it."""
    if expansion is not None:
        expansion.reason = str(e)
    else:
        ctx.fallback(e.node or node, str(e))


def _own_key_check(gm: fx.GraphModule, node: fx.Node, cap, info, write_order: WriteOrder) -> fx.GraphModule:
    """The run-time check that every valid query keeps its own key (``own_key_check``), fed the
    side values and tables exactly as the fused op gets them; Unsupported when it cannot be built."""
    layouts = info.layouts
    valid, negate = (info.validity[0], False) if info.validity else (info.padding[0], True)
    device = example(node.args[1]).device

    def operands(g: fx.Graph, env, ok: fx.Node):
        sides = {role: [_side_dense(g, env(s.node), layouts[s.node], ok) for s in cap.sides if s.role == role]
                 for role in ("q", "k")}
        tables = [_boundaries_input(g, cap, t, _table_input(g, env(t), view, device))
                  for t, view in zip(cap.tables, cap.views)]
        return sides["q"], sides["k"], tables

    key = register_score_mod(cap.score_mod, name="captured", kind="score")
    check = build_own_key_check(gm, valid, negate, [s.node for s in cap.sides] + list(cap.tables), operands, key,
                                cap.heads, write_order.writes_to)
    if isinstance(check, str):
        raise Unsupported(f"the attention mask also reads {' and '.join(cap.unknown_own_key)}, per-token data other "
                          f"than the padding, which may mask every key of a valid query (eager's softmax then spreads "
                          f"over every position, padded ones too), and no run-time check of it can be built: {check}",
                          node)
    return check


def _worth_fusing_unpadded(cap, causal: bool, expansion, node: fx.Node) -> None:
    """With nothing padded the fused op skips no key, so it pays only where it replaces a written-out
    attention (the ``[B, H, N, N]`` scores are never stored) or a bias tensor (computed in-kernel):
    a library call with no bias (SDPA, MultiheadAttention: already one fused kernel) and a
    non-causal attention are left as written."""
    if not causal:
        raise Unsupported("no padding mask and no causal mask: the attention is left as written", node)
    learned = cap.sides or any(view is None or view.static is None for view in cap.views)
    if expansion is not None and not learned:
        raise Unsupported(f"no padding mask and no bias: {expansion.label} is already one fused kernel", node)


def _valid_before(g: fx.Graph, node: fx.Node, info) -> fx.Node:
    """A ``[B, N]`` validity node usable at ``node`` (emitted at the insertion point): the mask the
    user computes, or its negated padding mask; when the user computes it only later in the
    program (after the attention), a copy of its computation (a comparison of the inputs)."""
    if info.unpadded is not None:  # nothing is padded: every position is valid
        return g.call_function(torch.ones_like, (info.unpadded,), {"dtype": torch.bool})
    order = {n: i for i, n in enumerate(g.nodes)}
    for v in info.validity:
        if order[v] < order[node]:
            return v
    for p in info.padding:
        if order[p] < order[node]:
            return g.call_function(torch.logical_not, (p,))
    source = (info.validity or info.padding)[0]
    copies: dict[fx.Node, fx.Node] = {}

    def copy(n: fx.Node) -> fx.Node:
        if order[n] < order[node]:
            return n
        if n not in copies:
            copies[n] = g.node_copy(n, lambda a: copy(a))
        return copies[n]

    valid = copy(source)
    return valid if source in info.validity else g.call_function(torch.logical_not, (valid,))


def _table_input(g: fx.Graph, leaf: fx.Node, view: TableView | None, device=None) -> fx.Node:
    """A gathered table as is; a symbolic size (``/ N`` of a dynamic graph) as a 0-d tensor; a
    per-pair / per-head tensor compacted to its varying axes (``[H?, N?, N?]``, the order the
    score_mod indexes; its other axes have size 1 and are squeezed, so no size is written into
    the graph), through a runtime check of the value the proof used when that value came from a
    buffer or tensor attribute."""
    if is_size_scalar(leaf):
        dtype = torch.int64 if isinstance(example(leaf), torch.SymInt) else torch.float64
        return g.call_function(torch.scalar_tensor, (leaf,), {"dtype": dtype, "device": device})
    if view is None:
        return leaf
    y = g.call_method("permute", (leaf, *view.order)) if view.order != sorted(view.order) else leaf
    if view.sizes:
        for d in reversed(range(len(view.sizes), len(view.order))):
            y = g.call_method("squeeze", (y, d))
    else:
        y = g.call_method("reshape", (y, ()))
    if view.checked:  # the proof read the value of a buffer / tensor attribute: check it on every call
        what = f"{leaf.name} (a mask read from a buffer or tensor attribute, {node_site(leaf)})"
        y = g.call_function(CHECK_UNCHANGED, (y, digest(view.static), what))
    return y


def _boundaries_input(g: fx.Graph, cap, leaf: fx.Node, table: fx.Node) -> fx.Node:
    """``torch.bucketize`` passes no gradient to its boundaries: a parameter used as boundaries
    enters the op detached (its ``.grad`` stays None, as in eager)."""
    ex = example(leaf)
    if leaf in cap.boundaries and isinstance(ex, torch.Tensor) and ex.requires_grad:
        return g.call_method("detach", (table,))
    return table


def _from_bnhd(g: fx.Graph, out: fx.Node, node: fx.Node, layout: Token) -> fx.Node:
    """``[B, N, H, dv]`` back to the contraction's own layout (size-1 axes unsqueezed back, so no
    size is written into the graph)."""
    shape = shape_of(node)
    nd = len(shape)
    heads = [a for a in range(nd) if a not in (layout.batch, layout.seq, nd - 1)]
    big = [a for a in heads if not is_one(shape[a])]
    if len(big) > 1:
        raise Unsupported(f"{node.name} {shape} has more than one head axis")
    head = big[0] if big else None
    # out axes: 0 = B, 1 = N, 2 = H, 3 = dv. Build the user's order, then restore size-1 axes.
    order_roles = {layout.batch: 0, layout.seq: 1, nd - 1: 3}
    if head is not None:
        order_roles[head] = 2
    kept = sorted(order_roles)
    if head is None:
        out = g.call_method("squeeze", (out, 2))
        perm_src = {0: 0, 1: 1, 3: 2}
        y = g.call_method("permute", (out, *[perm_src[order_roles[a]] for a in kept]))
    else:
        y = g.call_method("permute", (out, *[order_roles[a] for a in kept]))
    for a in range(nd):
        if a not in order_roles:
            y = g.call_method("unsqueeze", (y, a))
    return y