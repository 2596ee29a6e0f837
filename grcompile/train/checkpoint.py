"""Checkpoints that resume to exactly the uninterrupted run — weights, optimizer, torch RNG, the
position in the (seeded, deterministic) data order, the early-stopping state — and that are
checked before they are trusted.

Layout (one process and distributed alike): ``DIR/step_<global step>/`` holds the checkpoint's files
and ``manifest.json``, the size and SHA-256 of every file, written last; ``DIR/LATEST`` names the newest
(for people: loading orders the ``step_*`` directories by their step). A checkpoint is written under
``step_N.tmp`` and renamed when complete, so a killed save leaves no torn checkpoint; the last
``keep`` (2) are kept.

At load the newest checkpoint whose files all match their manifest is used. One that does not
(a flipped byte, a truncated or missing or unreadable file) is skipped with a warning naming the file
and what failed, and the previous one is tried; when none is good the error names every path and
its fault. Checkpoints written before manifests existed (``step_N/`` without ``manifest.json``, or a
single ``latest.pt``) load with a warning that they cannot be verified.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

MANIFEST = "manifest.json"
LATEST = "LATEST"
STATE = "state.pt"  # the one-process checkpoint's one file
LEGACY_FILE = "latest.pt"  # the one-process format before manifests: one file, no checksum
FORMAT = "grcompile-checkpoint/1"
ALGORITHM = "sha256"
KEEP = 2
_CHUNK = 1 << 20


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt) or loaded without verification (no manifest)."""


def file_digest(path: Path, algorithm: str = ALGORITHM) -> dict[str, Any]:
    """``{"bytes": size, algorithm: hex}`` of one file, read in 1 MiB chunks."""
    digest, size = hashlib.new(algorithm), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, algorithm: digest.hexdigest()}


def digests(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    return {name: file_digest(directory / name) for name in names}


def write_manifest(directory: Path, files: dict[str, dict[str, Any]], global_step: int) -> None:
    """Written last (after every file it lists was written and closed), atomically."""
    body = {"format": FORMAT, "algorithm": ALGORITHM, "global_step": global_step, "files": dict(sorted(files.items()))}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, directory / MANIFEST)


def read_manifest(directory: Path) -> Optional[dict[str, Any]]:
    """The manifest, or None when the checkpoint has none (written before manifests). An unreadable
    manifest raises ``ValueError`` naming it."""
    path = directory / MANIFEST
    if not path.exists():
        return None
    try:
        body = json.loads(path.read_text())
        if body.get("format") != FORMAT or not isinstance(body.get("files"), dict):
            raise ValueError(f"not a {FORMAT} manifest")
        return body
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable manifest ({e})") from None


def verify_files(directory: Path, manifest: dict[str, Any], names: Iterable[str]) -> list[str]:
    """What is wrong with ``names`` (entries of the manifest), one line per bad file naming its path."""
    problems = []
    algorithm = manifest.get("algorithm", ALGORITHM)
    for name in names:
        expected, path = manifest["files"][name], directory / name
        try:
            size = path.stat().st_size
            if size != expected["bytes"]:
                problems.append(f"{path}: {size} bytes, the manifest says {expected['bytes']} (truncated or overwritten)")
                continue
            if file_digest(path, algorithm)[algorithm] != expected[algorithm]:
                problems.append(f"{path}: {algorithm} mismatch (the file changed after it was written)")
        except FileNotFoundError:
            problems.append(f"{path}: missing")
        except (OSError, KeyError, TypeError, ValueError) as e:  # unreadable file, or a manifest entry without a digest
            problems.append(f"{path}: cannot be verified ({type(e).__name__}: {e})")
    return problems


def verify(directory: Path) -> Optional[list[str]]:
    """All of ``directory``'s problems ([] when every file matches), or None without a manifest."""
    try:
        manifest = read_manifest(directory)
    except ValueError as e:
        return [str(e)]
    if manifest is None:
        return None
    return verify_files(directory, manifest, manifest["files"])


def candidates(root: Path) -> list[Path]:
    """Complete checkpoints (``step_N`` directories, not ``.tmp``), newest first."""
    found = []
    for path in root.glob("step_*"):
        step = path.name[len("step_"):]
        if path.is_dir() and step.isdigit():
            found.append((int(step), path))
    return [p for _, p in sorted(found, reverse=True)]


