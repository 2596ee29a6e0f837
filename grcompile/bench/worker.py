"""One compile mode of the benchmark, run in its own process (``python -m grcompile.bench.worker``).

Input: a JSON config as the first argument (or on stdin when there is none / it is ``-``).
Output: one JSON line on stdout (the last line), and the same JSON written to
``config["result_path"]`` when given. Everything else goes to stderr.

Every mode builds the same data (same seed → same synthetic dataset, same batches) and the same
initial weights (``torch.manual_seed(seed)`` right before the model is built, and again right
before the first step so dropout draws the same stream in eager), then applies the compile mode
to the ``SampledSoftmaxRetrieval`` module and runs ``warmup + steps`` training steps of
``zero_grad → loss forward → backward → Adam step``, each timed with ``time.perf_counter``; with
``precision="bf16"`` the loss forward runs under ``torch.autocast(bfloat16)`` in every mode;
``"fp8"`` too, and the grcompile mode also gets ``optimize(precision="fp8")`` (its linears run as
FP8 GEMMs — emulated on CPU; eager and inductor have no FP8 and stay bf16).

A ``model`` of the form ``path/to/file.py:factory`` is a user's model (grcompile/user_model.py):
the worker loads it itself (``max_len``, and ``num_items`` / ``dropout`` when given, go to the
factory when it takes them), step ``i`` runs on ``user.batch(batch_size, max_len, seed + i)``,
and the compiled module is ``StepLoss(user)`` (forward + ``user.step_loss``).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

PRECISIONS = ("fp32", "bf16", "fp8")

DEFAULTS: dict[str, Any] = dict(model="hstu", preset="small", max_len=1024, batch_size=32, steps=5, warmup=2,
                                seed=0, threads=None, num_users=None, num_items=None, num_negatives=128,
                                dropout=None, lr=1e-3, temperature=0.05, device="cpu", mode="eager",
                                result_path=None, aot=True, precision="fp32", remat=None, checkpoint_blocks=False)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _proc_status_mb(field: str) -> float | None:
    """A memory field of /proc/self/status (``VmHWM``, ``VmRSS``) in MB (MiB); None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def peak_rss_mb() -> float | None:
    """Peak resident set size of this process (VmHWM), MB (MiB)."""
    peak = _proc_status_mb("VmHWM")
    if peak is not None:
        return peak
    try:  # non-Linux fallback
        import resource

        scale = 1024.0 * 1024.0 if sys.platform == "darwin" else 1024.0
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale
    except Exception:  # pragma: no cover
        return None


def current_rss_mb() -> float | None:
    return _proc_status_mb("VmRSS")


def apply_mode(module: Any, mode: str, pipeline: str = "default", remat: Any = None,
               fp8: bool = False, fp8_skip: tuple[str, ...] = ()) -> tuple[Any, Any]:
    """Returns (compiled module, describe() -> str); ``pipeline`` picks grcompile's passes,
    ``remat`` is grcompile's ``optimize(remat=...)`` (``"selective"``: the per-block policy, a float:
    the partitioner's budget; falsy: off), ``fp8`` its FP8 GEMMs (but not
    for the linears whose module path contains one of ``fp8_skip``)."""
    from grcompile.modes import apply_compile_mode, describe_mode
    from grcompile.passes import PIPELINES

    options = {"passes": PIPELINES[pipeline](), **({"remat": True if remat == "selective" else remat} if remat else {}),
               **({"precision": "fp8"} if fp8 else {}),
               **({"fp8_filter": lambda path: not any(part in path for part in fp8_skip)} if fp8 and fp8_skip else {})} \
        if mode == "grcompile" else {}
    compiled = apply_compile_mode(module, mode, **options)
    extras = ((f" + remat (budget {remat})" if isinstance(remat, float) else " + remat") if remat else "") + (" + fp8" if fp8 else "") + \
        (f" (not {', '.join(fp8_skip)})" if fp8 and fp8_skip else "") if mode == "grcompile" else ""
    return compiled, (lambda: describe_mode(compiled) + extras)


def saved_activation_bytes(step_fn: Any, inputs: tuple, autocast: Any) -> int:
    """Bytes one forward saves for its backward (every tensor autograd saves, once per save; views
    of one buffer count each time): the activation memory a training step holds at its peak."""
    import torch

    saved = []

    def pack(t: Any) -> Any:
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        loss = step_fn(*inputs)
    del loss
    return sum(saved)


