"""Load balancing across data-parallel ranks: global token reallocation (balance.py), token-aware
dynamic batching (token_batching.py), SL / LBSL (stochastic_length.py)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from grcompile.bench.flops import preset_sequence_cost, sequence_cost_coefficients, training_flops
from grcompile.data.balance import (SequenceCost, assign_rows, equal_slices, imbalance, rank_loads,
                                    rebalance_local, row_lengths, select_rows)
from grcompile.data.batching import pad_batch
from grcompile.data.dataset import Sequence
from grcompile.data.stochastic_length import (LoadBalancedStochasticLength, lbsl_local, sl_keep_probability,
                                              sl_threshold, stochastic_length, truncate_rows)
from grcompile.data.token_batching import TokenBudgetLoader, cut_by_budget, plan_epoch, step_weights
from models import make_config

lengths_st = st.lists(st.integers(min_value=1, max_value=2048), min_size=1, max_size=96)
world_st = st.integers(min_value=1, max_value=8)
costs_st = st.sampled_from(["tokens", SequenceCost(8.0, 3.0), SequenceCost(1.0, 0.01)])
FAST = settings(max_examples=60, deadline=None)


# -- cost model ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["hstu", "fuxi", "sasrec"])
def test_cost_coefficients_reproduce_training_flops(model):
    config = make_config(model, "small", 10, max_len=2048)
    a, b = sequence_cost_coefficients(config, 128)
    for n in (0, 1, 7, 200, 2048):
        assert a * n + b * n * n == training_flops(config, [n], 128)
    assert preset_sequence_cost(model, "small", 128, max_len=2048) == SequenceCost(a, b)


# -- global token reallocation ------------------------------------------------------------------------
@FAST
@given(lengths_st, world_st, costs_st)
def test_assignment_is_a_permutation_and_deterministic(lengths, world, cost):
    parts = assign_rows(lengths, world, cost)
    assert len(parts) == world
    assert all(p.dtype == torch.long and bool((p[1:] > p[:-1]).all()) for p in parts)
    assert sorted(torch.cat(parts).tolist()) == list(range(len(lengths)))
    again = assign_rows(list(lengths), world, cost)
    assert all(torch.equal(p, q) for p, q in zip(parts, again))


@FAST
@given(lengths_st, world_st, costs_st)
def test_assignment_bounds(lengths, world, cost):
    """Never worse than equal slices; within the list-scheduling bound mean + (1 − 1/m)·max item."""
    loads = rank_loads(lengths, assign_rows(lengths, world, cost), cost)
    items = rank_loads(lengths, [[i] for i in range(len(lengths))], cost)
    assert loads.max() <= items.sum() / world + (1 - 1 / world) * items.max() + 1e-6 * items.sum()
    if len(lengths) % world == 0:
        sliced = rank_loads(lengths, equal_slices(len(lengths), world), cost)
        assert loads.max() <= sliced.max()
        assert imbalance(loads)["wait_share"] <= imbalance(sliced)["wait_share"] + 1e-12


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=7), st.integers(2, 3))
def test_assignment_within_four_thirds_of_optimum(lengths, world):
    """Graham's LPT bound against the brute-force optimum."""
    best = min(max(sum(n for n, r in zip(lengths, owner) if r == rank) for rank in range(world))
               for owner in itertools.product(range(world), repeat=len(lengths)))
    assert rank_loads(lengths, assign_rows(lengths, world)).max() <= 4 / 3 * best


def test_assignment_examples():
    # LPT gives 7 | 5 here; the equal slices [3, 3, 0] | [2, 2, 2] give 6 | 6 and are kept instead
    parts = assign_rows([3, 3, 0, 2, 2, 2], 2)
    assert rank_loads([3, 3, 0, 2, 2, 2], parts).tolist() == [6, 6]
    # long tail: one long sequence alone on a rank, the short ones spread over the others
    lengths = [2000, 10, 10, 10, 10, 10, 10, 300]
    parts = assign_rows(lengths, 4, SequenceCost(1.0, 1.0))
    assert [0] in [p.tolist() for p in parts]
    assert imbalance([2.0, 1.0, 1.0, 0.0]) == {"spread": 2.0, "max_over_min": float("inf"), "wait_share": 0.5}
    with pytest.raises(ValueError):
        assign_rows([1, 2], 0)
    with pytest.raises(ValueError):
        assign_rows([1, 2], 2, cost="flops")


