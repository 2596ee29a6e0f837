"""The torch.compile backend: capture -> ordered pass pipeline -> lowering.

Dynamo hands the backend one FX graph per captured region (pre-autograd torch IR: torch
functions, parameters as ``l_self_modules_..._parameters_weight_`` placeholders). We number it,
dump it, run the pipeline in place, dump after each pass, then lower the *transformed* module:
``inductor`` via ``compile_fx`` (which also builds the backward through AOTAutograd, so training
sees the rewrites), ``eager`` by running the transformed ``gm.forward`` under ordinary autograd.
If inductor raises on the transformed graph, the graph as captured is lowered instead, and if
that raises too it runs eagerly; a graph with a zero-size input runs as captured (failures.py
has the policy; each case is a ``report().unoptimized`` entry). ``strict`` raises instead.
"""
from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .checkpoints import inline_checkpoints, save_random_draws
from .dump import describe_inputs, emit_artifact, write_dump, write_score_mods
from ..lowering.checks import pin_checks
from .failures import describe_error
from .guarded import GuardedGraph
from ..passes.pass_manager import (GraphPass, PassContext, PassResult, copy_graph, graph_break, node_site, pass_name,
                                   run_pipeline)
from ..passes.op_semantics import may_draw_random
from .report import Report
from .shapes import ShapePolicy

__all__ = ["GrcompileBackend", "GrcompileState", "LOWERINGS"]

log = logging.getLogger("grcompile")

LOWERINGS = ("inductor", "eager")


def _graph_break_counts() -> Counter[str]:
    return Counter(torch._dynamo.utils.counters["graph_break"])


@dataclass
class GrcompileState:
    """Everything one ``optimize()`` call accumulates; ``report()`` reads it."""

    passes: list[GraphPass]
    lowering: str = "inductor"
    dump_dir: Path | None = None
    compiles: int = 0
    rewrites: list[dict[str, Any]] = field(default_factory=list)
    fallbacks: list[dict[str, Any]] = field(default_factory=list)
    counters: Counter[str] = field(default_factory=Counter)
    sparse_plan: str = ""  # what the sparse runtime took over (optimize(sparse=...))
    # Dynamo counts graph breaks process-wide; we report the growth since optimize().
    graph_breaks_at_start: Counter[str] = field(default_factory=_graph_break_counts)
    strict: bool = False  # raise instead of running unoptimized (failures.py)
    unoptimized: list[dict[str, Any]] = field(default_factory=list)  # {kind, graph, frame, error, site, ran}
    recompile_limit: dict[str, Any] | None = None  # the unoptimized entry once Dynamo's limit is hit
    compiled_signatures: set[tuple] = field(default_factory=set)     # input shapes seen before it
    unoptimized_signatures: set[tuple] = field(default_factory=set)  # new input shapes after it
    shapes: ShapePolicy = field(default_factory=ShapePolicy)  # static first, then symbolic B / N (shapes.py)
    # (Dynamo's reason, the user's line) for each compiled graph that ends at a graph break: Dynamo
    # counts only some breaks in counters["graph_break"] (not a data-dependent guard such as
    # reshape's -1 on an unbacked size, nor data-dependent branching)
    graph_breaks_seen: list[tuple[str, str]] = field(default_factory=list)
    recompiles: list[dict[str, Any]] = field(default_factory=list)  # {graph, reason} per compile after the first
    remat_budget: float | None = None  # optimize(remat=<float>): AOTAutograd's activation memory budget
    remat_policy: bool = False  # optimize(remat=True): the remat_policy pass tags what to recompute

    def report(self) -> Report:
        grown = _graph_break_counts()
        grown.subtract(self.graph_breaks_at_start)
        reasons: Counter[str] = Counter()
        for why, site in self.graph_breaks_seen:  # those with a graph before them, with the user's line
            reasons[f"{site}: {why.split(chr(10) * 2)[0].strip()}"] += 1  # its first paragraph
            if grown[why] > 0:  # Dynamo counted this one too
                grown[why] -= 1
        reasons.update({k: v for k, v in grown.items() if v > 0})  # breaks with no graph before them
        reasons = dict(reasons)
        from ..lowering import kernel_fallbacks, kernel_usage
        return Report(rewrites=list(self.rewrites), fallbacks=list(self.fallbacks),
                      kernels=kernel_usage(), kernel_fallbacks=kernel_fallbacks(),
                      compiles=self.compiles, graph_breaks=sum(reasons.values()),
                      counters=dict(self.counters), passes=[pass_name(p) for p in self.passes],
                      lowering=self.lowering, graph_break_reasons=reasons, sparse_plan=self.sparse_plan,
                      remat_budget=self.remat_budget, remat_policy=self.remat_policy,
                      unoptimized=[dict(u) for u in self.unoptimized], recompiles=list(self.recompiles))


