"""``python -m grcompile.bench.pipeline``: step time and exposed communication of the sparse
pipeline schedules (``SCHEDULES``: sync, fwp, dbp, dbp+fwp, semi-async, six-stage) on an emulated
network (``netns.py``).

Each rank runs in a network namespace of its own behind a rate-limited veth (gloo over real TCP).
Every schedule is timed twice, through the same code and the same namespaces: on the limited
link and on an unlimited one. Then, per schedule s:

* communication time = step(sync, limited) − step(sync, unlimited): in ``sync`` nothing overlaps,
  so everything the slow link adds is communication;
* exposed communication(s) = step(s, limited) − step(s, unlimited): what the link still adds to
  the step under schedule s;
* exposed ratio(s) = exposed(s) / communication time (NestPipe's metric: 1 = nothing hidden;
  FWP's theoretical floor is 1/N for N micro-batches, the first exchange and the last gradient).

Also written: a Chrome/Perfetto trace of one measured step per schedule (rank 0; threads: main,
the gradient thread, and six-stage's routing thread) and a PNG of it. The batches are made before
the timed steps, so six-stage's dataloader stage (a thread in the trainer) has nothing to hide here.

The dense all-reduce: ``SCHEDULE+overlap`` runs it bucket by bucket during the last backward
(``train/grad_sync.py``, ``--bucket-mb``); ``SCHEDULE+ab`` alternates the serial and the overlapped
all-reduce step by step in one run, each batch twice in a row (once per half; use an even
``--warmup``), reported as ``SCHEDULE`` and ``SCHEDULE+overlap`` (both halves under the same
machine load and batches; sparse stats and unique ids are the whole run's). Per schedule the
dense all-reduce's exposed time is reported too (serial: all of it; overlapped: ``finish()``'s wait).
Example::

    python -m grcompile.bench.pipeline --world 2 --rate-mbit 200 --json docs/bench/pipeline-2ranks.json \\
        --trace docs/bench/pipeline-2ranks.trace.json --plot docs/bench/pipeline-2ranks.png
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SCHEDULES = ("sync", "fwp", "dbp", "dbp+fwp", "semi-async", "six-stage")
OVERLAP = "+overlap"  # a schedule name's suffix: the dense all-reduce overlapped with the last backward
# a schedule name's suffix: serial and overlapped dense all-reduce on alternate steps of one run (both
# halves see the same machine load; reported as the schedule and the schedule + OVERLAP)
INTERLEAVED = "+ab"


# -- one rank ----------------------------------------------------------------------------------------
def _batches(args, steps: int) -> list[dict[str, torch.Tensor]]:
    """Global batches, the same on every rank: long-tail lengths, Zipf item ids, per-row negatives."""
    g = torch.Generator().manual_seed(args.seed)
    out = []
    ranks = torch.arange(1, args.items + 1, dtype=torch.float64)
    popularity = ranks ** -1.1
    for _ in range(steps):
        lengths = torch.clamp((torch.empty(args.batch_size).exponential_(generator=g) * args.max_len / 3).long() + 2,
                              max=args.max_len)
        ids = torch.multinomial(popularity, args.batch_size * args.max_len, replacement=True, generator=g)
        ids = (ids + 1).view(args.batch_size, args.max_len) * (torch.arange(args.max_len) < lengths[:, None])
        ts = torch.cumsum(torch.randint(1, 3600, (args.batch_size, args.max_len), generator=g), 1)
        negatives = torch.randint(1, args.items + 1, (args.batch_size, args.negatives), generator=g)
        out.append({"ids": ids, "timestamps": ts, "negatives": negatives})
    return out


def _run_schedule(args, schedule: str, rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from models import SampledSoftmaxRetrieval, build_encoder

    from ..runtime import dense_parameters, shard_embeddings
    from ..train.grad_sync import OverlappedAllReduce
    from ..train.parallel import all_reduce_gradients
    from ..train.pipeline import SparsePipeline

    interleaved = schedule.endswith(INTERLEAVED)
    schedule = schedule.removesuffix(INTERLEAVED)
    overlapped = schedule.endswith(OVERLAP) or interleaved
    schedule = schedule.removesuffix(OVERLAP)
    torch.manual_seed(0)
    encoder = build_encoder(args.model, "ml1m", args.items, max_len=args.max_len, num_blocks=args.blocks,
                            embedding_dim=args.dim, attention_dim=args.dim, linear_dim=args.dim, dropout=0.0)
    task = SampledSoftmaxRetrieval(encoder)
    runtime = shard_embeddings(task, backend="native", dedup="two_stage", sharding="row")
    dense = [p for p in dense_parameters(task) if p.requires_grad]
    optimizers = [torch.optim.Adam(dense, lr=1e-3), torch.optim.Adagrad(runtime.tables.parameters(), lr=0.05)]
    pipeline = SparsePipeline(task, runtime, args.micro_batches, world=world,
                              schedule=schedule if schedule != "sync" else "fwp")
    overlap_of_all = OverlappedAllReduce(dense, dist.new_group(), args.bucket_mb) if overlapped else None
    overlap = overlap_of_all  # this step's (None: the serial all-reduce)
    pipeline.before_backward = lambda i, n: overlap.arm() if overlap is not None and i == n - 1 else None
    # per half (serial: False, overlapped: True): step times, dense all-reduce times
    steps, all_reduce, B = {False: [], True: []}, {False: [], True: []}, args.batch_size
    traced_steps = {args.warmup + 1, args.warmup + 2} if interleaved else {args.warmup + 1}  # one per half
    traces: dict[bool, list] = {}
    batches = _batches(args, args.warmup + args.steps)
    if interleaved:  # each batch twice in a row, once per half: the halves time the same batches
        batches = [{k: v.clone() for k, v in b.items()} for b in batches[:(len(batches) + 1) // 2] for _ in (0, 1)]
        batches = batches[:args.warmup + args.steps]

    def local_of(batch):
        return {k: v[rank * B // world:(rank + 1) * B // world] for k, v in batch.items()}

    for i, batch in enumerate(batches):
        overlap = overlap_of_all if not interleaved or i % 2 else None
        local = local_of(batch)
        dist.barrier()
        timeline: list = [] if i in traced_steps else None
        runtime.timeline = timeline
        start = time.perf_counter()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        runtime.new_step()
        with runtime.span("forward+backward"):
            if schedule == "sync":
                weight = task.count_targets(local["ids"]) / max(task.count_targets(batch["ids"]), 1)
                loss = task(local["ids"], local["timestamps"], local["negatives"]) * weight
                if overlap is not None:
                    overlap.arm()
                loss.backward()
            else:
                ahead = [(b, local_of(b)) for b in batches[i + 1:i + 1 + pipeline.lookahead]]
                pipeline.step(task, batch, local, *ahead)
        reduce_start = time.perf_counter()
        with runtime.span("dense all-reduce" + (" wait" if overlap is not None else "")):
            if overlap is not None:
                overlap.finish()  # launched bucket by bucket during the last backward
            else:
                all_reduce_gradients(dense)
        all_reduce_end = time.perf_counter()
        with runtime.span("optimizer"):
            for opt in optimizers:
                opt.step()
        if i >= args.warmup:
            steps[overlap is not None].append(time.perf_counter() - start)
            all_reduce[overlap is not None].append(all_reduce_end - reduce_start)
        if timeline is not None:
            traces[overlap is not None] = [(name, thread, t0 - start, t1 - start) for name, thread, t0, t1 in timeline]
        runtime.timeline = None
    stats = runtime.tables.stats.as_dict()
    if overlap_of_all is not None:
        overlap_of_all.close()
    out = {}
    for half in (False, True):
        if steps[half]:
            out[schedule + (OVERLAP if half else "")] = {
                "step_s": steps[half], "trace": traces.get(half, []), "sparse_stats": stats,
                "unique_ids": pipeline.unique_ids,
                "micro_batches": pipeline.micro_batches and min(pipeline.micro_batches, B // world),
                "dense_all_reduce_s": all_reduce[half], "dense_buckets": len(overlap_of_all.buckets) if half else 1}
    return out


def worker(args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    if args.interface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.interface
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=args.world)
    try:
        out = {}
        for s in args.schedules.split(","):
            out.update(_run_schedule(args, s, args.rank, args.world))
    finally:
        dist.destroy_process_group()
    Path(args.out).write_text(json.dumps(out))


# -- the driver --------------------------------------------------------------------------------------
def _launch(args, rate_mbit, tmp: Path, label: str) -> list[dict]:
    from .netns import EmulatedNetwork

    with EmulatedNetwork(args.world, rate_mbit) as hosts:
        procs = []
        for rank, host in enumerate(hosts):
            out = tmp / f"{label}-{rank}.json"
            argv = [sys.executable, "-m", "grcompile.bench.pipeline", "--worker", "--rank", str(rank),
                    "--world", str(args.world), "--master", hosts[0].address, "--port", str(args.port),
                    "--interface", host.interface, "--out", str(out), *_passthrough(args)]
            procs.append(subprocess.Popen(host.command(argv), cwd=os.getcwd(), env=os.environ.copy()))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"{label}: ranks exited with {codes}")
        return [json.loads((tmp / f"{label}-{rank}.json").read_text()) for rank in range(args.world)]


def _passthrough(args) -> list[str]:
    keys = ("model", "items", "max_len", "blocks", "dim", "batch_size", "negatives", "micro_batches", "steps",
            "warmup", "seed", "threads", "schedules", "bucket_mb")
    return [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def summarize(limited: list[dict], unlimited: list[dict]) -> dict[str, Any]:
    """Per schedule: median step time (max over ranks per step) on both links, exposed communication."""
    def step_ms(results: list[dict], schedule: str) -> float:
        per_step = [max(r[schedule]["step_s"][i] for r in results) for i in range(len(results[0][schedule]["step_s"]))]
        return 1e3 * statistics.median(per_step)

    schedules = list(limited[0])
    out: dict[str, Any] = {}
    # the communication time is sync's (serial) — a run without it reports no ratios
    comm = step_ms(limited, "sync") - step_ms(unlimited, "sync") if "sync" in schedules else None
    for s in schedules:
        lim, unl = step_ms(limited, s), step_ms(unlimited, s)
        out[s] = {"step_ms_limited_link": round(lim, 1), "step_ms_unlimited_link": round(unl, 1),
                  "exposed_comm_ms": round(lim - unl, 1),
                  "exposed_comm_ratio": round((lim - unl) / comm, 3) if comm is not None and comm > 0 else None,
                  "embedding_bytes_per_rank": limited[0][s]["sparse_stats"]["embedding_bytes"],
                  "dense_all_reduce_ms_limited_link": _dense_all_reduce_ms(limited, s),
                  "dense_buckets": limited[0][s].get("dense_buckets", 1),
                  "micro_batches": limited[0][s]["micro_batches"] if "fwp" in s else 1,
                  "unique_ids": limited[0][s]["unique_ids"] if "fwp" in s else None}
    out["communication_ms"] = round(comm, 1) if comm is not None else None
    return out


def _dense_all_reduce_ms(results: list[dict], schedule: str):
    """Median over steps (slowest rank per step) of the dense all-reduce's exposed time: the whole
    serial all-reduce, or the overlapped one's ``finish()`` (None where a result has no record)."""
    per_rank = [r[schedule].get("dense_all_reduce_s") for r in results]
    if not per_rank[0] or any(t is None for t in per_rank):
        return None
    return round(1e3 * statistics.median(max(t[i] for t in per_rank) for i in range(len(per_rank[0]))), 1)


