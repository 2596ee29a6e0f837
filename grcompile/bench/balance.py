"""``python -m grcompile.bench.balance``: load balance across data-parallel ranks on synthetic
long-tail sequence lengths, per balancing method (issue 13; docs/load-balancing.md).

    python -m grcompile.bench.balance --json docs/bench/balance.json --plot docs/bench/balance.png \\
        --measure-steps 6

Methods (every step draws the next ``--batch-size`` rows of a seeded per-epoch permutation, as
TrainLoader does; token-aware batching cuts the same stream by a token budget instead):

* ``equal``            equal row slices (``Parallel.local``, the baseline)
* ``realloc_tokens``   global token reallocation, balancing tokens (``assign_rows(cost="tokens")``)
* ``realloc_cost``     global token reallocation, balancing the model's ``a·n + b·n²`` FLOPs
* ``token_batching``   token-aware dynamic batching, budget = mean length × rows per rank
* ``cost_batching``    the same cut by a cost budget (mean cost × rows per rank) instead of tokens
* ``sl``               equal slices + HSTU stochastic length (the baseline LBSL replaces)
* ``lbsl``             equal slices + load-balanced stochastic length

Per method and step: valid tokens and estimated cost (training FLOPs of ``--model/--preset``)
per rank. Reported, averaged over steps: the max − min token count across ranks (and its maximum
over steps), max/min rank cost, and the **modelled** share of step time the ranks wait at the
gradient all-reduce, ``1 − mean/max`` of the per-rank cost (step time ∝ cost, communication
ignored). ``sl`` / ``lbsl`` change the data (they cut sequences): compare them with each other,
over the steps after LBSL's warm-up.

``--measure-steps K`` also *measures* the wait: ``--world`` gloo processes on loopback (one
thread each), each running forward + backward of a small HSTU over its rows of the first K
steps, one row at a time (so the compute follows ``a·n + b·n²`` like a jagged kernel, not the
padded batch), then timing ``dist.all_reduce`` of the dense gradients. The wait of a rank is the
first all-reduce's time minus a second, already synchronised one. On a machine with fewer cores
than ranks the processes share cores (a rank that waits frees its core for the others), so the
measured wait is noisy and understates the imbalance; the report prints the cores seen.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from typing import Any, Optional

import numpy as np

from grcompile.bench.flops import preset_sequence_cost
from grcompile.data.balance import SequenceCost, assign_rows, equal_slices, imbalance
from grcompile.data.stochastic_length import LoadBalancedStochasticLength, stochastic_length
from grcompile.data.token_batching import plan_epoch

METHODS = ("equal", "realloc_tokens", "realloc_cost", "token_batching", "cost_batching", "sl", "lbsl")
MEASURED_METHODS = ("equal", "realloc_tokens", "realloc_cost", "realloc_timed", "token_batching")
# the small HSTU of the measurement (dropout 0, so every rank's work depends on its rows only)
MEASURE_MODEL = dict(embedding_dim=32, num_blocks=1, num_heads=2, attention_dim=16, linear_dim=16, dropout=0.0)
MEASURE_NEGATIVES = 16


def synthetic_lengths(num_users: int, max_len: int, seed: int = 0, tail_share: float = 0.2) -> np.ndarray:
    """Long-tail lengths: ``1 − tail_share`` log-normal (median 120, σ 0.9), ``tail_share``
    64 × Zipf(1.5); at least 2 tokens, capped at ``max_len``."""
    rng = np.random.default_rng((seed, 7))
    body = rng.lognormal(math.log(120), 0.9, num_users)
    tail = 64.0 * rng.zipf(1.5, num_users)
    lengths = np.where(rng.random(num_users) < tail_share, tail, body)
    return np.clip(lengths.astype(np.int64), 2, max_len)


def global_batches(num_users: int, batch_size: int, steps: int, seed: int) -> list[np.ndarray]:
    """Row indices of ``steps`` global batches: consecutive slices of per-epoch permutations."""
    out, epoch = [], 0
    while len(out) < steps:
        order = np.random.default_rng((seed, epoch)).permutation(num_users)
        out += [order[s:s + batch_size] for s in range(0, num_users - batch_size + 1, batch_size)]
        epoch += 1
    return out[:steps]


def method_plans(lengths: np.ndarray, world: int, batch_size: int, steps: int, cost: SequenceCost, *,
                 seed: int, max_len: int, alpha: float, gamma: float, warmup: int, recalibrate: int,
                 methods: tuple[str, ...] = METHODS, extra_costs: Optional[dict[str, Any]] = None,
                 ) -> dict[str, list[list[np.ndarray]]]:
    """Per method: ``plan[step][rank]`` = the valid lengths of the rank's rows (after SL / LBSL)."""
    batches = global_batches(len(lengths), batch_size, steps, seed)
    plans: dict[str, list[list[np.ndarray]]] = {}
    costs = {"realloc_tokens": "tokens", "realloc_cost": cost, **{f"realloc_{k}": v for k, v in (extra_costs or {}).items()}}
    for method in methods:
        if method == "equal":
            plans[method] = [[lengths[b][r.numpy()] for r in equal_slices(len(b), world)] for b in batches]
        elif method in costs:
            plans[method] = [[lengths[b][r.numpy()] for r in assign_rows(lengths[b], world, costs[method])] for b in batches]
        elif method in ("token_batching", "cost_batching"):
            unit = "tokens" if method == "token_batching" else cost
            budget = float(np.mean(SequenceCost.tokens()(lengths) if unit == "tokens" else unit(lengths))) * batch_size / world
            plan, epoch = [], 0
            while len(plan) < steps:
                plan += plan_epoch(lengths, world, budget, seed=seed, epoch=epoch, cost=unit)
                epoch += 1
            plans[method] = [[lengths[rows] for rows in step] for step in plan[:steps]]
        elif method == "sl":
            plans[method] = [[stochastic_length(lengths[b][r.numpy()], max_len, alpha, np.random.default_rng((seed, 11, s, k)))
                              for k, r in enumerate(equal_slices(len(b), world))] for s, b in enumerate(batches)]
        elif method == "lbsl":
            lbsl = LoadBalancedStochasticLength(world, max_len, alpha, gamma, warmup, recalibrate, seed)
            plans[method] = [lbsl.lengths(s, [lengths[b][r.numpy()] for r in equal_slices(len(b), world)])
                             for s, b in enumerate(batches)]
        else:
            raise ValueError(f"unknown method {method!r}")
    return plans


