"""Tile sweep of the jagged attention kernels (how ``attention.triton.GPU_TILES`` is chosen): no GPU.

    python -m grcompile.lowering.tile_sweep --kernel fwd,bwd_kv,bwd_q --arch sm_80,sm_90 \\
        --bucket 64,128,256 [--json sweep.json]

For each (kernel, arch, head-width bucket), tiles (BLOCK_M, BLOCK_N ∈ {16, 32, 64, 128},
num_warps ∈ {4, 8}, num_stages ∈ {1, 2, 3}) are compiled with the AOT report's
:func:`~grcompile.lowering.aot.compile_config` for every score_mod of
:func:`~grcompile.lowering.attention.triton.aot_cases` at head width = the bucket (bf16).

A tile *passes* when, for every score_mod, it compiles without spills, fits the arch's shared
memory and has only the arch's tensor-core MMA (sm_90: ``wgmma`` and no ``mma.sync`` — each
``tl.dot`` needs M >= 64 per warpgroup). Tiles are walked by work per program (BLOCK_M ·
BLOCK_N) from the largest; the first size with a passing tile wins, and among its passing tiles
a pipelined one (2 or 3 stages: the key and value tiles of the next blocks are prefetched by
asynchronous copies while this one computes; 1 stage waits for every load), then the fewest
registers (the most of any score_mod), then more stages. Where only one-stage tiles pass at the
first size, the next size down is tried: a pipelined tile there wins over them (half the work
per program, its loads overlapped), else the larger one-stage tile stands. A tile stops at its first
failing score_mod (the heaviest are compiled first).

``--dtype fp32`` sweeps float32 inputs (IEEE products on FMA: no tensor-core requirement) for
``attention.triton.FP32_TILES``; ``--sizes``, ``--stages`` and ``--max-area`` narrow the tiles tried.

When no tile passes, every tile whose plain kernel (SASRec, no score_mod) compiles without
spills is compiled for every score_mod (up to its first spill once some tile with the arch's
MMA is spill-free for all), and the least-spilling one is chosen: plain kernel spill-free first,
then the arch's tensor-core MMA in the PTX (a sm_90 tile on ``mma.sync`` alone is taken only when
no ``wgmma`` tile keeps the plain kernel spill-free: d = 256), the fewest spilling score_mods, the
fewest spilled bytes (summed), the arch's MMA alone over mixed (sm_90 ``wgmma`` + ``mma.sync``:
a tl.dot with M < 64 stays on ``mma.sync``), larger tiles (a one-stage tile counting as one size
down), pipelined ones, fewer registers. Such a choice is
printed as ``SPILLS`` and / or ``MMA`` (not only the arch's tensor-core instruction).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

SIZES = (16, 32, 64, 128)
WARPS = (4, 8)
STAGES = (1, 2, 3)
# heaviest first: a tile that fails stops early
ORDER = ("hstu", "time_bucket_per_head", "fuxi_positional", "sasrec")
PLAIN = "sasrec"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# At head width 256 tiles above 64 x 64 are not tried: every one tried spilled at least 1.4 KB
# (fwd sm_80 / sm_90, bwd_kv sm_80), and they are the slowest to compile.
MAX_AREA = {256: 64 * 64}


def tiles(bucket: int = 64, sizes: tuple = SIZES, stages: tuple = STAGES,
          max_area: int = 1 << 30) -> list[tuple[int, int, int, int]]:
    return [t for t in itertools.product(sizes, sizes, WARPS, stages)
            if t[0] * t[1] <= min(MAX_AREA.get(bucket, 1 << 30), max_area)]


def _summary(record: dict[str, Any]) -> dict[str, Any]:
    """``hard``: the AOT report's failures other than spills and tensor cores (not compiled, shared
    memory); ``mma_level``: 0 only the arch's MMA, 1 mixed (sm_90: ``mma.sync`` beside ``wgmma``),
    2 not the arch's MMA at all (sm_90 on ``mma.sync`` only: the AOT report fails it); float32
    (IEEE products, no tensor cores by design) is level 0."""
    arch_mma = {"sm_80": "mma.sync", "sm_90": "wgmma"}[record["arch"]]
    hard = [f for f in record["failures"] if not f.startswith("spills") and " in the PTX (" not in f]
    if not record["compiled"]:
        hard = hard or [f"not compiled: {record['error']}"]
    level = 0 if record["mma"] == [arch_mma] or record.get("ieee") else 1 if arch_mma in record["mma"] else 2
    return {"registers": record["registers"], "spill_bytes": record["spill_bytes"] or 0,
            "shared_bytes": record["shared_bytes"], "mma": record["mma"], "hard": hard, "mma_level": level,
            "passes": record["compiled"] and not record["failures"] and level == 0,
            "seconds": round((record["compile_seconds"] or 0) + (record["ptxas_seconds"] or 0), 2)}


class Sweep:
    def __init__(self, kernel: str, arch: str, bucket: int, dtype: str = "bf16", sizes: tuple = SIZES,
                 stages: tuple = STAGES, max_area: int = 1 << 30):
        from .attention.triton import aot_kernels
        self.kernel, self.arch, self.bucket = kernel, arch, bucket
        self.dtype, self.sizes, self.stages, self.max_area = DTYPES[dtype], sizes, stages, max_area
        self.models = [m for m in ORDER if kernel in aot_kernels(m)]
        self.results: dict[tuple, dict[str, dict]] = {}

    def compile(self, tile: tuple, model: str) -> dict[str, Any]:
        from .aot import compile_config
        from .attention.triton import aot_config
        done = self.results.setdefault(tile, {})
        if model not in done:
            done[model] = _summary(compile_config(aot_config(model, self.kernel, self.arch, self.bucket, tile,
                                                             dtype=self.dtype), self.arch))
        return done[model]

    def evaluate(self, tile: tuple, models: list[str], stop: bool) -> bool:
        passes = True
        for model in models:
            passes &= self.compile(tile, model)["passes"]
            if not passes and stop:
                return False
        return passes

    def run(self) -> dict[str, Any]:
        start = time.perf_counter()
        by_area: dict[int, list] = {}
        for tile in tiles(self.bucket, self.sizes, self.stages, self.max_area):
            by_area.setdefault(tile[0] * tile[1], []).append(tile)
        def choose(passing: list) -> dict[str, Any]:
            chosen = min(passing, key=lambda t: (t[3] < 2, self.max_regs(t), -t[3], t[2]))
            return self.report(chosen, start=start, passing=passing)

        one_stage: Optional[list] = None  # the largest size's passing tiles, when all have one stage
        for area in sorted(by_area, reverse=True):
            passing = [t for t in by_area[area] if self.evaluate(t, self.models, stop=True)]
            pipelined = [t for t in passing if t[3] >= 2]
            if one_stage is not None:  # one size down: a pipelined tile, else the larger one-stage one
                return choose(pipelined or one_stage)
            if pipelined:
                return choose(passing)
            if passing:
                one_stage = passing
        if one_stage is not None:
            return choose(one_stage)
        # nothing passes: the least-spilling tile whose plain kernel passes
        # once some tile with the arch's MMA is spill-free everywhere, a tile stops at its first spill
        clean = False
        for tile in tiles(self.bucket, self.sizes, self.stages, self.max_area):  # small tiles first: they find a spill-free one soonest
            plain = self.compile(tile, PLAIN)
            if plain["spill_bytes"] == 0 and not plain["hard"]:
                spill_free = True
                for model in self.models:
                    r = self.compile(tile, model)
                    spill_free &= r["spill_bytes"] == 0 and not r["hard"] and r["mma_level"] < 2
                    if not spill_free and clean:
                        break
                clean |= spill_free

        def rank(t: tuple) -> tuple:
            res = self.results[t]
            plain = res[PLAIN]["spill_bytes"] > 0 or bool(res[PLAIN]["hard"])
            spilling = [m for m in self.models if m not in res or res[m]["spill_bytes"]]
            level = max(r["mma_level"] for r in res.values())
            # a one-stage tile counts as half its size: a pipelined tile one size down beats it, as above
            size = t[0] * t[1] // (2 if t[3] < 2 else 1)
            return (any(r["hard"] for r in res.values()), plain, level == 2, len(spilling),
                    sum(r["spill_bytes"] for r in res.values()), level, -size, t[3] < 2, self.max_regs(t))
        chosen = min(self.results, key=rank)
        return self.report(chosen, start=start, passing=[])

    def max_regs(self, tile: tuple) -> int:
        return max(r["registers"] or 0 for r in self.results[tile].values())

    def report(self, chosen: tuple, start: float, passing: list) -> dict[str, Any]:
        res = self.results[chosen]
        return {"kernel": self.kernel, "arch": self.arch, "bucket": self.bucket, "tile": list(chosen),
                "dtype": str(self.dtype).removeprefix("torch."),
                "spills": any(r["spill_bytes"] for r in res.values()) or set(res) != set(self.models),
                "mma_level": max(r["mma_level"] for r in res.values()), "per_model": res,
                "passing_same_size": [list(t) for t in passing],
                "compiles": sum(len(v) for v in self.results.values()),
                "seconds": round(time.perf_counter() - start, 1),
                "evaluated": {",".join(map(str, t)): v for t, v in self.results.items()}}


def format_result(r: dict[str, Any]) -> str:
    head = (f"{r['kernel']:6s} {r['arch']} d<={r['bucket']:<3d} tile={tuple(r['tile'])}"
            f"{'  SPILLS' if r['spills'] else ''}{'  MMA' if r['mma_level'] else ''}"
            f"  ({r['compiles']} compiles, {r['seconds']} s)")
    lines = [head]
    for model, s in r["per_model"].items():
        lines.append(f"    {model:22s} regs={s['registers']} spill={s['spill_bytes']} smem={s['shared_bytes']} "
                     f"mma={'+'.join(s['mma']) or '-'}{' ! ' + '; '.join(s['hard']) if s['hard'] else ''}")
    if len(r["passing_same_size"]) > 1:
        lines.append(f"    also passing at this size: {[tuple(t) for t in r['passing_same_size'] if t != r['tile']]}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grcompile.lowering.tile_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", default="fwd,bwd_kv,bwd_q")
    parser.add_argument("--arch", default="sm_80,sm_90")
    parser.add_argument("--bucket", default="64,128,256")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                        help="q / k / v dtype (fp32: IEEE products, FP32_TILES)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="BLOCK_M / BLOCK_N values to try")
    parser.add_argument("--stages", default=",".join(map(str, STAGES)), help="num_stages values to try")
    parser.add_argument("--max-area", type=int, default=1 << 30, help="largest BLOCK_M * BLOCK_N to try")
    parser.add_argument("--json", metavar="PATH", help="every compiled (tile, score_mod) and the choices")
    args = parser.parse_args(argv)
    sizes, stages = tuple(int(x) for x in args.sizes.split(",")), tuple(int(x) for x in args.stages.split(","))
    results = []
    for kernel in args.kernel.split(","):
        for arch in args.arch.split(","):
            for bucket in (int(b) for b in args.bucket.split(",")):
                results.append(Sweep(kernel, arch, bucket, args.dtype, sizes, stages, args.max_area).run())
                print(format_result(results[-1]), flush=True)
                if args.json:
                    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.json).write_text(json.dumps(results, indent=1))
    table: dict[str, dict[str, dict[int, tuple]]] = {}
    for r in results:
        table.setdefault(r["kernel"], {}).setdefault(r["arch"], {})[r["bucket"]] = tuple(r["tile"])
    print("FP32_TILES =" if args.dtype == "fp32" else "GPU_TILES =", table)
    return 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, "-m", "grcompile.lowering.tile_sweep", *sys.argv[1:]], env)
    sys.exit(main())