def batches(cfg: dict[str, Any], needed: int) -> tuple[list[dict[str, Any]], int]:
    """The first ``needed`` batches of the seeded synthetic loader (epochs cycled if short)."""
    from grcompile.data import TrainLoader, get_dataset

    synthetic = {k: cfg[k] for k in ("num_users", "num_items") if cfg.get(k) is not None}
    if "num_users" not in synthetic:
        synthetic["num_users"] = max(512, 2 * cfg["batch_size"] * needed)
    ds = get_dataset("synthetic", max_len=cfg["max_len"], seed=cfg["seed"], **synthetic)
    split = ds.leave_one_out()
    loader = TrainLoader(split.train, cfg["batch_size"], cfg["max_len"], ds.num_items,
                         num_negatives=cfg["num_negatives"], seed=cfg["seed"])
    out: list[dict[str, Any]] = []
    epoch = 0
    while len(out) < needed:
        for batch in loader.iterate(epoch):
            out.append(batch)
            if len(out) == needed:
                break
        epoch += 1
    return out, ds.num_items


@dataclass
class Workload:
    """What one mode trains: ``task(*inputs[i])`` is the loss of step ``i``."""
    task: Any  # torch.nn.Module
    inputs: list[tuple]
    valid_tokens: list[int]  # per step
    shape: tuple[int, int]  # (B, N) of the padded batch
    forward_flops: list[dict[str, int]] | None  # per step (analytic, valid tokens); None: not counted
    fields: dict[str, Any]  # result fields of this kind of model (num_items, model_config)


def builtin_workload(cfg: dict[str, Any], device: Any, total_steps: int) -> Workload:
    """``SampledSoftmaxRetrieval`` over a model of models/ on the seeded synthetic loader."""
    import torch

    from grcompile.bench.flops import forward_flops, valid_lengths
    from models import SampledSoftmaxRetrieval, build_encoder

    data, num_items = batches(cfg, total_steps)
    data = [{k: v.to(device) for k, v in b.items()} for b in data]
    torch.manual_seed(int(cfg["seed"]))
    encoder = build_encoder(cfg["model"], cfg["preset"], num_items, max_len=cfg["max_len"], dropout=cfg["dropout"],
                            checkpoint_blocks=cfg["checkpoint_blocks"] or None)
    task = SampledSoftmaxRetrieval(encoder, temperature=cfg["temperature"]).to(device)
    lengths = [valid_lengths(b["ids"].cpu(), encoder.config.pad_id) for b in data]
    return Workload(task, [(b["ids"], b["timestamps"], b["negatives"]) for b in data], [sum(ls) for ls in lengths],
                    tuple(data[0]["ids"].shape), [forward_flops(encoder.config, ls, cfg["num_negatives"]) for ls in lengths],
                    {"num_items": num_items, "model_config": encoder.config.to_dict()})


def user_factory_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """What a user's factory is offered (it gets those its signature takes): ``max_len``, and
    ``num_items`` / ``dropout`` when set on the command line."""
    return {"max_len": cfg["max_len"], **{k: cfg[k] for k in ("num_items", "dropout") if cfg.get(k) is not None}}


