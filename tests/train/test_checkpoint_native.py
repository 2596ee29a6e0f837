"""Checkpoints of the native (row-wise, HSP) and dynamic hash-table backends (issue 13).

Quick (2 gloo ranks, the item table native row-wise, the category table a dynamic hash table,
row-wise Adagrad on both — per-row optimizer state that must travel with the rows):
* a rank killed at step 5 leaves a checkpoint at step 3 whose manifest hashes each rank's row files;
  resumed, the run reproduces the uninterrupted losses exactly;
* the same checkpoint evaluates identically on 2 ranks in HSP groups of 1 (every rank a full replica:
  the rows of 2 shards become one shard), trains on there like the uninterrupted 2-rank run, and what
  it trained evaluates identically back on 2 ranks without HSP (rank 0 alone wrote the replica's rows);
* one process with a dynamic hash table resumes exactly, falling back over a damaged checkpoint.
Slow (4 ranks): 2 → 4 → 2 ranks for native + dynamic (row-wise Adagrad) and native with Adam (per-row
moments + a shared step), identical evaluation and training on 4 ranks like the 2-rank run; HSP on 4
ranks in groups of 2 (element-wise Adagrad) resumes exactly after a kill and reshards to 2 ranks;
TorchRec tables (DCP) with a dynamic hash table resume exactly after a kill.
"""
import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from grcompile.train import checkpoint
from grcompile.train.checkpoint import CheckpointWarning
from grcompile.train.loop import train
from grcompile.train.parallel import Parallel
from tests.train.test_checkpoint import flip_bytes
from tests.train.test_distributed import BASE, METRICS, run_ranks

NATIVE_DYNAMIC = dataclasses.replace(BASE, sharding="row", sparse_backend="native", sparse_optimizer="rowwise_adagrad",
                                     sparse_lr=0.05, dynamic_features=["encoder.category_embedding"], steps=8,
                                     checkpoint_every=3)


def _losses(values):
    return torch.tensor(values, dtype=torch.float64)


def _same_evaluation(got, ref):
    for m in METRICS:
        assert got[m] == ref[m], m


def test_native_and_dynamic_resume_after_a_kill_and_reshard_into_hsp_replicas(tmp_path):
    ck = tmp_path / "ck"
    run_ranks(2, [("dies", NATIVE_DYNAMIC, {"checkpoint_dir": str(ck), "fail_at_step": 5})], expect_failure=True)
    assert sorted(p.name for p in ck.iterdir()) == ["LATEST", "step_3"]
    files = json.loads((ck / "step_3" / "manifest.json").read_text())["files"]
    assert {"native_0_of_2.pt", "native_1_of_2.pt", "dynamic_0_of_2.pt", "dynamic_1_of_2.pt", "dense.pt"} <= set(files)
    assert not any(name.endswith(".distcp") for name in files)
    assert checkpoint.verify(ck / "step_3") == []

    resume = {"checkpoint_dir": str(ck), "resume": True}
    replicas = dataclasses.replace(NATIVE_DYNAMIC, hsp_group_size=1)
    got = run_ranks(2, [
        ("run10", dataclasses.replace(NATIVE_DYNAMIC, steps=10), {}),
        ("resumed", NATIVE_DYNAMIC, resume),  # from step 3 to 8; saves step 8
        ("replicas_eval", replicas, resume),  # step 8 on one shard of 2 replicas: evaluation only
        ("replicas_train_on", dataclasses.replace(replicas, steps=10), resume),  # steps 9, 10; saves step 10
        ("back", dataclasses.replace(NATIVE_DYNAMIC, steps=10), resume),  # step 10 on 2 shards: evaluation only
    ])
    assert got["resumed"]["losses"] == got["run10"]["losses"][:8]  # exactly: same data order, state, RNG
    _same_evaluation(got["replicas_eval"], got["resumed"])
    torch.testing.assert_close(_losses(got["replicas_train_on"]["losses"]), _losses(got["run10"]["losses"]),
                               rtol=1e-5, atol=0)
    _same_evaluation(got["back"], got["replicas_train_on"])
    written = json.loads((ck / "step_10" / "manifest.json").read_text())["files"]
    assert "native_0_of_1.pt" in written and "native_1_of_1.pt" not in written  # one replica writes the rows
    assert {"dynamic_0_of_2.pt", "dynamic_1_of_2.pt"} <= set(written)


