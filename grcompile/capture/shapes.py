"""Shape policy: one static compile, then one compile symbolic in the batch and sequence axes.

Real training changes ``B`` (the last batch of an epoch, evaluation batches) and ``N`` (loaders
that pad to each batch's longest row) all the time. Dynamo's defaults compile per new shape
(its automatic-dynamic recompile marks only the axes that changed *so far*: B and N changing at
different steps cost two recompiles, a batch of 1 a third) and run eagerly after 8 compiles.

What grcompile does instead, scoped to calls of the optimized model:

1. The first call compiles statically (fixed-shape workloads keep fully specialised code).
   While compiling, the backend asks the padding analysis which input axes are rows and which
   are positions (``learn``): axes tied to the validity mask by dataflow, not by their sizes.
2. The first call whose input shapes differ marks, on that call's tensors, every row axis
   *unbacked* (``mark_unbacked``: no 0/1 specialisation, so batches of 1 reuse the graph, and no
   size hints, so inductor adds no ``B·N <= 4096``-style guards) and every position axis backed
   dynamic (``maybe_mark_dynamic``), plus any other axis that changed. Dynamo recompiles once;
   later calls keep the same marks and hit that graph for any B >= 1, any N >= 2 and any length
   mix. Rows are marked with ``min=1`` (a guard ``1 <= B``, and the range [1, inf) for the
   symbol): a plain unbacked B may be 0, so user code that needs B·N != 0 cannot be traced —
   ``reshape(B, N, -1)`` infers the -1 in C++ with a check on ``Ne(B*N, 0)`` (a graph break,
   and inside a loop the whole frame eager), ``F.dropout`` tests ``numel() == 0`` (the fusion
   passes failed on the expanded attention's dropout). The range answers both without a size
   hint, so nothing is specialised to the batch at hand. A batch of 0 rows after that runs the
   user's code eagerly (``force_eager``; nothing to optimize in it, and eager is what such a
   batch got from the static graph's zero-size path); counted as ``shapes.empty_batch_eager``.
3. Duck sizing is off inside our calls (``use_duck_shape=False``): a ``[B, R]`` input with
   ``R == N`` at the moment of the recompile does not get N's symbol (it would be guarded equal).

4. Unbacked rows must survive AOTAutograd's joint trace, which runs autograd's C++ formulas on
   the symbols: ``x.repeat(batch_size, 1, 1)`` (a learned position table spread over the batch)
   has a backward that branches on each count (``Eq(u0, 0)``, ``Ne(u0, 1)``), and an unbacked
   count cannot answer: ``GuardOnDataDependentSymNode``, the graph cannot be lowered and would
   run eagerly. So every graph is made lowerable just before lowering (``make_lowerable``: the
   transformed graph after the passes, and the copy kept as captured for the lowering fallback):
   ``repeat`` / ``tile`` by symbolic counts become ``expand`` (+ ``flatten`` for tiled axes) + a
   contiguous ``clone`` — ``passes/symbolic_repeat.py``: the same elements, a fresh tensor, the same gradient sums, and a
   backward (``sum_to``) that decides broadcast axes from static sizes only. Not chosen: hints for
   unbacked sizes (``hint_override`` / ``backed_size_oblivious``) would answer the guard with this
   batch's size: a graph silently specialised to one B, or a recompile per B; nor backing the batch
   on failure (a recompile per batch of 1 again, the thing unbacked rows exist to avoid).

Why positions stay backed: unbacked positions make library code break the graph
(``nn.MultiheadAttention`` views with ``-1`` and tests ``N == 0``: measured, 2 graph breaks),
and ``backed_size_oblivious`` (which would cover N = 1 too) makes inductor specialise N again in
the backward (measured: a static size reappears in ``bmm``'s backward). So a batch with N = 1
(every row of length <= 1) compiles once more, specialised to N = 1; the report says so.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental import _config as fx_config

__all__ = ["ShapePolicy"]

ROWS, POSITIONS = "rows", "positions"
# ops whose output size depends on data (nonzero, a user's fbgemm dense_to_jagged) stay in the graph
# with an unbacked size instead of breaking it: the graph after such an op would otherwise be
# recompiled for every new size (every length mix)
_CAPTURE_DYNAMIC_OUTPUTS = torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
# built once and reused (re-entrant): torch's ``config.patch`` leaves a fresh ContextVar in the
# caller's context per patch object, so one built per call would grow the context every call
_NO_DUCK_SHAPE = fx_config.patch(use_duck_shape=False)


def _flat_tensors(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor in the call's arguments, in a stable order."""
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    out = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append((_path_name(path), leaf))
    return out