def user_workload(cfg: dict[str, Any], device: Any, total_steps: int) -> Workload:
    """A user's ``file.py:factory``: step ``i`` on ``user.batch(B, N, seed + i)``; valid tokens
    from ``user.valid`` (every position when it is None); FLOPs are not counted."""
    import torch

    from grcompile.user_model import StepLoss, load_user_model

    seed, B, N = int(cfg["seed"]), int(cfg["batch_size"]), int(cfg["max_len"])
    kwargs = user_factory_kwargs(cfg)
    torch.manual_seed(seed)
    user = load_user_model(cfg["model"], **kwargs)
    inputs = [tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in user.batch(B, N, seed + i))
              for i in range(total_steps)]
    tokens = [int(user.valid(*args).sum()) if user.valid is not None else B * N for args in inputs]
    task = StepLoss(user).to(device)
    config = {"spec": cfg["model"], "name": user.name, "module": type(user.module).__name__,
              "parameters": sum(p.numel() for p in user.module.parameters()), "factory_kwargs": kwargs}
    return Workload(task, inputs, tokens, (B, N), None, {"num_items": cfg.get("num_items"), "model_config": config})


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    pos = (len(values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch

    from grcompile.bench.flops import TRAINING_MULTIPLIER
    from grcompile.user_model import is_user_spec

    cfg = {**DEFAULTS, **cfg}
    mode, seed = cfg["mode"], int(cfg["seed"])
    if cfg["steps"] < 1:
        raise ValueError("steps must be >= 1")
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    device = torch.device(cfg["device"])
    cuda = device.type == "cuda"

    total_steps = int(cfg["warmup"]) + int(cfg["steps"])
    workload = (user_workload if is_user_spec(cfg["model"]) else builtin_workload)(cfg, device, total_steps)
    task = workload.task
    task.train()
    optimizer = torch.optim.Adam(task.parameters(), lr=cfg["lr"])
    if cfg["precision"] not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {cfg['precision']!r}")
    step_fn, describe = apply_mode(task, mode, cfg.get("pipeline", "default"), cfg.get("remat") or None,
                                   fp8=cfg["precision"] == "fp8", fp8_skip=tuple(cfg.get("fp8_skip") or ()))
    half = cfg["precision"] in ("bf16", "fp8")  # fp8: bf16 autocast around the FP8 GEMMs (eager, inductor: bf16)

    rss_before = current_rss_mb()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    torch.manual_seed(seed)
    times, losses = [], []
    for i, inputs in enumerate(workload.inputs):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
            loss = step_fn(*inputs)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        log(f"[bench.worker] {mode} step {i + 1}/{total_steps}: {times[-1] * 1e3:.1f} ms, loss {losses[-1]:.6f}, "
            f"peak RSS {peak_rss_mb():.0f} MB")

    activation_bytes = saved_activation_bytes(
        step_fn, workload.inputs[-1],
        lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=half))
    blocks = (workload.fields.get("model_config") or {}).get("num_blocks")
    timed = times[cfg["warmup"]:] if len(times) > cfg["warmup"] else times
    first_timed = len(times) - len(timed)
    median_s = statistics.median(timed)
    B, N = workload.shape
    tokens = workload.valid_tokens[first_timed:]
    mean_tokens = sum(tokens) / len(tokens)
    mean_flops: float | None = None
    breakdown: dict[str, float] | None = None
    if workload.forward_flops is not None:
        parts = workload.forward_flops[first_timed:]
        breakdown = {k: TRAINING_MULTIPLIER * sum(p[k] for p in parts) / len(parts) for k in parts[0]}
        mean_flops = breakdown["total"]
    rss_peak = peak_rss_mb()
    cuda_peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    aot = _aot_figures() if mode == "grcompile" and cfg.get("aot") else None

    return {
        "mode": mode,
        "precision": cfg["precision"],
        "fp8_skip": list(cfg.get("fp8_skip") or []) if cfg["precision"] == "fp8" and mode == "grcompile" else [],
        "description": describe(),
        "step_ms": median_s * 1e3,
        "step_ms_p10": _percentile(timed, 0.1) * 1e3,
        "step_ms_p90": _percentile(timed, 0.9) * 1e3,
        "step_ms_all": [t * 1e3 for t in times],
        "compile_s": times[0],
        "timed_steps": len(timed),
        "peak_mem_mb": cuda_peak if cuda else rss_peak,
        "activation_mb": activation_bytes / 2**20,
        "activation_mb_per_block": activation_bytes / 2**20 / blocks if blocks else None,
        "remat": (cfg.get("remat") or False) if mode == "grcompile" else False,
        "peak_rss_mb": rss_peak,
        "rss_before_steps_mb": rss_before,
        "cuda_max_allocated_mb": cuda_peak,
        "tokens_per_s": mean_tokens / median_s,
        "valid_tokens_per_step": mean_tokens,
        "padding_fraction": 1.0 - mean_tokens / (B * N),
        "flops_per_step": mean_flops,
        "flops_breakdown_per_step": breakdown,
        "tflops": None if mean_flops is None else mean_flops / median_s / 1e12,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "losses": losses,
        "device": str(device) if not cuda else f"{device} ({torch.cuda.get_device_name(device)})",
        "torch_version": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "aot": aot,
        "tuned_tiles": _tuned_tiles() if cuda and mode == "grcompile" else None,
        **workload.fields,
    }


def _tuned_tiles() -> list[dict[str, Any]]:
    """The attention kernels' autotuned tiles of this run, with every trial's time."""
    from grcompile.lowering.attention.triton import tuned_tiles
    return tuned_tiles()


def _aot_figures() -> list[dict[str, Any]] | None:
    """The Triton attention kernels of the variants this run used, compiled for sm_80 / sm_90
    (after the timed steps: not part of any timing). Never fails the benchmark."""
    from grcompile.lowering.attention import SEEN_VARIANTS
    from grcompile.lowering.attention_aot_spec import compile_seen

    if not SEEN_VARIANTS:
        return None
    log(f"[bench.worker] compiling the Triton kernels of {len(SEEN_VARIANTS)} attention variant(s) for sm_80/sm_90")
    try:
        return compile_seen(dict(SEEN_VARIANTS))
    except Exception as error:  # noqa: BLE001 - figures, not the benchmark
        return [{"kernel": "jagged_attention", "compiled": False, "error": f"{type(error).__name__}: {error}"}]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = argv[0] if argv and argv[0] != "-" else sys.stdin.read()
    cfg = json.loads(text)
    result = run(cfg)
    line = json.dumps(result)
    if cfg.get("result_path"):
        tmp = cfg["result_path"] + ".part"
        with open(tmp, "w") as f:
            f.write(line)
        os.replace(tmp, cfg["result_path"])
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
