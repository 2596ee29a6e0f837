"""Checkpoint files of the native (row-wise, HSP) and dynamic hash-table sparse backends, in a
layout that any later world size loads (TorchRec's tables go through DCP instead: ``parallel.py``).

Design: every owner writes the rows it owns as plain tensors, with their optimizer state laid out
like the rows, and a loading rank picks out of each file the rows the *new* layout gives it. Nothing
is gathered on one rank (a table larger than one rank's memory saves and loads), and files are read
memory-mapped, so a loading rank holds its new shard plus the pages it touches, not whole old shards.

Files, next to ``dense.pt`` and the manifest (which hashes them like every other file):

* ``native_<s>_of_<S>.pt`` — written by shard rank ``s`` of ``S`` (with HSP only the ranks of group 0
  write: the other groups hold the same rows and optimizer state). ``{"shard_rank", "shard_world",
  "tables": {table: {"num_rows", "dim", "weight" [n_s, D], "per_row", "shared"}}}``: local row ``i``
  is global row ``s + S·i`` (``dedup.py``'s layout). ``per_row[j][key]`` is the state entry ``key`` of
  optimizer ``j`` (the trainer's list: Adam's ``exp_avg`` / ``exp_avg_sq``, Adagrad's ``sum``, the
  row-wise Adagrad's ``sum`` [n_s]) whose first dimension is the shard's rows: it travels with them.
  ``shared[j]`` holds the others (``step``); loading on another layout checks they agree across shards.
* ``dynamic_<r>_of_<W>.pt`` — written by every rank (ids are owned by ``id % W``): per hash table
  ``DynamicEmbedding.export_rows()``: sorted ids, values, row-wise Adagrad accumulator, counts,
  last_seen, step clock. A loading rank keeps the ids ``id % W' == rank``.

``dense.pt`` keeps the trainer's optimizers' state dicts without the shards' entries (they are in
the row files) and ``sparse_layout``: the shard world ``S`` and dynamic world ``W`` the files were
written with. One process with dynamic tables keeps the same per-table payload inside its ``state.pt``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..runtime.sparse import DynamicTables, NativeTables
from . import checkpoint

LAYOUT_KEY = "sparse_layout"
OptimizerEntries = dict[int, dict[str, Any]]  # optimizer index -> its state entries for one parameter


def native_file(rank: int, world: int) -> str:
    return f"native_{rank}_of_{world}.pt"


def dynamic_file(rank: int, world: int) -> str:
    return f"dynamic_{rank}_of_{world}.pt"


def _shards(tables: NativeTables) -> dict[str, Any]:
    return {name: tables._shard(name) for name in tables.tables}  # the ShardedEmbedding of each table


def _hash_tables(dynamic: DynamicTables) -> dict[str, Any]:
    return {name: dynamic._hash_table(name) for name in dynamic.tables}


def _dynamic_rank(dynamic: DynamicTables) -> tuple[int, int]:
    """(rank, world) over which the hash tables are sharded by id (0, 1 in one process)."""
    for module in dynamic.tables.values():
        if hasattr(module, "world"):
            return module.rank, module.world
    return 0, 1


def layout(runtime) -> dict[str, Optional[int]]:
    """How the row files of a checkpoint are split (the same on every rank)."""
    out: dict[str, Optional[int]] = {"native_world": None, "dynamic_world": None}
    if runtime is None:
        return out
    if isinstance(runtime.tables, NativeTables) and runtime.tables.tables:
        out["native_world"] = next(iter(_shards(runtime.tables).values())).world
    if runtime.dynamic is not None and runtime.dynamic.tables:
        out["dynamic_world"] = _dynamic_rank(runtime.dynamic)[1]
    return out


# -- optimizer state of the shard parameters -------------------------------------------------------
def _flat_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in ``state_dict()``'s index order."""
    return [p for group in opt.param_groups for p in group["params"]]


def shard_parameters(runtime) -> list[nn.Parameter]:
    """Parameters whose optimizer state lives in the row files, not in ``dense.pt``."""
    if runtime is None or not isinstance(runtime.tables, NativeTables):
        return []
    return [shard.weight for shard in _shards(runtime.tables).values()]


def dense_optimizer_states(optimizers: Iterable[torch.optim.Optimizer], runtime) -> list[dict[str, Any]]:
    """Each optimizer's ``state_dict()`` without the entries of the native shards (they differ per
    rank and are written with their rows)."""
    skip = {id(p) for p in shard_parameters(runtime)}
    out = []
    for opt in optimizers:
        sd = opt.state_dict()
        drop = {i for i, p in enumerate(_flat_params(opt)) if id(p) in skip}
        out.append({**sd, "state": {k: v for k, v in sd["state"].items() if k not in drop}})
    return out