def _dynamo_reason() -> str:
    """The guard failure Dynamo recorded for the compile in progress ("" when none)."""
    try:
        metrics = torch._dynamo.utils.get_metrics_context()._metrics  # noqa: SLF001 - read-only
    except Exception:  # noqa: BLE001 - an internal of Dynamo's: the reason is optional
        return ""
    reason = metrics.get("recompile_reason") if isinstance(metrics, dict) else None
    return " ".join(str(reason).split())[:300] if reason else ""


def _source_name(source: str) -> str:
    """Dynamo's ``L['ids']`` / ``L['batch']['ids']`` as the user spells it: ``ids`` / ``batch['ids']``."""
    import re

    m = re.fullmatch(r"L\['([^']+)'\](.*)", source)
    return m.group(1) + m.group(2) if m else source


def _path_name(path: tuple) -> str:
    """``args[0]`` / ``kwargs['ids']`` / ``args[1]['mask']`` for a pytree key path."""
    parts = [str(getattr(k, "idx", getattr(k, "key", k))) for k in path]
    if not parts:
        return "input"
    head = "args" if parts[0] == "0" else "kwargs"
    rest = parts[1:]
    if head == "kwargs" and rest:
        return rest[0] + "".join(f"[{p!r}]" if not p.isdigit() else f"[{p}]" for p in rest[1:])
    return head + "".join(f"[{p}]" for p in rest)


