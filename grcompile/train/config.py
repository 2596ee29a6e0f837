"""Everything that determines a training run (written into the JSON and the checkpoints)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TrainConfig:
    model: str = "hstu"
    preset: str = "ml1m"
    data: str = "synthetic"
    compile: str = "eager"
    epochs: int = 100
    steps: int | None = None  # stop after this many optimizer steps in total
    max_minutes: float | None = None
    batch_size: int = 128
    eval_batch_size: int = 256
    max_len: int | None = None  # None: the preset's
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.0
    temperature: float = 0.05
    num_negatives: int = 128
    negatives: str = "per-position"  # or "per-row" (shared by a row's positions; cheaper)
    patience: int = 10  # epochs without a better validation NDCG@10 before stopping
    eval_every: int = 1
    k_core: int = 0
    threads: int | None = None
    # distributed (torchrun): None = one process; row | table | column | auto shards the sparse tables
    sharding: str | None = None
    sparse_backend: str = "torchrec"  # or "native" (row-wise on torch.distributed; HSP)
    dedup: str = "two_stage"  # none | comm | lookup | two_stage
    hsp_group_size: int | None = None  # hierarchical sparse parallelism (native backend)
    dense_optimizer: str = "adam"  # or "sgd"
    sparse_optimizer: str = "adam"  # adam (same as dense) | sgd | adagrad | rowwise_adagrad
    sparse_lr: float | None = None  # None: lr
    dynamic_features: list[str] = field(default_factory=list)  # embedding modules made hash tables
    checkpoint_every: int | None = None  # steps between checkpoints (besides every epoch's end)
    synthetic: dict[str, Any] = field(default_factory=dict)  # SyntheticConfig overrides
    model_overrides: dict[str, Any] = field(default_factory=dict)  # ModelConfig overrides

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
