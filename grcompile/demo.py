"""``make demo``: train HSTU on the embedded synthetic data through grcompile, print the test
metrics, an eager-vs-grcompile speed line on identical batches, and grcompile's report.

Sized for 2 CPU cores and well under 10 minutes; ``--quick`` shrinks it further (used by tests).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import grcompile
from grcompile.data import TrainLoader
from grcompile.modes import apply_compile_mode, describe_mode
from grcompile.train import TrainConfig, build, train


def step_times(step_fn, parameters, batches, warmup: int) -> list[float]:
    optimizer = torch.optim.Adam(parameters, lr=1e-3)
    times = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        step_fn(batch["ids"], batch["timestamps"], batch["negatives"]).backward()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m grcompile.demo", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds, for smoke tests)")
    args = p.parse_args(argv)
    if args.quick:
        sizes = dict(max_len=24, users=120, items=80, epochs=1, batch=16, timed=3, long_len=48, long_batch=4)
    else:
        sizes = dict(max_len=200, users=3000, items=2000, epochs=4, batch=128, timed=8, long_len=1024,
                     long_batch=8)

    print(f"grcompile {grcompile.__version__} demo: HSTU (ML-1M paper config) on synthetic KuaiRand-like "
          f"data, {sizes['users']} users x {sizes['items']} items, max_len {sizes['max_len']}\n", flush=True)
    config = TrainConfig(model="hstu", preset="ml1m", data="synthetic", compile="grcompile",
                         epochs=sizes["epochs"], batch_size=sizes["batch"], max_len=sizes["max_len"],
                         synthetic=dict(num_users=sizes["users"], num_items=sizes["items"]))
    result = train(config, progress=sys.stderr.isatty())
    metrics = "  ".join(f"{k} {result[k]:.4f}" for k in ("hr@10", "hr@50", "hr@200", "ndcg@10", "ndcg@200"))
    print(f"\ntest metrics after {result['epochs_run']:.0f} epochs: {metrics}")

    # Same seeded batches and the same initial weights for both modes.
    ds, split, _, _ = build(config)
    loader = TrainLoader(split.train, sizes["batch"], sizes["max_len"], ds.num_items, seed=config.seed)
    batches = list(loader.iterate(0))[: sizes["timed"] + 2]
    timings, last = {}, None
    for mode in ("eager", "grcompile"):
        _, _, _, task = build(config)
        step_fn = apply_compile_mode(task, mode)
        timings[mode] = statistics.median(step_times(step_fn, task.parameters(), batches, warmup=2))
        last = step_fn
    tokens = statistics.mean(int((b["ids"] != 0).sum()) for b in batches)
    eager_ms, gr_ms = 1e3 * timings["eager"], 1e3 * timings["grcompile"]
    print(f"speed (median train step, batch {sizes['batch']}, {tokens:.0f} valid tokens): eager {eager_ms:.1f} ms, "
          f"grcompile {gr_ms:.1f} ms -> {eager_ms / gr_ms:.2f}x  [{describe_mode(last)}]")
    long = _long_sequence_speed(sizes)
    print()
    print(grcompile.report(last))
    return {"metrics": {k: result[k] for k in ("hr@10", "ndcg@10")}, "eager_ms": eager_ms, "grcompile_ms": gr_ms,
            "long": long}


def _long_sequence_speed(sizes: dict) -> dict:
    """Where padding and N² attention dominate (TurboGR's ``tiny`` HSTU at long length), the
    jagged rewrite pays off; one more speed line on the same seeded batches."""
    N, B = sizes["long_len"], sizes["long_batch"]
    config = TrainConfig(model="hstu", preset="tiny", data="synthetic", max_len=N, batch_size=B,
                         model_overrides=dict(dropout=0.0),
                         synthetic=dict(num_users=B * (sizes["timed"] + 3), num_items=sizes["items"]))
    ds, split, _, _ = build(config)
    batches = list(TrainLoader(split.train, B, N, ds.num_items, seed=config.seed).iterate(0))[:sizes["timed"] + 2]
    timings = {}
    for mode in ("eager", "grcompile"):
        _, _, _, task = build(config)
        timings[mode] = statistics.median(step_times(apply_compile_mode(task, mode), task.parameters(), batches, 2))
    padding = statistics.mean(float((b["ids"] == 0).float().mean()) for b in batches)
    print(f"speed at long sequences (HSTU tiny, N={N}, batch {B}, {100 * padding:.0f}% padding): "
          f"eager {1e3 * timings['eager']:.0f} ms, grcompile {1e3 * timings['grcompile']:.0f} ms -> "
          f"{timings['eager'] / timings['grcompile']:.2f}x")
    return {k: 1e3 * v for k, v in timings.items()}


if __name__ == "__main__":
    main(sys.argv[1:])
