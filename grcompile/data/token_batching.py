"""Token-aware dynamic batching (MTGRBoost §5.1, Algorithm 1; TurboGR §4.1.3 "token-aware dynamic
batch scaling"): batches cut by a token budget instead of a row count, so that every rank
computes on about the same number of tokens per step.

From the papers:
  * a batch is the prefix of the sample stream whose cumulative token count is *closest* to the
    target ``N`` (binary search in the cumulative sums); MTGRBoost sets ``N`` = average sequence
    length × batch size;
  * the rank batches then hold different numbers of samples, so each rank's gradient is weighted
    by its share of the step's samples (MTGRBoost exchanges batch sizes by an all-to-all).

Our choices:
  * one stream per epoch — the permutation of all samples seeded by ``(seed, epoch)`` — cut into
    budget batches one after the other; batch ``j`` goes to rank ``j mod world`` at step
    ``j // world``. (MTGRBoost cuts a stream per GPU; a shared stream keeps every rank at the same
    number of steps.) The plan depends only on the lengths, the seed and the epoch, so every rank
    computes every rank's batch sizes locally: no all-to-all is needed for the weights.
  * the tail, if fewer than ``world`` batches are left at the end, is pooled and split over all
    ranks by ``balance.assign_rows`` as one last step; a tail under half a step's budget joins the
    last full step's rows instead (no near-empty last step). A rank gets an empty batch only if
    fewer rows than ranks are left. Every sample is emitted exactly once per epoch (tested);
    nothing is dropped.
  * weights: ``weighting="targets"`` (default) — a rank's share of the step's target positions,
    which makes the weighted sum of the ranks' mean losses the exact global mean of this repo's
    loss (SampledSoftmaxRetrieval averages over target positions, ``n − 1`` per row);
    ``"samples"`` is MTGRBoost's rule (exact for a per-sample mean loss).
  * a budget may be a cost (``cost=SequenceCost``) instead of tokens; ``max_rows`` caps a batch's
    row count (memory of padded batches: rows × longest row).
  * a sequence longer than ``max_len`` counts ``max_len`` tokens (``pad_batch`` keeps its last
    ``max_len`` items).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np
import torch

from .balance import CostLike, _cost_fn, assign_rows
from .batching import pad_batch
from .dataset import Sequence

__all__ = ["cut_by_budget", "plan_epoch", "step_weights", "TokenBudgetLoader", "StepBatches"]


def cut_by_budget(costs: np.ndarray, budget: float, max_rows: Optional[int] = None) -> list[int]:
    """Sizes of the consecutive batches Algorithm 1 cuts from a stream with per-sample ``costs``:
    each batch is the prefix whose cumulative cost is closest to ``budget`` (ties: the smaller
    batch), at least one sample, at most ``max_rows``. The sizes sum to ``len(costs)``."""
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    costs = np.asarray(costs, dtype=np.float64)
    cumulative = np.cumsum(costs)
    sizes, start, base = [], 0, 0.0
    while start < len(costs):
        # S[k-1] - base = cost of the first k remaining samples; first k with S >= target:
        hi = int(np.searchsorted(cumulative, base + budget, side="left"))  # absolute index
        k = hi - start + 1  # samples up to and including hi
        if hi >= len(costs):
            k = len(costs) - start
        elif k > 1:
            over = cumulative[hi] - base - budget
            under = budget - (cumulative[hi - 1] - base)
            if under <= over:
                k -= 1
        if max_rows is not None:
            k = min(k, max_rows)
        sizes.append(k)
        start += k
        base = float(cumulative[start - 1])
    return sizes


def plan_epoch(lengths: Any, world: int, budget: float, seed: int = 0, epoch: int = 0,
               cost: CostLike = "tokens", max_rows: Optional[int] = None) -> list[list[np.ndarray]]:
    """Sample indices per step and rank: ``plan[step][rank]`` (int64 arrays). Deterministic in
    ``(lengths, world, budget, seed, epoch, cost, max_rows)``."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.random.default_rng((seed, epoch)).permutation(len(lengths))
    costs = np.asarray(_cost_fn(cost)(lengths[order]), dtype=np.float64)
    bounds = np.cumsum([0] + cut_by_budget(costs, budget, max_rows))
    batches = [order[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
    full = len(batches) // world * world
    plan = [batches[s:s + world] for s in range(0, full, world)]
    if full < len(batches):
        rest = np.concatenate(batches[full:])
        if plan and float(costs[bounds[full]:].sum()) < world * budget / 2:
            rest = np.concatenate(plan.pop() + [rest])  # a small tail joins the last full step
        split = assign_rows(lengths[rest], world, cost)
        plan.append([rest[rows.numpy()] for rows in split])
    return plan


def step_weights(rank_lengths: list[np.ndarray], weighting: str = "targets") -> list[float]:
    """Weights of the ranks' mean losses whose sum is the global mean over the step:
    target positions (``n − 1`` per row of ``n`` tokens, the loss of SampledSoftmaxRetrieval) or
    samples (MTGRBoost). A rank with nothing to average gets weight 0."""
    if weighting == "targets":
        counts = [float(np.clip(np.asarray(n, dtype=np.int64) - 1, 0, None).sum()) for n in rank_lengths]
    elif weighting == "samples":
        counts = [float(len(n)) for n in rank_lengths]
    else:
        raise ValueError(f"weighting must be 'targets' or 'samples', got {weighting!r}")
    total = sum(counts)
    return [c / total if total > 0 else 0.0 for c in counts]


@dataclass
class StepBatches:
    """One synchronous step: a padded batch per rank, the weight of each rank's mean loss, and the
    sample indices (into ``TokenBudgetLoader.sequences``) per rank."""

    batches: list[dict[str, torch.Tensor]]
    weights: list[float]
    rows: list[np.ndarray] = field(repr=False)


class TokenBudgetLoader:
    """Padded training batches cut by a token budget per rank, deterministic in (seed, epoch, step).

    Each rank's batch is ``dict(ids=[B_r, L], timestamps=[B_r, L], negatives=[B_r, R] or
    [B_r, L, R])`` like ``TrainLoader``'s, with ``B_r`` varying and ``L`` the batch's longest row
    (``pad_to="longest"``) or ``max_len`` (``pad_to="max_len"``). ``token_budget`` defaults to the
    mean (capped) sequence length × ``rows_per_rank`` (MTGRBoost's rule).

    Use ``iterate(epoch)`` for all ranks' batches (benchmarks, tests) or
    ``iterate_rank(epoch, rank)`` for ``(batch, weight)`` of one rank: the rank multiplies its mean
    loss by ``weight`` and the summed (all-reduced) gradients are those of the global mean.
    """

    def __init__(self, sequences: list[Sequence], world: int, max_len: int, num_items: int,
                 token_budget: Optional[float] = None, rows_per_rank: Optional[int] = None,
                 num_negatives: int = 128, seed: int = 0, per_position: bool = False, pad_to: str = "longest",
                 cost: CostLike = "tokens", max_rows: Optional[int] = None, weighting: str = "targets") -> None:
        sequences = [s for s in sequences if len(s) >= 2]  # as TrainLoader: one item has no target
        if not sequences:
            raise ValueError("no training sequence has two or more items")
        if pad_to not in ("longest", "max_len"):
            raise ValueError(f"pad_to must be 'longest' or 'max_len', got {pad_to!r}")
        self.sequences, self.world, self.max_len, self.num_items = sequences, world, max_len, num_items
        self.lengths = np.minimum(np.array([len(s) for s in sequences], dtype=np.int64), max_len)
        if token_budget is None:
            if rows_per_rank is None:
                raise ValueError("give token_budget or rows_per_rank")
            token_budget = float(np.asarray(_cost_fn(cost)(self.lengths)).mean()) * rows_per_rank
        self.token_budget, self.cost, self.max_rows, self.weighting = float(token_budget), cost, max_rows, weighting
        self.num_negatives, self.seed, self.per_position, self.pad_to = num_negatives, seed, per_position, pad_to
        step_weights([], weighting)  # validates the name

    def plan(self, epoch: int) -> list[list[np.ndarray]]:
        return plan_epoch(self.lengths, self.world, self.token_budget, self.seed, epoch, self.cost, self.max_rows)

    def steps(self, epoch: int) -> int:
        """Steps of ``epoch`` (varies a little from epoch to epoch)."""
        return len(self.plan(epoch))

    def _batch(self, rows: np.ndarray, epoch: int, step: int, rank: int) -> dict[str, torch.Tensor]:
        width = self.max_len if self.pad_to == "max_len" else max(int(self.lengths[rows].max(initial=1)), 1)
        ids, ts = pad_batch([self.sequences[r] for r in rows], width)
        rng = np.random.default_rng((self.seed, epoch, step, rank, 1))
        shape = (len(rows), width, self.num_negatives) if self.per_position else (len(rows), self.num_negatives)
        negatives = torch.from_numpy(rng.integers(1, self.num_items + 1, size=shape))
        return {"ids": ids, "timestamps": ts, "negatives": negatives}

    def iterate(self, epoch: int, start_step: int = 0) -> Iterator[StepBatches]:
        for step, ranks in enumerate(self.plan(epoch)):
            if step < start_step:
                continue
            yield StepBatches([self._batch(rows, epoch, step, r) for r, rows in enumerate(ranks)],
                              step_weights([self.lengths[rows] for rows in ranks], self.weighting), ranks)

    def iterate_rank(self, epoch: int, rank: int, start_step: int = 0) -> Iterator[tuple[dict[str, torch.Tensor], float]]:
        """This rank's ``(batch, loss weight)`` per step; only this rank's batch is padded."""
        for step, ranks in enumerate(self.plan(epoch)):
            if step < start_step:
                continue
            weights = step_weights([self.lengths[rows] for rows in ranks], self.weighting)
            yield self._batch(ranks[rank], epoch, step, rank), weights[rank]
