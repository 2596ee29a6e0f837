"""``python -m grcompile.bench.step_split``: sharded training steps on N gloo ranks, timed and counted.

    python -m grcompile.bench.step_split --nproc 2 --runs torchrec-row-none,torchrec-row-two_stage \\
        --steps 12 --json docs/runtime/step-split-2.json --plot docs/runtime/step-split-2.png

Each run is ``grcompile.train`` (synthetic Zipf data, global batch ``--batch-size`` sliced over the
ranks, item + category features merged into one table) with a sparse configuration named
``<backend>-<sharding>-<dedup>[-hsp<G>]``. Reported per run, per step after the warm-up (mean of the
slowest rank): the wall time split into the sparse forward (TorchRec: id all-to-all, table lookup,
embedding all-to-all), the sparse backward (embedding all-to-all backward + fused table update),
the dense gradient all-reduce, HSP's sparse gradient sync, and the dense compute + optimizer; and
ids / embedding bytes received from other ranks, summed over ranks.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..runtime.launch import run_on_ranks

PHASES = ("id_all_to_all", "table_lookup", "embedding_all_to_all", "sparse_forward", "sparse_backward",
          "dense_all_reduce", "hsp_sync", "dense_compute_and_optimizer", "total")


def parse_run(name: str) -> dict:
    parts = name.split("-")
    if len(parts) not in (3, 4) or parts[0] not in ("torchrec", "native"):
        raise SystemExit(f"run {name!r}: expected <torchrec|native>-<row|table|column|auto>-<dedup>[-hsp<G>]")
    run = {"sparse_backend": parts[0], "sharding": parts[1], "dedup": parts[2]}
    if len(parts) == 4:
        if not parts[3].startswith("hsp"):
            raise SystemExit(f"run {name!r}: the 4th part must be hsp<G>")
        run["hsp_group_size"] = int(parts[3][3:])
    return run


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    from grcompile.train.config import TrainConfig
    from grcompile.train.loop import train

    out = {}
    for name in args.runs.split(","):
        config = TrainConfig(
            data="synthetic", preset="ml1m", max_len=args.max_len, batch_size=args.batch_size,
            eval_batch_size=512, num_negatives=args.num_negatives, negatives="per-row", threads=1, epochs=1,
            steps=args.steps, sparse_optimizer="sgd", sparse_lr=0.005, compile=args.compile,
            synthetic={"num_users": max(2000, args.batch_size * (args.steps + 1))},
            model_overrides={"embedding_dim": args.dim, "num_categories": 50, "dropout": 0.0},
            **parse_run(name))
        result = train(config, progress=False, log=lambda *a: None)
        out[name] = {k: result[k] for k in ("step_time_ms", "sparse_stats", "final_loss")}
    return out


def summarize(per_rank: dict, runs: list[str], nproc: int, steps: int) -> dict:
    summary = {}
    for name in runs:
        ranks = [per_rank[r][name] for r in range(nproc)]
        slowest = max(ranks, key=lambda r: r["step_time_ms"]["total"])["step_time_ms"]
        stats = {k: sum(r["sparse_stats"][k] for r in ranks) / steps for k in ranks[0]["sparse_stats"]}
        summary[name] = {"ms": {k: slowest.get(k, 0.0) for k in PHASES}, "steps_timed": slowest["steps_measured"],
                         "per_step_all_ranks": stats, "final_loss": ranks[0]["final_loss"]}
    return summary


def print_table(summary: dict, args: argparse.Namespace) -> None:
    print(f"{args.nproc} gloo ranks, global batch {args.batch_size}, max_len {args.max_len}, dim {args.dim}, "
          f"{args.steps} steps (first 2 not timed); ms per step on the slowest rank; ids and MB received "
          f"from other ranks per step, all ranks")
    head = ["run", "id a2a", "lookup", "emb a2a", "sparse fwd", "sparse bwd", "dense AR", "hsp sync", "dense", "total",
            "ids recv", "emb MB recv", "HSP sync MB"]
    print(" | ".join(head))
    for name, s in summary.items():
        ms, st = s["ms"], s["per_step_all_ranks"]
        print(" | ".join([name] + [f"{ms[k]:.1f}" for k in PHASES] +
                         [f"{st['ids_sent']:.0f}", f"{st['embedding_bytes'] / 2**20:.2f}",
                          f"{st['hsp_sync_bytes'] / 2**20:.2f}"]))


def plot(summary: dict, path: str, nproc: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    parts = [("sparse_forward", "sparse forward (lookup + all-to-alls)"), ("sparse_backward", "sparse backward"),
             ("dense_all_reduce", "dense all-reduce"), ("hsp_sync", "HSP sparse sync"),
             ("dense_compute_and_optimizer", "dense compute + optimizer")]
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(names), 4))
    bottom = [0.0] * len(names)
    for key, label in parts:
        values = [summary[n]["ms"][key] for n in names]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms per step (slowest rank)")
    ax.set_title(f"Sharded training step on {nproc} gloo ranks (CPU)")
    ax.legend(fontsize=7)
    plt.xticks(rotation=20, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m grcompile.bench.step_split", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--runs", default="torchrec-row-none,torchrec-row-two_stage,torchrec-table-two_stage,native-row-two_stage")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=128, help="global batch")
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--num-negatives", type=int, default=128)
    p.add_argument("--compile", choices=("eager", "grcompile"), default="eager")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    runs = args.runs.split(",")
    for name in runs:
        parse_run(name)
    per_rank = run_on_ranks(_worker, args.nproc, args)
    summary = summarize(per_rank, runs, args.nproc, args.steps)
    print_table(summary, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "runs": summary}, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot(summary, args.plot, args.nproc)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