def summarize(plan: list[list[np.ndarray]], cost: SequenceCost, skip: int = 0) -> dict[str, float]:
    steps = plan[skip:]
    tokens = np.array([[n.sum() for n in step] for step in steps], dtype=np.float64)
    loads = [np.array([cost(n).sum() for n in step]) for step in steps]
    stats = [imbalance(x) for x in loads]
    rows = np.array([[len(n) for n in step] for step in steps])
    return {
        "steps": len(steps),
        "token_spread_mean": float((tokens.max(1) - tokens.min(1)).mean()),
        "token_spread_max": float((tokens.max(1) - tokens.min(1)).max()),
        "tokens_per_step": float(tokens.sum(1).mean()),
        "rows_per_step": float(rows.sum(1).mean()),
        "rows_spread_mean": float((rows.max(1) - rows.min(1)).mean()),
        "cost_max_over_min_mean": float(np.mean([s["max_over_min"] for s in stats])),
        "wait_share_modelled": float(np.mean([s["wait_share"] for s in stats])),
        "step_cost_max_mean": float(np.mean([x.max() for x in loads])),
    }


class TimedCost:
    """Per-sequence cost interpolated (piecewise linear) through measured seconds at some lengths."""

    def __init__(self, lengths: list[int], seconds: list[float]) -> None:
        self.lengths, self.seconds = list(lengths), list(seconds)

    def __call__(self, lengths: Any) -> np.ndarray:
        return np.interp(np.asarray(lengths, dtype=np.float64), self.lengths, self.seconds)


# -- measured wait (gloo ranks) ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_task(max_len: int):
    import torch

    from models import SampledSoftmaxRetrieval, build_encoder

    torch.manual_seed(0)
    encoder = build_encoder("hstu", "tiny", 1000, max_len=max_len, **MEASURE_MODEL)
    return SampledSoftmaxRetrieval(encoder)


def _row_step(task, n: int, rng: np.random.Generator) -> None:
    import torch

    ids = torch.from_numpy(rng.integers(1, 1001, (1, n)))
    ts = torch.arange(n).unsqueeze(0) * 60
    negatives = torch.from_numpy(rng.integers(1, 1001, (1, MEASURE_NEGATIVES)))
    task(ids, ts, negatives).backward()


