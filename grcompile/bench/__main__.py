"""``python -m grcompile.bench``: training-step benchmark of the compile modes, one subprocess per mode.

    python -m grcompile.bench --model hstu --preset small --max-len 1024 --batch-size 32 \\
        --modes eager,inductor,grcompile --steps 5 --warmup 1 \\
        --json docs/bench/hstu-small-1024.json --plot docs/bench/hstu-small-1024.png

Each mode runs ``python -m grcompile.bench.worker`` in a fresh process on the same seeded batches
and initial weights; a mode that fails is recorded with its error instead of stopping the run.
``--model path/to/file.py:factory`` benchmarks a user's model (grcompile/user_model.py).
See grcompile/bench/README.md for the JSON schema.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import inspect
from typing import Any

from grcompile.user_model import UserModelSpecError, is_user_spec, load_factory, load_user_model
from models import PRESETS

MODES = ("eager", "inductor", "grcompile")
RESULT_KEYS = ("step_ms", "peak_mem_mb", "tokens_per_s", "tflops")


def _remat_option(text: str) -> str | float:
    """``--remat`` (the selective policy) or ``--remat 0.4`` (a partitioner budget in (0, 1))."""
    if text == "selective":
        return text
    try:
        budget = float(text)
    except ValueError:
        budget = -1.0
    if not 0 < budget < 1:
        raise argparse.ArgumentTypeError(f"--remat takes no value or a budget in (0, 1), got {text!r}")
    return budget


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m grcompile.bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="hstu", metavar="{%s} | FILE.py:FACTORY" % ",".join(sorted(PRESETS)),
                   help="a built-in model, or a user's factory (grcompile/user_model.py)")
    p.add_argument("--preset", default=None, help="preset name (models/presets.py) of a built-in model (default: small)")
    p.add_argument("--max-len", type=int, default=None,
                   help="padded sequence length (default: the preset's, or the max_len default of a user's factory)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each worker")
    p.add_argument("--num-users", type=int, default=None,
                   help="synthetic users (default: max(512, 2 x batch x (warmup + steps)))")
    p.add_argument("--num-items", type=int, default=None, help="synthetic items (default: the generator's, 3000); "
                                                                  "a user's factory gets num_items= if it takes it")
    p.add_argument("--num-negatives", type=int, default=128)
    p.add_argument("--dropout", type=float, default=None,
                   help="override the preset's dropout (0 makes losses comparable across modes); "
                        "a user's factory gets dropout= if it takes it")
    p.add_argument("--pipeline", choices=("default", "attention", "jagged"), default="default",
                   help="grcompile's pass pipeline (default: grcompile.passes.default_pipeline(), the jagged one)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--checkpoint-blocks", action="store_true",
                   help="the built-in models train each block under torch.utils.checkpoint (every mode)")
    p.add_argument("--remat", nargs="?", const="selective", default=None, type=_remat_option, metavar="BUDGET",
                   help="grcompile mode: activation rematerialisation; alone: the per-block selective policy "
                        "(optimize(remat=True)); with a fraction in (0, 1): AOTAutograd's partitioner budget instead")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp8"), default="fp32",
                   help="bf16: every mode's forward under torch.autocast(bfloat16); fp8: the same, and the "
                        "grcompile mode's linears as FP8 GEMMs (optimize(precision='fp8'); emulated on CPU)")
    p.add_argument("--fp8-skip", default="",
                   help="with --precision fp8: comma-separated module-path parts whose linears stay bf16 "
                        "(e.g. 'output': the blocks' output projections)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per mode before it is killed")
    p.add_argument("--no-aot", dest="aot", action="store_false",
                   help="skip compiling, for sm_80 / sm_90, the Triton attention kernels of the variants the "
                        "grcompile mode ran (their registers, spills and tensor-core use go in the JSON)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a bar chart (PNG) here")
    args = p.parse_args(argv)
    args.model_spec = args.model if is_user_spec(args.model) else None
    if args.model_spec is not None:
        if args.preset is not None:
            p.error(f"--preset applies to the built-in models, not to {args.model!r}")
        if args.checkpoint_blocks:
            p.error(f"--checkpoint-blocks applies to the built-in models; {args.model!r} checkpoints as it is written")
        if args.max_len is None:
            args.max_len = _factory_default_max_len(p, args.model)
    elif args.model not in PRESETS:
        p.error(f"--model {args.model!r}: choose from {', '.join(sorted(PRESETS))} or give FILE.py:FACTORY")
    else:
        args.preset = args.preset or "small"
        if args.preset not in PRESETS[args.model]:
            p.error(f"--preset {args.preset!r} unknown; choose from {sorted(PRESETS[args.model])}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes {args.modes!r}: choose from {','.join(MODES)}")
    if len(set(modes)) != len(modes):
        p.error(f"--modes {args.modes!r} repeats a mode")
    args.modes = modes
    if args.max_len is None:
        args.max_len = PRESETS[args.model][args.preset]["max_len"]
    for name in ("max_len", "batch_size", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.model_spec is not None:  # fail here, once, with a usage error rather than in every worker
        from .worker import user_factory_kwargs

        try:
            load_user_model(args.model_spec, **user_factory_kwargs(vars(args)))
        except UserModelSpecError as exc:
            p.error(str(exc))
    return args


def _factory_default_max_len(p: argparse.ArgumentParser, spec: str) -> int:
    try:
        factory = load_factory(spec)
    except UserModelSpecError as exc:
        p.error(str(exc))
    try:
        default = inspect.signature(factory).parameters["max_len"].default
    except (KeyError, TypeError, ValueError):
        default = inspect.Parameter.empty
    if not isinstance(default, int) or isinstance(default, bool):
        p.error(f"--max-len is required: {spec} has no integer max_len default")
    return default


def _tail(text: str, lines: int = 30, chars: int = 4000) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])[-chars:]


def run_mode(config: dict[str, Any], mode: str, timeout: float | None = None, echo: bool = True) -> dict[str, Any]:
    """Run one worker subprocess; returns its result dict, or ``{"mode", "error", "returncode"}``.

    The worker's stderr is echoed live (when ``echo``) and its tail kept for the error record; the
    result is read from the worker's result file, else from the last line of its stdout.
    """
    with tempfile.TemporaryDirectory(prefix="grcompile-bench-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        cfg = dict(config, mode=mode, result_path=result_path)
        cmd = [sys.executable, "-m", "grcompile.bench.worker", json.dumps(cfg)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, bufsize=1)
        except OSError as exc:
            return {"mode": mode, "error": f"could not start worker: {exc}", "returncode": None}
        stderr_tail: collections.deque[str] = collections.deque(maxlen=200)
        stdout_lines: list[str] = []

        def pump_stderr() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                stderr_tail.append(line.rstrip("\n"))
                if echo:
                    sys.stderr.write(f"  | {line}")
                    sys.stderr.flush()

        def pump_stdout() -> None:
            assert proc.stdout is not None
            stdout_lines.extend(proc.stdout)

        readers = [threading.Thread(target=pump_stderr, daemon=True), threading.Thread(target=pump_stdout, daemon=True)]
        for reader in readers:
            reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait()
        for reader in readers:
            reader.join(timeout=10)
        stdout = "".join(stdout_lines)
        wall = time.perf_counter() - t0
        tail = _tail("\n".join(stderr_tail))
        if timed_out:
            return {"mode": mode, "error": f"timed out after {timeout} s\n{tail}", "returncode": None, "wall_s": wall}
        result = None
        if os.path.exists(result_path):
            try:
                with open(result_path) as f:
                    result = json.load(f)
            except (OSError, json.JSONDecodeError):
                result = None
        if result is None and stdout.strip():
            try:
                result = json.loads(stdout.strip().splitlines()[-1])
            except json.JSONDecodeError:
                result = None
        if proc.returncode != 0 or not isinstance(result, dict):
            return {"mode": mode, "error": tail or f"worker exited with {proc.returncode} and no result",
                    "returncode": proc.returncode, "wall_s": wall}
        result["wall_s"] = wall
        return result


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """speedup_vs_eager = eager step_ms / mode step_ms; mem_vs_eager = mode peak / eager peak."""
    eager = results.get("eager", {})
    out: dict[str, dict[str, float | None]] = {}
    for mode, r in results.items():
        ok = "error" not in r and "error" not in eager and eager
        speed = eager["step_ms"] / r["step_ms"] if ok and r.get("step_ms") else None
        mem = r["peak_mem_mb"] / eager["peak_mem_mb"] if ok and r.get("peak_mem_mb") and eager.get("peak_mem_mb") \
            else None
        out[mode] = {"speedup_vs_eager": speed, "mem_vs_eager": mem}
    return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def model_title(config: dict[str, Any]) -> str:
    """``hstu/small`` for a built-in model, the spec for a user's."""
    return config["model"] if config.get("preset") is None else f"{config['model']}/{config['preset']}"