class GrcompileBackend:
    """``torch.compile(model, backend=GrcompileBackend(state))``; one instance per optimize()."""

    def __init__(self, state: GrcompileState) -> None:
        self.state = state
        self.__name__ = "grcompile"  # Dynamo names backends in logs and errors

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        state = self.state
        k = state.compiles
        state.compiles += 1
        n_passes = len(state.passes)
        self._emit(k, 0, "captured", gm, [
            f"captured by Dynamo; {len(gm.graph.nodes)} nodes; inputs: {describe_inputs(example_inputs)}",
            f"pipeline ({n_passes} pass(es)): {', '.join(pass_name(p) for p in state.passes) or 'empty'}; "
            f"lowering: {state.lowering}",
        ])

        if (gb := graph_break(gm)) is not None:
            state.graph_breaks_seen.append(gb)
        region = _region_site(gm)  # where the captured region starts
        empty = _zero_size_input(gm, example_inputs)
        if empty is not None:
            # Nothing to optimize in an empty batch, and the passes reason about rows that exist:
            # run the graph as captured (exactly the user's ops), and say so.
            state.unoptimized.append({"kind": "zero_size", "graph": k, "frame": region, "site": region,
                                      "error": f"input {empty} has a zero-size dimension",
                                      "ran": "the captured graph, eagerly (passes and lowering skipped)"})
            log.info("grcompile graph %d: input %s has a zero-size dimension; runs as captured", k, empty)
            return gm.forward
        captured = fx.GraphModule(gm, copy_graph(gm.graph))  # for the lowering fallbacks below
        inlined, kept = inline_checkpoints(gm)  # the passes see inside torch.utils.checkpoint regions
        if inlined:
            state.counters["capture.checkpoints_inlined"] += inlined
        for call, why in kept:
            state.fallbacks.append({"pass": "capture", "site": node_site(call), "graph": k, "reason": (
                f"the torch.utils.checkpoint region is left closed ({why}): the passes do not see inside it, "
                f"so what it computes runs as written")})
        if inlined and state.lowering == "eager" and not self._remat_on():
            state.fallbacks.append({"pass": "capture", "site": region, "graph": k, "reason": (
                "lowering='eager' without remat does not split the graph into forward and backward, so the "
                "torch.utils.checkpoint regions' activations are saved, not recomputed; the inductor lowering or "
                "remat=True recomputes them")})
        state.shapes.make_lowerable(captured)  # guard-free spellings of symbolic sizes (shapes.py, point 4)
        if (why := state.shapes.recompile_reason(k)) is not None:
            state.recompiles.append(why)
        state.shapes.learn(gm)  # which inputs carry rows / positions, for the next shape change
        guards = _shape_guards(gm)

        ctx = PassContext(graph_index=k, example_inputs=list(example_inputs))

        def on_pass(g: fx.GraphModule, r: PassResult) -> None:
            if r.error is not None:
                what = [f"FELL BACK: pass raised {r.error}; graph restored as before the pass"]
            else:
                what = [f"{len(r.rewrites)} rewrite(s); nodes {r.nodes_before} -> {r.nodes_after}",
                        "counters: " + (", ".join(f"{c}={v}" for c, v in sorted(r.counters.items())) or "none")]
                what += [f"  {x['op']} at {x['site']}" + "".join(
                    f" {k}={v}" for k, v in x.items() if k not in ("pass", "op", "site", "graph")) for x in r.rewrites]
            self._emit(k, r.index, r.name, g, [f"after pass {r.index}/{n_passes} '{r.name}'", *what])

        run_pipeline(gm, state.passes, ctx, on_pass=on_pass)
        state.shapes.make_lowerable(gm, ctx)  # after the passes: they read the user's spellings
        ctx.example_inputs = None  # the call's tensors: not kept past the compile
        state.rewrites += ctx.rewrites
        state.fallbacks += ctx.fallbacks
        state.counters.update(ctx.counters)
        for f in ctx.fallbacks:
            log.warning("grcompile graph %d: pass %s fell back at %s: %s", k, f["pass"], f["site"], f["reason"])
        if guards is not None and len(guards) > (n_guards := guards.n):
            # a pass compared symbolic sizes with ==/int()/bool(): the graph is specialised to them
            added = [str(g.expr) for g in guards.env.guards[n_guards:]]
            state.counters["passes.size_guards"] += len(added)
            log.warning("grcompile graph %d: the passes guarded on symbolic sizes (%s): this graph is specialised "
                        "to them and other sizes recompile", k, "; ".join(added))

        if state.dump_dir is not None:
            write_score_mods(state.dump_dir, k, gm)
        if state.lowering == "eager":
            # not split for an opened checkpoint region alone: AOTAutograd's nop-compiled backward
            # crashes on some graphs eager runs (a BatchNorm on a transposed input: a view of a
            # non-contiguous gradient, torch.compile(backend="aot_eager") too), so the regions'
            # activations are saved; remat, or the inductor lowering, recomputes them
            compiled = self._remat_eagerly(k, region, gm, example_inputs) if self._remat_on() else gm.forward
        else:
            compiled, transformed = self._lower(k, region, gm, captured, example_inputs)
            if not transformed:  # the graph as captured runs: no pass's check applies
                return compiled
        if ctx.preconditions:
            # exact only where the passes' run-time checks hold; elsewhere the captured graph runs
            return GuardedGraph(compiled, captured.forward, "the captured graph, eagerly",
                                ctx.preconditions, state, k, region)
        return compiled

    def _remat_on(self) -> bool:
        return self.state.remat_policy or self.state.remat_budget is not None

    def _remat_patch(self) -> dict[str, Any]:
        return {} if self.state.remat_budget is None else {"activation_memory_budget": self.state.remat_budget}

    def _save_draws_under_budget(self, gm: fx.GraphModule) -> bool:
        """Under a remat budget, the random draws outside checkpointed regions are saved, never
        recomputed (:func:`save_random_draws`); True when ``gm`` has any. Inductor must then run
        random ops as aten ops (``fallback_random``): its own random kernels, seeded in the joint
        graph, were recomputed with a fresh draw too (wrong gradients with ``remat=0.3``); a
        checkpointed region's draws are replayed from aten's RNG state either way."""
        if self.state.remat_budget is None:
            return False
        saved = save_random_draws(gm)
        self.state.counters["capture.random_draws_saved"] += saved
        return any(n.op in ("call_function", "call_method") and may_draw_random(n) for n in gm.graph.nodes)

    def _remat_eagerly(self, k: int, region: str, gm: fx.GraphModule,
                       example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """``lowering="eager"`` with ``remat``: AOTAutograd splits the graph into forward and
        backward with the min-cut partitioner (which reads the recompute tags and the budget) and
        both run as the graphs they are, without inductor. If AOTAutograd cannot trace the graph,
        it runs as is, and the report says that rematerialisation is off for it."""
        from functorch.compile import min_cut_rematerialization_partition, nop
        from torch._dynamo.backends.common import aot_autograd

        split = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=min_cut_rematerialization_partition,
                             keep_inference_input_mutations=True)
        self._save_draws_under_budget(gm)
        try:
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True, **self._remat_patch()):
                return split(gm, list(example_inputs))
        except Exception as exc:  # noqa: BLE001 - the policy: fall back, report, never crash
            if self.state.strict:
                raise
            log.debug("grcompile graph %d: AOTAutograd for remat failed", k, exc_info=True)
            self.state.unoptimized.append({"kind": "remat_error", "graph": k, "frame": region,
                                           "error": f"splitting the graph for rematerialisation raised "
                                                    f"{describe_error(exc)}",
                                           "site": region, "ran": "the transformed graph, saving every activation"})
            return gm.forward

    def _lower(self, k: int, region: str, gm: fx.GraphModule, captured: fx.GraphModule,
               example_inputs: Sequence[Any]) -> tuple[Callable[..., Any], bool]:
        """Inductor on the transformed graph; if that raises (and not ``strict``): inductor on the
        graph as captured, then the captured graph eagerly. Each step is reported. Returns the
        callable and whether it is the transformed graph."""
        from torch._inductor.compile_fx import compile_fx  # heavy import: only when lowering

        def lower(gm: fx.GraphModule) -> Callable[..., Any]:
            # the backward compiles now, not at the first backward(), so its failures land here too
            from ..lowering import preferred_backend
            # a kernel backend chosen by hand (GRCOMPILE_BACKEND / use_backend) changes what the
            # autograd formulas trace (gated_norm's backward op) without changing the caches' keys:
            # compile without the caches then, or a graph traced for another backend is reused
            forced = preferred_backend() != "auto"
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True, **self._remat_patch(),
                                               **({"enable_autograd_cache": False} if forced else {})):
                from .lowering_config import inductor_config  # scoped to this compile (and its backward)
                patches = {**inductor_config(), **({"fx_graph_cache": False} if forced else {}),
                           **({"fallback_random": True} if self._save_draws_under_budget(gm) else {})}
                return compile_fx(gm, list(example_inputs), config_patches=patches)

        pin_checks(gm)  # index checks run before any kernel reads the index
        try:
            return lower(gm), True
        except Exception as exc:  # noqa: BLE001 - the policy: fall back, report, never crash
            if self.state.strict:
                raise
            error = describe_error(exc)
            log.debug("grcompile graph %d: lowering the transformed graph failed", k, exc_info=True)
        try:
            compiled = lower(captured)
            ran = "the captured graph without grcompile's passes, lowered by inductor"
        except Exception as exc:  # noqa: BLE001
            log.debug("grcompile graph %d: lowering the captured graph failed", k, exc_info=True)
            compiled = captured.forward
            ran = f"the captured graph, eagerly (inductor failed on it too: {describe_error(exc)})"
        self.state.unoptimized.append({"kind": "lowering_error", "graph": k, "frame": region,
                                       "error": f"lowering the transformed graph raised {error}",
                                       "site": region, "ran": ran})
        return compiled, False

    def _emit(self, k: int, step: int, label: str, gm: fx.GraphModule, lines: list[str]) -> None:
        emit_artifact(k, step, label, gm)
        if self.state.dump_dir is not None:
            write_dump(self.state.dump_dir, k, step, label, gm, lines)