def load_optimizers(optimizers: Iterable[torch.optim.Optimizer], saved: list[dict[str, Any]],
                    shard_entries: dict[int, OptimizerEntries]) -> None:
    """``opt.load_state_dict`` of the saved (dense) states with the shards' entries put back at their
    parameters' indices. ``shard_entries``: ``id(shard weight) -> {optimizer index: entries}``."""
    for j, (opt, sd) in enumerate(zip(optimizers, saved)):
        state = dict(sd["state"])
        for i, p in enumerate(_flat_params(opt)):
            entries = shard_entries.get(id(p), {}).get(j)
            if entries:
                state[i] = entries
        opt.load_state_dict({**sd, "state": state})


def _split_entries(optimizers: list[torch.optim.Optimizer], param: torch.Tensor) -> tuple[dict, dict]:
    """``(per_row, shared)``: ``param``'s state in each optimizer holding it, split into the entries
    laid out like its rows and the rest."""
    per_row: dict[int, dict[str, torch.Tensor]] = {}
    shared: dict[int, dict[str, Any]] = {}
    for j, opt in enumerate(optimizers):
        if not any(p is param for p in _flat_params(opt)):
            continue
        per_row[j], shared[j] = {}, {}
        for key, value in opt.state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == param.shape[0]:
                per_row[j][key] = value.detach()
            else:
                shared[j][key] = value
    return per_row, shared


# -- save ------------------------------------------------------------------------------------------
def save_rank_files(directory: Path, runtime, optimizers: list[torch.optim.Optimizer]) -> list[str]:
    """Write this rank's row files into ``directory``; the names written (for the manifest)."""
    written = []
    if runtime is None:
        return written
    if isinstance(runtime.tables, NativeTables) and runtime.tables.tables:
        shards = _shards(runtime.tables)
        first = next(iter(shards.values()))
        # HSP: group 0's ranks (global ranks 0..S-1, shard ranks 0..S-1) write; replicas hold the same
        if dist.get_rank() < first.world:
            tables = {}
            for name, shard in shards.items():
                per_row, shared = _split_entries(optimizers, shard.weight)
                tables[name] = {"num_rows": shard.num_embeddings, "dim": shard.dim, "weight": shard.weight.detach(),
                                "per_row": per_row, "shared": shared}
            name = native_file(first.rank, first.world)
            torch.save({"shard_rank": first.rank, "shard_world": first.world, "tables": tables}, directory / name)
            written.append(name)
    if runtime.dynamic is not None and runtime.dynamic.tables and dist.is_initialized():
        rank, world = _dynamic_rank(runtime.dynamic)
        name = dynamic_file(rank, world)
        torch.save(dynamic_payload(runtime.dynamic), directory / name)
        written.append(name)
    return written


def dynamic_payload(dynamic: DynamicTables) -> dict[str, dict[str, Any]]:
    """Every hash table's ``export_rows()`` (this rank's ids)."""
    return {name: table.export_rows() for name, table in _hash_tables(dynamic).items()}


# -- load ------------------------------------------------------------------------------------------
def _read(path: Path) -> dict[str, Any]:
    """A row file, memory-mapped (only the rows picked out of it are read). The file was verified
    against the manifest before; a failure here names it all the same."""
    return checkpoint.torch_load(path, mmap=True, weights_only=True)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return type(a) is type(b) and a == b


def load_rank_files(directory: Path, saved_layout: Optional[dict[str, Any]], runtime) -> dict[int, OptimizerEntries]:
    """Load the rows this rank owns now from ``directory``'s row files (written with
    ``saved_layout``) into the tables; returns the shards' optimizer entries for ``load_optimizers``."""
    current = layout(runtime)
    saved_layout = saved_layout or {"native_world": None, "dynamic_world": None}
    for kind in ("native_world", "dynamic_world"):
        if (current[kind] is None) != (saved_layout.get(kind) is None):
            what = "native sharded tables" if kind == "native_world" else "dynamic hash tables"
            has = "has" if saved_layout.get(kind) is not None else "has no"
            raise ValueError(f"checkpoint {directory} {has} {what}, this run {'has' if current[kind] else 'has none'}")
    entries: dict[int, OptimizerEntries] = {}
    if current["native_world"] is not None:
        entries = _load_native(directory, saved_layout["native_world"], runtime.tables)
    if current["dynamic_world"] is not None:
        rank, world = _dynamic_rank(runtime.dynamic)
        saved_world = saved_layout["dynamic_world"]
        if saved_world == world:  # the same owners: this rank's own file, as it was
            load_dynamic(runtime.dynamic, [_read(directory / dynamic_file(rank, world))], origin=str(directory))
        else:
            payloads = [_read(directory / dynamic_file(r, saved_world)) for r in range(saved_world)]
            load_dynamic(runtime.dynamic, payloads, keep=(rank, world), origin=str(directory))
    return entries


