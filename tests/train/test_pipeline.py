"""Frozen-window pipelining (``train/pipeline.py``): the keys extracted from the traced forward are
the lookups it makes; clustering is a partition that sends fewer unique ids; FWP on 2 gloo ranks
trains exactly like the synchronous step (float64), and a window that is not frozen does not."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from grcompile.passes.lookup_keys import extract_lookup_keys
from grcompile.runtime import dense_parameters, shard_embeddings
from grcompile.runtime.launch import run_on_ranks
from grcompile.train.pipeline import (KeyExtractor, SparsePipeline, PipelineUnsupported, cluster_rows,
                                      unique_ids_sent)
from grcompile.train.sparse_optim import RowWiseAdagrad
from tests.runtime.test_embedding_rewrite import N, V, length_mix, make_task


# -- key extraction ---------------------------------------------------------------------------------
def test_extracted_keys_are_the_lookups_the_forward_makes():
    task = make_task()
    runtime = shard_embeddings(task)
    ids, ts, negatives = length_mix(4)
    keys = KeyExtractor(task)(ids, ts, negatives)
    runtime.recorded = []
    task(ids, ts, negatives)
    recorded, runtime.recorded = runtime.recorded, None
    assert [f for f, _ in keys] == [f for f, _ in recorded]
    for (feature, extracted), (_, looked_up) in zip(keys, recorded):
        pad = runtime.plan.features[feature].pad
        flat = extracted.reshape(-1)
        torch.testing.assert_close(flat[flat != pad], looked_up, rtol=0, atol=0)


def test_a_lookup_prefetched_padded_is_taken_by_the_packed_lookup_the_jagged_rewrite_makes():
    """Keys are extracted from the padded forward; compiled by grcompile, the lookup receives the
    same valid ids packed ([T]): the prefetched lookup must serve it, laid out for [T]."""
    task = make_task()
    runtime = shard_embeddings(task)
    ids, _, _ = length_mix(5)
    feature = "encoder.item_embedding"
    packed = ids[ids != 0]
    expected = runtime.forward(feature, packed, keep_graph=False)
    runtime.prefetch([(feature, ids)])
    got = runtime.forward(feature, packed, keep_graph=False)
    assert got.shape == (packed.numel(), 16) and runtime.prefetched() == 0
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    runtime.prefetch([(feature, ids)])
    with pytest.raises(RuntimeError, match="other ids than the ones extracted ahead"):
        runtime.forward(feature, packed[1:], keep_graph=False)


class KeysFromEmbeddings(nn.Module):
    """Second lookup's ids chosen from the first lookup's values: unknowable ahead."""

    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(10, 4, padding_idx=0)
        self.tags = nn.Embedding(5, 4, padding_idx=0)

    def forward(self, ids):
        first = self.items(ids)
        return self.tags((first.sum(-1) > 0).long() + 1).sum()


class RandomKeys(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(10, 4, padding_idx=0)

    def forward(self, ids):
        dropped = ids * (torch.rand(ids.shape) > 0.1)  # id dropout: another draw if computed ahead
        return self.items(dropped).sum()


class KeysFromAMutatedBuffer(nn.Module):
    """A per-item counter updated in forward picks the ids: computed ahead, they would be the old ones."""

    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(10, 4, padding_idx=0)
        self.register_buffer("seen", torch.zeros(10, dtype=torch.long))

    def forward(self, ids):
        self.seen.add_(1)
        return self.items((ids + self.seen[ids]) % 9 + 1).sum()


class KeysFromParameters(nn.Module):
    """Ids bucketed by a learned threshold: fine within a step (FWP), stale a step ahead (DBP)."""

    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(10, 4, padding_idx=0)
        self.threshold = nn.Parameter(torch.tensor(3.0))

    def forward(self, ids):
        return self.items(torch.where(ids.float() > self.threshold, ids, 1)).sum()


def test_keys_from_parameters_are_fine_within_a_step_but_not_a_step_ahead():
    m = KeysFromParameters()
    shard_embeddings(m)
    ids = torch.randint(1, 9, (2, 3))
    (feature, keys), = KeyExtractor(m)(ids)
    torch.testing.assert_close(keys, torch.where(ids > 3, ids, 1))
    with pytest.raises(PipelineUnsupported, match="computed from parameters"):
        KeyExtractor(m, step_ahead=True)(ids)


@pytest.mark.parametrize("model, reason", [(KeysFromEmbeddings, "computed from the embeddings of feature 'items'"),
                                           (RandomKeys, "random op"),
                                           (KeysFromAMutatedBuffer, "state the forward changes")])
def test_keys_that_cannot_be_known_ahead_are_declined_with_a_reason(model, reason):
    m = model()
    shard_embeddings(m)
    with pytest.raises(PipelineUnsupported, match=reason):
        KeyExtractor(m)(torch.randint(1, 5, (2, 3)))


def test_extraction_of_a_graph_without_lookups_says_so():
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    assert extract_lookup_keys(gm) == "the model makes no sparse lookup"


# -- clustering -------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 24), parts=st.integers(1, 6), seed=st.integers(0, 10_000))
def test_clustering_is_a_partition_with_tensor_split_sizes(rows, parts, seed):
    parts = min(parts, rows)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 12, (rows, 7), generator=g)
    clusters = cluster_rows(ids, parts)
    assert sorted(torch.cat(clusters).tolist()) == list(range(rows))
    assert [len(c) for c in clusters] == [len(c) for c in torch.tensor_split(torch.arange(rows), parts)]
    assert all(torch.equal(a, b) for a, b in zip(clusters, cluster_rows(ids, parts)))  # deterministic


def test_clustering_sends_fewer_unique_ids_on_users_with_shared_interests():
    g = torch.Generator().manual_seed(0)
    groups = [torch.arange(1, 30), torch.arange(100, 130), torch.arange(200, 230), torch.arange(300, 330)]
    # rows interleaved by interest group, so plain contiguous micro-batches mix all groups
    ids = torch.stack([groups[r % 4][torch.randint(0, 29, (12,), generator=g)] for r in range(32)])
    plain = list(torch.tensor_split(torch.arange(32), 4))
    clustered = cluster_rows(ids, 4)
    assert unique_ids_sent(ids, clustered) < 0.5 * unique_ids_sent(ids, plain)


# -- FWP == sync on 2 ranks ------------------------------------------------------------------------
STEPS, B = 4, 12


def _batches(world: int, steps: int = STEPS):
    """Global batches with empty, length-1 and full rows; every rank sees the same ones."""
    out = []
    for step in range(steps):
        ids, ts, negatives = length_mix(100 + step, B=B)
        out.append({"ids": ids, "timestamps": ts, "negatives": negatives})
    return out


def _optimizers(task, runtime, optimizer: str, lr: float = 0.05) -> list[torch.optim.Optimizer]:
    """``adagrad`` / ``adam`` on every parameter; ``rowwise_adagrad``: fbgemm's row-wise Adagrad on
    the tables (one accumulator per row), element-wise Adagrad on the dense part."""
    params = list(task.parameters())
    if optimizer == "adagrad":
        return [torch.optim.Adagrad(params, lr=lr)]
    if optimizer == "adam":
        return [torch.optim.Adam(params, lr=0.01)]
    assert optimizer == "rowwise_adagrad", optimizer
    tables = {id(p) for p in runtime.tables.parameters()}
    return [torch.optim.Adagrad([p for p in params if id(p) not in tables], lr=lr),
            RowWiseAdagrad([p for p in params if id(p) in tables], lr=lr)]


class _Optimizers:
    """Several optimizers stepped as one (the trainer keeps dense and sparse ones apart)."""

    def __init__(self, optimizers):
        self.optimizers = optimizers

    def zero_grad(self, set_to_none=True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self):
        for opt in self.optimizers:
            opt.step()


def _train(rank: int, world: int, schedule: str, optimizer: str, dedup: str, group_size=None,
           steps: int = STEPS, dtype: torch.dtype = torch.float64, lr: float = 0.05) -> dict:
    task = make_task().to(dtype)
    runtime = shard_embeddings(task, backend="native", dedup=dedup, sharding="row", group_size=group_size)
    opt = _Optimizers(_optimizers(task, runtime, optimizer, lr))
    pipelined = schedule.removeprefix("stale-")
    pipeline = SparsePipeline(task, runtime, micro_batches=3, world=world,
                              schedule=pipelined if pipelined in ("fwp", "dbp", "dbp+fwp") else "fwp")
    pipeline.check_optimizers(opt.optimizers)
    runtime.refresh_prefetched = not schedule.startswith("stale-")  # negative control: stale buffers
    batches = _batches(world, steps)

    def local_of(batch):
        return {k: v[rank * B // world:(rank + 1) * B // world] for k, v in batch.items()}

    losses = []
    for step, batch in enumerate(batches):
        local = local_of(batch)
        opt.zero_grad(set_to_none=True)
        runtime.new_step()
        if schedule == "sync":
            weight = task.count_targets(local["ids"]) / max(task.count_targets(batch["ids"]), 1)
            loss = task(local["ids"], local["timestamps"], local["negatives"]) * weight
            loss.backward()
            loss = loss.detach()
        elif schedule == "unfrozen":  # negative control: the optimizers step after every micro-batch
            loss = torch.zeros(())
            for part in pipeline.parts(local, B // world):
                mb = {k: v[part] for k, v in local.items()}
                l_mb = task(mb["ids"], mb["timestamps"], mb["negatives"]) * (
                    task.count_targets(mb["ids"]) / max(task.count_targets(batch["ids"]), 1))
                l_mb.backward()
                _all_reduce_dense(task)
                opt.step()
                opt.zero_grad(set_to_none=True)
                loss = loss + l_mb.detach()
        else:
            upcoming = (batches[step + 1], local_of(batches[step + 1])) if step + 1 < len(batches) else None
            loss = pipeline.step(task, batch, local, upcoming)
        if schedule != "unfrozen":
            runtime.after_backward()  # HSP's cross-group gradient sum (nothing otherwise)
            _all_reduce_dense(task)
            opt.step()
        total = loss.clone()
        dist.all_reduce(total)
        losses.append(float(total))
    pipeline.discard()
    tables = {t: runtime.tables.full(t) for t in runtime.plan.tables}
    dense = {k: v.detach().clone() for k, v in task.state_dict().items() if "grcompile" not in k}
    return {"losses": losses, "tables": tables, "dense": dense, "unique": pipeline.unique_ids}


def _all_reduce_dense(task) -> None:
    for p in dense_parameters(task):
        if p.grad is not None:
            dist.all_reduce(p.grad)


SCHEDULES = ("sync", "fwp", "dbp", "dbp+fwp", "unfrozen", "stale-dbp")


def _schedules(rank: int, world: int, optimizer: str, dedup: str, schedules=SCHEDULES, group_size=None,
               steps: int = STEPS, dtype: torch.dtype = torch.float64, lr: float = 0.05) -> dict:
    return {s: _train(rank, world, s, optimizer, dedup, group_size, steps, dtype, lr) for s in schedules}


def _assert_same_training(run, sync, dtype: torch.dtype = torch.float64):
    """float64: the same sums in another grouping (micro-batch means weighted by target shares), so
    equal to rounding; float32: within 1e-5 relative (losses, tables and dense weights alike)."""
    loss_tol, weight_tol = (dict(rtol=1e-12, atol=1e-12), dict(rtol=1e-10, atol=1e-12)) if dtype == torch.float64 \
        else (dict(rtol=1e-5, atol=1e-6), dict(rtol=1e-5, atol=1e-6))
    torch.testing.assert_close(run["losses"], sync["losses"], **loss_tol)
    for part in ("tables", "dense"):
        for name in sync[part]:
            torch.testing.assert_close(run[part][name], sync[part][name], **weight_tol)


def _assert_moved_off(run, sync):
    assert max(abs(a - b) for a, b in zip(run["losses"], sync["losses"])) > 1e-6


def test_pipelines_on_two_ranks_train_exactly_like_the_synchronous_step():
    """FWP, DBP and both, with Adagrad (state per row) and two-stage dedup; the negative controls
    (a window that is not frozen, prefetch buffers not synced with the last update) move off."""
    results = run_on_ranks(_schedules, 2, "adagrad", "two_stage")
    for rank, r in results.items():
        for schedule in ("fwp", "dbp", "dbp+fwp"):
            _assert_same_training(r[schedule], r["sync"])
        _assert_moved_off(r["unfrozen"], r["sync"])
        _assert_moved_off(r["stale-dbp"], r["sync"])
        assert r["fwp"]["unique"]["clustered"] <= r["fwp"]["unique"]["unclustered"]


def test_dbp_with_row_wise_adagrad_on_four_ranks_trains_like_sync():
    """Four ranks in the default run: DBP and DBP+FWP with the row-wise Adagrad state that must
    travel with the rows (row-wise Adagrad moves no row without gradient, so DBP takes it)."""
    results = run_on_ranks(_schedules, 4, "rowwise_adagrad", "two_stage", ("sync", "dbp", "dbp+fwp", "stale-dbp"))
    for r in results.values():
        _assert_same_training(r["dbp"], r["sync"])
        _assert_same_training(r["dbp+fwp"], r["sync"])
        _assert_moved_off(r["stale-dbp"], r["sync"])


LONG_LR = 0.005  # the 100-step tests' learning rate (see below)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_100_steps_of_every_exact_schedule_equal_sync_in_float64(world, optimizer):
    """The issue's proof at length: 100 steps, 2 and 4 ranks, FWP / DBP / DBP+FWP against sync,
    float64, and the stale-buffer control still moves off. At ``LONG_LR``: with the short tests'
    lr 0.05 this tiny task is chaotic (FWP's regrouped sums differ from sync's by 1e-16, and that
    grows ~1.45x a step: 4e-9 at step 30, 3e-4 at step 100), so no tolerance would tell a wrong
    schedule from rounding; at 0.005 FWP stays within 6e-16 of sync over 100 steps."""
    results = run_on_ranks(_schedules, world, optimizer, "two_stage", ("sync", "fwp", "dbp", "dbp+fwp", "stale-dbp"),
                           None, 100, torch.float64, LONG_LR)
    for r in results.values():
        for schedule in ("fwp", "dbp", "dbp+fwp"):
            _assert_same_training(r[schedule], r["sync"])
        _assert_moved_off(r["stale-dbp"], r["sync"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_100_steps_of_every_exact_schedule_equal_sync_in_float32(world):
    """float32, 100 steps: the regrouped sums round differently, within 1e-5 relative."""
    results = run_on_ranks(_schedules, world, "adagrad", "two_stage", ("sync", "fwp", "dbp", "dbp+fwp"),
                           None, 100, torch.float32, LONG_LR)
    for r in results.values():
        for schedule in ("fwp", "dbp", "dbp+fwp"):
            _assert_same_training(r[schedule], r["sync"], torch.float32)


@pytest.mark.slow
def test_fwp_with_adam_and_no_dedup_on_four_ranks():
    results = run_on_ranks(_schedules, 4, "adam", "none", ("sync", "fwp"))
    for r in results.values():
        _assert_same_training(r["fwp"], r["sync"])


@pytest.mark.slow
def test_fwp_with_hierarchical_sparse_parallelism_on_four_ranks():
    """HSP groups of 2: the lookups' and gradients' all-to-alls stay inside a group (the gradient
    channel too), the cross-group sum runs once after the last micro-batch."""
    results = run_on_ranks(_schedules, 4, "adagrad", "two_stage", ("sync", "fwp"), 2)
    for r in results.values():
        _assert_same_training(r["fwp"], r["sync"])


def test_dbp_refuses_optimizers_that_move_rows_without_gradient():
    task = make_task()
    runtime = shard_embeddings(task)
    pipeline = SparsePipeline(task, runtime, schedule="dbp")
    pipeline.check_optimizers([torch.optim.Adagrad(task.parameters())])
    pipeline.check_optimizers([RowWiseAdagrad(runtime.tables.parameters(), lr=0.1)])
    with pytest.raises(PipelineUnsupported, match="Adam moves table rows that got no gradient"):
        pipeline.check_optimizers([torch.optim.Adam(task.parameters())])


# -- through the trainer -----------------------------------------------------------------------------
def _trainer_worker(rank, world, jobs):
    from grcompile.train.loop import train

    out = {}
    for key, config in jobs:
        result = train(config, progress=False, log=lambda *a: None, return_weights=True)
        out[key] = {k: result[k] for k in ("losses", "feature_weights", "dense_weights", "pipeline")}
    return out


def test_trainer_pipelines_and_balanced_ranks_train_like_sync():
    """``--pipeline fwp | dbp+fwp`` and ``--balance cost`` on 2 native ranks, Adagrad tables: the
    losses and weights of the synchronous run with equal slices (float32, 20 steps)."""
    import dataclasses

    from tests.train.test_distributed import BASE, assert_same_training

    base = dataclasses.replace(BASE, sharding="row", sparse_backend="native", sparse_optimizer="adagrad",
                               sparse_lr=0.05)
    jobs = [("sync", base),
            ("fwp", dataclasses.replace(base, pipeline="fwp", micro_batches=3)),
            ("dbp+fwp", dataclasses.replace(base, pipeline="dbp+fwp", micro_batches=2, balance="cost"))]
    results = run_on_ranks(_trainer_worker, 2, jobs)[0]
    for key in ("fwp", "dbp+fwp"):
        assert results[key]["pipeline"]["running"].startswith(key) and results[key]["pipeline"]["reason"] is None
        # micro-batches and cost-balanced slices sum each gradient in another order (float32): up to
        # 1.7e-5 on an item table of largest weight 0.30 after 20 Adagrad steps (AVX-512 machine)
        assert_same_training(results[key], results["sync"], table_atol_of_scale=1e-4)


def test_trainer_says_why_a_pipeline_is_declined():
    from grcompile.train.loop import train
    from tests.train.test_distributed import BASE

    import dataclasses

    lines = []
    result = train(dataclasses.replace(BASE, steps=2, pipeline="fwp"), progress=False, log=lines.append)
    assert result["pipeline"] == {"requested": "fwp", "running": "sync",
                                  "reason": "there are no sharded tables to overlap (one process, no sparse runtime)"}
    assert any("--pipeline fwp declined, running sync" in line for line in lines)


def test_semi_async_is_stale_but_trains_to_the_same_loss_within_noise():
    """TurboGR's semi-async over 100 steps on 2 native ranks (Adam tables, which it allows): not the
    synchronous training (the embeddings are one step old), labelled stale, and its loss over the
    last 50 steps within one step-to-step standard deviation of the synchronous run's."""
    import dataclasses

    import numpy as np

    from tests.train.test_distributed import BASE

    base = dataclasses.replace(BASE, sharding="row", sparse_backend="native", sparse_optimizer="adam", steps=100,
                               epochs=10)
    results = run_on_ranks(_trainer_worker, 2, [("sync", base), ("semi", dataclasses.replace(base, pipeline="semi-async"))])[0]
    sync, semi = np.array(results["sync"]["losses"]), np.array(results["semi"]["losses"])
    assert "STALE" in results["semi"]["pipeline"]["running"]
    assert np.abs(semi - sync).max() > 1e-6  # stale: not the synchronous numbers
    noise = sync[-50:].std()
    assert abs(semi[-50:].mean() - sync[-50:].mean()) < noise, (semi[-50:].mean(), sync[-50:].mean(), noise)