class _Guards:
    def __init__(self, env: Any) -> None:
        self.env, self.n = env, len(env.guards)

    def __len__(self) -> int:
        return len(self.env.guards)


def _shape_guards(gm: fx.GraphModule) -> _Guards | None:
    """The ShapeEnv of the graph's fake values and its guard count now."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            break
        value = node.meta.get("example_value")
        env = getattr(getattr(value, "fake_mode", None), "shape_env", None)
        if env is None and isinstance(value, torch.SymInt):
            env = value.node.shape_env
        if env is not None:
            return _Guards(env)
    return None


def _region_site(gm: fx.GraphModule) -> str:
    """Where the captured region starts in the user's code (its first op with a source line)."""
    first = next((n for n in gm.graph.nodes if n.op != "placeholder" and n.meta.get("stack_trace")), None)
    return node_site(first) if first is not None else "<graph>"


def _zero_size_input(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str | None:
    """``'ids' (int64[0, 16])`` for the first input with a zero-size dimension, else None."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor) and any(type(s) is int and s == 0 for s in value.shape):
            source = getattr(node.meta.get("grapharg"), "source", None)
            name = source.name if source is not None else node.name
            name = re.sub(r"^L\['([^']+)'\]", r"\1", name)  # L['ids'] -> ids, as the user spelled it
            return f"'{name}' ({describe_inputs([value])})"
    return None
