"""Time ``grcompile::jagged_attention``'s CPU reference alone: forward and backward (through
autograd, as training runs it) on a seeded mix of row lengths.

    python -m grcompile.bench.attention_cpu --rows 32 --max-len 1024 --heads 2 --head-dim 32 \\
        --activation softmax --dropout 0.2 --json attn-cpu.json

``--rab hstu`` adds HSTU's relative attention bias (learned position and time-bucket tables,
their gradients included): the HSTU presets' training workload. Lengths are uniform in
``0..max_len`` (the first rows empty, length 1 and full), as in the outside-style benchmark models
(examples/). Reports the median of ``--iters`` timed calls after
``--warmup`` untimed ones (the first compiles the chunk kernels), and the causal (query, key)
pairs per second. One process, this machine: compare runs only against each other.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Optional

import torch

HSTU_TIME_BUCKETS = 32  # the HSTU presets' num_time_buckets


def _inputs(args) -> tuple[tuple, dict, int]:
    gen = torch.Generator().manual_seed(args.seed)
    B, N, H, d = args.rows, args.max_len, args.heads, args.head_dim
    lengths = torch.randint(0, N + 1, (B,), generator=gen)
    lengths[:3] = torch.tensor([0, 1, N])[:B]
    offsets = torch.zeros(B + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    T = int(offsets[-1])
    positions = torch.cat([torch.arange(int(n)) for n in lengths]) if T else torch.zeros(0, dtype=torch.int64)
    q, k, v = (torch.randn(T, H, d, generator=gen).requires_grad_() for _ in range(3))
    seed = torch.tensor([args.seed], dtype=torch.int64) if args.dropout else None
    score_mod, q_side, k_side, tables = "", [], [], []
    if args.rab == "hstu":  # HSTU's relative bias: position table + log time-bucket table, both learned
        from grcompile.lowering.score_mod import hstu_rab_key
        score_mod = hstu_rab_key(N, HSTU_TIME_BUCKETS)
        timestamps = torch.cat([torch.randint(0, 10 ** 6, (int(n),), generator=gen).sort().values for n in lengths]) \
            if T else torch.zeros(0, dtype=torch.int64)
        q_side = k_side = [timestamps]
        tables = [torch.randn(2 * N - 1, generator=gen).requires_grad_(),
                  torch.randn(HSTU_TIME_BUCKETS + 1, generator=gen).requires_grad_()]
    kwargs = dict(score_mod=score_mod, use_qk=True, activation=args.activation, scale=d ** -0.5, out_scale=1.0,
                  causal=not args.bidirectional, max_len=N, dropout_p=args.dropout)
    pairs = int((lengths * (lengths + 1) // 2).sum() if not args.bidirectional else (lengths ** 2).sum()) * H
    return (q, k, v, offsets, positions, q_side, k_side, tables, seed), kwargs, pairs


def run(args) -> dict[str, Any]:
    import grcompile.lowering  # noqa: F401  (registers the op)

    torch.set_num_threads(args.threads) if args.threads else None
    inputs, kwargs, pairs = _inputs(args)
    q = inputs[0]
    grad = torch.randn(q.shape[0], q.shape[1], inputs[2].shape[2])
    op = torch.ops.grcompile.jagged_attention
    forward, backward = [], []
    for i in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        out = op(*inputs, **kwargs)
        t1 = time.perf_counter()
        out.backward(grad)
        t2 = time.perf_counter()
        if i >= args.warmup:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    fwd, bwd = statistics.median(forward), statistics.median(backward)
    return {"rows": args.rows, "max_len": args.max_len, "heads": args.heads, "head_dim": args.head_dim,
            "activation": args.activation, "rab": args.rab, "causal": not args.bidirectional, "dropout": args.dropout,
            "tokens": int(q.shape[0]), "pairs": pairs, "threads": torch.get_num_threads(),
            "forward_ms": fwd * 1e3, "backward_ms": bwd * 1e3,
            "forward_ms_all": [t * 1e3 for t in forward], "backward_ms_all": [t * 1e3 for t in backward],
            "pairs_per_s_forward": pairs / fwd, "pairs_per_s_backward": pairs / bwd}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--activation", choices=("softmax", "silu", "identity"), default="softmax")
    p.add_argument("--rab", choices=("none", "hstu"), default="none",
                   help="hstu: HSTU's relative attention bias (position + time-bucket tables) as the score_mod")
    p.add_argument("--bidirectional", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if min(args.rows, args.max_len, args.heads, args.head_dim, args.iters) < 1 or args.warmup < 0:
        p.error("--rows, --max-len, --heads, --head-dim and --iters must be >= 1, --warmup >= 0")
    result = run(args)
    print(f"{result['tokens']} tokens, {result['pairs']:,} pairs x heads: forward {result['forward_ms']:.1f} ms, "
          f"backward {result['backward_ms']:.1f} ms ({result['threads']} threads)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
