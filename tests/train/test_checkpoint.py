"""One-process checkpoints are verified before they are trusted (issue 13).

A run of 5 steps checkpoints at steps 4 and 5 (``--checkpoint-every 4``, 4 steps an epoch; the two
newest are kept). Each test damages a copy of that directory the way disks and killed jobs do —
40 bytes flipped inside the tensor data (before checksums this resumed silently, with different
losses), the file truncated — and resumes to step 8: the damaged checkpoint is skipped with a
warning naming the file and the fault, the previous one is used, and the losses equal the
uninterrupted 8-step run exactly. With both damaged the error names both files. Checkpoints without a
manifest (the format before this one) load with a warning that they are unverified; a truncated one
of those fails naming the file. ``--resume`` with another model fails before any weight is loaded,
naming the fields that differ.
"""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from grcompile.train import checkpoint
from grcompile.train.__main__ import main
from grcompile.train.checkpoint import CheckpointWarning

TINY = ["--model", "hstu", "--data", "synthetic", "--max-len", "12", "--synthetic-users", "40",
        "--synthetic-items", "30", "--batch-size", "8", "--eval-batch-size", "16", "--num-negatives", "8",
        "--no-progress", "--epochs", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted 8-step losses and a checkpoint directory holding steps 4 and 5."""
    root = tmp_path_factory.mktemp("ck")
    full = main(TINY + ["--steps", "8"])
    main(TINY + ["--steps", "5", "--checkpoint-every", "4", "--checkpoint-dir", str(root / "ck")])
    assert sorted(p.name for p in (root / "ck").iterdir()) == ["LATEST", "step_4", "step_5"]
    return full["losses"], root / "ck"


def copy_of(runs, tmp_path) -> Path:
    target = tmp_path / "ck"
    shutil.copytree(runs[1], target)
    return target


def flip_bytes(path: Path, count: int = 40) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        old = f.read(count)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xA5 for b in old))


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 3)


def resume(ck: Path) -> dict:
    return main(TINY + ["--steps", "8", "--checkpoint-dir", str(ck), "--resume"])


def test_manifest_lists_every_file_with_its_checksum(runs):
    manifest = json.loads((runs[1] / "step_5" / "manifest.json").read_text())
    assert manifest["global_step"] == 5 and set(manifest["files"]) == {"state.pt"}
    entry = manifest["files"]["state.pt"]
    assert entry == checkpoint.file_digest(runs[1] / "step_5" / "state.pt")
    assert entry["bytes"] > 0 and len(entry["sha256"]) == 64
    assert (runs[1] / "LATEST").read_text() == "step_5"


@pytest.mark.parametrize("damage, fault", [(flip_bytes, "sha256 mismatch"), (truncate, "bytes, the manifest says")])
def test_damaged_checkpoint_falls_back_to_the_previous_one(runs, tmp_path, damage, fault):
    ck = copy_of(runs, tmp_path)
    damage(ck / "step_5" / "state.pt")
    with pytest.warns(CheckpointWarning, match=f"{ck / 'step_5' / 'state.pt'}: .*{fault}"):
        resumed = resume(ck)
    assert resumed["losses"] == runs[0]  # from step 4: the same run, exactly


def test_no_good_checkpoint_names_every_file(runs, tmp_path):
    ck = copy_of(runs, tmp_path)
    flip_bytes(ck / "step_5" / "state.pt")
    truncate(ck / "step_4" / "state.pt")
    with pytest.warns(CheckpointWarning), pytest.raises(RuntimeError, match="no good checkpoint") as err:
        resume(ck)
    assert str(ck / "step_5" / "state.pt") in str(err.value) and str(ck / "step_4" / "state.pt") in str(err.value)


def test_checkpoints_without_a_manifest_load_unverified(runs, tmp_path):
    ck = copy_of(runs, tmp_path)
    for step in ("step_4", "step_5"):
        os.remove(ck / step / "manifest.json")
    with pytest.warns(CheckpointWarning, match="no manifest.json .* unverified"):
        assert resume(ck)["losses"] == runs[0]
    # the one-file format before manifests (latest.pt): loads, unverified; truncated, it names the file
    for name in ("legacy", "legacy_truncated"):
        (tmp_path / name).mkdir()
        shutil.copy(runs[1] / "step_5" / "state.pt", tmp_path / name / "latest.pt")
    with pytest.warns(CheckpointWarning, match="format before checksums"):
        assert resume(tmp_path / "legacy")["losses"] == runs[0]
    legacy = tmp_path / "legacy_truncated"
    truncate(legacy / "latest.pt")
    with pytest.warns(CheckpointWarning), pytest.raises(ValueError, match=f"{legacy / 'latest.pt'}: cannot be loaded"):
        resume(legacy)


@pytest.mark.filterwarnings("ignore:.*has no manifest.json")
def test_unloadable_checkpoint_without_manifest_falls_back(runs, tmp_path):
    ck = copy_of(runs, tmp_path)
    for step in ("step_4", "step_5"):
        os.remove(ck / step / "manifest.json")
    truncate(ck / "step_5" / "state.pt")
    with pytest.warns(CheckpointWarning, match=f"{ck / 'step_5' / 'state.pt'}: cannot be loaded"):
        assert resume(ck)["losses"] == runs[0]


def test_resume_with_another_model_names_the_fields_before_loading(runs, tmp_path, monkeypatch):
    ck = copy_of(runs, tmp_path)
    loaded = []
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", lambda self, *a, **k: loaded.append(self))
    argv = [a if a != "hstu" else "sasrec" for a in TINY]
    with pytest.raises(ValueError, match="different config") as err:
        main(argv + ["--steps", "8", "--checkpoint-dir", str(ck), "--resume", "--lr", "0.01"])
    assert "model: 'hstu' in the checkpoint, 'sasrec' in this run" in str(err.value)
    assert "lr: 0.001 in the checkpoint, 0.01 in this run" in str(err.value)
    assert str(ck / "step_5") in str(err.value)
    assert not loaded


def test_a_save_at_the_same_step_replaces_it_and_two_are_kept(tmp_path):
    for step in (1, 2, 2, 3):
        checkpoint.save(tmp_path, {"state": {"global_step": step}, "value": step})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_2", "step_3"]
    assert checkpoint.verify(tmp_path / "step_2") == [] and checkpoint.load(tmp_path)["value"] == 3


def test_a_config_key_written_before_todays_fields_still_matches():
    """A checkpoint's config key from an older version: it lacks the newer fields (pipeline, balance,
    token budget, LBSL ...) and still has ones no longer compared (hsp_group_size): the same run."""
    from grcompile.train import checkpoint as ckpt
    from grcompile.train.config import TrainConfig
    from grcompile.train.loop import _resume_key

    config = TrainConfig(model="sasrec", steps=3)
    old = {k: v for k, v in _resume_key(config).items()
           if k not in ("pipeline", "micro_batches", "balance", "token_budget", "lbsl")}
    old["hsp_group_size"] = None
    written = _resume_key({**_resume_key(TrainConfig()), **old})
    assert ckpt.config_differences(written, _resume_key(config)) == []
    stale = _resume_key(TrainConfig(model="sasrec", pipeline="semi-async"))
    assert ckpt.config_differences(written, stale) == ["pipeline: 'synchronous' in the checkpoint, 'stale' in this run"]
