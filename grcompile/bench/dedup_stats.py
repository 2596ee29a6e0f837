"""``python -m grcompile.bench.dedup_stats``: ids and bytes through the all-to-alls of a
row-wise sharded item table, per dedup mode, on N gloo processes with the synthetic (Zipf) data.

    python -m grcompile.bench.dedup_stats --nproc 2 --batch-size 128 --max-len 200 --dim 64 --steps 5

Each rank takes its slice of every global batch (``--batch-size`` is global) and looks up the
*valid* item ids of its rows plus their sampled negatives (padding never leaves the rank). Printed
per mode: ids and embedding bytes sent to other ranks, rows read, lookup time (forward +
backward), summed over ranks and averaged over steps; ``--json`` writes the same.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

from ..runtime.launch import run_on_ranks


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m grcompile.bench.dedup_stats", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128, help="global batch")
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--num-negatives", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--group-size", type=int, default=None,
                   help="hierarchical sparse parallelism: all-to-alls within groups of this many ranks, "
                        "sparse gradient sync across groups")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    from grcompile.data import TrainLoader, get_dataset
    from grcompile.runtime import DEDUP_MODES, ShardedEmbedding
    from grcompile.runtime.hsp import HSPEmbedding

    torch.set_num_threads(1)
    ds = get_dataset("synthetic", max_len=args.max_len, seed=args.seed,
                     num_users=max(512, args.batch_size * args.steps))
    loader = TrainLoader(ds.leave_one_out().train, args.batch_size, args.max_len, ds.num_items,
                         num_negatives=args.num_negatives, seed=args.seed, per_position=False)
    batches = []
    for batch in loader.iterate(0):
        rows = slice(rank * args.batch_size // args.nproc, (rank + 1) * args.batch_size // args.nproc)
        ids, negatives = batch["ids"][rows], batch["negatives"][rows]
        batches.append(torch.cat([ids[ids != 0], negatives.reshape(-1)]))
        if len(batches) == args.steps:
            break
    full = torch.randn(ds.num_items + 1, args.dim, generator=torch.Generator().manual_seed(args.seed)) * 0.02
    out = {}
    for mode in DEDUP_MODES:
        if args.group_size:
            emb = HSPEmbedding(ds.num_items + 1, args.dim, group_size=args.group_size, name="item_id",
                               dedup=mode, full_weight=full)
        else:
            emb = ShardedEmbedding(ds.num_items + 1, args.dim, name="item_id", dedup=mode, full_weight=full)
        dist.barrier()
        t0 = time.perf_counter()
        for ids in batches:
            emb(ids).sum().backward()
            if args.group_size:
                emb.sync_gradients()
                emb.weight.grad = None
        sync = emb.sync_stats.embedding_bytes if args.group_size else 0
        out[mode] = {**emb.stats.as_dict(), "lookup_ms": (time.perf_counter() - t0) * 1e3,
                     "ids_looked_up": sum(len(b) for b in batches), "sync_bytes": sync}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    per_rank = run_on_ranks(_worker, args.nproc, args)
    modes = list(per_rank[0])
    keys = ["ids_looked_up", "ids_sent", "id_bytes", "rows_sent", "embedding_bytes", "rows_read", "sync_bytes"]
    summary = {}
    for mode in modes:
        summary[mode] = {k: sum(per_rank[r][mode][k] for r in per_rank) / args.steps for k in keys}
        summary[mode]["lookup_ms"] = max(per_rank[r][mode]["lookup_ms"] for r in per_rank) / args.steps
    base = summary["none"]
    hsp = f", HSP groups of {args.group_size}" if args.group_size else ""
    print(f"{args.nproc} gloo ranks{hsp}, global batch {args.batch_size}, max_len {args.max_len}, dim {args.dim}; "
          f"per step, summed over ranks (lookup time: slowest rank, fwd+bwd)")
    print(f"{'mode':10s} {'ids':>9s} {'ids sent':>9s} {'rows sent':>10s} {'emb MB':>8s} {'rows read':>10s} "
          f"{'vs none':>8s} {'sync MB':>8s} {'lookup ms':>10s}")
    for mode, s in summary.items():
        ratio = s["embedding_bytes"] / base["embedding_bytes"] if base["embedding_bytes"] else float("nan")
        print(f"{mode:10s} {s['ids_looked_up']:9.0f} {s['ids_sent']:9.0f} {s['rows_sent']:10.0f} "
              f"{s['embedding_bytes'] / 2**20:8.2f} {s['rows_read']:10.0f} {ratio:7.2f}x {s['sync_bytes'] / 2**20:8.2f} "
              f"{s['lookup_ms']:10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "per_step": summary, "per_rank": per_rank}, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