def test_one_process_dynamic_tables_resume_exactly_and_fall_back_over_damage(tmp_path):
    config = dataclasses.replace(BASE, dynamic_features=["encoder.category_embedding"],
                                 sparse_optimizer="rowwise_adagrad", sparse_lr=0.05, steps=8, checkpoint_every=3)
    quiet = dict(progress=False, log=lambda *a: None)
    uninterrupted = train(config, **quiet)
    ck = tmp_path / "ck"
    train(dataclasses.replace(config, steps=5), checkpoint_dir=str(ck), **quiet)  # checkpoints at 3 and 5
    saved = torch.load(ck / "step_5" / "state.pt", weights_only=False)
    (table,) = saved["dynamic_tables"].values()  # the one hash table (holding the category feature)
    assert table["ids"].numel() > 0 and table["adagrad"] is not None and int(table["counts"].min()) > 0
    assert not any(k.startswith("grcompile_dynamic_tables") for k in saved["model"])

    resumed = train(config, checkpoint_dir=str(ck), resume=True, **quiet)
    assert resumed["losses"] == uninterrupted["losses"]
    _same_evaluation(resumed, uninterrupted)

    flip_bytes(ck / "step_8" / "state.pt")  # the newest is damaged: step 6 is used, to the same end
    with pytest.warns(CheckpointWarning, match="sha256 mismatch"):
        again = train(config, checkpoint_dir=str(ck), resume=True, **quiet)
    assert again["losses"] == uninterrupted["losses"]


def test_backends_without_checkpoints_are_refused_at_start():
    unknown = SimpleNamespace(runtime=SimpleNamespace(tables=SimpleNamespace(plan=SimpleNamespace(tables={"t": None}))),
                              distributed=True)
    with pytest.raises(NotImplementedError, match="TorchRec or native sparse tables"):
        Parallel.check_checkpointable(unknown)


# -- 4 ranks -----------------------------------------------------------------------------------------
NATIVE_ADAM = dataclasses.replace(BASE, sharding="row", sparse_backend="native", sparse_optimizer="adam", steps=8)


@pytest.mark.slow
def test_two_to_four_to_two_ranks_evaluate_identically_and_train_on_alike(tmp_path):
    """Native + dynamic (row-wise Adagrad) and native with Adam: a 2-rank checkpoint at step 8
    evaluates identically on 4 ranks; 4 more steps there train like the 2-rank run (the optimizer
    state came along: a fresh Adam or Adagrad state steps far off); 2 ranks evaluate what 4 trained
    identically."""
    configs = {"dyn": NATIVE_DYNAMIC, "adam": NATIVE_ADAM}
    cks = {key: {"checkpoint_dir": str(tmp_path / key)} for key in configs}
    resume = {key: {**ck, "resume": True} for key, ck in cks.items()}
    two = run_ranks(2, [job for key, config in configs.items()
                        for job in ((key, config, cks[key]), (key + "12", dataclasses.replace(config, steps=12), {}))])
    four = run_ranks(4, [job for key, config in configs.items()
                         for job in ((key + "_eval", config, resume[key]),
                                     (key + "_train_on", dataclasses.replace(config, steps=12), resume[key]))])
    back = run_ranks(2, [(key, dataclasses.replace(config, steps=12), resume[key]) for key, config in configs.items()])
    for key in configs:
        _same_evaluation(four[key + "_eval"], two[key])
        assert four[key + "_train_on"]["losses"][:8] == two[key]["losses"]  # the checkpoint's history
        torch.testing.assert_close(_losses(four[key + "_train_on"]["losses"]), _losses(two[key + "12"]["losses"]),
                                   rtol=1e-5, atol=0)
        _same_evaluation(back[key], four[key + "_train_on"])
    assert {f"native_{r}_of_4.pt" for r in range(4)} | {f"dynamic_{r}_of_4.pt" for r in range(4)} \
        <= set(json.loads((tmp_path / "dyn" / "step_12" / "manifest.json").read_text())["files"])


