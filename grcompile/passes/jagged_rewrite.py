"""Pass ``jagged_rewrite``: row-wise work on padded ``[B, N, ...]`` tensors → values ``[T, ...]``.

Matches: the region of heavy Token tensors (a feature axis > 1, a real batch axis) computed by
row-wise ops — embedding lookups, linear, norms, activations, dropout, elementwise gating and
residuals, feature reshapes/splits — plus the fused attentions ``fuse_attention`` emitted.
Emits: one ``grcompile::pack_index(valid)`` (the data-dependent T, an unbacked size, so no
recompiles), gathers at the region's inputs (ids are packed *before* the embedding), the same
ops on ``[T, ...]``, ``grcompile::jagged_attention`` for the attentions, and a scatter back to
``[B, N, ...]`` (zeros at padding) where a value leaves the region.
A mean / sum ``cross_entropy`` / ``nll_loss`` of the flattened tokens (or the K-dimensional
``[B, C, N]`` form) whose padded positions' targets are its ``ignore_index`` leaves through
``ignored_loss``: the same loss on the jagged values and the gathered targets.
Invariant: exact at every valid position. Leaving the region is allowed only where the original
value is provably zero at padding (multiplied by the validity mask, or a fused attention output),
so the zeros of the scatter equal the original, or where its consumer ignores the padded
positions (a loss whose padded targets are its ``ignore_index``: proved, or checked on each call
with the call run as captured where the check fails); otherwise the values it reads stay dense
and the report names the consumer.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from .effects import WriteOrder, remove_dead_code
from .pass_manager import CHECKPOINT_META, GraphPass, PassContext, copy_graph, ends_at_return, node_site
from ..lowering.attention import JAGGED_ATTENTION
from ..lowering.jagged import jagged_to_dense, segment_softmax, valid_to_offsets
from ..lowering.pack import PACK_INDEX
from .attention_capture import Unsupported, side_value, _Any
from .detect_padding import analyse
from .exit_checks import build_read_check
from . import ignored_loss
from .jagged_exits import ExitEmitter, confined_row_axes, prove_reads_valid, segment_kind, selection_kind
from .jagged_region import ZeroAtPadding, feature_index, hoist_validity, sequence_softmaxes, shrink, tiled_along
from . import row_spellings
from .layout import Flat, Pair, Token, TupleOf, feature_axes, token_axes
from .op_semantics import arg, canonical, describe_op, shape_of
from .symbolic import SizeArgs, Unresolved, gt_one, hoist_sizes, is_one, known_eq

_POINTWISE = ("ne", "eq", "gt", "ge", "lt", "le", "and", "or", "not", "add", "sub", "mul", "div", "neg",
              "unary", "where", "masked_fill", "dropout")
_HANDLED = _POINTWISE + ("linear", "layer_norm", "rms_norm", "normalize", "softmax", "embedding", "reshape",
                         "unsqueeze", "squeeze", "transpose", "permute", "expand", "split", "chunk", "getitem",
                         "cat", "matmul", "reduce", "fused_attention", "class_loss", "einsum")


def _smaller(u: fx.Node, x: fx.Node) -> bool:
    """Does selection ``u`` read well under half of ``x`` (a gather beats the dense unpack)?"""
    su, sx = shape_of(u), shape_of(x)
    if su is None or sx is None or not all(type(s) is int for s in (*su, *sx)):
        return True  # unknown or symbolic sizes: a selection is usually a few rows
    return 2 * math.prod(su) < math.prod(sx)


_WORK = ("embedding", "linear", "layer_norm", "rms_norm", "matmul", "fused_attention")


class JaggedRewrite(GraphPass):
    name = "jagged_rewrite"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        saved = copy_graph(gm.graph)
        hoist_sizes(gm)  # a dynamic graph's x.shape reads would keep the dense x alive
        spelled = row_spellings.normalise(gm)  # conv1x1 -> linear, ...: undone with the rest on a fallback
        info = analyse(gm)  # fresh layouts: earlier passes added nodes
        if info is None:
            gm.graph = saved
            return
        # the graph ends at the frame's return (no graph break): its outputs are what the user gets,
        # and their padded positions are not part of the contract (exact at valid positions)
        outputs_free = ends_at_return(gm)
        dense: dict[str, str] = {}  # region nodes whose jagged form failed: kept dense, retried
        while True:
            try:
                rewriter = _Rewriter(gm, info, dense, outputs_free, ctx.example_inputs)
                converted = rewriter.run()
                if converted:
                    _allow_data_dependent_sizes(gm)
                break
            except _KeepDense as e:
                gm.graph = copy_graph(saved)
                row_spellings.normalise(gm)
                info = analyse(gm)
                if e.name in dense or len(dense) >= _MAX_DENSE or info is None:
                    gm.graph = saved
                    ctx.fallback(e.node, f"jagged rewrite skipped: {e.reason}")
                    return
                dense[e.name] = e.reason
            except Unsupported as e:
                gm.graph = saved
                ctx.fallback(e.node, f"jagged rewrite skipped: {e}")
                return
        if not converted:
            gm.graph = saved  # nothing went jagged: the user's spellings stay as they were
        else:
            for key, n in spelled.items():
                ctx.count(key, n)
        for op, node in converted:
            ctx.rewrite(op, node)
        for node, how in rewriter.loss_exits:
            ctx.rewrite("ignored_target_loss", node, target_at_padding=how)
        for node, reason in rewriter.notes:  # parts kept dense (exact), with why
            ctx.fallback(node, reason)
        for node, check, reason in rewriter.preconditions:
            ctx.precondition(check, node, reason)
        for key, n in rewriter.counts.items():
            ctx.count(key, n)


_MAX_DENSE = 32  # region nodes without a jagged form that may be kept dense before giving up


class _KeepDense(Exception):
    """Converting region node ``name`` failed: rerun with it kept dense (its inputs then leave
    the region, which is exact or shrinks further)."""

    def __init__(self, node: fx.Node, reason: str) -> None:
        super().__init__(reason)
        self.node, self.name, self.reason = node, node.name, reason


def _allow_data_dependent_sizes(gm: fx.GraphModule) -> None:
    """``pack_index`` has a data-dependent size (T). Dynamo built this graph's ShapeEnv without
    permission for such ops (nothing in the user's code needed it); AOTAutograd and inductor
    handle the unbacked size fine once the ShapeEnv allows it."""
    import dataclasses

    for n in gm.graph.nodes:
        fake_mode = getattr(n.meta.get("example_value"), "fake_mode", None)
        if n.op == "placeholder" and fake_mode is not None and fake_mode.shape_env is not None:
            env = fake_mode.shape_env
            env.settings = dataclasses.replace(env.settings, allow_dynamic_output_shape_ops=True)
            return


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, info, dense: dict[str, str] | None = None,
                 outputs_free: bool = False, inputs=None) -> None:
        self.gm, self.g, self.info = gm, gm.graph, info
        self.dense = dense or {}  # node name -> why it has no jagged form
        self.outputs_free = outputs_free
        self.layouts = info.layouts
        self.B, self.N = info.batch, info.seq_len  # ints, or SymInts after a shape change: compare with
        self._sizes = SizeArgs(gm)                  # symbolic.known_eq, emit through self._size
        self.jagged: dict[fx.Node, fx.Node] = {}
        self.packed: dict[tuple[fx.Node, object], fx.Node] = {}  # (tensor, layout read with) -> values
        self.notes: list[tuple[fx.Node, str]] = []
        self.counts: dict[str, int] = {}
        self.write_order = WriteOrder(self.g)  # before any conversion: the user's program order
        # softmax over the positions of masked logits (attention pooling): a segment softmax
        self.seq_softmax = sequence_softmaxes(self.g, self.layouts, set(info.validity), set(info.padding))
        self.region = self._select()
        self._proofs: dict[tuple[fx.Node, fx.Node], str | None] = {}
        # selections whose reads are checked on each call instead of proved (exit_checks.py)
        self._read_checks: dict[tuple[fx.Node, fx.Node], tuple[fx.GraphModule, str]] = {}
        self.preconditions: list[tuple[fx.Node, fx.GraphModule, str]] = []
        # mean / sum losses that ignore the padded positions' targets (ignored_loss.py)
        self.inputs = inputs  # the call being compiled, when known: a check it fails is not installed
        self._losses: dict[tuple[fx.Node, fx.Node], ignored_loss.IgnoredLoss | None] = {}
        self.loss_exits: list[tuple[fx.Node, str]] = []
        by_name = {n.name: n for n in self.g.nodes}
        for name, reason in self.dense.items():
            self.notes.append((by_name.get(name), f"{name} stays dense: {reason}"))
        self._shrink()

    def _size(self, s):
        """A size as a graph argument (an int, or a node computing the symbol from an input)."""
        try:
            return self._sizes(s)
        except Unresolved as e:
            raise Unsupported(f"{e}: the jagged form would need it as a graph value") from None

    # ---------------------------------------------------------------- region
    def _heavy(self, n: fx.Node) -> bool:
        layout, shape = self.layouts.get(n), shape_of(n)
        return any(gt_one(shape[a]) for a in feature_axes(layout))

    def _select(self) -> list[fx.Node]:
        region: list[fx.Node] = []
        members: set[fx.Node] = set()
        for n in self.g.nodes:
            op, layout = canonical(n), self.layouts.get(n)
            if op not in _HANDLED or n.name in self.dense:
                continue
            fed = any(a in members for a in n.all_input_nodes)
            if isinstance(layout, TupleOf) and fed:
                pass
            elif op == "fused_attention":
                pass
            elif isinstance(layout, Flat):  # flattened tokens (a per-position loss): only what the region feeds
                if not fed or not known_eq(shape_of(n)[layout.axis], self.B * self.N):
                    continue
            elif not (isinstance(layout, Token) and layout.batch is not None and layout.seq is not None):
                continue
            elif not known_eq(shape_of(n)[layout.batch], self.B) or not (self._heavy(n) or fed):
                continue
            elif op == "matmul" and self.layouts.get(n.args[1]) is not None:
                continue
            elif op == "einsum" and any(isinstance(self.layouts.get(a), Pair) for a in n.all_input_nodes):
                continue  # attention left unfused: scores stay dense
            region.append(n)
            members.add(n)
        self.members = members
        return region

    def _valid_mask(self) -> fx.Node:
        return self.info.validity[0] if self.info.validity else self.info.padding[0]

    def _proof(self, n: fx.Node, u: fx.Node) -> str | None:
        """Why a selection ``u`` of region value ``n`` may read padded positions (None: proved it
        does not, for non-empty rows)."""
        if (n, u) not in self._proofs:
            if self.info.validity:
                rows = confined_row_axes(u, self.layouts, self.B, self.outputs_free)
                why = prove_reads_valid(u, n, self.layouts[n], self.info.validity[0], self.layouts, self.B, self.N,
                                        rows)
                if why is not None:
                    check = build_read_check(self.gm, u, n, self.layouts[n], self.info.validity[0],
                                             self.write_order.writes_to, rows)
                    if isinstance(check, fx.GraphModule):
                        self._read_checks[(n, u)] = (check, why)
                        why = None  # proved on each call instead
                    else:
                        why = f"{why}; nor can it be checked on each call: {check}"
                self._proofs[(n, u)] = why
            else:
                self._proofs[(n, u)] = "the validity is only given as a padding mask"
        return self._proofs[(n, u)]

    def _ignored_loss(self, n: fx.Node, u: fx.Node) -> ignored_loss.IgnoredLoss | None:
        """``u`` as an ignored-target loss of region value ``n`` (``ignored_loss.decide``), None when
        it is not a mean / sum loss of ``n``; its ``why`` is None when the exit may be used."""
        if (n, u) not in self._losses:
            self._losses[(n, u)] = ignored_loss.decide(u, n, self.info, self.layouts, self.write_order.writes_to,
                                                       self.inputs)
        return self._losses[(n, u)]

    def _shrink(self) -> None:
        """Keep dense (exactly as written) the region values whose outside users need their
        padded values, and what they are computed from back to a value that is 0 at padding."""
        validity, padding = set(self.info.validity), set(self.info.padding)

        def make_check(members: set[fx.Node]):
            zero = ZeroAtPadding(members, self.layouts, validity, padding, self.seq_softmax)

            def ok(n: fx.Node, u: fx.Node) -> bool:
                layout = self.layouts.get(n)
                if not isinstance(layout, (Token, Flat)):
                    return False  # a split consumed outside: no dense form of the tuple
                if zero(n) or (u.op == "output" and self.outputs_free):
                    return True
                loss = self._ignored_loss(n, u)
                if loss is not None:
                    return loss.why is None
                return isinstance(layout, Token) and selection_kind(u, n, members) is not None and self._proof(n, u) is None
            return ok

        kept, dropped = shrink(self.region, make_check, self.layouts)
        if not dropped:
            return
        causes: dict[tuple[fx.Node, fx.Node], int] = {}
        for cause in dropped.values():
            causes[cause] = causes.get(cause, 0) + 1
        # worth a pack only if real work stays jagged (not just a mask product before a sum)
        heavy_left = any(canonical(n) in _WORK for n in kept)
        for (n, u), count in causes.items():
            who = "the graph output" if u.op == "output" else f"{u.name} ({node_site(u)})"
            why = self._proofs.get((n, u)) if selection_kind(u, n, set(self.region)) else None
            if self._losses.get((n, u)) is not None:
                why = self._losses[(n, u)].why
            reason = (f"{who} reads {n.name} at padded positions, and {n.name} is not provably zero at padding"
                      + (f" ({why})" if why else "") + ": ")
            if not heavy_left:
                raise Unsupported(reason + "the row-wise block stays dense (multiply it by the validity mask "
                                           "before it leaves the block)", u if u.op != "output" else n)
            self.notes.append((u if u.op != "output" else n,
                               reason + f"{count} row-wise op(s) from the last masked value stay dense"))
        self.counts["dense_tail_ops"] = len(dropped)
        self.region = kept
        self.members = set(kept)

    # ---------------------------------------------------------------- emit
    def run(self) -> list[tuple[str, fx.Node]]:
        if not any(self._heavy(n) for n in self.region if isinstance(self.layouts.get(n), Token)):
            return []
        g = self.g
        first = self.region[0]
        mask = self._valid_mask()
        moved = hoist_validity(g, mask, first, self.members)  # dataflow, not program order
        if moved:
            self.counts["validity_hoisted_ops"] = moved
        valid = mask
        if not self.info.validity:
            with g.inserting_after(mask):
                valid = g.call_function(torch.logical_not, (mask,))
        self.valid = valid
        with g.inserting_after(valid):
            self.index = g.call_function(PACK_INDEX, (valid,))
        with g.inserting_after(self.index):
            self.positions = g.call_function(operator.mod, (self.index, self._size(self.N)))
        with g.inserting_after(self.positions):
            self.rows = g.call_function(operator.floordiv, (self.index, self._size(self.N)))
        with g.inserting_after(self.rows):
            self.offsets = g.call_function(valid_to_offsets, (valid,))
        if list(g.nodes).index(self.offsets) > list(g.nodes).index(first):
            raise Unsupported("the validity mask is computed after the first row-wise op", first)
        self.exits = ExitEmitter(g, valid, self.index, self.rows, self._size(self.B), self._size(self.N),
                                 self.offsets, size=self._size)
        done = []
        for n in self.region:
            with g.inserting_before(n):
                try:
                    self.jagged[n] = self._convert(n)
                except Unsupported as e:
                    raise _KeepDense(n, str(e)) from e
            for key in ("stack_trace", "nn_module_stack", row_spellings.WRITTEN_AS, *CHECKPOINT_META):  # what the user wrote, where, and a checkpoint region's tags
                if n.meta.get(key) and not self.jagged[n].meta.get(key):
                    self.jagged[n].meta[key] = n.meta[key]
            done.append((canonical(n) if canonical(n) != "fused_attention" else "jagged_attention", n))
        self._exits()
        remove_dead_code(g)
        return [d for d in done if d[0] in ("embedding", "linear", "jagged_attention", "layer_norm", "rms_norm")]

    def _exits(self) -> None:
        g = self.g
        zero = ZeroAtPadding(self.members, self.layouts, set(self.info.validity), set(self.info.padding),
                             self.seq_softmax)
        for n in self.region:
            outside = [u for u in n.users if u not in self.members]
            if not outside:
                continue
            if isinstance(self.layouts.get(n), TupleOf):
                raise Unsupported(f"split {n.name} is consumed outside the jagged region", outside[0])
            layout = self.layouts[n]
            tokens = isinstance(layout, Token)  # flattened tokens leave through the dense form
            dense = None
            for u in outside:
                self._check_no_write_between(n, u)  # the exits read the jagged values, taken at n
                # jagged exits first: a segment sum or a row selection reads the values directly
                kind = segment_kind(u, n, layout) if tokens and zero(n) else None
                if kind is not None:
                    with g.inserting_before(u):
                        new = self.exits.segment(u, self.jagged[n], layout, kind)
                    self._count(f"exit_segment_{kind}")
                elif tokens and selection_kind(u, n, self.members) is not None and (
                        (zero(n) and _smaller(u, n)) or (not zero(n) and self._proof(n, u) is None)):
                    with g.inserting_before(u):
                        new = self.exits.select(u, n, self.jagged[n], layout)
                    self._count("exit_row_select")
                    if not zero(n) and (n, u) in self._read_checks:
                        check, why = self._read_checks[(n, u)]
                        self.preconditions.append((u, check, (
                            f"{describe_op(u)} ({node_site(u)}) may read a padded position of {n.name} ({why}): "
                            f"each call checks that it reads only valid positions (or an empty row's own)")))
                elif (loss := self._ignored_loss(n, u)) is not None and loss.why is None and (
                        loss.check is None or not zero(n)):  # 0 at padding: the dense exit needs no check
                    with g.inserting_before(u):
                        new = self._loss_exit(u, n, loss)
                    self._count("exit_ignored_loss")
                    self._count(f"ignored_loss_{loss.how}")
                    self.loss_exits.append((u, loss.how))
                    if loss.check is not None:
                        self.preconditions.append((u, loss.check, ignored_loss.check_reason(
                            u, loss, "the loss computed on the valid positions only")))
                else:
                    new = None
                if new is not None:
                    if u.meta.get("stack_trace"):
                        new.meta["stack_trace"] = u.meta["stack_trace"]
                    u.replace_all_uses_with(new)
                    continue
                if not zero(n) and not (u.op == "output" and self.outputs_free):
                    raise Unsupported(f"{n.name} is used by {u.name} outside the jagged region and is not "
                                      f"provably zero at padding (multiply it by the validity mask)", u)
                if dense is None:
                    dense = self._unpack(n, layout)
                    self._count("exit_dense")
                u.replace_input_with(n, dense)

    def _loss_exit(self, u: fx.Node, n: fx.Node, loss: ignored_loss.IgnoredLoss) -> fx.Node:
        """``u`` on the jagged values ``[T, C]`` and the targets at the valid positions ``[T]``, every
        other argument as written."""
        t = loss.target
        if self.write_order.between(t, u) is not None:  # written in place after t: gathered where u reads it
            flat = t if isinstance(loss.aligned, Flat) else self.g.call_method("flatten", (t, 0, 1))
            target = self.g.call_function(operator.getitem, (flat, self.index))
        else:
            target = self.jagged[t] if t in self.members else self._pack(t, loss.aligned)
        args, kwargs = list(u.args), dict(u.kwargs)
        for index, name, value in ((0, "input", self.jagged[n]), (1, "target", target)):
            if len(args) > index:
                args[index] = value
            else:
                kwargs[name] = value
        return self.g.call_function(u.target, tuple(args), kwargs)

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def _unpack(self, n: fx.Node, layout: Token | Flat) -> fx.Node:
        g = self.g
        with g.inserting_after(self.jagged[n]):
            dense = g.call_function(jagged_to_dense, (self.jagged[n], self.index, self._size(self.B),
                                                      self._size(self.N)))
        if isinstance(layout, Flat):
            with g.inserting_after(dense):
                dense = g.call_method("flatten", (dense, 0, 1))
        order = token_axes(layout) + feature_axes(layout)
        if order != list(range(len(order))):
            inverse = [order.index(a) for a in range(len(order))]
            with g.inserting_after(dense):
                dense = g.call_method("permute", (dense, *inverse))
        return dense

    # ---------------------------------------------------------------- operands
    def _pack(self, x: fx.Node, layout: Token | Flat | None = None) -> fx.Node:
        """A Token or Flat tensor from outside the region as ``[T, *features]`` (``layout``: the
        one ``x`` is read with when the analysis gave it none, see ``_aligned_rows``)."""
        layout, shape = layout or self.layouts[x], shape_of(x)
        if (x, layout) in self.packed:
            return self.packed[(x, layout)]
        g = self.g
        nodes = list(g.nodes)
        point = x if nodes.index(x) > nodes.index(self.offsets) else self.offsets

        def emit(kind: str, target, *args) -> fx.Node:
            nonlocal point
            with g.inserting_after(point):
                point = g.call_method(target, args) if kind == "method" else g.call_function(target, args)
            return point

        order = token_axes(layout) + feature_axes(layout)
        y = emit("method", "permute", x, *order) if order != list(range(len(order))) else x
        if isinstance(layout, Flat):
            if not known_eq(shape[layout.axis], self.B * self.N):
                raise Unsupported(f"cannot pack {x.name} {shape}", x)
            y = emit("function", operator.getitem, y, self.index)
            self.packed[(x, layout)] = y
            return y
        b = shape[layout.batch] if layout.batch is not None else 1
        s = shape[layout.seq] if layout.seq is not None else 1
        if known_eq(b, self.B) and known_eq(s, self.N):
            idx = self.index
        elif is_one(b) and known_eq(s, self.N):
            idx = self.positions
        elif known_eq(b, self.B) and is_one(s):
            idx = self.rows
        else:
            raise Unsupported(f"cannot pack {x.name} {shape}", x)
        # [b?, s?, *features] -> [b·s, *features] without writing a size into the graph
        if layout.batch is not None and layout.seq is not None:
            y = emit("method", "flatten", y, 0, 1)
        y = emit("function", operator.getitem, y, idx)
        self.packed[(x, layout)] = y
        return y

    def _operand(self, a, n: fx.Node):
        """Argument ``a`` of pointwise ``n`` in the jagged frame of ``n``'s output."""
        if not isinstance(a, fx.Node):
            return a
        out_layout = self.layouts[n]
        nd = out_layout.ndim
        if a in self.members:
            value, layout = self.jagged[a], self.layouts[a]
        elif isinstance(self.layouts.get(a), Flat):
            value, layout = self._pack(a), self.layouts[a]
        elif isinstance(self.layouts.get(a), Token):
            a = self._one_row(a, out_layout)
            value, layout = self._pack(a), self.layouts[a]
        else:
            shape = shape_of(a)
            if shape is None or len(shape) == 0:
                return a
            offset = nd - len(shape)
            drop = [i for i in range(len(shape)) if i + offset in token_axes(out_layout)]
            if isinstance(out_layout, Flat) and drop and not is_one(shape[drop[0]]):
                # no layout, but broadcasting lines its elements up with the flattened tokens one
                # to one (``torch.zeros(B * N)``): its valid positions are the same gather
                layout = Flat(drop[0], len(shape))
                value = self._pack(a, layout)
            else:
                if any(not is_one(shape[i]) for i in drop):
                    raise Unsupported(f"{a.name} {shape} varies along the token axes without a layout", n)
                for i in reversed(drop):
                    a = self.g.call_method("squeeze", (a, i))
                return a
        offset = nd - layout.ndim
        mapped = [f + offset for f in feature_axes(layout)]
        shape = shape_of(a)
        # a broadcast axis of `a` (size 1) that lands on one of the output's token axes is not a
        # feature of the jagged form: squeeze it
        squeeze = [i for i, m in enumerate(mapped) if m in token_axes(out_layout)]
        if any(not is_one(shape[feature_axes(layout)[i]]) for i in squeeze):
            raise Unsupported(f"{a.name} {shape} does not line up with {n.name}'s token axes", n)
        for i in reversed(squeeze):
            value = self.g.call_method("squeeze", (value, 1 + i))
        mapped = [m for i, m in enumerate(mapped) if i not in squeeze]
        out_feats = feature_axes(out_layout)
        if mapped != out_feats[len(out_feats) - len(mapped):]:
            raise Unsupported(f"{a.name} broadcasts across feature axes in a way the jagged form cannot keep", n)
        for _ in range(len(out_feats) - len(mapped)):  # [T, *f] against [T, *g, *f]: T stays first
            value = self.g.call_method("unsqueeze", (value, 1))
        return value

    def _one_row(self, a: fx.Node, out_layout: Token) -> fx.Node:
        """A Token without a batch axis (the same for every row) whose tensor is nevertheless tiled
        over the rows (``table[:N].unsqueeze(0).repeat(B, 1, 1)``, ``arange(N).expand_as(ids)``):
        any one row of it, so the pack does not gather B copies."""
        from .op_semantics import example

        layout, shape = self.layouts[a], shape_of(a)
        axis = None if out_layout.batch is None else out_layout.batch - (out_layout.ndim - layout.ndim)
        if layout.batch is not None or axis is None or axis < 0 or axis == layout.seq or is_one(shape[axis]):
            return a
        if not tiled_along(a, axis):
            raise Unsupported(f"{a.name} {list(shape)} varies along the rows, which its layout does not follow", a)
        narrowed = self.__dict__.setdefault("_narrowed", {})
        if (a, axis) not in narrowed:
            with self.g.inserting_after(a):
                row = self.g.call_method("narrow", (a, axis, 0, 1))
            row.meta["example_value"] = example(a).narrow(axis, 0, 1)
            self.layouts[row] = layout
            narrowed[(a, axis)] = row
        return narrowed[(a, axis)]

    def _dim(self, n: fx.Node, d: int, layout: Token | None = None) -> int:
        layout = layout or self.layouts[n.args[0]] if isinstance(n.args[0], fx.Node) else layout
        d = d + layout.ndim if d < 0 else d
        feats = feature_axes(layout)
        if d not in feats:
            raise Unsupported(f"{n.name} works along a token axis", n)
        return 1 + feats.index(d)

    # ---------------------------------------------------------------- ops
    def _check_no_write_between(self, value: fx.Node, reader: fx.Node) -> None:
        """``reader``'s jagged form reads ``value`` as it was where it was defined (its jagged copy
        or its pack): refuse if the user's code writes into it in between."""
        write = self.write_order.between(value, reader)
        if write is not None:
            raise Unsupported(f"{value.name} is written in place by {describe_op(write)} at {node_site(write)} "
                              f"before {reader.name} reads it: a packed copy would miss the write", reader)

    def _convert(self, n: fx.Node) -> fx.Node:
        for a in n.all_input_nodes:
            self._check_no_write_between(a, n)
        g, op = self.g, canonical(n)
        x = n.args[0] if n.args else None
        J = lambda a: self.jagged[a] if a in self.members else (self._pack(a) if isinstance(self.layouts.get(a), (Token, Flat)) else a)  # noqa: E731
        call = (lambda args, kwargs: g.call_method(n.target, args, kwargs)) if n.op == "call_method" else \
            (lambda args, kwargs: g.call_function(n.target, args, kwargs))
        if op in _POINTWISE:
            args = fx.node.map_arg(n.args, lambda a: self._operand(a, n))
            kwargs = fx.node.map_arg(n.kwargs, lambda a: self._operand(a, n))
            return call(args, kwargs)
        if op in ("linear", "layer_norm", "rms_norm"):
            return call((J(x), *n.args[1:]), dict(n.kwargs))
        if op == "embedding":
            return call((self._pack(x), *n.args[1:]), dict(n.kwargs))
        if op == "class_loss":  # one loss per row: the target's rows are gathered like the input's
            target = arg(n, 1, "target")
            if isinstance(self.layouts.get(target), Flat):
                target = J(target)
            elif self.layouts.get(target) is not None:
                raise Unsupported(f"the target of {describe_op(n)} does not line up with its rows", n)
            else:
                target = self._pack(target, Flat(0, len(shape_of(target))))
            args, kwargs = list(n.args), dict(n.kwargs)
            if len(args) > 1:
                args[1] = target
            else:
                kwargs["target"] = target
            return call((J(x), *args[1:]), kwargs)
        if op == "matmul":
            return call((J(x), n.args[1]), {})
        if n in self.seq_softmax:
            self._count("segment_softmax")
            values = J(x)
            dtype = n.kwargs.get("dtype", arg(n, 2, "dtype"))
            if dtype is not None:
                values = g.call_method("to", (values, dtype))
            log = getattr(n.target, "__name__", n.target) == "log_softmax"
            return g.call_function(segment_softmax, (values, self.rows, self._size(self.B), log))
        if op in ("normalize", "softmax"):
            index, name, default = (2, "dim", 1) if op == "normalize" else (1, "dim", None)
            d = self._dim(n, arg(n, index, name, default))
            args = list(n.args)
            kwargs = dict(n.kwargs)
            if len(args) > index:
                args[index] = d
            else:
                kwargs[name] = d
            return call((J(x), *args[1:]), kwargs)
        if op in ("reshape", "expand"):
            out_layout = self.layouts[n]
            shape = shape_of(n)
            sizes = [self._size(shape[a]) for a in feature_axes(out_layout)]
            value = J(x)
            if op == "expand":
                # the input's features in the output's feature order: a new leading axis is 1, and
                # a size-1 input feature the expand makes a token axis (``pe.unsqueeze(0).expand(B,
                # N, D)``) is already the jagged values' row axis
                in_shape = shape_of(x)
                offset = out_layout.ndim - len(in_shape)
                aligned = [1 if a < offset else self._size(in_shape[a - offset]) for a in feature_axes(out_layout)]
                value = g.call_method("reshape", (value, -1, *aligned))
            return g.call_method("reshape" if op == "reshape" else "expand", (value, -1, *sizes))
        if op == "unsqueeze":
            d = arg(n, 1, "dim")
            out_layout = self.layouts[n]
            return g.call_method("unsqueeze", (J(x), self._dim(n, d, out_layout)))
        if op == "squeeze":
            return g.call_method("squeeze", (J(x), self._dim(n, arg(n, 1, "dim"))))
        if op in ("transpose", "permute"):
            in_layout, out_layout = self.layouts[x], self.layouts[n]
            nd = in_layout.ndim
            if op == "transpose":
                d0, d1 = (arg(n, 1, "dim0") % nd, arg(n, 2, "dim1") % nd)
                source = [d1 if a == d0 else d0 if a == d1 else a for a in range(nd)]
            else:
                dims = n.args[1:] if len(n.args) > 2 else arg(n, 1, "dims")
                source = [d % nd for d in dims]
            in_feats = feature_axes(in_layout)
            perm = [0] + [1 + in_feats.index(source[a]) for a in feature_axes(out_layout)]
            return g.call_method("permute", (J(x), *perm))
        if op in ("split", "chunk"):
            d = self._dim(n, arg(n, 2, "dim", 0))
            args = list(n.args)
            kwargs = dict(n.kwargs)
            if len(args) > 2:
                args[2] = d
            else:
                kwargs["dim"] = d
            return call((J(x), *args[1:]), kwargs)
        if op == "getitem":
            if isinstance(self.layouts.get(x), TupleOf):
                return g.call_function(operator.getitem, (J(x), n.args[1]))
            return g.call_function(operator.getitem, (J(x), feature_index(n.args[1], self.layouts[x], n)))
        if op == "cat":
            tensors = arg(n, 0, "tensors")
            d = self._dim(n, arg(n, 1, "dim", 0), self.layouts[tensors[0]])
            return g.call_function(torch.cat, ([J(t) for t in tensors],), {"dim": d})
        if op == "reduce":  # sum / mean / amax / amin / var / std over feature axes; other arguments kept
            dims = arg(n, 1, "dim")
            dims = [self._dim(n, d) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
            args, kwargs = list(n.args), dict(n.kwargs)
            if len(args) > 1:
                args[1] = dims
            else:
                kwargs["dim"] = dims
            return call((J(x), *args[1:]), kwargs)
        if op == "fused_attention":
            return self._attention(n)
        if op == "einsum":
            return self._token_local(n)
        raise Unsupported(f"{describe_op(n)} ({n.name}) has no jagged form", n)

    def _token_local(self, n: fx.Node) -> fx.Node:
        """An op whose output at a token reads the region's values at that token only, plus
        per-row or constant operands (``einsum("bnd,brd->bnr", h, negatives)``: its layout keeps
        the sequence letter and contracts none): run as written on the unpacked operands (zeros
        at padding, never read back), then its valid positions gathered."""
        dense = {a: self._unpack(a, self.layouts[a]) for a in n.all_input_nodes if a in self.members}
        copy = self.g.node_copy(n, lambda a: dense.get(a, a))
        self._count(f"{canonical(n)}_through_dense")
        return self._pack(copy, self.layouts[n])

    def _attention(self, n: fx.Node) -> fx.Node:
        g = self.g
        q, k, v, _valid, q_sides, k_sides, tables, seed = n.args
        opts = n.kwargs
        Jt = lambda a: self.jagged[a] if a in self.members else self._pack(a)  # noqa: E731
        vj = Jt(v)
        if q is None:
            qj = kj = g.call_function(torch.zeros_like, (g.call_function(operator.getitem, (vj, (Ellipsis, slice(0, 1)))),))
        else:
            qj, kj = Jt(q), Jt(k)
        # a side computed inside the region (a gate over the tokens' values) is jagged already:
        # packed again from its dense form, it would be read outside the region
        qs = [Jt(s) for s in q_sides]
        ks = [Jt(s) for s in k_sides]
        activation = {"none": "identity", "softmax": "softmax"}[opts["normalize"]]
        return g.call_function(JAGGED_ATTENTION,
                               (qj, kj, vj, self.offsets, self.positions, qs, ks, list(tables), seed),
                               {"score_mod": opts["score_mod"], "use_qk": q is not None, "activation": activation,
                                "scale": 1.0, "out_scale": 1.0, "causal": opts["causal"], "max_len": self._size(self.N),
                                "dropout_p": opts["dropout_p"]})
