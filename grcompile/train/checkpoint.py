"""Checkpoints that resume to exactly the uninterrupted run: weights, optimizer, torch RNG, the
position in the (seeded, deterministic) data order, and the early-stopping state."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

LATEST = "latest.pt"


def save(directory: str | os.PathLike, state: dict[str, Any]) -> Path:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / (LATEST + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path / LATEST)  # atomic: an interrupted save never leaves a torn checkpoint
    return path / LATEST


def load(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / LATEST
    if not path.exists():
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    return torch.load(path, map_location="cpu", weights_only=False)
