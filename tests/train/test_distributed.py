"""Sharded training on gloo ranks equals one process; checkpoints reshard and resume.

* 20 steps on 2 ranks (TorchRec row-wise with two-stage dedup, table-wise without dedup,
  column-wise, planner's choice with stage-1 dedup only; native row-wise) and on 4 ranks (native with hierarchical sparse parallelism, groups of 2): the global
  losses within 1e-5 relative of a one-process run of the unmodified model, the final item/category
  tables and dense weights equal up to float32 summation order (gradients are summed across ranks
  in another order; TorchRec's CPU kernels are float32 only). Measured: losses within 3e-7 relative.
  (With a sparse SGD step 10x larger the loss jumps at step 2 and rounding differences grow to 1e-5
  by step 20: the tolerance is only meaningful on a stable run.)
* TorchRec checkpoints (DCP): a rank killed mid-run, then resumed from the last checkpoint,
  reproduces the uninterrupted losses exactly; a checkpoint of 2 row-wise ranks evaluates the same
  on 4 table-wise ranks, and back on 2 row-wise ranks after 4 ranks trained on.
* Bad ids raise on the rank, naming the feature, before any collective (every rank gets past a
  barrier afterwards).
"""
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grcompile.runtime.launch import run_on_ranks
from grcompile.train.config import TrainConfig
from grcompile.train.loop import train

STEPS = 20
BASE = TrainConfig(data="synthetic", preset="ml1m", max_len=24, batch_size=16, eval_batch_size=64, num_negatives=8,
                   negatives="per-row", threads=1, seed=3, epochs=1, steps=STEPS, sparse_optimizer="sgd",
                   sparse_lr=0.005, lr=1e-3, synthetic={"num_users": 400, "num_items": 120},
                   model_overrides={"embedding_dim": 16, "attention_dim": 8, "linear_dim": 8, "num_blocks": 1,
                                    "dropout": 0.0, "num_categories": 6})
METRICS = ("hr@10", "ndcg@10", "mrr")


def _worker(rank, world, jobs):
    results = {}
    for key, config, kwargs in jobs:
        out = train(config, progress=False, log=lambda *a: None, **kwargs)
        results[key] = {k: out[k] for k in ("losses", "feature_weights", "dense_weights", *METRICS,
                                            "sparse_stats") if k in out}
    return results if rank == 0 else None


def run_ranks(world, jobs, expect_failure=False):
    try:
        results = run_on_ranks(_worker, world, jobs)
    except mp.ProcessExitedException:
        if not expect_failure:
            raise
        return None
    assert not expect_failure, "the run was expected to die"
    return results[0]


@pytest.fixture(scope="module")
def one_process():
    return train(BASE, progress=False, log=lambda *a: None, return_weights=True)


def assert_same_training(got, ref, table_atol_of_scale: float = 0.0):
    """Same losses and weights. ``table_atol_of_scale``: the tables' absolute tolerance as a fraction
    of the table's largest weight (at least 1e-5), for runs whose batches are sliced or summed in
    another order: Adagrad divides by the root of the summed squared gradients, so a rounding-level
    difference in a small gradient moves a small weight by a sizeable fraction of its own value."""
    torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                               torch.tensor(ref["losses"], dtype=torch.float64), rtol=1e-5, atol=0)
    assert set(got["feature_weights"]) == set(ref["feature_weights"]) == {"encoder.item_embedding",
                                                                          "encoder.category_embedding"}
    for name, weight in ref["feature_weights"].items():
        atol = max(1e-5, table_atol_of_scale * weight.abs().max().item())
        torch.testing.assert_close(got["feature_weights"][name], weight, rtol=1e-4, atol=atol)
    shared = got["dense_weights"].keys() & ref["dense_weights"].keys()
    assert "encoder.blocks.0.uvqk.weight" in shared
    for name in shared:
        torch.testing.assert_close(got["dense_weights"][name], ref["dense_weights"][name], rtol=1e-4, atol=1e-5)


def sharded(**changes):
    return dataclasses.replace(BASE, **changes)


def test_two_ranks_equal_one_process(one_process):
    jobs = [("torchrec_row_two_stage", sharded(sharding="row", dedup="two_stage"), {"return_weights": True}),
            ("torchrec_table_no_dedup", sharded(sharding="table", dedup="none"), {"return_weights": True}),
            ("torchrec_column_two_stage", sharded(sharding="column"), {"return_weights": True}),
            ("torchrec_auto_comm", sharded(sharding="auto", dedup="comm"), {"return_weights": True}),
            ("native_row_two_stage", sharded(sharding="row", sparse_backend="native"), {"return_weights": True})]
    results = run_ranks(2, jobs)
    for key, _, _ in jobs:
        assert_same_training(results[key], one_process)
    row, table = results["torchrec_row_two_stage"]["sparse_stats"], results["torchrec_table_no_dedup"]["sparse_stats"]
    assert row["lookups"] == table["lookups"] > 0 and 0 < row["ids_sent"]