@dataclass
class ShapePolicy:
    """Per optimized model: which call compiled statically, which input axes are rows /
    positions, and whether later calls mark them symbolic."""

    enabled: bool = True
    first: dict[str, tuple] | None = None  # input shapes of the call that compiled first, by argument path
    roles: dict[str, dict[int, str]] = field(default_factory=dict)  # argument path -> {dim: role}
    names: dict[str, str] = field(default_factory=dict)             # argument path -> the user's name
    dynamic: bool = False               # the token axes are marked symbolic on every call
    _call: list[tuple[str, torch.Tensor]] | None = None             # the call in progress
    _change: str = ""                   # what changed in the call in progress (for the report)

    # ------------------------------------------------------------------ around each call
    @contextlib.contextmanager
    def call(self, state: Any, args: tuple, kwargs: dict) -> Iterator[None]:
        flat = _flat_tensors(args, kwargs)
        shapes = {path: tuple(t.shape) for path, t in flat}
        self._call, self._change = flat, ""
        compiles = state.compiles
        stance: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self.enabled and (self.dynamic or (self.first is not None and shapes != self.first)) \
                and self._empty_rows(flat):
            # the symbolic graph holds rows >= 1 (``_mark``): an empty batch runs the user's code
            # eagerly (nothing to optimize in it) instead of compiling a graph for it
            state.counters["shapes.empty_batch_eager"] += 1
            stance = torch.compiler.set_stance("force_eager")
        elif self.enabled and self.first is not None and shapes != self.first:
            if not self.dynamic:
                self._change = self._describe_change(flat)
                self.dynamic = True
            self._mark(flat)
        elif self.enabled and self.dynamic:
            self._mark(flat)
        try:
            with _NO_DUCK_SHAPE, _CAPTURE_DYNAMIC_OUTPUTS, stance:
                yield
        finally:
            if self.first is None and state.compiles > compiles:
                self.first = shapes
            self._call = None

    def _name(self, path: str) -> str:
        return self.names.get(path, path)

    def _empty_rows(self, flat: list[tuple[str, torch.Tensor]]) -> bool:
        """A row axis of this call's inputs has size 0."""
        return any(t.shape[dim] == 0 for path, t in flat for dim, role in self.roles.get(path, {}).items()
                   if role == ROWS and dim < t.dim())

    def _mark(self, flat: list[tuple[str, torch.Tensor]]) -> None:
        for path, t in flat:
            roles = self.roles.get(path, {})
            for dim, role in roles.items():
                if dim >= t.dim():
                    continue
                if role == ROWS:
                    # min=1: the graph may assume a row exists (the module docstring, point 2)
                    torch._dynamo.decorators.mark_unbacked(t, dim, min=1)
                else:
                    torch._dynamo.maybe_mark_dynamic(t, dim)
            before = (self.first or {}).get(path)
            if before is not None and len(before) == t.dim():  # any other axis that changed
                for dim in range(t.dim()):
                    if before[dim] != t.shape[dim] and dim not in roles:
                        torch._dynamo.maybe_mark_dynamic(t, dim)

    def _describe_change(self, flat: list[tuple[str, torch.Tensor]]) -> str:
        changed = [f"{self._name(path)} {list(self.first[path])} -> {list(t.shape)}" for path, t in flat
                   if path in self.first and tuple(t.shape) != self.first[path]]
        new = [self._name(path) for path, _ in flat if path not in self.first]
        return "input shapes changed (" + ", ".join(changed + [f"{n} new" for n in new]) + ")"

    # ------------------------------------------------------------------ from the backend
    @staticmethod
    def make_lowerable(gm: fx.GraphModule, ctx: Any = None) -> None:
        """Rewrite, in place, the spellings whose autograd formula cannot be traced once a row axis
        is unbacked (``repeat`` / ``tile`` by a symbolic count -> ``expand``; the module docstring,
        point 4): for the graph as captured and for the transformed graph after the passes (which
        read the user's spellings), just before lowering. A no-op on static graphs. ``ctx`` (a
        ``PassContext``) records the rewrites in the report; None records nothing.
        """
        from ..passes.pass_manager import PassContext, run_pipeline
        from ..passes.symbolic_repeat import SymbolicRepeat, repeat_counts

        if any(repeat_counts(n) is not None for n in gm.graph.nodes):
            run_pipeline(gm, [SymbolicRepeat()], ctx if ctx is not None else PassContext())

    def learn(self, gm: fx.GraphModule) -> None:
        """Record which inputs of the call in progress carry row / position axes of ``gm``
        (placeholders whose example is one of the call's tensors, by identity). Graphs of one
        call (graph breaks) add to what earlier ones found."""
        if self._call is None:
            return
        from ..passes.detect_padding import analyse  # analysis only: the graph is not changed

        try:
            info = analyse(gm)
        except Exception:  # noqa: BLE001 - no roles: Dynamo's own automatic dynamic still applies
            return
        if info is None:
            return
        by_id = {id(t): path for path, t in self._call}
        for node, layout in info.layouts.items():
            if node.op != "placeholder" or layout is None or not hasattr(layout, "seq"):
                continue
            grapharg = node.meta.get("grapharg")
            example = getattr(grapharg, "example", None) if grapharg is not None else None
            path = by_id.get(id(example)) if isinstance(example, torch.Tensor) else None
            if path is None or path in self.roles:
                continue
            dims = {}
            if layout.batch is not None:
                dims[layout.batch] = ROWS
            if layout.seq is not None:
                dims[layout.seq] = POSITIONS
            if dims:
                self.roles[path] = dims
                source = getattr(getattr(grapharg, "source", None), "name", None)
                self.names[path] = _source_name(source) if isinstance(source, str) else path

    def recompile_reason(self, graph_index: int) -> dict[str, Any] | None:
        """The report entry for a compile after the first: why it happened (what changed, and the
        guard of Dynamo's that failed, when Dynamo recorded one)."""
        if graph_index == 0 or self._call is None:
            return None
        guard = _dynamo_reason()
        if self._change:
            axes = self.describe_roles()
            reason = (f"{self._change}: compiled once more with "
                      + (axes if axes else "the changed axes dynamic (no row / position axes known)"))
        else:
            small = [f"{self._name(path)} dim {d} = {t.shape[d]}" for path, t in self._call
                     for d, role in self.roles.get(path, {}).items() if role == POSITIONS and d < t.dim()
                     and t.shape[d] < 3]
            shapes = ", ".join(f"{self._name(path)} {list(t.shape)}" for path, t in self._call)
            reason = f"inputs ({shapes}) not covered by the graphs compiled so far"
            if small:
                reason += (f"; positions of size {', '.join(small)}: Dynamo specialises a backed size (or one the "
                           "model derives from it, such as N - 1) that is 0 or 1, so such a batch gets its own graph")
        if guard:
            reason += f" [Dynamo: {guard}]"
        return {"graph": graph_index, "reason": reason}

    def describe_roles(self) -> str:
        rows = [f"{self._name(p)} dim {d}" for p in self.roles for d, r in self.roles[p].items() if r == ROWS]
        pos = [f"{self._name(p)} dim {d}" for p in self.roles for d, r in self.roles[p].items() if r == POSITIONS]
        parts = []
        if rows:
            parts.append("rows (" + ", ".join(rows) + ") unbacked-symbolic")
        if pos:
            parts.append("positions (" + ", ".join(pos) + ") symbolic")
        return " and ".join(parts)
