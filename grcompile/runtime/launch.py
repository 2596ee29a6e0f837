"""Run a function on N spawned gloo ranks of this machine and collect what each returns — the
harness of the sparse-runtime measurements (``grcompile.bench.dedup_stats``, ``grcompile.bench.step_split``)
and multi-process tests.
(``torchrun`` is the user-facing launcher; this one needs no rendezvous port.)"""
from __future__ import annotations

import gc
import os
import tempfile
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, init_file: str, results, fn: Callable, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results[rank] = fn(rank, world, *args)
    finally:
        gc.collect()  # the rank's TorchRec modules go while the process group and interpreter live
        dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], nproc: int, *args: Any) -> dict[int, Any]:
    """``{rank: fn(rank, nproc, *args)}`` with a gloo process group initialised around each call.
    ``fn`` must be importable (a module-level function). A rank that dies raises
    ``torch.multiprocessing.ProcessExitedException`` here."""
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.get_context("spawn").Manager().dict()
        mp.spawn(_entry, args=(nproc, os.path.join(tmp, "init"), results, fn, args), nprocs=nproc, join=True)
        return dict(results)


__all__ = ["run_on_ranks"]