def test_two_ranks_dynamic_hash_table_equal_one_process():
    """The category feature as a dynamic hash table (ids inserted on first sight; sharded by id on
    2 ranks): the same losses as the one-process hash table (initial rows depend on the id only)."""
    dynamic = dataclasses.replace(BASE, dynamic_features=["encoder.category_embedding"])
    reference = train(dynamic, progress=False, log=lambda *a: None)
    results = run_ranks(2, [("torchrec", dataclasses.replace(dynamic, sharding="row"), {}),
                            ("native", dataclasses.replace(dynamic, sharding="row", sparse_backend="native"), {})])
    for key in ("torchrec", "native"):
        torch.testing.assert_close(torch.tensor(results[key]["losses"], dtype=torch.float64),
                                   torch.tensor(reference["losses"], dtype=torch.float64), rtol=1e-5, atol=0)
        assert results[key]["sparse_stats"]["lookups"] > 0


def test_two_ranks_with_the_dense_part_compiled_by_grcompile(one_process):
    """The sparse lookups stay opaque ops inside the one compiled graph (jagged, fused attention);
    sharded + grcompile equals one eager process."""
    short = dataclasses.replace(BASE, steps=6)
    reference = train(short, progress=False, log=lambda *a: None)
    got = run_ranks(2, [("compiled", dataclasses.replace(short, sharding="row", compile="grcompile"), {})])["compiled"]
    torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                               torch.tensor(reference["losses"], dtype=torch.float64), rtol=1e-5, atol=0)


def test_four_ranks_hierarchical_sparse_parallel_equal_one_process(one_process):
    jobs = [("hsp", sharded(sharding="row", sparse_backend="native", hsp_group_size=2), {"return_weights": True})]
    assert_same_training(run_ranks(4, jobs)["hsp"], one_process)


def test_checkpoints_resume_after_a_killed_rank_and_reshard(tmp_path):
    config = sharded(sharding="row", steps=8, checkpoint_every=3)  # SGD: TorchRec refuses the Adagrads (they would step per lookup)
    uninterrupted = run_ranks(2, [("run", config, {})])["run"]

    ck = str(tmp_path / "ck")
    run_ranks(2, [("dies", config, {"checkpoint_dir": ck, "fail_at_step": 5})], expect_failure=True)
    assert open(os.path.join(ck, "LATEST")).read() == "step_3"
    resumed = run_ranks(2, [("resumed", config, {"checkpoint_dir": ck, "resume": True})])["resumed"]
    assert resumed["losses"] == uninterrupted["losses"]  # exactly: same data order, state, RNG
    for m in METRICS:
        assert resumed[m] == uninterrupted[m]

    # 2 row-wise ranks -> 4 table-wise ranks: the same model, the same evaluation
    on_four = run_ranks(4, [("eval", dataclasses.replace(config, sharding="table"), {"checkpoint_dir": ck, "resume": True}),
                            ("train_on", dataclasses.replace(config, sharding="table", steps=9),
                             {"checkpoint_dir": ck, "resume": True})])
    for m in METRICS:
        assert on_four["eval"][m] == uninterrupted[m]
    # 4 -> 2 ranks (row-wise again): what the 4 ranks trained evaluates the same
    back = run_ranks(2, [("eval", dataclasses.replace(config, steps=9), {"checkpoint_dir": ck, "resume": True})])
    for m in METRICS:
        assert back["eval"][m] == on_four["train_on"][m]


def _bad_ids_worker(rank, world):
    from grcompile.runtime import shard_embeddings
    from grcompile.train.loop import build

    _, _, _, task = build(BASE)
    weight = task.encoder.item_embedding.weight.detach().clone()
    shard_embeddings(task, backend="torchrec", sharding="row")
    # one rank has only padding (an empty KJT), the other real ids: both lookups complete
    ids = torch.tensor([[5, 9, 0]]) if rank == 0 else torch.zeros(1, 3, dtype=torch.int64)
    out = task.encoder.item_embedding(ids)
    torch.testing.assert_close(out, weight[ids])
    messages = []
    for bad in (torch.tensor([[1, 121]]), torch.tensor([[-3, 1]]), torch.tensor([[1.0, 2.0]])):
        try:
            task.encoder.item_embedding(bad)
        except ValueError as e:
            messages.append(str(e))
    dist.barrier()  # nobody is stuck in a lookup's all-to-all
    return messages


def test_bad_ids_fail_on_the_rank_before_any_collective_and_empty_lookups_work():
    results = run_on_ranks(_bad_ids_worker, 2)
    for rank in range(2):
        ranged, negative, dtype = results[rank]
        assert "feature 'encoder.item_embedding': ids must lie in [0, 121)" in ranged
        assert "got values in [-3, 1]" in negative
        assert "encoder.item_embedding" in dtype and "int64" in dtype

