"""What the training loop does differently on N ranks: sparse tables sharded by the runtime, the
dense part data-parallel, every rank on its slice of the global batch.

Equal to one process step by step (tested): each rank's loss is its slice's *sum* over the global
number of targets (``count_targets`` of the whole batch, known to every rank without communication),
so the sparse gradients — summed by the embedding all-to-all's backward — and the dense gradients —
summed here by one all-reduce — are exactly the single-process gradients of the global mean.
"""
from __future__ import annotations

import copy
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..runtime.features import find_sparse_features
from ..runtime.dedup import LookupStats
from ..runtime.features import FeatureConfig
from ..runtime.sparse import DYNAMIC_ATTR, TABLES_ATTR, NativeTables, SparseRuntime, dense_parameters, shard_embeddings
from . import checkpoint, sparse_checkpoint
from .config import SPARSE_OPTIMIZERS, TrainConfig, sparse_optimizer_problem
from .sparse_optim import ADAGRAD_EPS, RowWiseAdagrad


@dataclass
class Parallel:
    world: int = 1
    rank: int = 0
    runtime: Optional[SparseRuntime] = None
    distributed: bool = False  # tables over a process group (else: a one-process runtime, or none)
    seconds: dict[str, float] = field(default_factory=lambda: {"dense_all_reduce": 0.0, "hsp_sync": 0.0})
    balance: str = "equal"  # rows to ranks: equal | tokens | cost
    cost: Any = "tokens"  # balance's cost of a row (a SequenceCost for "cost")
    _pinned: dict = field(default_factory=dict)  # id(batch ids) -> (ids, parts): pin_assignment

    @classmethod
    def setup(cls, task: nn.Module, config: TrainConfig, log=print) -> "Parallel":
        dynamic = [FeatureConfig(m, dynamic=True) for m in config.dynamic_features]
        _check_sparse_optimizer(config)
        fused = {"type": config.sparse_optimizer, "lr": config.sparse_lr or config.lr}
        if dynamic and config.sparse_optimizer == "rowwise_adagrad":
            fused["type"] = "adagrad"  # the hash tables' name for their row-wise Adagrad (hash_embedding.py)
        if config.sharding is None:
            if not dynamic:
                return cls()
            runtime = shard_embeddings(task, backend="local", features=dynamic, dedup=config.dedup,
                                       fused_optimizer=fused, seed=config.seed, log=log)
            return cls(runtime=runtime)
        if not dist.is_initialized():
            raise RuntimeError("--sharding needs torch.distributed: launch with torchrun (or init a process group)")
        world, rank = dist.get_world_size(), dist.get_rank()
        if config.batch_size % world:
            raise ValueError(f"--batch-size {config.batch_size} (global) must be a multiple of the {world} ranks")
        runtime = shard_embeddings(task, backend=config.sparse_backend, dedup=config.dedup, sharding=config.sharding,
                                   group_size=config.hsp_group_size, fused_optimizer=fused, features=dynamic,
                                   seed=config.seed, log=log if rank == 0 else None)
        if rank == 0 and hasattr(runtime.tables, "describe"):
            log(f"[grcompile.train] sharding plan: {runtime.tables.describe()}")
        cost: Any = "tokens"
        if config.balance == "cost":
            from ..bench.flops import sequence_cost

            cost = sequence_cost(task.encoder.config, config.num_negatives)
        return cls(world=world, rank=rank, runtime=runtime, distributed=True, balance=config.balance, cost=cost)

    def check_checkpointable(self) -> None:
        """Fail at start, not at the first save: which sparse state a checkpoint can hold. Written:
        TorchRec tables (DCP), native row-wise tables with or without HSP and dynamic hash tables (row
        files, ``sparse_checkpoint.py``), the one-process tables (in ``state.pt``)."""
        if self.runtime is None or not self.distributed:
            return
        tables = self.runtime.tables
        if not (hasattr(tables, "dmp") or isinstance(tables, NativeTables) or not tables.plan.tables):
            raise NotImplementedError(f"distributed checkpoints hold TorchRec or native sparse tables, not "
                                      f"{type(tables).__name__}")

    def begin_step(self) -> None:
        if self.runtime is not None:
            self.runtime.new_step()

    # -- data -----------------------------------------------------------------------------------
    def assignment(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Rows of the global batch per rank (every rank computes the same): equal slices, or the
        greedy of ``data/balance.py`` on tokens or estimated cost (``balance``), or what
        ``pin_assignment`` fixed for this batch."""
        from ..data.balance import assign_rows, equal_slices, row_lengths

        pinned = self._pinned.get(id(batch["ids"]))
        if pinned is not None and pinned[0] is batch["ids"]:
            return pinned[1]
        if self.balance == "equal":
            return equal_slices(batch["ids"].shape[0], self.world)
        return assign_rows(row_lengths(batch["ids"]), self.world, self.cost)

    def pin_assignment(self, batch: dict[str, torch.Tensor], parts: list[torch.Tensor]) -> None:
        """Use ``parts`` for ``batch`` (LBSL cuts a batch after assigning its rows: the cut batch
        keeps the rows the load targets were set for). The last few batches are remembered."""
        self._pinned[id(batch["ids"])] = (batch["ids"], parts)
        while len(self._pinned) > 4:
            del self._pinned[next(iter(self._pinned))]

    def local(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.distributed:
            return batch
        rows = self.assignment(batch)[self.rank]
        return {k: v[rows] for k, v in batch.items()}

    def loss_weight(self, task: nn.Module, batch: dict, local: dict) -> float:
        """Multiply the slice's mean loss by this to get its share of the global mean."""
        if not self.distributed:
            return 1.0
        return task.count_targets(local["ids"]) / max(task.count_targets(batch["ids"]), 1)

    # -- gradients ------------------------------------------------------------------------------
    def sync_gradients(self, task: nn.Module) -> None:
        t0 = time.perf_counter()
        if self.runtime is not None:
            self.runtime.after_backward()
        t1 = time.perf_counter()
        self.seconds["hsp_sync"] += t1 - t0
        if not self.distributed:
            return
        all_reduce_gradients([p for p in dense_parameters(task) if p.requires_grad])
        self.seconds["dense_all_reduce"] += time.perf_counter() - t1

    # -- best-state snapshots (tables gathered whole: any world size can restore them) ----------
    def snapshot(self, task: nn.Module) -> dict[str, Any]:
        """Dense state + static tables (dynamic hash tables are not snapshotted: they keep training state)."""
        if self.runtime is None:
            return copy.deepcopy(task.state_dict())
        return {"dense": dense_state(task), "tables": {t: self.runtime.tables.full(t) for t in self.runtime.tables.plan.tables}}

    def restore(self, task: nn.Module, snapshot: dict[str, Any]) -> None:
        if self.runtime is None:
            task.load_state_dict(snapshot)
            return
        load_dense(task, snapshot["dense"])
        for name, weight in snapshot["tables"].items():
            self.runtime.tables.load_full(name, weight)

    # -- one-process checkpoints (state.pt; distributed ones: save_distributed / load_distributed) ----
    def local_checkpoint(self, task: nn.Module, optimizers: list) -> dict[str, Any]:
        """The model and optimizers of a one-process run; dynamic hash tables as their rows
        (``sparse_checkpoint.dynamic_payload``), not as value blocks that a fresh table lacks."""
        dynamic = self.runtime.dynamic if self.runtime is not None else None
        model = {k: v for k, v in task.state_dict().items() if not (dynamic is not None and k.startswith(DYNAMIC_ATTR))}
        out = {"model": model, "optimizers": [o.state_dict() for o in optimizers]}
        if dynamic is not None:
            out["dynamic_tables"] = sparse_checkpoint.dynamic_payload(dynamic)
        return out

    def load_local_checkpoint(self, task: nn.Module, optimizers: list, saved: dict[str, Any]) -> None:
        dynamic = self.runtime.dynamic if self.runtime is not None else None
        if dynamic is None:
            task.load_state_dict(saved["model"])
        else:
            if "dynamic_tables" not in saved:
                raise ValueError(f"checkpoint {saved['resumed'].path} holds no dynamic hash tables")
            missing, unexpected = task.load_state_dict(saved["model"], strict=False)
            wrong = [k for k in [*missing, *unexpected] if not k.startswith(DYNAMIC_ATTR)]
            if wrong:
                raise ValueError(f"checkpoint does not match the model: differing keys {sorted(wrong)[:5]}")
            sparse_checkpoint.load_dynamic(dynamic, [saved["dynamic_tables"]], origin=str(saved["resumed"].path))
        for opt, sd in zip(optimizers, saved["optimizers"]):
            opt.load_state_dict(sd)

    def sparse_stats(self) -> dict[str, int]:
        """Ids, bytes and rows through this rank's lookups so far (static + dynamic tables, HSP sync)."""
        if self.runtime is None:
            return {}
        stats = LookupStats(**self.runtime.tables.stats.as_dict())
        if self.runtime.dynamic is not None:
            stats.add(self.runtime.dynamic.stats)
        return {**stats.as_dict(), "hsp_sync_bytes": getattr(self.runtime.tables, "sync_bytes", 0)}

    def feature_weights(self, task: nn.Module) -> dict[str, torch.Tensor]:
        """Every sparse feature's whole table (gathered on every rank when sharded)."""
        if self.runtime is None:
            modules = dict(task.named_modules())
            return {f.name: modules[f.module].weight.detach().clone() for f in find_sparse_features(task)}
        return {name: self.runtime.full_weight(name) for name, f in self.runtime.plan.features.items() if not f.dynamic}

    def agree(self, decision: bool) -> bool:
        """``decision`` of any rank, on every rank (a time limit read on each rank's own clock must
        stop them all at the same step, or their collectives would no longer pair)."""
        if not self.distributed:
            return decision
        flag = torch.tensor([int(decision)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def global_loss(self, weighted_loss: torch.Tensor) -> float:
        value = weighted_loss.detach().clone()
        if self.distributed:
            dist.all_reduce(value)
        return float(value)


class StepTiming:
    """Per-step wall time split into the sparse lookups (TorchRec backend: id all-to-all, table
    lookup, embedding all-to-all), the sparse backward (embedding all-to-all backward + table
    update), the gradient syncs, and the rest — the dense forward/backward and optimizer step."""

    def __init__(self, parallel: Parallel) -> None:
        self.parallel = parallel
        self.steps: list[dict[str, float]] = []

    def _counters(self) -> dict[str, float]:
        p = self.parallel
        out = dict(p.seconds)
        if p.runtime is not None:
            out.update({f"sparse_{k}": v for k, v in p.runtime.seconds.items()})
            out.update(getattr(p.runtime.tables, "seconds", {}))
        return out

    def begin(self) -> None:
        self._start, self._before = time.perf_counter(), self._counters()

    def end(self) -> None:
        total = time.perf_counter() - self._start
        step = {k: v - self._before.get(k, 0.0) for k, v in self._counters().items()}
        step["total"] = total
        spent = sum(v for k, v in step.items() if k in ("sparse_forward", "sparse_backward", "dense_all_reduce", "hsp_sync"))
        step["dense_compute_and_optimizer"] = total - spent
        self.steps.append(step)

    def summary(self, warmup: int = 2) -> dict[str, float]:
        """Mean milliseconds per step after ``warmup`` steps (compilation happens there)."""
        steps = self.steps[warmup:] if len(self.steps) > warmup else self.steps
        if not steps:
            return {}
        return {k: 1e3 * sum(s[k] for s in steps) / len(steps) for k in steps[0]} | {"steps_measured": len(steps)}


def _check_sparse_optimizer(config: TrainConfig) -> None:
    """Refuse a sparse optimizer that would not train as it does in one process (``config.py``)."""
    if config.sparse_optimizer not in SPARSE_OPTIMIZERS:
        raise ValueError(f"sparse optimizer must be one of {SPARSE_OPTIMIZERS}, got {config.sparse_optimizer!r} "
                         f"(resolve_sparse_optimizer fills in the default)")
    problem = sparse_optimizer_problem(config, config.sparse_optimizer)
    if problem is not None:
        raise ValueError(f"--sparse-optimizer {config.sparse_optimizer}: {problem}")


def all_reduce_gradients(params: list[nn.Parameter]) -> None:
    """Sum ``params``' gradients over the ranks in one flattened all-reduce (a missing gradient
    counts as zeros, so every rank sends the same layout)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    for p, chunk in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = chunk.view_as(p)


def make_optimizers(task: nn.Module, config: TrainConfig, parallel: Parallel) -> list[torch.optim.Optimizer]:
    """``config.dense_optimizer`` (Adam by default) for the dense part; the sparse tables get
    ``config.sparse_optimizer`` (``adam``: the same Adam; on TorchRec the optimizer is fused into the
    backward and not listed here). The Adagrads match fbgemm's kernels (``sparse_optim.py``): the
    same update in one process, on native shards and in the dynamic hash tables."""
    _check_sparse_optimizer(config)
    if config.dense_optimizer not in ("adam", "sgd"):
        raise ValueError(f"dense optimizer must be adam or sgd, got {config.dense_optimizer!r}")

    def dense_optimizer(params) -> torch.optim.Optimizer:
        if config.dense_optimizer == "sgd":
            return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
        return torch.optim.Adam(params, lr=config.lr, betas=(0.9, 0.98), weight_decay=config.weight_decay)

    if config.sparse_optimizer == "adam":
        return [dense_optimizer(task.parameters())]
    if parallel.runtime is not None:
        sparse = parallel.runtime.tables.sparse_parameters()
        dense = dense_parameters(task)
    else:
        modules = dict(task.named_modules())
        sparse = [modules[f.module].weight for f in find_sparse_features(task)]
        dense = [p for p in task.parameters() if all(p is not s for s in sparse)]
    optimizers: list[torch.optim.Optimizer] = [dense_optimizer(dense)]
    if sparse:
        lr = config.sparse_lr or config.lr
        if config.sparse_optimizer == "sgd":
            optimizers.append(torch.optim.SGD(sparse, lr=lr))
        elif config.sparse_optimizer == "adagrad":
            optimizers.append(torch.optim.Adagrad(sparse, lr=lr, eps=ADAGRAD_EPS))
        else:
            optimizers.append(RowWiseAdagrad(sparse, lr=lr))
    return optimizers


_SPARSE_PREFIXES = (TABLES_ATTR, DYNAMIC_ATTR)


def dense_state(task: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in task.state_dict().items() if not k.startswith(_SPARSE_PREFIXES)}


@torch.no_grad()
def load_dense(task: nn.Module, dense: dict[str, torch.Tensor]) -> None:
    """Copy the replicated part in place (``load_state_dict`` would run TorchRec's hooks, which
    want the sharded tables in the same dict)."""
    current = {k: v for k, v in task.state_dict(keep_vars=True).items() if not k.startswith(_SPARSE_PREFIXES)}
    if current.keys() != dense.keys():
        raise ValueError(f"checkpoint does not match the model: differing keys "
                         f"{sorted(current.keys() ^ dense.keys())[:5]}")
    for k, v in current.items():
        v.copy_(dense[k])


# -- checkpoints (torch.distributed.checkpoint; layout, manifest and fallback: checkpoint.py) ----------
DENSE = "dense.pt"


def _sharded_state(parallel: Parallel) -> Optional[dict[str, Any]]:
    """The TorchRec tables' state for DCP (None for the other backends: their rows go to the row
    files of ``sparse_checkpoint.py``)."""
    parallel.check_checkpointable()
    tables = parallel.runtime.tables if parallel.runtime is not None else None
    if not hasattr(tables, "dmp"):
        return None
    # Loaded in place: the local shards of these sharded tensors are views of the TBE weights and
    # optimizer states. A rank without a shard (table-wise) has empty containers, which DCP would
    # take for missing leaves: pruned.
    return _prune_empty({"tables": tables.dmp.state_dict(), "fused_optimizer": tables.fused_optimizer.state_dict()})


def _prune_empty(tree: Any) -> Any:
    if isinstance(tree, dict):
        pruned = {k: _prune_empty(v) for k, v in tree.items()}
        return {k: v for k, v in pruned.items() if not (isinstance(v, dict) and not v)}
    return tree


def _rng_file(parallel: Parallel) -> str:
    return f"rng_{parallel.rank}_of_{parallel.world}.pt"


def save_distributed(directory: str | os.PathLike, parallel: Parallel, task: nn.Module,
                     optimizers: list, extra: dict[str, Any], keep: int = checkpoint.KEEP) -> Path:
    """One checkpoint per call: TorchRec's sharded tables + fused optimizer state through DCP, the
    native and dynamic tables as row files with their optimizer state (``sparse_checkpoint.py``) —
    either loads on any later world size —, the replicated dense part from rank 0, each rank's RNG.
    Every rank hashes the files it wrote (its ``__<rank>_*.distcp`` shards or row files, its RNG;
    rank 0 also DCP's ``.metadata`` and ``dense.pt``); rank 0 writes the manifest of them all, then
    renames the directory into place: never a torn or unverifiable checkpoint."""
    import torch.distributed.checkpoint as dcp

    root = Path(directory)
    step = extra["state"]["global_step"]
    name = f"step_{step}"
    tmp = root / (name + ".tmp")
    if parallel.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed: stale shards
        tmp.mkdir(parents=True)
    dist.barrier()
    sharded = _sharded_state(parallel)
    if sharded is not None:
        dcp.save(sharded, checkpoint_id=str(tmp))
    torch.save(torch.get_rng_state(), tmp / _rng_file(parallel))
    written = [_rng_file(parallel), *sorted(p.name for p in tmp.glob(f"__{parallel.rank}_*.distcp"))]
    written += sparse_checkpoint.save_rank_files(tmp, parallel.runtime, optimizers)
    if parallel.rank == 0:
        torch.save({"model": dense_state(task),
                    "optimizers": sparse_checkpoint.dense_optimizer_states(optimizers, parallel.runtime),
                    sparse_checkpoint.LAYOUT_KEY: sparse_checkpoint.layout(parallel.runtime), **extra}, tmp / DENSE)
        written += [DENSE] + ([".metadata"] if sharded is not None else [])
    per_rank: list[Any] = [None] * parallel.world
    dist.all_gather_object(per_rank, checkpoint.digests(tmp, written))
    if parallel.rank == 0:
        files = {k: v for digests in per_rank for k, v in digests.items()}
        unclaimed = [p.name for p in tmp.iterdir() if p.is_file() and p.name not in files]
        files.update(checkpoint.digests(tmp, unclaimed))  # files DCP named otherwise: hashed here
        checkpoint.write_manifest(tmp, files, step)
        checkpoint.publish(root, tmp, name, keep)
    dist.barrier()
    return root / name


def _verify_collectively(parallel: Parallel, path: Path) -> Optional[list[str]]:
    """``checkpoint.verify`` with the files split over the ranks; every rank gets the same answer."""
    try:
        manifest = checkpoint.read_manifest(path)
        if manifest is None:
            mine: Optional[list[str]] = None
        else:
            names = sorted(manifest["files"])[parallel.rank::parallel.world]
            mine = checkpoint.verify_files(path, manifest, names)
    except ValueError as e:
        mine = [str(e)]
    per_rank: list[Any] = [None] * parallel.world
    dist.all_gather_object(per_rank, mine)
    if all(p is None for p in per_rank):
        return None
    return sorted({problem for p in per_rank if p for problem in p})


def _written_by_ranks(path: Path) -> Path:
    """``path``, unless it is a one-process checkpoint: that one cannot resume on ranks (a plain error,
    not a damaged file to skip)."""
    if not (path / DENSE).exists() and (path / checkpoint.STATE).exists():
        raise ValueError(f"--resume: {path} was written by one process ({checkpoint.STATE}); a sharded run "
                         f"resumes from checkpoints written by ranks only: resume it in one process")
    return path


def load_distributed(directory: str | os.PathLike, parallel: Parallel, task: nn.Module, optimizers: list,
                     check_config: Optional[Callable[[dict[str, Any], Path], None]] = None) -> dict[str, Any]:
    """Resume from the newest checkpoint whose files match their manifest (``checkpoint.py``: damaged
    ones are skipped with a warning, on rank 0). ``check_config(saved, path)`` runs before anything is
    loaded into the model or the tables. ``saved["resumed"]`` says which checkpoint was used."""
    import torch.distributed.checkpoint as dcp

    root = Path(directory)
    with warnings.catch_warnings():
        if parallel.rank != 0:
            warnings.simplefilter("ignore", checkpoint.CheckpointWarning)
        saved, resumed = checkpoint.load_newest_good(root, lambda p: _verify_collectively(parallel, p),
                                                     lambda p: checkpoint.torch_load(_written_by_ranks(p) / DENSE))
    if check_config is not None:
        check_config(saved, resumed.path)
    state = _sharded_state(parallel)
    if state is not None:
        dcp.load(state, checkpoint_id=str(resumed.path))
    shard_entries = sparse_checkpoint.load_rank_files(resumed.path, saved.get(sparse_checkpoint.LAYOUT_KEY),
                                                      parallel.runtime)
    load_dense(task, saved["model"])
    sparse_checkpoint.load_optimizers(optimizers, saved["optimizers"], shard_entries)
    rng = resumed.path / _rng_file(parallel)
    saved["rng"] = checkpoint.torch_load(rng) if rng.exists() else None  # another world size: fresh streams
    saved["resumed"] = resumed
    return saved


__all__ = ["Parallel", "SPARSE_OPTIMIZERS", "StepTiming", "load_distributed", "make_optimizers", "save_distributed"]
