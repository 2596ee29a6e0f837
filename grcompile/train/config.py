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
    synthetic: dict[str, Any] = field(default_factory=dict)  # SyntheticConfig overrides
    model_overrides: dict[str, Any] = field(default_factory=dict)  # ModelConfig overrides

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
