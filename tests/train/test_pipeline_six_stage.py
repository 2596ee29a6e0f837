"""TurboGR's six-stage schedule (``--pipeline six-stage``, ``train/pipeline.py``): semi-async
made deeper — t+2's keys routed on a thread and a process group of their own, t+1's rows read and
sent, t computed, t's gradient exchange on the gradient thread — must be *the same training as
semi-async*, only run at other times. Proved on 2 gloo ranks in float64 with Adagrad; a negative
control (the stage order broken: t+1's rows read after t's update) moves off it."""
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from grcompile.runtime import dense_parameters, shard_embeddings
from grcompile.runtime.launch import run_on_ranks
from grcompile.train.pipeline import PIPELINES, STALE, DataStage, SparsePipeline
from tests.runtime.test_embedding_rewrite import length_mix, make_task

STEPS, B = 20, 12


def _batches(steps: int = STEPS) -> list[dict]:
    """Global batches with empty, length-1 and full rows (``length_mix``); the same on every rank."""
    out = []
    for step in range(steps):
        ids, ts, negatives = length_mix(300 + step, B=B)
        out.append({"ids": ids, "timestamps": ts, "negatives": negatives})
    return out


def _train(rank: int, world: int, schedule: str, trace: bool = False, optimizer: str = "adagrad",
           dedup: str = "two_stage", steps: int = STEPS) -> dict:
    """``schedule``: sync, semi-async, six-stage, six-stage-late (the negative control: t+1's rows read
    after t's update), or six-stage-wrong (the step after next announced wrongly every time)."""
    task = make_task()
    runtime = shard_embeddings(task, backend="native", dedup=dedup, sharding="row")
    opt = torch.optim.Adagrad(task.parameters(), lr=0.05) if optimizer == "adagrad" \
        else torch.optim.Adam(task.parameters(), lr=0.01)
    pipeline = SparsePipeline(task, runtime, world=world,
                              schedule="six-stage" if schedule.startswith("six-stage") else
                              schedule if schedule != "sync" else "fwp")
    pipeline.read_ahead = not schedule.endswith("-late")
    batches = _batches(steps)
    pairs = [(b, {k: v[rank * B // world:(rank + 1) * B // world] for k, v in b.items()}) for b in batches]
    losses, threads = [], set()
    runtime.timeline = [] if trace else None
    for step, (batch, local) in enumerate(pairs):
        opt.zero_grad(set_to_none=True)
        runtime.new_step()
        if schedule == "sync":
            weight = task.count_targets(local["ids"]) / max(task.count_targets(batch["ids"]), 1)
            loss = task(local["ids"], local["timestamps"], local["negatives"]) * weight
            loss.backward()
            loss = loss.detach()
        else:
            ahead = pairs[step + 1:step + 1 + pipeline.lookahead]
            if schedule.endswith("-wrong") and step + 3 < len(pairs):
                ahead[1] = pairs[step + 3]  # t+3 routed as if it were t+2: dropped and re-routed at t+1
            loss = pipeline.step(task, batch, local, *ahead)
        for p in dense_parameters(task):
            if p.grad is not None:
                dist.all_reduce(p.grad)
        opt.step()
        total = loss.clone()
        dist.all_reduce(total)
        losses.append(float(total))
    pipeline.discard()
    if trace:
        threads = {(name.split(" ")[0], thread) for name, thread, _, _ in runtime.timeline}
    return {"losses": losses, "tables": {t: runtime.tables.full(t) for t in runtime.plan.tables},
            "dense": {k: v.detach().clone() for k, v in task.state_dict().items() if "grcompile" not in k},
            "threads": threads, "stats": runtime.tables.stats.as_dict()}


def _schedules(rank: int, world: int) -> dict:
    out = {s: _train(rank, world, s) for s in ("sync", "semi-async", "six-stage-late")}
    out["six-stage"] = _train(rank, world, "six-stage", trace=True)
    return out


def _assert_same(run: dict, reference: dict) -> None:
    torch.testing.assert_close(run["losses"], reference["losses"], rtol=1e-12, atol=0)
    for part in ("tables", "dense"):
        for name in reference[part]:
            torch.testing.assert_close(run[part][name], reference[part][name], rtol=1e-12, atol=0)


def _moved_off(run: dict, reference: dict) -> bool:
    return max(abs(a - b) for a, b in zip(run["losses"], reference["losses"])) > 1e-6


def test_six_stage_trains_exactly_like_semi_async_on_two_ranks():
    """20 steps, Adagrad (state per row), two-stage dedup, empty / length-1 / full rows: six-stage
    gives semi-async's losses, final tables and dense weights; neither is the synchronous training
    (one step stale); the control with t+1's rows read after t's update is not semi-async (it is
    the synchronous training: nothing stale is left)."""
    results = run_on_ranks(_schedules, 2)
    for rank, r in results.items():
        _assert_same(r["six-stage"], r["semi-async"])
        assert _moved_off(r["six-stage"], r["sync"])
        assert _moved_off(r["six-stage-late"], r["semi-async"])  # the negative control fails the test above
        _assert_same(r["six-stage-late"], r["sync"])
        # the routing stage ran on its own thread; the gradient exchange on the gradient thread
        spans = r["six-stage"]["threads"]
        assert {thread for name, thread in spans if name == "route"} and all(
            t.startswith("grcompile-sparse-route") for name, t in spans if name in ("route", "key"))
        assert all(t.startswith("grcompile-sparse-grad") for name, t in spans if name == "gradient"
                   and not t.startswith("Main"))
        # the same ids and rows crossed ranks as under semi-async (routing on another group counts the same)
        assert r["six-stage"]["stats"] == r["semi-async"]["stats"]


def _semi_and_six(rank: int, world: int, optimizer: str, dedup: str, steps: int) -> dict:
    return {s: _train(rank, world, s, optimizer=optimizer, dedup=dedup, steps=steps)
            for s in ("sync", "semi-async", "six-stage", "six-stage-wrong")}


@pytest.mark.slow
def test_six_stage_with_adam_and_no_dedup_on_four_ranks_over_40_steps():
    """Adam (momentum moves rows without gradient: allowed, as under semi-async), no dedup, 4 ranks;
    and a caller that announces the wrong step after next: the routing made for it is dropped (its
    collectives finished on every rank) and the right batch routed, the training unchanged."""
    results = run_on_ranks(_semi_and_six, 4, "adam", "none", 40)
    for r in results.values():
        _assert_same(r["six-stage"], r["semi-async"])
        _assert_same(r["six-stage-wrong"], r["semi-async"])
        assert _moved_off(r["six-stage"], r["sync"])


def test_six_stage_is_labelled_stale_and_shares_semi_asyncs_resume_key():
    from grcompile.train.config import TrainConfig
    from grcompile.train.loop import _resume_key

    assert "six-stage" in PIPELINES and "six-stage" in STALE
    six, semi = (_resume_key(TrainConfig(model="sasrec", pipeline=p)) for p in ("six-stage", "semi-async"))
    assert six["pipeline"] == semi["pipeline"] == "stale"
    assert _resume_key(TrainConfig(model="sasrec", pipeline="sync"))["pipeline"] == "synchronous"


# -- the dataloader stage ---------------------------------------------------------------------------
def test_data_stage_yields_in_order_one_item_ahead_and_reraises():
    made = []

    def items():
        for i in range(6):
            made.append(i)
            yield i

    stage = DataStage(items())
    got = []
    for item in stage:
        deadline = time.monotonic() + 5
        while len(made) < min(item + 2, 6) and time.monotonic() < deadline:
            time.sleep(0.001)  # the thread prepares the next item while this one is used ...
        time.sleep(0.01)
        assert len(made) <= item + 2  # ... and no more (bounded: one ahead)
        got.append(item)
    assert got == list(range(6))

    def broken():
        yield 1
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        list(DataStage(broken()))

    stage = DataStage(iter(range(100)))
    assert next(iter(stage)) == 0
    stage.close()  # stops its thread though the iterator is not exhausted
    assert not stage._thread.is_alive()


# -- through the trainer ----------------------------------------------------------------------------
from tests.train.test_pipeline import _trainer_worker  # noqa: E402 - the same worker, one definition


def test_trainer_six_stage_is_semi_async_with_a_data_stage():
    """``--pipeline six-stage`` through the trainer (2 native ranks, Adagrad tables, 6 steps, the
    data stage on its thread): semi-async's losses and weights, labelled STALE."""
    from tests.train.test_distributed import BASE

    base = dataclasses.replace(BASE, sharding="row", sparse_backend="native", sparse_optimizer="adagrad",
                               sparse_lr=0.05, pipeline="semi-async", steps=6)
    jobs = [("semi", base), ("six", dataclasses.replace(base, pipeline="six-stage"))]
    results = run_on_ranks(_trainer_worker, 2, jobs)[0]
    six, semi = results["six"], results["semi"]
    assert six["pipeline"]["reason"] is None and "STALE" in six["pipeline"]["running"]
    assert six["pipeline"]["running"].startswith("six-stage")
    assert six["losses"] == semi["losses"]
    for part in ("feature_weights", "dense_weights"):
        for name in semi[part]:
            torch.testing.assert_close(six[part][name], semi[part][name], rtol=0, atol=0)


@pytest.mark.slow
def test_trainer_six_stage_with_cost_balance_and_lbsl_is_semi_async():
    """The data stage draws LBSL cuts and balanced assignments on its thread, a batch ahead: the
    rows each rank trains on, and so the training, are semi-async's."""
    from tests.train.test_distributed import BASE

    base = dataclasses.replace(BASE, sharding="row", sparse_backend="native", sparse_optimizer="adagrad",
                               sparse_lr=0.05, pipeline="semi-async", steps=12, max_len=48, balance="cost", lbsl=True)
    jobs = [("semi", base), ("six", dataclasses.replace(base, pipeline="six-stage"))]
    results = run_on_ranks(_trainer_worker, 2, jobs)
    for r in results.values():
        assert r["six"]["pipeline"]["reason"] is None
        assert r["six"]["losses"] == r["semi"]["losses"]
        for part in ("feature_weights", "dense_weights"):
            for name in r["semi"][part]:
                torch.testing.assert_close(r["six"][part][name], r["semi"][part][name], rtol=0, atol=0)
