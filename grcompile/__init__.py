"""grcompile: a torch.compile compiler for generative-recommendation models.

    model = grcompile.optimize(model)    # same call signature; compiled lazily; trains
    print(grcompile.report(model))       # what each pass rewrote where, what fell back and why
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import torch

from .capture import LOWERINGS, GrcompileBackend, GrcompileState, GraphPass, PassContext, Report
from .capture.dump import resolve_dump_dir
from .capture.failures import CallScope, UnoptimizedWarning, input_signature

__version__ = "0.1.0"
__all__ = ["__version__", "optimize", "report", "Report", "GraphPass", "PassContext", "OPTIONS",
           "UnoptimizedWarning"]

# option -> default; dump_dir None means "$GRCOMPILE_DUMP_DIR if set".
OPTIONS: dict[str, Any] = {"dump_dir": None, "passes": None, "lowering": "inductor",
                           "dynamic": False, "fullgraph": False, "sparse": None, "strict": False,
                           "backend": None, "remat": None, "precision": None, "fp8_filter": None}
PRECISIONS = (None, "fp8")
# optimize(remat=True): ULTRA-HSTU's per-block policy (passes/remat_policy.py); a float in (0, 1)
# is instead a budget for AOTAutograd's partitioner (the fraction of activation bytes it may save)
REMAT_POLICIES = (True, "selective")

_STATE_ATTR = "_grcompile_state"


def _merge_options(options: dict[str, Any] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    options = dict(options or {})
    for key in options.keys() & kwargs.keys():
        if options[key] is not kwargs[key] and options[key] != kwargs[key]:
            raise ValueError(f"option {key!r} given twice with different values")
    options.update(kwargs)
    unknown = sorted(options.keys() - OPTIONS.keys())
    if unknown:
        raise ValueError(f"unknown grcompile option(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(sorted(OPTIONS))}")
    return {**OPTIONS, **options}


def optimize(model: torch.nn.Module, options: dict[str, Any] | None = None, **kwargs: Any) -> torch.nn.Module:
    """Return ``model`` compiled lazily by torch.compile with the grcompile backend.

    Options (as ``options={...}`` or keywords): ``dump_dir`` (default ``$GRCOMPILE_DUMP_DIR``),
    ``passes`` (``None`` -> ``grcompile.passes.default_pipeline()``, ``[]`` -> none, else a list of ``GraphPass``),
    ``lowering`` (``"inductor"`` or ``"eager"``: run the transformed graph as is),
    ``dynamic`` and ``fullgraph`` (passed to torch.compile), ``sparse`` (``None``: embeddings stay as
    written; a dict of ``grcompile.runtime.shard_embeddings`` keywords, e.g.
    ``{"backend": "torchrec", "sharding": "row"}``: the padded ``nn.Embedding`` lookups move to the
    sharded sparse runtime first — the model is rewritten in place — and only the dense part is compiled),
    ``strict`` (default ``False``: code that Dynamo cannot trace, or a graph the lowering cannot
    compile, runs unoptimized — the user's code eagerly, or the captured graph without the passes —
    with an ``UnoptimizedWarning`` and a ``report().unoptimized`` entry; ``True``: raise instead),
    ``backend`` (the kernels of grcompile's ops: ``None`` leaves the process's choice, i.e.
    ``$GRCOMPILE_BACKEND`` or ``"auto"`` — Triton on CUDA, Ascend on NPU, the reference on CPU;
    ``"triton"`` / ``"reference"`` / ``"ascend"`` set it for the process: ops pick their kernel when
    they run, and a training step's backward runs outside the module's call, so the choice cannot
    be per module. ``report()`` lists the kernels that ran),
    ``remat`` (``None`` / ``False``: off; ``True`` or ``"selective"``: ULTRA-HSTU's per-block
    selective rematerialisation — the ``remat_policy`` pass runs last and every block saves its
    input and its attention's output, recomputing the normed input, the input projection and its
    split in the backward; a float in (0, 1): instead a budget for AOTAutograd's min-cut
    partitioner, which saves at most that fraction of the activation bytes the graph would save and
    recomputes the cheapest rest. Values and gradients are unchanged; with ``lowering="eager"``
    AOTAutograd still splits forward and backward, without inductor),
    ``precision`` (``None``: the model's own — bf16 comes from its weights or ``torch.autocast``;
    ``"fp8"``: the ``fp8_linear`` pass runs last — linear layers become FP8 GEMMs with row-wise
    scales, fused with the norm before them and the residual after them; gradients stay in the
    model's precision. Not exact by design: values within e4m3 rounding, see docs/precision-memory.md),
    ``fp8_filter`` (with ``precision="fp8"``: ``filter(path) -> bool`` picks the linears that go
    FP8 by the dotted path of the module calling them, e.g. ``lambda p: not p.endswith("output")``;
    None: every aligned linear).
    """
    opts = _merge_options(options, kwargs)
    remat_budget, remat_policy = _remat(opts["remat"])
    from .lowering import BACKENDS, set_backend
    if opts["backend"] is not None and opts["backend"] not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {opts['backend']!r}")
    if opts["lowering"] not in LOWERINGS:
        raise ValueError(f"lowering must be one of {LOWERINGS}, got {opts['lowering']!r}")
    if opts["passes"] is None:
        from .passes import default_pipeline

        passes = default_pipeline()
    else:
        passes = list(opts["passes"])
        bad = [p for p in passes if not isinstance(p, GraphPass)]
        if bad:
            raise TypeError(f"passes must be GraphPass instances, got {bad!r}")
    passes = _with_precision(passes, opts["precision"], opts["fp8_filter"])
    if remat_policy or remat_budget is not None:
        from .passes.remat_policy import RematPolicy

        passes = [p for p in passes if not isinstance(p, RematPolicy)] + [RematPolicy(selective=remat_policy)]
    dump_dir: Path | None = resolve_dump_dir(opts["dump_dir"])
    sparse_plan = ""
    if opts["sparse"] is not None:
        from .runtime import shard_embeddings

        if not isinstance(opts["sparse"], dict):
            raise TypeError(f"sparse must be a dict of shard_embeddings options, got {type(opts['sparse']).__name__}")
        runtime = shard_embeddings(model, **opts["sparse"])
        sparse_plan = f"{opts['sparse'].get('backend', 'local')} sparse runtime (dedup {runtime.dedup}): " \
                      + runtime.plan.describe().replace("\n", "; ")
    state = GrcompileState(passes=passes, lowering=opts["lowering"], dump_dir=dump_dir, sparse_plan=sparse_plan,
                           strict=bool(opts["strict"]), remat_budget=remat_budget,
                           remat_policy=remat_policy)
    state.shapes.enabled = opts["dynamic"] is not True  # dynamic=True: every axis symbolic from the start
    if opts["sparse"] is not None:
        state.counters["sparse.features"] = len(runtime.plan.features)
        state.counters["sparse.tables"] = len(runtime.plan.tables)
    if opts["backend"] is not None:  # process-wide: set once every option is known to be valid
        set_backend(opts["backend"])
    compiled = torch.compile(model, backend=GrcompileBackend(state), dynamic=opts["dynamic"],
                             fullgraph=opts["fullgraph"])
    # The failure policy applies to calls of this model only (capture/failures.py).
    where = _where(model)
    if isinstance(compiled, torch.nn.Module):
        compiled.forward = _in_scope(compiled.forward, state, where)
    else:
        compiled = _in_scope(compiled, state, where)
    # object.__setattr__: OptimizedModule.__setattr__ would forward it to the wrapped model,
    # and report(original_model) must not pretend the original was optimized.
    object.__setattr__(compiled, _STATE_ATTR, state)
    return compiled


def _with_precision(passes: list[GraphPass], precision: Any, fp8_filter: Any = None) -> list[GraphPass]:
    """``passes`` plus the precision pass ``precision`` asks for (once, last)."""
    if precision not in PRECISIONS:
        hint = " (bf16: give the model bf16 weights or run it under torch.autocast; optimize keeps " \
               "the model's precision)" if precision in ("bf16", "fp16", "fp32") else ""
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}{hint}")
    if fp8_filter is not None and (precision != "fp8" or not callable(fp8_filter)):
        raise ValueError("fp8_filter must be a callable(path) -> bool and goes with precision='fp8'")
    if precision != "fp8":
        return passes
    from .passes.fp8_linear import Fp8Linear

    return [p for p in passes if not isinstance(p, Fp8Linear)] + [Fp8Linear(fp8_filter)]


def _remat(remat: Any) -> tuple[float | None, bool]:
    """``(partitioner budget or None, per-block policy on)`` for the ``remat`` option; checks it."""
    if remat is None or remat is False:
        return None, False
    policy = any(remat is p or (isinstance(remat, str) and remat == p) for p in REMAT_POLICIES)
    if not policy and (isinstance(remat, bool) or not isinstance(remat, (int, float)) or not 0 < remat < 1):
        raise ValueError(f"remat must be None, False, True, 'selective' or a budget in (0, 1), got {remat!r}")
    return (None, True) if policy else (float(remat), False)


def _where(model: Any) -> str:
    """``SASRec.forward (sasrec.py:40)``: the user's function, for report entries."""
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", type(model).__name__)
    return f"{name} ({Path(code.co_filename).name}:{code.co_firstlineno})" if code is not None else name


def _in_scope(fn: Callable[..., Any], state: GrcompileState, where: str) -> Callable[..., Any]:
    from .passes.decompose_attention import python_attention_paths

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with CallScope(state, input_signature(args, kwargs), where), state.shapes.call(state, args, kwargs), \
                python_attention_paths():  # nn.MultiheadAttention / TransformerEncoderLayer: the fusable path
            return fn(*args, **kwargs)

    return call


def report(optimized: Any) -> Report:
    """What grcompile did to ``optimized`` (a module returned by ``optimize``) so far."""
    state = vars(optimized).get(_STATE_ATTR) if hasattr(optimized, "__dict__") else None
    if not isinstance(state, GrcompileState):
        raise TypeError(f"grcompile.report() needs a module returned by grcompile.optimize(), "
                        f"got {type(optimized).__name__}")
    return state.report()