def time_rows(max_len: int, lengths: list[int], repeats: int = 2) -> list[float]:
    """Seconds of forward + backward of one row of each length (one thread; the fastest of ``repeats``)."""
    import torch

    torch.set_num_threads(1)
    task, rng = _build_task(max_len), np.random.default_rng(0)
    _row_step(task, 16, rng)
    out = []
    for n in lengths:
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            _row_step(task, int(n), rng)
            best = min(best, time.perf_counter() - t0)
        out.append(best)
    return out


def measure_serial(plans: dict[str, list[list[np.ndarray]]], max_len: int, warmup_steps: int = 1,
                   repeats: int = 2) -> dict[str, Any]:
    """Each rank's rows timed in this process, one rank after the other (one thread, no sharing;
    the fastest of ``repeats`` runs, against other load on the machine): the wait share
    ``1 − mean/max`` of the measured per-rank compute, per step."""
    import torch

    torch.set_num_threads(1)
    task, rng = _build_task(max_len), np.random.default_rng(5)
    out = {}
    for method, plan in plans.items():
        shares, tops = [], []
        for step, ranks in enumerate(plan):
            compute = []
            for rows in ranks:
                best = math.inf
                for _ in range(repeats if step >= warmup_steps else 1):
                    task.zero_grad(set_to_none=True)
                    t0 = time.perf_counter()
                    for n in rows:
                        _row_step(task, int(n), rng)
                    best = min(best, time.perf_counter() - t0)
                compute.append(best)
            if step >= warmup_steps:
                shares.append(1 - float(np.mean(compute)) / max(compute))
                tops.append(1e3 * max(compute))
        out[method] = {"wait_share": float(np.mean(shares)), "step_ms": float(np.mean(tops))}
    return out


def _measure_worker(rank: int, world: int, port: int, max_len: int, plans: dict, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    task = _build_task(max_len)
    params = [p for p in task.parameters() if p.requires_grad]
    rng = np.random.default_rng((rank, 3))
    records: dict[str, list[dict[str, float]]] = {}
    for method, plan in plans.items():
        records[method] = []
        for step, ranks in enumerate(plan):
            for p in params:
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            for n in ranks[rank]:
                _row_step(task, int(n), rng)
            computed = time.perf_counter()
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            dist.all_reduce(flat)
            reduced = time.perf_counter()
            dist.all_reduce(flat)  # everyone is here now: the transfer alone
            again = time.perf_counter()
            records[method].append({"compute": computed - start, "all_reduce": reduced - computed,
                                    "transfer": again - reduced})
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def measure(plans: dict[str, list[list[np.ndarray]]], world: int, max_len: int, warmup_steps: int = 1) -> dict[str, Any]:
    """Run ``plans`` (per method, per step, per rank: row lengths) on ``world`` gloo processes."""
    import tempfile

    import torch.multiprocessing as mp

    payload = {m: [[[int(n) for n in r] for r in step] for step in plan] for m, plan in plans.items()}
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "records.json")
        mp.spawn(_measure_worker, args=(world, _free_port(), max_len, payload, out_path), nprocs=world, join=True)
        with open(out_path) as f:
            per_rank = json.load(f)
    results = {}
    for method in plans:
        shares, modelled, steps_ms, compute_ms = [], [], [], []
        for step in range(warmup_steps, len(plans[method])):
            rows = [per_rank[r][method][step] for r in range(world)]
            waits = [max(x["all_reduce"] - x["transfer"], 0.0) for x in rows]
            step_s = [x["compute"] + x["all_reduce"] for x in rows]
            compute = [x["compute"] for x in rows]
            shares.append(float(np.mean(waits) / np.mean(step_s)))
            modelled.append(1 - float(np.mean(compute)) / max(compute))
            steps_ms.append(1e3 * float(np.mean(step_s)))
            compute_ms.append([1e3 * c for c in compute])
        results[method] = {"steps": len(shares), "wait_share_measured": float(np.mean(shares)),
                           "wait_share_from_measured_compute": float(np.mean(modelled)),
                           "step_ms": float(np.mean(steps_ms)), "rank_compute_ms": compute_ms}
    return results


# -- report --------------------------------------------------------------------------------------------
LABELS = {"equal": "equal slices", "realloc_tokens": "realloc (tokens)", "realloc_cost": "realloc (cost)",
          "realloc_timed": "realloc (timed)", "token_batching": "token batching", "cost_batching": "cost batching", "sl": "SL", "lbsl": "LBSL"}