@pytest.mark.slow
def test_fwp_under_grcompile_where_lookups_receive_packed_ids():
    """``--compile grcompile``: the jagged rewrite packs the ids before the lookup; FWP still takes
    its prefetched lookups and trains like sync (2 native ranks, 6 steps)."""
    import dataclasses

    from tests.train.test_distributed import BASE, assert_same_training

    base = dataclasses.replace(BASE, sharding="row", sparse_backend="native", sparse_optimizer="adagrad",
                               sparse_lr=0.05, compile="grcompile", steps=6)
    results = run_on_ranks(_trainer_worker, 2, [("sync", base),
                                                ("fwp", dataclasses.replace(base, pipeline="fwp", micro_batches=2))])[0]
    assert results["fwp"]["pipeline"]["reason"] is None
    assert_same_training(results["fwp"], results["sync"])


def _token_worker(rank, world, config):
    from grcompile.data import get_dataset
    from grcompile.train.loop import train

    result = train(config, progress=False, log=lambda *a: None)
    ds = get_dataset(config.data, max_len=config.max_len, seed=config.seed, **config.synthetic)
    train_split = ds.leave_one_out().train
    expected = sum(min(len(s), config.max_len) for s in train_split if len(s) >= 2)
    return {"losses": result["losses"], "tokens": result["train_tokens"],
            "expected": expected, "steps": result["steps_run"]}


