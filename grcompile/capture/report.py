"""``Report``: what the pipeline did to a compiled module, as data (``to_dict`` / ``to_json``)
and as a table for people (``str``)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .failures import unoptimized_message

__all__ = ["Report"]


@dataclass
class Report:
    rewrites: list[dict[str, Any]] = field(default_factory=list)   # {pass, op, site, graph}
    fallbacks: list[dict[str, Any]] = field(default_factory=list)  # {pass, site, reason, graph}
    compiles: int = 0          # graphs handed to the backend (recompiles included)
    graph_breaks: int = 0      # Dynamo graph breaks since optimize()
    counters: dict[str, int] = field(default_factory=dict)         # "<pass>.<what>" -> count
    passes: list[str] = field(default_factory=list)                # pipeline, in order
    lowering: str = "inductor"
    graph_break_reasons: dict[str, int] = field(default_factory=dict)
    sparse_plan: str = ""  # embeddings moved to the sparse runtime, if any
    remat_budget: float | None = None  # optimize(remat=<float>), if on
    remat_policy: bool = False  # optimize(remat=True): per-block selective rematerialisation
    # what ran without grcompile and why: {kind, graph, frame, error, site, ran} (+ calls, shapes
    # for kind "recompile_limit"); kinds: trace_error, lowering_error, recompile_limit, zero_size
    unoptimized: list[dict[str, Any]] = field(default_factory=list)
    # why each compile after the first happened: {graph, reason} (capture/shapes.py)
    recompiles: list[dict[str, Any]] = field(default_factory=list)
    # grcompile ops run so far in this process, per kernel backend: {op: {backend: calls}}, and
    # why an op ran its reference instead of the device's kernel (one sentence each)
    kernels: dict[str, dict[str, int]] = field(default_factory=dict)
    kernel_fallbacks: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=indent, default=str)

    def __str__(self) -> str:
        lines = [
            f"grcompile report: {self.compiles} graph(s) compiled, {len(self.passes)} pass(es) in "
            f"pipeline, {len(self.rewrites)} rewrite(s), {len(self.fallbacks)} fallback(s), "
            f"{self.graph_breaks} graph break(s)"
            + (f", {len(self.unoptimized)} unoptimized" if self.unoptimized else "")
        ]
        if not self.passes:
            lines.append("no passes in the pipeline: the graph is lowered unchanged")
        else:
            lines.append(f"pipeline: {' -> '.join(self.passes)}; lowering: {self.lowering}")
            if not self.rewrites and not self.fallbacks:
                lines.append("no pass fired")
        for r in self.rewrites:
            lines.append(f"  rewrite   graph {r.get('graph', '?')}  {r['pass']}: {r['op']}  at {r['site']}")
        for f in self.fallbacks:
            lines.append(f"  fallback  graph {f.get('graph', '?')}  {f['pass']}  at {f['site']}: {f['reason']}")
        for u in self.unoptimized:
            lines.append("  unoptimized  " + unoptimized_message(u).removeprefix("grcompile: "))
        for r in self.recompiles:
            lines.append(f"  recompile graph {r['graph']}: {r['reason']}")
        if self.sparse_plan:
            lines.append(f"sparse: {self.sparse_plan}")
        if self.remat_policy:
            lines.append("remat: per block, the normed input, the input projection and its split are recomputed in "
                         "the backward (remat_policy tags them; AOTAutograd's partitioner saves none of them)")
        if self.remat_budget is not None:
            lines.append(f"remat: saved activations capped at {self.remat_budget:g} of what the graph would save; "
                         "AOTAutograd's min-cut partitioner recomputes the rest in the backward")
        if self.kernels:
            lines.append("kernels run (this process): " + "; ".join(
                f"{op}: " + ", ".join(f"{b} x{n}" for b, n in sorted(calls.items()))
                for op, calls in sorted(self.kernels.items())))
        for why in self.kernel_fallbacks:
            lines.append(f"  kernel fallback  {why}")
        if self.counters:
            lines.append("counters: " + ", ".join(f"{k}={v}" for k, v in sorted(self.counters.items())))
        for reason, n in sorted(self.graph_break_reasons.items()):
            lines.append(f"  graph break x{n}: {reason}")
        return "\n".join(lines)