def _aot_summary(records: list[dict[str, Any]]) -> str:
    """One line: per arch, the kernels compiled, their worst registers and spills, tensor cores."""
    parts = []
    for arch in sorted({r.get("arch") for r in records if r.get("arch")}):
        rs = [r for r in records if r.get("arch") == arch]
        ok = [r for r in rs if r.get("compiled")]
        parts.append(f"{arch} {len(ok)}/{len(rs)} compiled, max {max((r.get('registers') or 0) for r in ok) if ok else '-'} "
                     f"registers, {sum((r.get('spill_bytes') or 0) for r in ok)} B spilled, "
                     f"tensor cores in {sum(bool(r.get('tensor_cores')) for r in ok)}")
    skipped = [r for r in records if not r.get("arch")]
    if skipped:
        parts.append(f"{len(skipped)} variant(s) not compiled: {skipped[0].get('error', '')[:120]}")
    return "; ".join(parts)


def format_table(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [f"grcompile.bench: {model_title(c)}, max_len {c['max_len']}, batch {c['batch_size']}, "
             f"{c['steps']} timed steps after {c['warmup']} warmup, seed {c['seed']}"]
    header = (f"{'mode':<10} {'step ms':>10} {'p10-p90 ms':>17} {'compile s':>9} {'peak MB':>9} {'tok/s':>9} "
              f"{'TFLOP/s':>8} {'speedup':>8} {'mem':>6} {'act MB':>8} {'first loss':>11} {'last loss':>10}")
    lines += [header, "-" * len(header)]
    for mode, r in report["results"].items():
        if "error" in r:
            first = r["error"].strip().splitlines()[-1] if r["error"].strip() else "error"
            lines.append(f"{mode:<10} FAILED: {first[:150]}")
            continue
        rt = report["ratios"].get(mode, {})
        spread = f"{r['step_ms_p10']:.1f}-{r['step_ms_p90']:.1f}"
        lines.append(f"{mode:<10} {r['step_ms']:>10.1f} {spread:>17} {r['compile_s']:>9.1f} {r['peak_mem_mb']:>9.0f} "
                     f"{r['tokens_per_s']:>9.0f} {_fmt(r['tflops'], '.4f'):>8} {_fmt(rt.get('speedup_vs_eager'), '.2f'):>7}x "
                     f"{_fmt(rt.get('mem_vs_eager'), '.2f'):>5}x {_fmt(r.get('activation_mb'), '.1f'):>8} "
                     f"{r['first_loss']:>11.6f} {r['last_loss']:>10.6f}")
    ok = [r for r in report["results"].values() if "error" not in r]
    if ok:
        r0 = ok[0]
        flops = ("model FLOPs/step not counted (user model)" if r0.get("flops_per_step") is None
                 else f"model FLOPs/step {r0['flops_per_step'] / 1e9:.4g} GFLOP (valid tokens only)")
        lines.append(f"valid tokens/step {r0['valid_tokens_per_step']:.0f}, padding {r0['padding_fraction']:.1%}, "
                     f"{flops}, "
                     f"device {r0['device']}, torch {r0['torch_version']}, {r0['num_threads']} threads")
    for mode, r in report["results"].items():
        if r.get("aot"):
            lines.append(f"  {mode} Triton kernels, compiled ahead of time: " + _aot_summary(r["aot"]))
    for mode, r in report["results"].items():
        if "error" in r:
            lines.append(f"  {mode}: FAILED")
        else:
            text = r["description"]
            lines.append(f"  {text}" if text.startswith(f"{mode}:") else f"  {mode}: {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = dict(model=args.model, preset=args.preset, max_len=args.max_len, batch_size=args.batch_size,
                  steps=args.steps, warmup=args.warmup, seed=args.seed, threads=args.threads,
                  num_users=args.num_users, num_items=args.num_items, num_negatives=args.num_negatives,
                  dropout=args.dropout, pipeline=args.pipeline, device=args.device, dataset="synthetic",
                  model_spec=args.model_spec, aot=args.aot, precision=args.precision, remat=args.remat,
                  checkpoint_blocks=args.checkpoint_blocks,
                  fp8_skip=[p for p in args.fp8_skip.split(',') if p])
    if args.model_spec is not None:  # the user's make_batch makes the data; these do not apply
        config.update(num_users=None, num_negatives=None, dataset=f"{args.model_spec} make_batch")
    results: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        print(f"[grcompile.bench] running {mode} ...", file=sys.stderr, flush=True)
        results[mode] = run_mode(config, mode, timeout=args.timeout)
        r = results[mode]
        if "error" in r:
            print(f"[grcompile.bench] {mode} FAILED:\n{r['error']}", file=sys.stderr, flush=True)
        else:
            print(f"[grcompile.bench] {mode}: {r['step_ms']:.1f} ms/step, peak {r['peak_mem_mb']:.0f} MB "
                  f"({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    report = {"config": config, "results": results, "ratios": ratios(results)}
    print(format_table(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"[grcompile.bench] wrote {args.json}")
    if args.plot:
        from .plot import plot_report

        plot_report(report, args.plot)
        print(f"[grcompile.bench] wrote {args.plot}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