def _padded(lengths, max_len, seed=0, per_position=True):
    rng = np.random.default_rng(seed)
    seqs = [Sequence(rng.integers(1, 50, n), np.arange(n)) for n in lengths]
    ids, ts = pad_batch(seqs, max_len)
    negatives = torch.from_numpy(rng.integers(1, 50, (len(lengths), max_len, 3) if per_position else (len(lengths), 3)))
    return {"ids": ids, "timestamps": ts, "negatives": negatives}


def test_rebalance_local_partitions_the_batch_and_keeps_the_target_count():
    lengths = [12, 3, 7, 2, 9, 12, 5, 4]
    batch = _padded(lengths, 12)
    targets = lambda ids: int(((ids[:, :-1] != 0) & (ids[:, 1:] != 0)).sum())  # SampledSoftmaxRetrieval's
    locals_ = [rebalance_local(batch, 4, r, SequenceCost(1, 1), trim=True) for r in range(4)]
    assert sum(targets(x["ids"]) for x in locals_) == targets(batch["ids"])
    assert sorted(sum((row_lengths(x["ids"]).tolist() for x in locals_), [])) == sorted(lengths)
    for x in locals_:  # trimmed to the rank's longest row, every tensor along the same columns
        width = int(row_lengths(x["ids"]).max())
        assert x["ids"].shape[1] == x["timestamps"].shape[1] == x["negatives"].shape[1] == width
    rows = torch.tensor([1, 3])
    kept = select_rows(batch, rows, trim=True)
    assert torch.equal(kept["ids"], batch["ids"][rows, :3]) and kept["negatives"].shape == (2, 3, 3)
    per_row = _padded(lengths, 12, per_position=False)
    assert select_rows(per_row, rows, trim=True)["negatives"].shape == (2, 3)


# -- token-aware dynamic batching ---------------------------------------------------------------------
@FAST
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=200), st.integers(1, 5000), st.none() | st.integers(1, 20))
def test_cut_by_budget_takes_the_closest_prefix(tokens, budget, max_rows):
    sizes = cut_by_budget(np.array(tokens), budget, max_rows)
    assert sum(sizes) == len(tokens) and min(sizes) >= 1
    start = 0
    for k in sizes:
        rest = np.cumsum(tokens[start:])
        best = np.abs(rest - budget)
        limit = len(rest) if max_rows is None else min(max_rows, len(rest))
        assert k - 1 == int(np.argmin(best[:limit]))  # the closest prefix within the row cap; ties: the shorter
        start += k


@FAST
@given(st.lists(st.integers(2, 2048), min_size=1, max_size=300), st.integers(1, 6), st.integers(0, 3),
       st.floats(200, 20000))
def test_plan_emits_every_sample_once_and_is_deterministic(lengths, world, epoch, budget):
    plan = plan_epoch(lengths, world, budget, seed=7, epoch=epoch)
    assert all(len(step) == world for step in plan)
    emitted = np.concatenate([rows for step in plan for rows in step])
    assert sorted(emitted.tolist()) == list(range(len(lengths)))
    again = plan_epoch(lengths, world, budget, seed=7, epoch=epoch)
    assert all(np.array_equal(a, b) for s, t in zip(plan, again) for a, b in zip(s, t))