def publish(root: Path, tmp: Path, name: str, keep: int = KEEP) -> Path:
    """Rename the finished ``tmp`` to ``root/name`` (replacing a checkpoint of the same step: the
    end of an epoch right after a ``checkpoint_every`` save), point ``LATEST`` at it, drop all but
    the newest ``keep``."""
    final = root / name
    if final.exists():
        aside = root / (name + ".old")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    (root / (LATEST + ".tmp")).write_text(name)
    os.replace(root / (LATEST + ".tmp"), root / LATEST)
    for old in candidates(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


@dataclass
class Resumed:
    """What a load found: the checkpoint used, and the newer ones skipped with their faults."""

    path: Path
    verified: bool
    skipped: list[str] = field(default_factory=list)


def load_newest_good(root: Path, check: Callable[[Path], Optional[list[str]]],
                     open_checkpoint: Callable[[Path], Any]) -> tuple[Any, Resumed]:
    """``open_checkpoint(path)`` of the newest checkpoint under ``root`` that ``check`` (``verify``, or
    a collective variant that gives every rank the same answer) finds good. A damaged one is skipped
    with a warning; so is one that ``open_checkpoint`` cannot read (it raises ``UnreadableCheckpoint``).
    Raises ``FileNotFoundError`` when there is no checkpoint at all, ``RuntimeError`` naming every
    path and fault when none is good."""
    skipped: list[str] = []
    for path in candidates(root):
        problems = check(path)
        if problems:
            skipped.extend(problems)
            warnings.warn(f"checkpoint {path} is damaged, trying the previous one: " + "; ".join(problems),
                          CheckpointWarning, stacklevel=3)
            continue
        if problems is None:
            warnings.warn(f"checkpoint {path} has no {MANIFEST} (written before checksums): loading it "
                          f"unverified", CheckpointWarning, stacklevel=3)
        try:
            opened = open_checkpoint(path)
        except UnreadableCheckpoint as e:
            skipped.append(str(e))
            warnings.warn(f"{e}; trying the previous checkpoint", CheckpointWarning, stacklevel=3)
            continue
        return opened, Resumed(path, verified=problems is not None, skipped=skipped)
    if skipped:
        raise RuntimeError(f"--resume: no good checkpoint in {root}: " + "; ".join(skipped))
    raise FileNotFoundError(f"--resume: no checkpoint in {root}")


class UnreadableCheckpoint(ValueError):
    """A checkpoint file that does not load (the message names it)."""


def torch_load(path: Path, **options: Any) -> Any:
    """``torch.load`` whose failure names the file (a truncated zip says only "failed finding
    central directory"); ``options`` go to ``torch.load`` (e.g. ``mmap=True, weights_only=True``)."""
    try:
        return torch.load(path, **{"map_location": "cpu", "weights_only": False, **options})
    except Exception as e:  # noqa: BLE001 - any failure to unpickle is reported with the path
        raise UnreadableCheckpoint(f"{path}: cannot be loaded ({type(e).__name__}: {e})") from e


# -- one process -----------------------------------------------------------------------------------
def save(directory: str | os.PathLike, state: dict[str, Any], keep: int = KEEP) -> Path:
    """``state`` (with ``state["state"]["global_step"]``) as ``step_N/state.pt`` + manifest."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{state['state']['global_step']}"
    tmp = root / (name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / STATE)
    write_manifest(tmp, digests(tmp, [STATE]), state["state"]["global_step"])
    return publish(root, tmp, name, keep)


def load(directory: str | os.PathLike) -> dict[str, Any]:
    """The newest good checkpoint's state dict (see module docstring), nothing loaded into a model
    yet; ``saved["resumed"]`` (a ``Resumed``) says which checkpoint and what was skipped."""
    root = Path(directory)
    if not candidates(root) and (root / LEGACY_FILE).exists():
        path = root / LEGACY_FILE
        warnings.warn(f"checkpoint {path} is in the format before checksums: loading it unverified",
                      CheckpointWarning, stacklevel=2)
        saved = torch_load(path)
        saved["resumed"] = Resumed(path, verified=False)
        return saved
    saved, resumed = load_newest_good(root, verify, lambda path: torch_load(_written_by_one_process(path) / STATE))
    saved["resumed"] = resumed
    return saved


def _written_by_one_process(path: Path) -> Path:
    if not (path / STATE).exists() and (path / "dense.pt").exists():
        raise ValueError(f"--resume: {path} was written by ranks (dense.pt and shards); one process resumes "
                         f"from a one-process checkpoint only: resume it under torchrun")
    return path


# -- the config written into a checkpoint ------------------------------------------------------------
def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"field: A in the checkpoint, B in this run"`` for every field (and sub-field of a dict
    field such as ``model_overrides``) that differs."""
    out = []
    for key in sorted(saved.keys() | current.keys()):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(f"{key}.{d}" for d in config_differences(a, b))
        else:
            out.append(f"{key}: {a!r} in the checkpoint, {b!r} in this run")
    return out
