"""Loss parity of two benchmark runs (bf16 vs fp32, remat vs not, ...): their per-step training
losses (the ``losses`` of one mode in each ``python -m grcompile.bench --json`` file) side by side.

    python -m grcompile.bench.parity fp32.json bf16.json --mode grcompile --plot parity.png

Prints, per run, the mean loss over the last ``--window`` steps and its standard error (step-to-step
spread over the window / sqrt(window)), and the gap between the runs in those standard errors; the
plot shows both curves (raw, faint) with their moving averages.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Optional


def run_losses(path: str, mode: str) -> tuple[str, list[float]]:
    """``(label, losses)`` of ``mode`` in the bench JSON at ``path``; label names its precision / remat."""
    report = json.loads(Path(path).read_text())
    result = report["results"].get(mode)
    if result is None or "losses" not in result:
        raise SystemExit(f"{path}: no losses for mode {mode!r} (modes: {', '.join(report['results'])})")
    label = f"{mode} {result.get('precision', 'fp32')}" + (" remat" if result.get("remat") else "") + \
        "".join(f" -{part}" for part in result.get("fp8_skip") or [])
    return label, [float(x) for x in result["losses"]]


def tail_stats(losses: list[float], window: int) -> tuple[float, float]:
    """Mean of the last ``window`` losses and its standard error."""
    tail = losses[-window:]
    spread = statistics.stdev(tail) if len(tail) > 1 else 0.0
    return statistics.fmean(tail), spread / math.sqrt(len(tail))


def moving_average(values: list[float], width: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def compare(runs: list[tuple[str, list[float]]], window: int) -> dict[str, Any]:
    stats = {label: tail_stats(losses, window) for label, losses in runs}
    (a, (ma, sa)), (b, (mb, sb)) = list(stats.items())[:2]
    gap = mb - ma
    se = math.hypot(sa, sb)
    return {"window": window, "runs": {k: {"mean": m, "stderr": s, "steps": len(dict(runs)[k])}
                                       for k, (m, s) in stats.items()},
            "gap": gap, "gap_in_stderr": gap / se if se else math.inf}


def plot(runs: list[tuple[str, list[float]]], path: str, width: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gap_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    averaged = []
    for (label, losses), color, style in zip(runs, ("#1f77b4", "#d62728", "#2ca02c", "#7f7f7f"), ("-", "--", ":", "-.")):
        ax.plot(losses, color=color, alpha=0.2, linewidth=0.6)
        averaged.append(moving_average(losses, width))
        ax.plot(averaged[-1], color=color, linestyle=style, label=f"{label} (moving average of {width})")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    # the curves overlap at this scale: their difference is what a reader wants to see
    steps = min(len(a) for a in averaged[:2])
    gap_ax.plot([averaged[1][i] - averaged[0][i] for i in range(steps)], color="#444444")
    gap_ax.axhline(0.0, color="#999999", linewidth=0.8)
    gap_ax.set_ylabel(f"{runs[1][0].split()[-1]} − {runs[0][0].split()[-1]}")
    gap_ax.set_xlabel("training step")
    gap_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m grcompile.bench.parity", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs=2, metavar="BENCH.json")
    p.add_argument("--mode", default="grcompile")
    p.add_argument("--window", type=int, default=200, help="last steps averaged")
    p.add_argument("--plot", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    runs = [run_losses(path, args.mode) for path in args.runs]
    result = compare(runs, args.window)
    for label, r in result["runs"].items():
        print(f"{label}: last {args.window} of {r['steps']} steps, loss {r['mean']:.4f} ± {r['stderr']:.4f}")
    print(f"gap {result['gap']:+.4f} = {result['gap_in_stderr']:+.2f} standard errors")
    if args.plot:
        plot(runs, args.plot, max(1, args.window // 4))
        print(f"wrote {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
