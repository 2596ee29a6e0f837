"""The torch.compile backend: capture -> ordered pass pipeline -> lowering.

Dynamo hands the backend one FX graph per captured region (pre-autograd torch IR: torch
functions, parameters as ``l_self_modules_..._parameters_weight_`` placeholders). We number it,
dump it, run the pipeline in place, dump after each pass, then lower the *transformed* module:
``inductor`` via ``compile_fx`` (which also builds the backward through AOTAutograd, so training
sees the rewrites), ``eager`` by running the transformed ``gm.forward`` under ordinary autograd.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .dump import describe_inputs, emit_artifact, write_dump, write_score_mods
from .pass_manager import GraphPass, PassContext, PassResult, pass_name, run_pipeline
from .report import Report

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

    def report(self) -> Report:
        grown = _graph_break_counts()
        grown.subtract(self.graph_breaks_at_start)
        reasons = {k: v for k, v in grown.items() if v > 0}
        return Report(rewrites=list(self.rewrites), fallbacks=list(self.fallbacks),
                      compiles=self.compiles, graph_breaks=sum(reasons.values()),
                      counters=dict(self.counters), passes=[pass_name(p) for p in self.passes],
                      lowering=self.lowering, graph_break_reasons=reasons, sparse_plan=self.sparse_plan)


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

        ctx = PassContext(graph_index=k)

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
        state.rewrites += ctx.rewrites
        state.fallbacks += ctx.fallbacks
        state.counters.update(ctx.counters)
        for f in ctx.fallbacks:
            log.warning("grcompile graph %d: pass %s fell back at %s: %s", k, f["pass"], f["site"], f["reason"])

        if state.dump_dir is not None:
            write_score_mods(state.dump_dir, k, gm)
        if state.lowering == "eager":
            return gm.forward
        from torch._inductor.compile_fx import compile_fx  # heavy import: only when lowering

        return compile_fx(gm, list(example_inputs))

    def _emit(self, k: int, step: int, label: str, gm: fx.GraphModule, lines: list[str]) -> None:
        emit_artifact(k, step, label, gm)
        if self.state.dump_dir is not None:
            write_dump(self.state.dump_dir, k, step, label, gm, lines)