def test_token_budget_batches_on_two_ranks_see_every_sample_once_and_train():
    """``--token-budget``: one epoch on 2 ranks emits every training token exactly once across ranks
    and steps, and the loss goes down; the combinations it does not support are refused."""
    import dataclasses

    from grcompile.train.config import TrainConfig
    from tests.train.test_distributed import BASE

    config = dataclasses.replace(BASE, sharding="row", sparse_backend="native", steps=None, epochs=1,
                                 token_budget=120.0)
    out = run_on_ranks(_token_worker, 2, config)[0]
    assert out["tokens"] == out["expected"]
    losses = out["losses"]
    assert sum(losses[-5:]) < sum(losses[:5])
    with pytest.raises(ValueError, match="token_budget"):
        dataclasses.replace(TrainConfig(), token_budget=100.0, pipeline="fwp").validate()


def _lbsl_worker(rank, world, config, checkpoint_dir, fail_at_step):
    from grcompile.train.loop import train

    kwargs = {"checkpoint_dir": checkpoint_dir} if checkpoint_dir else {}
    if fail_at_step is not None:
        kwargs["fail_at_step"] = fail_at_step
    resume = bool(checkpoint_dir) and fail_at_step is None
    result = train(config, progress=False, log=lambda *a: None, resume=resume, **kwargs)
    return {"losses": result["losses"], "tokens": result["train_tokens"]}


