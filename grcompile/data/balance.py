"""Global token reallocation (TurboGR §4.1.3): the rows of one global batch assigned to the ranks
so that every rank gets about the same estimated compute, whole sequences only.

Why: with equal row slices (``Parallel.local``) a rank that drew the long sequences computes for
longer and every other rank waits for it at the gradient all-reduce. Every rank already holds the
global batch, so every rank can compute the same assignment without communicating.

How: longest-processing-time-first (LPT) list scheduling. Rows sorted by estimated cost, most
expensive first (ties: lower row index first); each goes to the currently least-loaded rank
(ties: lower rank). The cost of a row of ``n`` valid tokens is ``a·n + b·n²`` (``SequenceCost``;
``bench.flops.sequence_cost`` takes ``a``, ``b`` from the analytic FLOPs of bench/flops.py), or
plain tokens (``a=1, b=0``). Guarantees (tested): every row exactly once; deterministic; the
largest rank load is at most ``mean + (1 − 1/world)·max row`` (list scheduling) and at most 4/3 of
the optimum (LPT, Graham 1969); and never above equal slicing's — where the equal row slices
happen to be better balanced (LPT is not optimal), they are returned instead.

The gradient stays the exact global mean whatever the assignment: ``Parallel.loss_weight``
weights each rank's mean loss by its share of the global target count.

Metrics (``rank_loads``, ``imbalance``) are shared with the benchmark
(``python -m grcompile.bench.balance``).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import numpy as np
import torch

__all__ = ["SequenceCost", "CostLike", "assign_rows", "equal_slices", "rebalance_local", "select_rows",
           "row_lengths", "rank_loads", "imbalance"]


@dataclass(frozen=True)
class SequenceCost:
    """Estimated cost ``a·n + b·n²`` of one sequence of ``n`` valid tokens (any unit)."""

    a: float = 1.0
    b: float = 0.0

    @classmethod
    def tokens(cls) -> "SequenceCost":
        return cls(1.0, 0.0)

    def __call__(self, lengths: Any) -> np.ndarray:
        n = np.asarray(lengths, dtype=np.float64)
        return self.a * n + self.b * n * n


CostLike = Union[SequenceCost, str, tuple, Callable[[np.ndarray], np.ndarray], None]


def _cost_fn(cost: CostLike) -> Callable[[np.ndarray], np.ndarray]:
    if cost is None or cost == "tokens":
        return SequenceCost.tokens()
    if isinstance(cost, tuple):
        return SequenceCost(*cost)
    if callable(cost):
        return cost
    raise ValueError(f"cost must be 'tokens', (a, b), a SequenceCost or a callable, got {cost!r}")


def _lengths(lengths: Any) -> np.ndarray:
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.detach().cpu().numpy()
    out = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if (out < 0).any():
        raise ValueError("lengths must be >= 0")
    return out


def row_lengths(ids: torch.Tensor, pad_id: int = 0) -> np.ndarray:
    """Valid (non-padding) tokens per row of a right-padded ``[B, N]`` batch."""
    return (ids != pad_id).sum(dim=1).cpu().numpy().astype(np.int64)


def equal_slices(num_rows: int, world: int) -> list[torch.Tensor]:
    """The baseline: rows ``[r·B/world, (r+1)·B/world)`` to rank ``r`` (what ``Parallel.local`` does)."""
    _check_world(world)
    return [torch.arange(r * num_rows // world, (r + 1) * num_rows // world, dtype=torch.long) for r in range(world)]


def _check_world(world: int) -> None:
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")


def _lpt(costs: np.ndarray, world: int) -> list[list[int]]:
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, rank) for rank in range(world)]
    ranks: list[list[int]] = [[] for _ in range(world)]
    for i in order:
        load, rank = heapq.heappop(heap)
        ranks[rank].append(i)
        heapq.heappush(heap, (load + float(costs[i]), rank))
    return ranks


def assign_rows(lengths: Any, world: int, cost: CostLike = "tokens") -> list[torch.Tensor]:
    """Row indices (int64, ascending) of the global batch for each of ``world`` ranks.

    ``lengths``: valid tokens per row (list, array or tensor; ``row_lengths(batch["ids"])``).
    ``cost``: ``"tokens"``, ``(a, b)``, a ``SequenceCost`` or any callable mapping a length array to
    a cost array. A rank may get no row when there are fewer rows than ranks.
    """
    _check_world(world)
    n = _lengths(lengths)
    costs = np.asarray(_cost_fn(cost)(n), dtype=np.float64)
    if costs.shape != n.shape or not np.isfinite(costs).all() or (costs < 0).any():
        raise ValueError("cost must map lengths to finite non-negative costs of the same shape")
    greedy = [torch.tensor(sorted(rows), dtype=torch.long) for rows in _lpt(costs, world)]
    if len(n) % world == 0:  # equal slicing is a candidate only where it is defined (equal row counts)
        sliced = equal_slices(len(n), world)
        if _max_load(costs, sliced) < _max_load(costs, greedy):
            return sliced
    return greedy


def _max_load(costs: np.ndarray, assignment: list[torch.Tensor]) -> float:
    return max(float(costs[rows.numpy()].sum()) for rows in assignment)


def select_rows(batch: dict[str, torch.Tensor], rows: torch.Tensor, trim: bool = False,
                pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The batch's tensors at ``rows`` (first dimension). ``trim``: also cut the padding columns
    beyond the longest selected row, in every tensor that has the ids' column dimension (ids,
    timestamps, per-position negatives ``[B, N, R]``) — a padded model then computes on
    ``[B_r, N_r]`` instead of ``[B_r, N]``; the outputs at valid positions of right-padded causal
    models do not depend on trailing padding columns, but shapes vary from step to step."""
    out = {k: v[rows] for k, v in batch.items()}
    if trim and "ids" in out:
        N = out["ids"].shape[1]
        keep = max(int(row_lengths(out["ids"], pad_id).max(initial=0)), 1)
        out = {k: (v[:, :keep] if v.dim() >= 2 and v.shape[1] == N and (k in ("ids", "timestamps") or v.dim() == 3)
                   else v) for k, v in out.items()}
    return out


def rebalance_local(batch: dict[str, torch.Tensor], world: int, rank: int, cost: CostLike = "tokens",
                    trim: bool = False, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """This rank's part of the global ``batch`` under ``assign_rows`` — a drop-in for
    ``Parallel.local``; ``Parallel.loss_weight(task, batch, local)`` still gives the exact weight."""
    rows = assign_rows(row_lengths(batch["ids"], pad_id), world, cost)[rank]
    return select_rows(batch, rows, trim=trim, pad_id=pad_id)


def rank_loads(lengths: Any, assignment: Sequence[Any], cost: CostLike = "tokens") -> np.ndarray:
    """Total cost per rank of ``assignment`` (row indices per rank)."""
    costs = np.asarray(_cost_fn(cost)(_lengths(lengths)), dtype=np.float64)
    return np.array([costs[np.asarray(rows, dtype=np.int64)].sum() for rows in assignment], dtype=np.float64)


def imbalance(loads: Any) -> dict[str, float]:
    """``spread`` = max − min, ``max_over_min`` (inf if a rank has nothing), and the modelled
    ``wait_share`` = 1 − mean/max: the share of a synchronous step the ranks spend, on average,
    waiting at the gradient all-reduce when step time is proportional to load."""
    loads = np.asarray(loads, dtype=np.float64)
    top, low = float(loads.max()), float(loads.min())
    return {"spread": top - low,
            "max_over_min": top / low if low > 0 else float("inf"),
            "wait_share": 1.0 - float(loads.mean()) / top if top > 0 else 0.0}