@pytest.mark.slow
def test_hsp_resumes_exactly_after_a_kill_and_reshards_to_two_ranks(tmp_path):
    hsp = dataclasses.replace(BASE, sharding="row", sparse_backend="native", hsp_group_size=2,
                              sparse_optimizer="adagrad", sparse_lr=0.05, steps=8, checkpoint_every=3)
    ck = tmp_path / "ck"
    run_ranks(4, [("dies", hsp, {"checkpoint_dir": str(ck), "fail_at_step": 5})], expect_failure=True)
    files = json.loads((ck / "step_3" / "manifest.json").read_text())["files"]
    assert {"native_0_of_2.pt", "native_1_of_2.pt"} <= set(files)  # group 0 wrote; group 1 holds the same
    resume = {"checkpoint_dir": str(ck), "resume": True}
    four = run_ranks(4, [("run12", dataclasses.replace(hsp, steps=12), {}), ("resumed", hsp, resume)])
    assert four["resumed"]["losses"] == four["run12"]["losses"][:8]
    no_hsp = dataclasses.replace(hsp, hsp_group_size=None)
    two = run_ranks(2, [("eval", no_hsp, resume), ("train_on", dataclasses.replace(no_hsp, steps=12), resume)])
    _same_evaluation(two["eval"], four["resumed"])
    torch.testing.assert_close(_losses(two["train_on"]["losses"]), _losses(four["run12"]["losses"]), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_torchrec_tables_with_a_dynamic_table_resume_exactly_after_a_kill(tmp_path):
    config = dataclasses.replace(BASE, sharding="row", dynamic_features=["encoder.category_embedding"], steps=8,
                                 checkpoint_every=3)
    ck = tmp_path / "ck"
    run_ranks(2, [("dies", config, {"checkpoint_dir": str(ck), "fail_at_step": 5})], expect_failure=True)
    files = json.loads((ck / "step_3" / "manifest.json").read_text())["files"]
    assert {".metadata", "dynamic_0_of_2.pt", "dynamic_1_of_2.pt"} <= set(files)
    got = run_ranks(2, [("run", config, {}), ("resumed", config, {"checkpoint_dir": str(ck), "resume": True})])
    assert got["resumed"]["losses"] == got["run"]["losses"]
    _same_evaluation(got["resumed"], got["run"])
    shutil.rmtree(ck)


def test_a_checkpoint_from_the_other_kind_of_run_says_so(tmp_path):
    """One process cannot resume a checkpoint written by ranks, nor ranks one written by one
    process: the error says that, instead of calling a good checkpoint damaged."""
    import torch

    from grcompile.train import checkpoint
    from grcompile.train.parallel import _written_by_ranks

    ranks_dir = tmp_path / "ranks" / "step_3"
    ranks_dir.mkdir(parents=True)
    torch.save({}, ranks_dir / "dense.pt")
    with pytest.warns(checkpoint.CheckpointWarning), pytest.raises(ValueError, match="written by ranks"):
        checkpoint.load(tmp_path / "ranks")
    one_dir = tmp_path / "one" / "step_3"
    one_dir.mkdir(parents=True)
    torch.save({}, one_dir / checkpoint.STATE)
    with pytest.raises(ValueError, match="written by one process"):
        _written_by_ranks(one_dir)
