"""TorchRec backend of the sparse runtime: the merged tables as one ``EmbeddingCollection`` sharded by
``DistributedModelParallel`` (planner by default; ``row`` / ``table`` / ``column`` constrain it),
``fused`` compute kernel with the optimizer applied in the backward (the kernel TorchRec runs on CPU;
fbgemm's CPU TBE has SGD, Adagrad and row-wise Adagrad, not Adam).

A lookup is TorchRec's own three phases, called one by one so each is timed: ``input_dist`` (the
KJT all-to-all of the ids), ``compute`` (the TBE lookup on the owner) and ``output_dist`` (the
embedding all-to-all). The KJT holds one "sample" per rank with the (valid, stage-1 unique) ids of
one table; the other tables' lengths are 0. Stage-2 dedup (``unique`` of the ids an owner received
from all senders) wraps the TBE modules of the sharded collection: TorchRec's own
``use_index_dedup`` needs CUDA-only fbgemm ops.
"""
from __future__ import annotations

import time
import types
from typing import Any

import torch
import torch.distributed as dist

from .dedup import LookupStats
from .features import TablePlan
from .sparse import Tables

SHARDING_TYPES = {"row": "row_wise", "table": "table_wise", "column": "column_wise"}
FUSED_OPTIMIZERS = {"sgd": "EXACT_SGD", "adagrad": "EXACT_ADAGRAD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD"}


def _dedup_forward(emb_op, tables: "TorchRecTables"):
    """Stage 2 around one TBE module: look each distinct (feature, id) up once, re-expand after."""
    original = emb_op.forward

    def forward(self, features):
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        values, lengths = features.values(), features.lengths().view(len(features.keys()), -1)
        per_key = lengths.sum(1).tolist()
        uniques, inverses, base = [], [], 0
        for chunk in values.split(per_key):
            u, inv = torch.unique(chunk, return_inverse=True)
            uniques.append(u)
            inverses.append(inv + base)
            base += u.numel()
        new_lengths = torch.zeros_like(lengths)
        new_lengths[:, 0] = torch.tensor([u.numel() for u in uniques], dtype=lengths.dtype)
        deduped = KeyedJaggedTensor(keys=features.keys(), values=torch.cat(uniques),
                                    lengths=new_lengths.view(-1), stride=features.stride())
        tables.stats.rows_read += base
        out = original(deduped)
        return out[torch.cat(inverses)] if inverses else out

    emb_op.forward = types.MethodType(forward, emb_op)