def chrome_trace(results: list[dict], path: Path) -> None:
    """The traced step of every schedule, rank 0's threads, one process per schedule."""
    events = []
    for pid, (schedule, r) in enumerate(results[0].items()):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{schedule} (rank 0)"}})
        for name, thread, t0, t1 in r["trace"]:
            events.append({"name": name, "ph": "X", "pid": pid, "tid": thread, "ts": 1e6 * t0, "dur": 1e6 * (t1 - t0)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events}))


def plot(results: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"forward+backward": "#c7c7c7", "route+read": "#1f77b4", "key extraction": "#aec7e8",
               "route": "#1f77b4", "routing wait": "#e377c2", "exchange start": "#17becf",
               "exchange wait": "#d62728",
               "gradient exchange": "#ff7f0e", "gradient exchange wait": "#9467bd", "dense all-reduce": "#8c564b",
               "optimizer": "#2ca02c"}
    schedules = list(results[0])
    fig, axes = plt.subplots(len(schedules), 1, figsize=(11, 1.9 * len(schedules) + 0.6), sharex=True)
    for ax, schedule in zip(axes, schedules):
        spans = results[0][schedule]["trace"]
        for name, thread, t0, t1 in spans:
            kind = next((k for k in sorted(colours, key=len, reverse=True) if name.startswith(k)), None)
            lane = 2 if "grad" in thread else 3 if "route" in thread else (0 if kind == "forward+backward" else 1)
            ax.broken_barh([(1e3 * t0, 1e3 * (t1 - t0))], (lane - 0.4, 0.8), color=colours.get(kind, "#17becf"))
        ax.set_yticks([0, 1, 2, 3], ["compute", "main: comm/wait", "gradient thread", "routing thread"])
        s = summary[schedule]
        ax.set_title(f"{schedule}: step {s['step_ms_limited_link']} ms, exposed communication ratio "
                     f"{s['exposed_comm_ratio']}", fontsize=9, loc="left")
    axes[-1].set_xlabel("ms since step start (rank 0, one step)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    fig.legend(handles, list(colours), loc="lower center", ncol=(len(colours) + 1) // 2, fontsize=7)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m grcompile.bench.pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rate-mbit", type=float, default=200.0, help="per-rank link rate, each direction")
    p.add_argument("--model", default="hstu")
    p.add_argument("--items", type=int, default=200_000)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64, help="global")
    p.add_argument("--negatives", type=int, default=256, help="per row")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--schedules", default=",".join(SCHEDULES),
                   help=f"comma-separated; a name with '{OVERLAP}' (sync{OVERLAP}, dbp+fwp{OVERLAP}, ...) overlaps the "
                        f"dense all-reduce with the last backward (train/grad_sync.py)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help=f"the {OVERLAP} schedules' bucket size cap")
    p.add_argument("--port", type=int, default=29631)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--trace", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    w = p.add_argument_group("worker (internal)")
    w.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    w.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    w.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    w.add_argument("--interface", default="", help=argparse.SUPPRESS)
    w.add_argument("--out", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        limited = _launch(args, args.rate_mbit, Path(tmp), "limited")
        unlimited = _launch(args, None, Path(tmp), "unlimited")
    summary = summarize(limited, unlimited)
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "rank", "master", "interface", "out",
                                                               "json", "trace", "plot")}
    result = {"config": config, "date": time.strftime("%Y-%m-%d"), "cpu_cores": os.cpu_count(), **summary}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.trace:
        chrome_trace(limited, args.trace)
    if args.plot:
        plot(limited, summary, args.plot)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