def load_dynamic(dynamic: DynamicTables, payloads: list[dict[str, Any]], keep: Optional[tuple[int, int]] = None,
                 origin: str = "checkpoint") -> None:
    """Rebuild every hash table from saved payloads (``dynamic_payload``): all their ids, or with
    ``keep=(rank, world)`` the ids with ``id % world == rank`` (the ids this rank owns now)."""
    for name, table in _hash_tables(dynamic).items():
        parts = []
        for payload in payloads:
            if name not in payload:
                raise ValueError(f"{origin}: no rows of dynamic table {name!r} (tables saved: {sorted(payload)})")
            part = payload[name]
            if keep is not None:
                mask = part["ids"] % keep[1] == keep[0]
                part = {**part, **{k: part[k][mask] for k in ("ids", "values", "counts", "last_seen")},
                        "adagrad": None if part["adagrad"] is None else part["adagrad"][mask]}
            parts.append(part)
        ids = torch.cat([p["ids"] for p in parts])
        order = torch.argsort(ids)
        adagrad = None
        if any(p["adagrad"] is not None for p in parts):
            adagrad = torch.cat([p["adagrad"] if p["adagrad"] is not None else torch.zeros(p["ids"].numel(),
                                                                                        dtype=p["values"].dtype)
                                 for p in parts])[order]
        steps = {int(p["step"]) for p in parts}
        table.load_rows(ids[order], torch.cat([p["values"] for p in parts])[order], adagrad=adagrad,
                        counts=torch.cat([p["counts"] for p in parts])[order],
                        last_seen=torch.cat([p["last_seen"] for p in parts])[order], step=max(steps))


@torch.no_grad()
def _load_native(directory: Path, saved_world: int, tables: NativeTables) -> dict[int, OptimizerEntries]:
    shards = _shards(tables)
    first = next(iter(shards.values()))
    rank, world = first.rank, first.world
    same_layout = saved_world == world
    sources = [native_file(rank, world)] if same_layout else [native_file(s, saved_world) for s in range(saved_world)]
    weights = {name: torch.empty_like(shard.weight) for name, shard in shards.items()}
    filled = {name: 0 for name in shards}
    per_row: dict[str, dict[int, dict[str, torch.Tensor]]] = {name: {} for name in shards}
    shared: dict[str, Optional[dict]] = {name: None for name in shards}
    for source in sources:
        path = directory / source
        saved = _read(path)
        s, S = saved["shard_rank"], saved["shard_world"]
        for name, shard in shards.items():
            entry = saved["tables"].get(name)
            if entry is None:
                raise ValueError(f"{path}: no rows of table {name!r} (tables saved: {sorted(saved['tables'])})")
            if (entry["num_rows"], entry["dim"]) != (shard.num_embeddings, shard.dim):
                raise ValueError(f"{path}: table {name!r} is [{entry['num_rows']}, {entry['dim']}] in the checkpoint, "
                                 f"[{shard.num_embeddings}, {shard.dim}] in this run")
            rows = s + S * torch.arange(entry["weight"].shape[0])
            mask = rows % world == rank
            dest = rows[mask] // world
            weights[name][dest] = entry["weight"][mask]
            filled[name] += int(mask.sum())
            if shared[name] is None:
                shared[name] = entry["shared"]
            elif not (shared[name].keys() == entry["shared"].keys() and all(
                    shared[name][j].keys() == entry["shared"][j].keys()
                    and all(_same(shared[name][j][k], v) for k, v in entry["shared"][j].items())
                    for j in entry["shared"])):
                raise ValueError(f"{path}: table {name!r}: the optimizer state that is not per row ({entry['shared']}) "
                                 f"differs from another shard's ({shared[name]}): it cannot be resharded")
            for j, state in entry["per_row"].items():
                into = per_row[name].setdefault(j, {})
                if source != sources[0] and into.keys() != state.keys():
                    raise ValueError(f"{path}: table {name!r}: optimizer {j} has state {sorted(state)} here and "
                                     f"{sorted(into)} in another shard: it cannot be resharded")
                for key, value in state.items():
                    if key not in into:
                        into[key] = value.new_zeros((shard.weight.shape[0], *value.shape[1:]))
                    into[key][dest] = value[mask]
        del saved
    entries: dict[int, OptimizerEntries] = {}
    for name, shard in shards.items():
        if filled[name] != shard.weight.shape[0]:
            raise ValueError(f"{directory}: table {name!r}: {filled[name]} of the {shard.weight.shape[0]} rows of "
                             f"shard {rank} of {world} found in {sources}")
        shard.weight.copy_(weights[name])
        entries[id(shard.weight)] = {j: {**(shared[name] or {}).get(j, {}), **per_row[name].get(j, {})}
                                     for j in (shared[name] or {})}
    return entries


__all__ = ["LAYOUT_KEY", "dense_optimizer_states", "dynamic_file", "dynamic_payload", "layout", "load_dynamic",
           "load_optimizers", "load_rank_files", "native_file", "save_rank_files", "shard_parameters"]