class TorchRecTables(Tables):
    def __init__(self, plan: TablePlan, *, sharding: str = "auto", stage2: bool = True,
                 fused_optimizer: dict[str, Any] | None = None) -> None:
        super().__init__(plan)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec import EmbeddingCollection, EmbeddingConfig
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
        from torchrec.distributed.types import ShardingEnv

        if sharding not in ("auto", *SHARDING_TYPES):
            raise ValueError(f"sharding must be auto, row, table or column, got {sharding!r}")
        dims = {t.dim for t in plan.tables.values()}
        if len(dims) > 1:
            raise ValueError(f"TorchRec's EmbeddingCollection needs one embedding dim for all tables, got {sorted(dims)}")
        if dims and next(iter(dims)) % 4:
            raise ValueError(f"fbgemm's table kernels need an embedding dim that is a multiple of 4, got "
                             f"{next(iter(dims))} (use the native backend, or another dim)")
        bad = [t.name for t in plan.tables.values() if t.dtype != torch.float32]
        if bad:
            raise ValueError(f"tables {bad}: TorchRec's CPU kernels train float32 tables only")
        options = dict(fused_optimizer or {"type": "sgd", "lr": 0.01})
        kind = options.pop("type")
        if kind not in FUSED_OPTIMIZERS:
            raise ValueError(f"fused optimizer must be one of {sorted(FUSED_OPTIMIZERS)} on CPU, got {kind!r}")
        fused = {"optimizer": getattr(EmbOptimType, FUSED_OPTIMIZERS[kind]),
                 "learning_rate": options.pop("lr"), **options}
        # TorchRec divides embedding gradients by the world size in the all-to-all backward (to pair with
        # DDP's averaging); the runtime's loss is already each rank's share of the global mean.
        from torchrec.distributed.comm_ops import set_gradient_division

        set_gradient_division(False)
        self.sharding, self.stage2, self.keys = sharding, stage2, list(plan.tables)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        ec = EmbeddingCollection(device=torch.device("meta"), tables=[
            EmbeddingConfig(name=name, embedding_dim=t.dim, num_embeddings=t.num_rows, feature_names=[name])
            for name, t in plan.tables.items()])
        sharder = EmbeddingCollectionSharder(fused_params=fused)
        constraints = {name: ParameterConstraints(
            sharding_types=[SHARDING_TYPES[sharding]] if sharding != "auto" else None, compute_kernels=["fused"])
            for name in plan.tables}
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=self.world, compute_device="cpu"),
                                           constraints=constraints)
        self.sharding_plan = planner.collective_plan(ec, [sharder], dist.group.WORLD)
        dmp = DistributedModelParallel(ec, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                       device=torch.device("cpu"), sharders=[sharder], plan=self.sharding_plan)
        # Kept out of the module tree: DMP expects to be the root — as a submodule its state_dict hooks
        # rename every key of the enclosing model. Checkpoints take ``dmp.state_dict()`` explicitly.
        object.__setattr__(self, "dmp", dmp)
        object.__setattr__(self, "sharded", dmp.module)
        if stage2:
            for lookup in self.sharded._lookups:
                for emb_op in getattr(lookup, "_emb_modules", []):
                    _dedup_forward(emb_op, self)
        self.seconds = {"id_all_to_all": 0.0, "table_lookup": 0.0, "embedding_all_to_all": 0.0}

    def describe(self) -> str:
        return "; ".join(f"{name}: {ps.sharding_type} on ranks {ps.ranks}"
                         for plan in self.sharding_plan.plan.values() for name, ps in plan.items())

    @property
    def fused_optimizer(self):
        return self.dmp.fused_optimizer

    def sparse_parameters(self) -> list:
        return []

    def lookup(self, table: str, rows: torch.Tensor) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        lengths = torch.tensor([rows.numel() if k == table else 0 for k in self.keys])
        kjt = KeyedJaggedTensor(keys=self.keys, values=rows, lengths=lengths, stride=1)
        sec = self.sharded
        t0 = time.perf_counter()
        ctx = sec.create_context()
        dist_input = sec.input_dist(ctx, kjt).wait().wait()
        t1 = time.perf_counter()
        if not self.stage2:
            self.stats.rows_read += sum(int(f.values().numel()) for f in dist_input)
        output = sec.compute(ctx, dist_input)
        t2 = time.perf_counter()
        result = sec.output_dist(ctx, output).wait()
        t3 = time.perf_counter()
        for key, seconds in zip(self.seconds, (t1 - t0, t2 - t1, t3 - t2)):
            self.seconds[key] += seconds
        received = 0
        for features, sharding_type in zip(dist_input, sec._sharding_type_to_sharding):
            per_sender = features.lengths().view(-1, self.world)
            others = int(per_sender.sum()) - int(per_sender[:, self.rank].sum())
            received += others
            dim = sec._embedding_dim_for_sharding_type(sharding_type)
            self.stats.rows_sent += others
            self.stats.embedding_bytes += others * dim * 4
        self.stats.add(LookupStats(ids_sent=received, id_bytes=received * rows.element_size(), lookups=1))
        return result[table].values()

    def _state(self, table: str):
        return self.dmp.state_dict()[f"embeddings.{table}.weight"]

    @torch.no_grad()
    def load_full(self, table: str, weight: torch.Tensor) -> None:
        for shard in self._state(table).local_shards():
            (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.copy_(weight[r:r + h, c:c + w])

    @torch.no_grad()
    def full(self, table: str) -> torch.Tensor:
        spec = self.plan.tables[table]
        out = torch.zeros(spec.num_rows, spec.dim)
        for shard in self._state(table).local_shards():  # shards are disjoint: a sum assembles them
            (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            out[r:r + h, c:c + w] = shard.tensor
        dist.all_reduce(out)
        return out


__all__ = ["FUSED_OPTIMIZERS", "SHARDING_TYPES", "TorchRecTables"]
