"""``python -m grcompile.train``: train and evaluate a naive padded model, optionally compiled.

Example (the README's ML-1M result)::

    python -m grcompile.train --model hstu --preset ml1m --data ml-1m --epochs 100 --json runs/hstu-ml1m.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from models import PRESETS

from ..data import DATASETS
from .config import SPARSE_OPTIMIZERS, TrainConfig, argparse_type, resolve_sparse_optimizer
from .loop import train
from .pipeline import PIPELINES


def build_parser() -> argparse.ArgumentParser:
    """The CLI; every number goes through ``argparse_type`` (its bound in ``config.BOUNDS``)."""
    p = argparse.ArgumentParser(prog="python -m grcompile.train", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="hstu")
    p.add_argument("--preset", default="ml1m", help=f"one of {sorted(PRESETS['hstu'])}")
    p.add_argument("--data", choices=DATASETS, default="synthetic")
    p.add_argument("--compile", choices=("eager", "inductor", "grcompile"), default="eager")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp8"), default="fp32",
                   help="bf16: every training step's forward under torch.autocast(bfloat16) (parameters, optimizer "
                        "and evaluation stay float32); fp8: the same plus optimize(precision='fp8') — needs "
                        "--compile grcompile")
    p.add_argument("--epochs", type=argparse_type("epochs"), default=100, help="0: evaluate only")
    p.add_argument("--steps", type=argparse_type("steps"), default=None,
                   help="stop after N optimizer steps in total (0: evaluate only)")
    p.add_argument("--max-minutes", type=argparse_type("max_minutes"), default=None,
                   help="stop training after this wall time")
    p.add_argument("--batch-size", type=argparse_type("batch_size"), default=128, help="global batch size")
    p.add_argument("--eval-batch-size", type=argparse_type("eval_batch_size"), default=256)
    p.add_argument("--max-len", type=argparse_type("max_len"), default=None, help="default: the preset's")
    p.add_argument("--seed", type=argparse_type("seed"), default=0)
    p.add_argument("--lr", type=argparse_type("lr"), default=1e-3)
    p.add_argument("--weight-decay", type=argparse_type("weight_decay"), default=0.0)
    p.add_argument("--num-negatives", type=argparse_type("num_negatives"), default=128)
    p.add_argument("--negatives", choices=("per-position", "per-row"), default="per-position",
                   help="uniform negatives per position (HSTU setup) or shared by a row's positions")
    p.add_argument("--temperature", type=argparse_type("temperature"), default=0.05)
    p.add_argument("--patience", type=argparse_type("patience"), default=10,
                   help="epochs without better validation NDCG@10")
    p.add_argument("--eval-every", type=argparse_type("eval_every"), default=1, help="validate every N epochs")
    p.add_argument("--k-core", type=argparse_type("k_core"), default=0, help="k-core filter for MovieLens (0: none)")
    p.add_argument("--threads", type=argparse_type("threads"), default=None, help="torch intra-op threads")
    p.add_argument("--dropout", type=argparse_type("dropout"), default=None, help="default: the preset's")
    p.add_argument("--embedding-dim", type=argparse_type("embedding_dim"), default=None, help="default: the preset's")
    p.add_argument("--num-blocks", type=argparse_type("num_blocks"), default=None, help="default: the preset's")
    p.add_argument("--num-categories", type=argparse_type("num_categories"), default=0,
                   help="add an item-category feature (a second sparse table feature) with this many categories")
    p.add_argument("--synthetic-users", type=argparse_type("num_users"), default=None)
    p.add_argument("--synthetic-items", type=argparse_type("num_items"), default=None)
    p.add_argument("--json", type=Path, default=None, help="write config, losses and metrics here")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="checkpoint every epoch here")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    p.add_argument("--no-progress", action="store_true")
    d = p.add_argument_group("distributed (launch with torchrun --nproc-per-node N -m grcompile.train ...)")
    d.add_argument("--sharding", choices=("row", "table", "column", "auto"), default=None,
                   help="shard the sparse tables (TorchRec planner; auto: the planner decides); "
                        "default: one process, or auto under torchrun")
    d.add_argument("--sparse-backend", choices=("torchrec", "native"), default="torchrec",
                   help="native: row-wise tables on torch.distributed (Adam-stepped shards, HSP)")
    d.add_argument("--dedup", choices=("none", "comm", "lookup", "two_stage"), default="two_stage",
                   help="ID dedup before the id all-to-all (comm), on the owner (lookup), or both")
    d.add_argument("--hsp-group-size", type=argparse_type("hsp_group_size"), default=None,
                   help="hierarchical sparse parallelism: tables sharded within groups of this many ranks")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="optimizer of the dense part")
    d.add_argument("--sparse-optimizer", choices=SPARSE_OPTIMIZERS, default=None,
                   help="optimizer of the sparse tables (default: the dense optimizer; sgd on TorchRec-sharded "
                        "or dynamic tables, which have no Adam: the run logs and records the choice and why)")
    d.add_argument("--sparse-lr", type=argparse_type("sparse_lr"), default=None, help="default: --lr")
    d.add_argument("--dynamic-tables", default="",
                   help="comma-separated embedding modules (e.g. encoder.category_embedding) to make dynamic hash "
                        "tables: any id >= 0, inserted on first sight, sharded by id when distributed")
    d.add_argument("--checkpoint-every", type=argparse_type("checkpoint_every"), default=None,
                   help="also checkpoint every N steps")
    d.add_argument("--pipeline", choices=PIPELINES, default="sync",
                   help="sparse pipeline schedule (native backend): fwp overlaps the embedding/gradient all-to-alls "
                        "of micro-batches with their neighbours' compute; dbp routes and reads the next batch's rows "
                        "during this step; the training is the synchronous one in each; semi-async sends the next "
                        "batch's embeddings during this step, one step STALE; six-stage is semi-async's training "
                        "with the data loading and the key routing on threads of their own, two steps ahead "
                        "(docs/pipelines.md)")
    d.add_argument("--micro-batches", type=argparse_type("micro_batches"), default=4, help="fwp: per step")
    d.add_argument("--balance", choices=("equal", "tokens", "cost"), default="equal",
                   help="rows of the global batch to ranks: equal slices, or by a greedy on tokens or on estimated "
                        "cost a·n + b·n² (never splitting a sequence; the gradient stays the global mean)")
    d.add_argument("--token-budget", type=argparse_type("token_budget"), default=None,
                   help="cut each rank's batches by this many tokens instead of --batch-size rows (MTGRBoost's "
                        "token-aware batching; loss weights keep the global mean exact)")
    d.add_argument("--lbsl", action="store_true",
                   help="ULTRA-HSTU's load-balanced stochastic length: long sequences cut at random, each rank to a "
                        "load target Σ n^1.5 (changes the data, as SL does; docs/load-balancing.md)")
    d.add_argument("--overlap-allreduce", action=argparse.BooleanOptionalAction, default=False,
                   help="all-reduce the dense gradients in buckets during the step's last backward (DDP-style, a "
                        "process group of its own) instead of after it; the same sums (docs/pipelines.md)")
    d.add_argument("--bucket-mb", type=argparse_type("bucket_mb"), default=25.0,
                   help="--overlap-allreduce: bucket size cap in MB")
    d.add_argument("--fail-at-step", type=int, default=None, help=argparse.SUPPRESS)  # fault injection (tests)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    synthetic = {k: v for k, v in (("num_users", args.synthetic_users), ("num_items", args.synthetic_items))
                 if v is not None}
    overrides = {k: v for k, v in (("dropout", args.dropout), ("num_blocks", args.num_blocks),
                                   ("embedding_dim", args.embedding_dim),
                                   ("num_categories", args.num_categories or None)) if v is not None}
    sharding = args.sharding or ("auto" if _launched_distributed() else None)
    if args.hsp_group_size and args.sparse_backend != "native":
        raise SystemExit("--hsp-group-size runs on --sparse-backend native (TorchRec's DMPCollection is CUDA-only)")
    if args.preset not in PRESETS[args.model]:
        raise SystemExit(f"--preset {args.preset!r} unknown; choose from {sorted(PRESETS[args.model])}")
    config = TrainConfig(model=args.model, preset=args.preset, data=args.data, compile=args.compile,
                       precision=args.precision,
                       epochs=args.epochs, steps=args.steps, max_minutes=args.max_minutes,
                       batch_size=args.batch_size, eval_batch_size=args.eval_batch_size, max_len=args.max_len,
                       seed=args.seed, lr=args.lr, weight_decay=args.weight_decay, temperature=args.temperature,
                       num_negatives=args.num_negatives, negatives=args.negatives, patience=args.patience, eval_every=args.eval_every,
                       k_core=args.k_core, threads=args.threads, synthetic=synthetic, sharding=sharding,
                       sparse_backend=args.sparse_backend, dedup=args.dedup, hsp_group_size=args.hsp_group_size,
                       dense_optimizer=args.optimizer, sparse_optimizer=args.sparse_optimizer, sparse_lr=args.sparse_lr,
                       checkpoint_every=args.checkpoint_every, model_overrides=overrides,
                       pipeline=args.pipeline, micro_batches=args.micro_batches, balance=args.balance,
                       token_budget=args.token_budget, lbsl=args.lbsl,
                       overlap_allreduce=args.overlap_allreduce, bucket_mb=args.bucket_mb,
                       dynamic_features=[m for m in args.dynamic_tables.split(",") if m])
    try:
        return resolve_sparse_optimizer(config)  # before any process group: a refused combination fails at once
    except ValueError as e:
        raise SystemExit(f"python -m grcompile.train: {e}") from None


def _launched_distributed() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    config = config_from_args(args)
    if config.sharding is not None and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)  # torchrun's env:// rendezvous (one process: set it up yourself)
    try:
        result = train(config, checkpoint_dir=args.checkpoint_dir, resume=args.resume,
                       progress=not args.no_progress, fail_at_step=args.fail_at_step)
    finally:
        if dist.is_initialized() and config.sharding is not None:
            gc.collect()  # the runtime's TorchRec modules go while the process group and interpreter live
            dist.destroy_process_group()
    if config.sharding is not None and int(os.environ.get("RANK", "0")) != 0:
        return result
    metrics = {k: round(result[k], 4) for k in ("hr@10", "hr@50", "hr@200", "ndcg@10", "ndcg@200", "mrr")}
    print(f"[grcompile.train] test {json.dumps(metrics)}  best epoch {result['best_epoch']}, "
          f"{result['epochs_run']:.2f} epochs ({result['stop_reason']}), "
          f"{result['minutes_per_epoch']:.2f} min/epoch, {result['tokens_per_s']:.0f} tokens/s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"[grcompile.train] wrote {args.json}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