def test_plan_depends_on_seed_and_epoch_and_balances_tokens():
    rng = np.random.default_rng(1)
    lengths = np.minimum(2048, rng.lognormal(4.5, 1.0, 4000).astype(int) + 2)
    budget = lengths.mean() * 32
    plans = [plan_epoch(lengths, 4, budget, seed=s, epoch=e) for s, e in [(0, 0), (0, 1), (1, 0)]]
    firsts = [p[0][0].tolist() for p in plans]
    assert firsts[0] != firsts[1] and firsts[0] != firsts[2]
    tokens = np.array([[lengths[r].sum() for r in step] for step in plans[0][:-1]])
    assert np.abs(tokens - budget).max() <= lengths.max() / 2 + 1  # closest cut: within half a sequence
    sliced = lengths[np.random.default_rng((0, 0)).permutation(len(lengths))][:len(plans[0]) * 128]
    sliced_tokens = sliced[:len(sliced) // 32 * 32].reshape(-1, 4, 32).sum(-1)
    assert (tokens.max(1) - tokens.min(1)).mean() < (sliced_tokens.max(1) - sliced_tokens.min(1)).mean() / 2


@FAST
@given(st.lists(st.lists(st.integers(1, 50), min_size=0, max_size=10), min_size=1, max_size=5), st.integers(0, 2**31))
def test_step_weights_give_the_global_mean(per_rank, seed):
    """Σ_r w_r · (rank r's mean over its targets) == the mean over all targets of the step."""
    rng = np.random.default_rng(seed)
    losses = [[rng.random(max(n - 1, 0)) for n in rank] for rank in per_rank]
    flat = np.concatenate([x for rank in losses for x in rank] + [np.zeros(0)])
    weights = step_weights([np.array(rank, dtype=np.int64) for rank in per_rank])
    means = [np.concatenate(rank + [np.zeros(0)]).mean() if sum(map(len, rank)) else 0.0 for rank in losses]
    if len(flat):
        assert sum(weights) == pytest.approx(1.0)
        assert sum(w * m for w, m in zip(weights, means)) == pytest.approx(flat.mean())
    assert step_weights([np.array(r) for r in per_rank], "samples") == pytest.approx(
        [len(r) / max(sum(map(len, per_rank)), 1) for r in per_rank] if sum(map(len, per_rank)) else [0.0] * len(per_rank))


def _sequences(n, seed=0, top=60):
    rng = np.random.default_rng(seed)
    return [Sequence(rng.integers(1, 40, k), np.sort(rng.integers(0, 10**6, k))) for k in rng.integers(1, top, n)]


@pytest.mark.parametrize("pad_to,per_position", [("longest", False), ("max_len", True)])
def test_token_budget_loader_batches(pad_to, per_position):
    seqs = _sequences(150)
    loader = TokenBudgetLoader(seqs, world=3, max_len=40, num_items=39, rows_per_rank=8, num_negatives=5,
                               seed=3, per_position=per_position, pad_to=pad_to)
    seen = []
    for step, sb in enumerate(loader.iterate(epoch=2)):
        assert sum(sb.weights) == pytest.approx(1.0) and len(sb.batches) == 3
        for rows, batch in zip(sb.rows, sb.batches):
            width = 40 if pad_to == "max_len" else int(loader.lengths[rows].max())
            ids, ts = pad_batch([loader.sequences[r] for r in rows], width)
            assert torch.equal(batch["ids"], ids) and torch.equal(batch["timestamps"], ts)
            R = (len(rows), width, 5) if per_position else (len(rows), 5)
            assert batch["negatives"].shape == R and batch["ids"].dtype == torch.int64
            assert int(batch["negatives"].min()) >= 1 and int(batch["negatives"].max()) <= 39
            seen += rows.tolist()
        ranks = list(loader.iterate_rank(2, 1))[step]
        assert torch.equal(ranks[0]["negatives"], sb.batches[1]["negatives"]) and ranks[1] == sb.weights[1]
    assert sorted(seen) == list(range(len(loader.sequences)))  # one-item sequences are left out, as in TrainLoader
    assert len(loader.sequences) == sum(len(s) >= 2 for s in seqs)


def test_weighted_rank_losses_equal_the_global_loss():
    """The sample-count (target-count) weighted rank losses of one step are the loss of the union
    batch: the gradients of the weighted sum are the global-mean gradients."""
    from models import SampledSoftmaxRetrieval, build_encoder

    torch.manual_seed(0)
    encoder = build_encoder("hstu", "ml1m", 39, max_len=40, embedding_dim=8, num_blocks=1, attention_dim=4,
                            linear_dim=4, dropout=0.0)
    task = SampledSoftmaxRetrieval(encoder).double()
    loader = TokenBudgetLoader(_sequences(60, seed=1), world=3, max_len=40, num_items=39, rows_per_rank=6,
                               num_negatives=4, pad_to="max_len")
    sb = next(loader.iterate(0))
    union = {k: torch.cat([b[k] for b in sb.batches]) for k in ("ids", "timestamps", "negatives")}
    with torch.no_grad():
        weighted = sum(w * task(b["ids"], b["timestamps"], b["negatives"]) for w, b in zip(sb.weights, sb.batches))
        global_loss = task(union["ids"], union["timestamps"], union["negatives"])
    assert float(weighted) == pytest.approx(float(global_loss), rel=1e-10)


# -- stochastic length and LBSL -----------------------------------------------------------------------
def test_sl_rule():
    assert sl_threshold(2048, 1.6) == 445 and sl_threshold(100, 2.0) == 100
    p = sl_keep_probability([10, 445, 446, 1000, 2048], 2048, 1.6)
    assert p[:2].tolist() == [1.0, 1.0] and p[3] == pytest.approx(2048 ** 1.6 / 1000 ** 2)
    assert np.all(np.diff(p[2:]) < 0)
    n = np.array([10, 445, 2048] * 500)
    kept = stochastic_length(n, 2048, 1.6, np.random.default_rng(0))
    assert set(kept[n == 10]) == {10} and set(kept[n == 445]) == {445} and set(kept[n == 2048]) == {445, 2048}
    assert np.mean(kept[n == 2048] == 2048) == pytest.approx(2048 ** 1.6 / 2048 ** 2, abs=0.05)


@FAST
@given(st.lists(st.integers(1, 2048), min_size=1, max_size=64), st.floats(0, 5e6), st.integers(0, 1000))
def test_lbsl_constrained_sampling_fits_the_target_greedily(lengths, target, seed):
    lbsl = LoadBalancedStochasticLength(2, 2048, alpha=1.6, gamma=1.5)
    n = np.array(lengths)
    kept = lbsl.constrained(n, target, np.random.default_rng(seed))
    T = lbsl.threshold
    assert np.all((kept == n) | (kept == np.minimum(n, T)))
    base = lbsl.load(np.minimum(n, T))
    assert lbsl.load(kept) <= max(target, base) * (1 + 1e-9)
    left = target - lbsl.load(kept)
    extra = n.astype(float) ** 1.5 - T ** 1.5
    assert not np.any((kept < n) & (extra <= left - 1e-6 * max(target, 1)))  # greedy fill: nothing else fits


def _rank_lengths(step, world=4, per_rank=32):
    rng = np.random.default_rng((5, step))
    return [np.minimum(2048, rng.lognormal(5.0, 1.2, per_rank).astype(int) + 2) for _ in range(world)]


def test_lbsl_warmup_calibration_and_state():
    lbsl = LoadBalancedStochasticLength(4, 2048, alpha=1.6, gamma=1.5, warmup_steps=3, recalibrate_every=4, seed=9)
    warm = []
    for step in range(3):
        out = lbsl.lengths(step, _rank_lengths(step))
        expected = [stochastic_length(n, 2048, 1.6, np.random.default_rng((9, step, r)))
                    for r, n in enumerate(_rank_lengths(step))]
        assert all(np.array_equal(a, b) for a, b in zip(out, expected))  # warm-up is plain SL
        warm += [lbsl.load(k) for k in out]
        assert lbsl.target is None
    lbsl.lengths(3, _rank_lengths(3))
    assert lbsl.target == pytest.approx(np.mean(warm))
    for step in range(4, 7):
        lbsl.lengths(step, _rank_lengths(step))
        assert lbsl.target == pytest.approx(np.mean(warm))
    snapshot = lbsl.state_dict()
    resumed = LoadBalancedStochasticLength(4, 2048, alpha=1.6, gamma=1.5, warmup_steps=3, recalibrate_every=4, seed=9)
    resumed.load_state_dict(snapshot)
    a, b = lbsl.lengths(7, _rank_lengths(7)), resumed.lengths(7, _rank_lengths(7))  # step 7 recalibrates
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert lbsl.target != pytest.approx(np.mean(warm)) and lbsl.target == resumed.target
    with pytest.raises(ValueError):
        lbsl.lengths(9, _rank_lengths(9))


def test_lbsl_balances_rank_loads_better_than_sl():
    lbsl = LoadBalancedStochasticLength(4, 2048, alpha=1.6, gamma=1.5, warmup_steps=10, recalibrate_every=50)
    sl_ratio, lbsl_ratio, sl_mean, lbsl_mean = [], [], [], []
    for step in range(80):
        per_rank = _rank_lengths(step)
        kept = lbsl.lengths(step, per_rank)
        if step < 10:
            continue
        sl = [stochastic_length(n, 2048, 1.6, np.random.default_rng((1, step, r))) for r, n in enumerate(per_rank)]
        sl_loads, lb_loads = [lbsl.load(k) for k in sl], [lbsl.load(k) for k in kept]
        sl_ratio.append(max(sl_loads) / min(sl_loads))
        lbsl_ratio.append(max(lb_loads) / min(lb_loads))
        sl_mean.append(np.mean(sl_loads))
        lbsl_mean.append(np.mean(lb_loads))
    assert np.mean(lbsl_ratio) < np.mean(sl_ratio)
    assert np.mean(lbsl_mean) <= np.mean(sl_mean) * 1.05  # about SL's mean load, not more


def test_lbsl_local_cuts_this_ranks_rows_like_every_other_rank():
    """Each rank (its own LBSL object) computes the same plan and keeps its own rows, cut."""
    world, lengths = 2, [30, 3, 25, 8, 30, 2, 17, 29]
    batch = _padded(lengths, 30)
    make = lambda: LoadBalancedStochasticLength(world, 30, alpha=1.5, gamma=1.5, warmup_steps=1, recalibrate_every=3)
    ranks, reference = [make() for _ in range(world)], make()
    parts = assign_rows(lengths, world, SequenceCost(1, 1))
    for step in range(4):
        kept = reference.lengths(step, [np.array(lengths)[p.numpy()] for p in parts])
        for rank, lbsl in enumerate(ranks):
            local = lbsl_local(lbsl, step, batch, parts, rank)
            assert row_lengths(local["ids"]).tolist() == kept[rank].tolist()
            assert local["ids"].shape == (len(parts[rank]), 30)
    assert all(r.state_dict() == reference.state_dict() for r in ranks)
    assert reference.target is not None


def test_truncate_rows_keeps_the_most_recent_tokens():
    batch = _padded([5, 2, 4], 6)
    out = truncate_rows(batch, [3, 5, 0])
    assert out["ids"][0].tolist() == batch["ids"][0, 2:5].tolist() + [0, 0, 0]
    assert torch.equal(out["ids"][1], batch["ids"][1]) and out["ids"][2].tolist() == [0] * 6
    assert torch.equal(out["timestamps"][0, :3], batch["timestamps"][0, 2:5])
    assert torch.equal(out["negatives"][0, :3], batch["negatives"][0, 2:5])
    assert row_lengths(out["ids"]).tolist() == [3, 2, 0]
    assert torch.equal(batch["ids"], _padded([5, 2, 4], 6)["ids"])  # input unchanged


# -- the benchmark CLI --------------------------------------------------------------------------------
def test_bench_balance_cli(tmp_path):
    import json

    from grcompile.bench.balance import main

    report = main(["--steps", "12", "--warmup", "3", "--num-users", "3000", "--json", str(tmp_path / "b.json"),
                   "--plot", str(tmp_path / "b.png")])
    assert json.loads((tmp_path / "b.json").read_text())["simulated"].keys() == report["simulated"].keys()
    assert (tmp_path / "b.png").stat().st_size > 0
    sim = report["simulated"]
    assert sim["realloc_cost"]["wait_share_modelled"] < sim["equal"]["wait_share_modelled"]
    assert sim["realloc_tokens"]["token_spread_mean"] < sim["equal"]["token_spread_mean"]
    assert sim["equal"]["rows_per_step"] == sim["realloc_cost"]["rows_per_step"] == 128
    assert sim["sl"]["steps"] == sim["lbsl"]["steps"] == 9


@pytest.mark.slow
def test_bench_balance_measures_on_gloo_ranks():
    from grcompile.bench.balance import measure, method_plans, synthetic_lengths

    lengths = synthetic_lengths(500, 256)
    plans = method_plans(lengths, 2, 8, 2, SequenceCost(1, 0.01), seed=0, max_len=256, alpha=1.6, gamma=1.5,
                         warmup=1, recalibrate=5, methods=("equal", "realloc_tokens"))
    out = measure(plans, 2, 256)
    assert set(out) == {"equal", "realloc_tokens"}
    assert all(0 <= r["wait_share_measured"] <= 1 and r["steps"] == 1 for r in out.values())
