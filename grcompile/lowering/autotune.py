"""Tile autotuning of the Triton kernels, keyed on a bucketed max length.

The fastest tile of a kernel depends on the score_mod (the HSTU bias kernels ran up to 2.3x slower
on the plain kernels' best tile on an H100), the head width, the dtype and the row length; a table
of tiles cannot cover that. So on CUDA the first call of a kernel for a *key* — the generated
module (its source digest: the score_mod, side tensors and tables), the kernel, its other
constexprs (activation, causal, q·k, dropout, ...), dtype, head widths, and :func:`length_bucket`
of ``max_len`` — times the table's tile and the candidates
(``triton.testing.do_bench``), keeps the fastest, and every later call with that key launches it.
A candidate over the device's shared memory (``OutOfResources``) is skipped.

Choices are kept per process and written to ``tiles-<device>-triton<version>.json`` in the kernel
cache directory, so the next process on the same kind of GPU does not tune again.

Invariant: tuning changes no result beyond float rounding. Every candidate computes the same
values (only the tile, so the order of the fp32 sums, differs); buffers a kernel *accumulates*
into (``atomic_add`` table gradients) are zeroed after the trials, and the chosen tile then runs
once for the call's result. Since the choice follows measured times, two processes without a
shared cache file may pick different tiles and differ in the last bits; ``GRCOMPILE_AUTOTUNE=0``
(or one cache file) makes runs repeat bit for bit, as far as the kernels' table-gradient atomics
allow.

Off when ``GRCOMPILE_AUTOTUNE=0``, on CPU tensors (the interpreter: the table's small tile), and for
a kernel whose tile is set by ``GRCOMPILE_TILES_<KERNEL>``. While a CUDA graph is being captured
nothing is timed (it would synchronise the stream): a choice made before is used, else the table's
tile. A remembered tile the device cannot load is forgotten and the table's tile runs.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Hashable, Optional, Sequence

Tile = tuple  # (constexpr blocks dict, num_warps, num_stages)

AUTOTUNE = os.environ.get("GRCOMPILE_AUTOTUNE", "1") != "0"
LENGTH_BUCKETS = (256, 1024, 4096, 16384)  # max_len up to each; longer rows share the last bucket


def length_bucket(max_len: int) -> int:
    """The max-length bucket a tuned tile is kept for: the first of :data:`LENGTH_BUCKETS` that
    holds ``max_len`` (the last for longer rows). Tiles change with the work per program and the
    grid's size, which move by factors, not by a few tokens."""
    return next((b for b in LENGTH_BUCKETS if max_len <= b), LENGTH_BUCKETS[-1])


def _bench(fn: Callable[[], None]) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=5, rep=20))


class TileTuner:
    """Chosen tiles by key, with the trials that chose them (``timings``: tile -> ms, None when the
    tile did not fit)."""

    def __init__(self, timer: Callable[[Callable[[], None]], float] = _bench,
                 cache_file: Optional[Path] = None) -> None:
        self.timer = timer
        self.cache_file = cache_file
        self.chosen: dict[Hashable, Tile] = {}
        self.timings: dict[Hashable, list[tuple[Tile, Optional[float]]]] = {}
        self._loaded = False

    def choose(self, key: Hashable, candidates: Sequence[Tile], run: Callable[[Tile], None],
               accumulators: Sequence = ()) -> Optional[Tile]:
        """The tile for ``key``: remembered, or the fastest of ``candidates`` under ``run(tile)``
        (``accumulators`` are zeroed after the trials). None when no candidate fits."""
        self._load()
        tile = self.chosen.get(key)
        if tile is not None:
            return tile
        from triton.runtime.errors import OutOfResources

        trials: list[tuple[Tile, Optional[float]]] = []
        for candidate in _unique(candidates):
            try:
                trials.append((candidate, self.timer(lambda: run(candidate))))
            except OutOfResources:
                trials.append((candidate, None))
        for t in accumulators:
            t.zero_()
        timed = [(ms, i) for i, (_, ms) in enumerate(trials) if ms is not None]
        self.timings[key] = trials
        if not timed:
            return None
        tile = trials[min(timed)[1]][0]
        self.chosen[key] = tile
        self._save(key, tile)
        return tile

    def remembered(self, key: Hashable) -> Optional[Tile]:
        """``key``'s choice from this process or the cache file, without timing anything."""
        self._load()
        return self.chosen.get(key)

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s choice (a remembered tile the device could not load), here and in the file."""
        self.chosen.pop(key, None)
        self._save(key, None)

    def report(self) -> list[dict]:
        """One record per tuned key: the key's fields, the chosen tile and every trial's time."""
        return [{"key": [str(part) for part in key], "chosen": _plain(self.chosen.get(key)),
                 "trials": [{"tile": _plain(tile), "ms": ms} for tile, ms in trials]}
                for key, trials in self.timings.items()]

    def _load(self) -> None:
        if self._loaded or self.cache_file is None:
            return
        self._loaded = True
        try:
            saved = json.loads(self.cache_file.read_text())
        except (OSError, ValueError):
            return
        for text, (blocks, warps, stages) in saved.items():
            self.chosen.setdefault(text, (dict(blocks), int(warps), int(stages)))

    def _save(self, key: Hashable, tile: Optional[Tile]) -> None:
        if self.cache_file is None or not isinstance(key, str):
            return
        try:
            saved = json.loads(self.cache_file.read_text()) if self.cache_file.exists() else {}
            if tile is None:
                saved.pop(key, None)
            else:
                saved[key] = _plain(tile)
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(saved, indent=1, sort_keys=True))
            tmp.replace(self.cache_file)
        except (OSError, ValueError):
            pass  # a cache that cannot be written only costs a tuning run in the next process


def _unique(tiles: Sequence[Tile]) -> list[Tile]:
    seen, out = set(), []
    for tile in tiles:
        mark = (tuple(sorted(tile[0].items())), tile[1], tile[2])
        if mark not in seen:
            seen.add(mark)
            out.append(tile)
    return out


def _plain(tile: Optional[Tile]):
    return None if tile is None else [dict(tile[0]), tile[1], tile[2]]


def device_cache_file(directory: Path, device) -> Path:
    """``tiles-<device name>-triton<version>.json`` in ``directory``: tiles are chosen per GPU model
    and Triton version."""
    import torch
    import triton

    name = "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name(device))
    return directory / f"tiles-{name}-triton{triton.__version__}.json"


__all__ = ["AUTOTUNE", "LENGTH_BUCKETS", "length_bucket", "TileTuner", "device_cache_file"]
