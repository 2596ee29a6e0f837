"""Distributed (DCP) checkpoints are verified before they are trusted (issue 13), on 2 gloo ranks.

A run killed at step 7 leaves checkpoints at steps 3 and 6. Their manifests list every file — each
rank's DCP shard, DCP's ``.metadata``, ``dense.pt``, each rank's RNG — with its size and SHA-256.
With 40 bytes flipped in rank 1's shard of step 6, the resume skips it (warning on rank 0) and
reproduces the uninterrupted losses exactly from step 3; with step 3's RNG file truncated as well,
every rank fails with an error naming both files (no rank hangs in a collective); resuming with
another embedding size fails before DCP loads anything, naming the field. Checkpoints without
manifests (written before them) resume, unverified.
"""
import dataclasses
import json
import shutil

import pytest

from grcompile.train import checkpoint
from grcompile.train.loop import train
from tests.train.test_checkpoint import flip_bytes, truncate
from tests.train.test_distributed import run_ranks, sharded

pytestmark = pytest.mark.slow

CONFIG = sharded(sharding="row", steps=8, checkpoint_every=3)


def _outcomes_worker(rank, world, jobs):
    """Each job's losses, or the error it raised (on every rank alike: the checks are collective)."""
    out = {}
    for key, config, kwargs in jobs:
        try:
            out[key] = {"losses": train(config, progress=False, log=lambda *a: None, **kwargs)["losses"]}
        except (RuntimeError, ValueError) as e:
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    return out


def test_damaged_shards_fall_back_and_configs_are_checked_first(tmp_path):
    from grcompile.runtime.launch import run_on_ranks

    uninterrupted = run_ranks(2, [("run", CONFIG, {})])["run"]
    ck = tmp_path / "ck"
    run_ranks(2, [("dies", CONFIG, {"checkpoint_dir": str(ck), "fail_at_step": 7})], expect_failure=True)
    assert sorted(p.name for p in ck.iterdir()) == ["LATEST", "step_3", "step_6"]

    manifest = json.loads((ck / "step_6" / "manifest.json").read_text())
    assert {".metadata", "dense.pt", "rng_0_of_2.pt", "rng_1_of_2.pt", "__0_0.distcp", "__1_0.distcp"} <= set(manifest["files"])
    assert checkpoint.verify(ck / "step_6") == []

    copies = {name: tmp_path / name for name in ("fallback", "none_good", "other_config", "unverified")}
    for path in copies.values():
        shutil.copytree(ck, path)
    for name in ("fallback", "none_good", "other_config"):
        flip_bytes(copies[name] / "step_6" / "__1_0.distcp")
    truncate(copies["none_good"] / "step_3" / "rng_1_of_2.pt")
    for step in ("step_3", "step_6"):  # as written before manifests existed: loads, unverified
        (copies["unverified"] / step / "manifest.json").unlink()
    other = dataclasses.replace(CONFIG, model_overrides={**CONFIG.model_overrides, "embedding_dim": 32})
    jobs = [("fallback", CONFIG, {"checkpoint_dir": str(copies["fallback"]), "resume": True}),
            ("none_good", CONFIG, {"checkpoint_dir": str(copies["none_good"]), "resume": True}),
            ("other_config", other, {"checkpoint_dir": str(copies["other_config"]), "resume": True}),
            ("unverified", CONFIG, {"checkpoint_dir": str(copies["unverified"]), "resume": True})]
    results = run_on_ranks(_outcomes_worker, 2, jobs)

    for rank in range(2):
        assert results[rank]["fallback"]["losses"] == uninterrupted["losses"]  # from step 3, exactly
        assert results[rank]["unverified"]["losses"] == uninterrupted["losses"]  # from step 6
        error = results[rank]["none_good"]["error"]
        assert error.startswith("RuntimeError: --resume: no good checkpoint")
        assert f"{copies['none_good'] / 'step_6' / '__1_0.distcp'}: sha256 mismatch" in error
        assert f"{copies['none_good'] / 'step_3' / 'rng_1_of_2.pt'}: " in error and "truncated" in error
        error = results[rank]["other_config"]["error"]
        assert "different config" in error and "model_overrides.embedding_dim: 16 in the checkpoint, 32 in this run" in error