def test_lbsl_cuts_tokens_trains_and_resumes_exactly(tmp_path):
    """``--lbsl`` on 2 native ranks: fewer tokens than the full run, the loss goes down, and a run
    killed at step 7 resumes from its step-6 checkpoint to the uninterrupted losses (the LBSL state,
    a step ahead under the loader's lookahead, is checkpointed as of the next step)."""
    import dataclasses

    import torch.multiprocessing as mp

    from tests.train.test_distributed import BASE

    base = dataclasses.replace(BASE, sharding="row", sparse_backend="native", steps=10, max_len=48,
                               checkpoint_every=3, model_overrides={**BASE.model_overrides, "dropout": 0.0})
    lbsl = dataclasses.replace(base, lbsl=True)
    full = run_on_ranks(_lbsl_worker, 2, base, "", None)[0]
    uninterrupted = run_on_ranks(_lbsl_worker, 2, lbsl, "", None)[0]
    assert uninterrupted["tokens"] < full["tokens"]
    assert sum(uninterrupted["losses"][-3:]) < sum(uninterrupted["losses"][:3])
    with pytest.raises(mp.ProcessExitedException):
        run_on_ranks(_lbsl_worker, 2, lbsl, str(tmp_path), 7)
    resumed = run_on_ranks(_lbsl_worker, 2, lbsl, str(tmp_path), None)[0]
    assert resumed["losses"] == uninterrupted["losses"]


def test_a_batch_cut_by_lbsl_keeps_the_rows_its_load_targets_were_set_for():
    """``--lbsl --balance tokens``: rows are assigned on the uncut batch; the cut batch must go to the
    same ranks (re-assigning it on the cut lengths would hand ranks rows planned for others)."""
    from grcompile.data.stochastic_length import LoadBalancedStochasticLength, lbsl_cut
    from grcompile.train.parallel import Parallel

    parallel = Parallel(world=2, rank=0, distributed=True, balance="tokens")
    ids, ts, negatives = length_mix(7, B=12)
    batch = {"ids": ids, "timestamps": ts, "negatives": negatives}
    parts = parallel.assignment(batch)
    cut = lbsl_cut(LoadBalancedStochasticLength(2, N, warmup_steps=1), 0, batch, parts)
    parallel.pin_assignment(cut, parts)
    assert all(torch.equal(a, b) for a, b in zip(parallel.assignment(cut), parts))
    torch.testing.assert_close(parallel.local(cut)["ids"], cut["ids"][parts[0]])