def _bars(ax, labels, series, fmt) -> None:
    """Grouped bars: ``series`` = [(name, values, color, hatch)], one group per label."""
    x = np.arange(len(labels))
    width = 0.8 / len(series)
    for i, (name, values, color, hatch) in enumerate(series):
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, color=color, hatch=hatch, label=name)
        for bar, v in zip(bars, values):
            if not np.isnan(v):
                ax.text(bar.get_x() + bar.get_width() / 2, v, fmt(v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x)
    ax.set_xticklabels([LABELS.get(m, m) for m in labels], rotation=30, ha="right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim, measured = report["simulated"], report.get("measured")
    methods = list(sim)
    count = lambda v: f"{v:,.0f}" if v >= 10 else f"{v:.2f}"
    percent = lambda v: f"{100 * v:.1f}%"
    panels = [("token_spread_mean", "max − min tokens across ranks (mean over steps)", count),
              ("cost_max_over_min_mean", "max / min rank cost (mean over steps)", count),
              ("wait_share_modelled", "modelled wait at the all-reduce, share of step", percent)]
    fig, axes = plt.subplots(1, 4 if measured else 3, figsize=(20 if measured else 15, 4.8))
    for ax, (key, title, fmt) in zip(axes, panels):
        _bars(ax, methods, [("modelled", [sim[m][key] for m in methods], "#1f77b4", None)], fmt)
        ax.set_title(title, fontsize=9)
    if measured:
        mc, serial = report["measure_config"], report["measured_serial"]
        names = list(measured)
        _bars(axes[3], names, [
            (f"gloo, {report['config']['world']} ranks on {mc['cpu_count']} shared cores",
             [measured[m]["wait_share_measured"] for m in names], "#ff7f0e", "//"),
            ("serial: each rank's compute alone", [serial[m]["wait_share"] for m in names], "#2ca02c", None)], percent)
        axes[3].set_title(f"measured wait share, small HSTU, {mc['steps']} steps", fontsize=9)
    c = report["config"]
    fig.suptitle(f"{c['world']} ranks, global batch {c['batch_size']}, lengths ≤ {c['max_len']} (long tail, mean "
                 f"{c['mean_length']:.0f}), cost = training FLOPs of {c['model']}/{c['preset']}; {c['steps']} steps, "
                 f"SL/LBSL over steps ≥ {c['warmup']}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    lengths = synthetic_lengths(args.num_users, args.max_len, args.seed)
    cost = preset_sequence_cost(args.model, args.preset, args.num_negatives, max_len=args.max_len)
    kw = dict(seed=args.seed, max_len=args.max_len, alpha=args.alpha, gamma=args.gamma, warmup=args.warmup,
              recalibrate=args.recalibrate)
    plans = method_plans(lengths, args.world, args.batch_size, args.steps, cost, **kw)
    simulated = {m: summarize(plan, cost, skip=args.warmup if m in ("sl", "lbsl") else 0) for m, plan in plans.items()}
    report: dict[str, Any] = {
        "config": {"world": args.world, "batch_size": args.batch_size, "steps": args.steps, "max_len": args.max_len,
                   "num_users": args.num_users, "seed": args.seed, "model": args.model, "preset": args.preset,
                   "num_negatives": args.num_negatives, "cost": {"a": cost.a, "b": cost.b},
                   "alpha": args.alpha, "gamma": args.gamma, "warmup": args.warmup, "recalibrate": args.recalibrate,
                   "mean_length": float(lengths.mean()), "share_at_max_len": float((lengths == args.max_len).mean()),
                   "length_percentiles": {str(q): float(np.percentile(lengths, q)) for q in (50, 90, 99)}},
        "simulated": simulated,
        "notes": "wait_share_modelled = mean over steps of 1 - mean/max of per-rank estimated cost "
                 "(training FLOPs a*n + b*n^2); modelled, not timed",
    }
    if args.measure_steps:
        small = preset_sequence_cost("hstu", "tiny", MEASURE_NEGATIVES, max_len=args.max_len, **MEASURE_MODEL)
        probe = sorted({n for n in (2, 16, 64, 128, 256, 512, 768, 1024, 1536, 2048, args.max_len) if n <= args.max_len})
        timed = TimedCost(probe, time_rows(args.max_len, probe, repeats=3))
        steps = args.measure_steps + 1  # the first step of each method is a warm-up
        mplans = method_plans(lengths, args.world, args.batch_size, steps, small, methods=MEASURED_METHODS,
                              extra_costs={"timed": timed}, **kw)
        started = time.perf_counter()
        report["measured"] = measure(mplans, args.world, args.max_len)
        report["measured_serial"] = measure_serial(mplans, args.max_len)
        report["measured_predicted"] = {m: summarize(plan[1:], timed)["wait_share_modelled"] for m, plan in mplans.items()}
        report["measure_config"] = {
            "model": {"model": "hstu", **MEASURE_MODEL, "num_negatives": MEASURE_NEGATIVES}, "steps": args.measure_steps,
            "warmup_steps": 1, "threads_per_rank": 1, "cpu_count": os.cpu_count(), "seconds": time.perf_counter() - started,
            "flops_cost": {"a": small.a, "b": small.b},
            "row_ms": {str(n): 1e3 * t for n, t in zip(timed.lengths, timed.seconds)},
            "notes": "measured: gloo on loopback, one thread per rank, rows run one at a time; wait = first all_reduce "
                     "minus a second (synchronised) one; the ranks share the machine's cores. measured_serial: each "
                     "rank's rows timed one rank after the other in one process (no sharing, fastest of 2 runs), wait = 1 - mean/max. "
                     "measured_predicted: 1 - mean/max of the per-rank sums of the timed per-row costs (row_ms)",
        }
    return report


def _print(report: dict[str, Any]) -> None:
    c = report["config"]
    print(f"{c['world']} ranks, global batch {c['batch_size']}, {c['steps']} steps, lengths mean {c['mean_length']:.0f} "
          f"(p50 {c['length_percentiles']['50']:.0f}, p99 {c['length_percentiles']['99']:.0f}, "
          f"{100 * c['share_at_max_len']:.1f}% at {c['max_len']}); cost a={c['cost']['a']:.3g} b={c['cost']['b']:.3g}")
    print(f"{'method':18s} {'tok spread':>10s} {'(max)':>8s} {'cost max/min':>12s} {'wait (model)':>12s} "
          f"{'tokens/step':>11s} {'rows/step':>9s}")
    for m, s in report["simulated"].items():
        print(f"{LABELS.get(m, m):18s} {s['token_spread_mean']:10.0f} {s['token_spread_max']:8.0f} "
              f"{s['cost_max_over_min_mean']:12.3f} {100 * s['wait_share_modelled']:11.1f}% "
              f"{s['tokens_per_step']:11.0f} {s['rows_per_step']:9.1f}")
    if "measured" in report:
        mc = report["measure_config"]
        rows = ", ".join(f"{n}: {v:.1f}" for n, v in mc["row_ms"].items())
        print(f"measured, {mc['steps']} steps per method, small HSTU one row at a time (fwd+bwd ms per row length: {rows});")
        print(f"gloo: {c['world']} ranks on {mc['cpu_count']} cores (shared); serial: each rank's rows alone, one after the other")
        for m, s in report["measured"].items():
            serial = report["measured_serial"][m]
            print(f"{LABELS.get(m, m):18s} wait gloo {100 * s['wait_share_measured']:5.1f}%   serial "
                  f"{100 * serial['wait_share']:5.1f}%   predicted from row timings "
                  f"{100 * report['measured_predicted'][m]:5.1f}%   step gloo {s['step_ms']:.0f} ms, serial max rank "
                  f"{serial['step_ms']:.0f} ms")


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m grcompile.bench.balance", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128, help="global rows per step (equal slices, reallocation)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--num-users", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="hstu")
    p.add_argument("--preset", default="small")
    p.add_argument("--num-negatives", type=int, default=128)
    p.add_argument("--alpha", type=float, default=1.6, help="SL / LBSL α")
    p.add_argument("--gamma", type=float, default=1.5, help="LBSL load exponent γ")
    p.add_argument("--warmup", type=int, default=20, help="LBSL warm-up steps (SL and LBSL are reported after them)")
    p.add_argument("--recalibrate", type=int, default=100, help="LBSL recalibration interval (steps)")
    p.add_argument("--measure-steps", type=int, default=0, help="also time K steps per method on gloo ranks")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if args.world < 1 or args.batch_size < args.world or args.steps <= args.warmup:
        p.error("need world >= 1, batch-size >= world and steps > warmup")
    report = run(args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    _print(report)
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
