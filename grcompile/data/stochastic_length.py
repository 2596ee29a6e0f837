"""Stochastic length (SL, HSTU §3.3) and load-balanced stochastic length (LBSL, ULTRA-HSTU).

SL (HSTU): with ``N`` the maximum length and ``α ∈ (1, 2]``, a sequence of ``n ≤ N^{α/2}`` tokens is
kept whole; a longer one is kept whole with probability ``N^α / n²`` and otherwise cut to
``N^{α/2}`` tokens. The expected attention cost per sequence is then ``O(N^α)``.

LBSL (ULTRA-HSTU, shared/seeds/ultra-hstu-notes-zh.txt). From the notes:
  * a rank's load is ``ℓ_r = Σ_{u ∈ rank} n_u^γ`` with ``γ ∈ (1, 2)`` (HSTU's superlinear cost);
  * warm-up: ``T_warm`` steps of plain SL, each rank accumulating ``ℓ_r``; then the target
    ``ℓ̄ = Σ_r ℓ_r / (R · T_warm)`` (an all-reduce) and the accumulators are cleared;
  * constrained sampling per rank and step: the SL weight ``p_u = SLWEIGHT(n_u; α)`` of every
    sequence (short ones high), a weighted random permutation without replacement by ``p_u``, then
    a greedy pass that keeps sequences *whole* while the added load fits the rank's headroom; the
    rest are cut by the SL rule. Short sequences are thus more likely kept whole (SL's bias) and
    every rank ends near ``ℓ̄``: heavy ranks keep fewer long sequences whole, light ones more;
  * every ``T_recal`` steps ``ℓ̄`` is recomputed (all-reduce) to follow a drifting length
    distribution.

Our choices, where the notes are silent or their formula did not survive extraction
("累计增加负载 = Σ_{u∈U_r}(n_u … SL_r) ≤ ℓ̄ − b × SL_r"):
  * ``SLWEIGHT(n; α) = min(1, N^α / n²)`` — SL's own probability of keeping ``n`` whole;
  * the headroom of rank ``r`` is ``ℓ̄ − Σ_u min(n_u, T)^γ`` (``T = ⌊N^{α/2}⌋``: the load with every
    long sequence cut), and keeping ``u`` whole adds ``n_u^γ − T^γ``; the greedy pass skips a
    sequence that does not fit and goes on with the next (a fill, not a stop);
  * "cut by the SL rule" for the sequences not kept whole means cut to ``T`` tokens, the most recent
    ``T`` (contiguous, so every position still predicts its true next item; HSTU's subsequence
    sampler is not specified in the notes);
  * the weighted permutation is Efraimidis–Spirakis (key ``U^{1/p_u}``, descending), with a
    generator seeded by ``(seed, step, rank)``;
  * recalibration accumulates, per rank and step, the load plain SL would have had *in
    expectation* (``Σ_u p_u n_u^γ + (1 − p_u) T^γ`` over long ``u``, ``n_u^γ`` over short ones):
    LBSL's own loads sit at or under the target, so recalibrating on them would ratchet it down;
  * the all-reduces become local sums: every rank of this trainer holds the global batch
    (``Parallel.local`` slices it), so ``LoadBalancedStochasticLength.lengths`` takes all ranks'
    rows and every rank computes the same result with no communication. State is a few floats
    (``state_dict`` / ``load_state_dict`` for checkpoints).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["sl_threshold", "sl_keep_probability", "stochastic_length", "LoadBalancedStochasticLength", "lbsl_cut",
           "lbsl_local", "truncate_rows"]


def sl_threshold(max_len: int, alpha: float) -> int:
    """``⌊N^{α/2}⌋``: SL keeps sequences up to this length whole and cuts longer ones to it."""
    if not 1.0 < alpha <= 2.0:
        raise ValueError(f"alpha must be in (1, 2], got {alpha}")
    return max(1, int(np.floor(float(max_len) ** (alpha / 2) + 1e-9)))


def sl_keep_probability(lengths: Any, max_len: int, alpha: float) -> np.ndarray:
    """``SLWEIGHT``: SL's probability of keeping each sequence whole (1 up to the threshold)."""
    n = np.asarray(lengths, dtype=np.float64)
    threshold = sl_threshold(max_len, alpha)
    with np.errstate(divide="ignore"):
        p = np.minimum(1.0, float(max_len) ** alpha / np.maximum(n, 1.0) ** 2)
    return np.where(n <= threshold, 1.0, p)


def stochastic_length(lengths: Any, max_len: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """Plain SL: the kept length of every sequence."""
    n = np.asarray(lengths, dtype=np.int64)
    threshold = sl_threshold(max_len, alpha)
    keep_whole = rng.random(len(n)) < sl_keep_probability(n, max_len, alpha)
    return np.where((n <= threshold) | keep_whole, n, threshold)


def _expected_sl_load(n: np.ndarray, max_len: int, alpha: float, gamma: float) -> float:
    threshold = sl_threshold(max_len, alpha)
    p = sl_keep_probability(n, max_len, alpha)
    full = n.astype(np.float64) ** gamma
    return float(np.where(n <= threshold, full, p * full + (1 - p) * float(threshold) ** gamma).sum())


class LoadBalancedStochasticLength:
    """LBSL over ``world`` ranks that all see the global batch. Call ``lengths(step, per_rank)``
    once per step, in step order; it returns each rank's kept lengths (apply them with
    ``truncate_rows``). Steps ``< warmup_steps`` are plain SL."""

    def __init__(self, world: int, max_len: int, alpha: float = 1.6, gamma: float = 1.5, warmup_steps: int = 20,
                 recalibrate_every: int = 200, seed: int = 0) -> None:
        if world < 1 or warmup_steps < 1 or recalibrate_every < 1:
            raise ValueError("world, warmup_steps and recalibrate_every must be >= 1")
        if not 1.0 < gamma < 2.0 + 1e-12:
            raise ValueError(f"gamma must be in (1, 2], got {gamma}")
        self.world, self.max_len, self.alpha, self.gamma = world, max_len, alpha, gamma
        self.warmup_steps, self.recalibrate_every, self.seed = warmup_steps, recalibrate_every, seed
        self.threshold = sl_threshold(max_len, alpha)
        self.target: float | None = None  # ℓ̄, per rank and step
        self._accumulated = [0.0] * world
        self._steps_accumulated = 0
        self._next_step = 0

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"target": self.target, "accumulated": list(self._accumulated),
                "steps_accumulated": self._steps_accumulated, "next_step": self._next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.target, self._accumulated = state["target"], list(state["accumulated"])
        self._steps_accumulated, self._next_step = state["steps_accumulated"], state["next_step"]

    def load(self, lengths: Any) -> float:
        """``Σ n^γ``."""
        return float((np.asarray(lengths, dtype=np.float64) ** self.gamma).sum())

    # -- one step -----------------------------------------------------------------------------
    def _calibrate_if_due(self, step: int) -> None:
        due = step == self.warmup_steps or (step > self.warmup_steps
                                            and (step - self.warmup_steps) % self.recalibrate_every == 0)
        if due and self._steps_accumulated:
            self.target = sum(self._accumulated) / (self.world * self._steps_accumulated)  # the all-reduce
            self._accumulated = [0.0] * self.world
            self._steps_accumulated = 0

    def constrained(self, lengths: Any, target: float, rng: np.random.Generator) -> np.ndarray:
        """One rank's kept lengths under the load target (weighted permutation + greedy fill)."""
        n = np.asarray(lengths, dtype=np.int64)
        T, g = self.threshold, self.gamma
        kept = np.minimum(n, T)
        headroom = target - float((kept.astype(np.float64) ** g).sum())
        long_rows = np.flatnonzero(n > T)
        if len(long_rows) == 0 or headroom <= 0:
            return kept
        p = sl_keep_probability(n[long_rows], self.max_len, self.alpha)
        keys = rng.random(len(long_rows)) ** (1.0 / p)  # Efraimidis–Spirakis
        order = long_rows[np.lexsort((long_rows, -keys))]  # descending key, ties by row
        extra_of = n.astype(np.float64) ** g - float(T) ** g
        spent = 0.0
        for u in order:
            if spent + extra_of[u] <= headroom:
                kept[u] = n[u]
                spent += extra_of[u]
        return kept

    def lengths(self, step: int, per_rank: Sequence[Any]) -> list[np.ndarray]:
        """Kept lengths per rank for ``step`` (valid tokens of each rank's rows, in row order)."""
        if len(per_rank) != self.world:
            raise ValueError(f"expected {self.world} ranks' lengths, got {len(per_rank)}")
        if step != self._next_step:
            raise ValueError(f"LBSL steps must come in order: expected step {self._next_step}, got {step}")
        self._next_step += 1
        self._calibrate_if_due(step)
        out = []
        for rank, lengths in enumerate(per_rank):
            n = np.asarray(lengths, dtype=np.int64)
            rng = np.random.default_rng((self.seed, step, rank))
            if self.target is None:  # warm-up: plain SL, accumulate its actual load
                kept = stochastic_length(n, self.max_len, self.alpha, rng)
                self._accumulated[rank] += self.load(kept)
            else:
                kept = self.constrained(n, self.target, rng)
                self._accumulated[rank] += _expected_sl_load(n, self.max_len, self.alpha, self.gamma)
            out.append(kept)
        self._steps_accumulated += 1
        return out


def lbsl_local(lbsl: LoadBalancedStochasticLength, step: int, batch: dict[str, torch.Tensor],
               parts: Sequence[torch.Tensor], rank: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """This rank's rows of the global ``batch`` (``parts``: row indices per rank, e.g. ``equal_slices``
    or ``assign_rows``), cut by LBSL. Every rank calls it once per step with the same arguments but
    ``rank`` (so every rank's ``lbsl`` state stays identical); checkpoint ``lbsl.state_dict()``."""
    from .balance import row_lengths, select_rows

    lengths = row_lengths(batch["ids"], pad_id)
    kept = lbsl.lengths(step, [lengths[p.numpy()] for p in parts])
    return truncate_rows(select_rows(batch, parts[rank]), kept[rank], pad_id)


def lbsl_cut(lbsl: LoadBalancedStochasticLength, step: int, batch: dict[str, torch.Tensor],
             parts: Sequence[torch.Tensor], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The whole global ``batch`` cut by LBSL (every rank's rows by its own load target; ``parts``:
    row indices per rank). Every rank computes the same; ``select_rows`` of it for the rank's part
    equals ``lbsl_local`` — and the global target count for the loss weights comes with it."""
    from .balance import row_lengths

    lengths = row_lengths(batch["ids"], pad_id)
    kept = lbsl.lengths(step, [lengths[p.numpy()] for p in parts])
    keep = np.zeros(len(lengths), dtype=np.int64)
    for rows, k in zip(parts, kept):
        keep[rows.numpy()] = k
    return truncate_rows(batch, keep, pad_id)


def truncate_rows(batch: dict[str, torch.Tensor], keep: Any, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Keep the most recent ``keep[b]`` valid tokens of each right-padded row, moved to the front
    (ids, timestamps and per-position negatives ``[B, N, R]`` alike); the rest becomes padding.
    Returns new tensors; ``batch`` is unchanged."""
    ids = batch["ids"]
    B, N = ids.shape
    valid = (ids != pad_id).sum(dim=1)
    keep = torch.as_tensor(np.asarray(keep, dtype=np.int64)).clamp(min=0)
    if keep.shape != (B,):
        raise ValueError(f"keep must have one length per row ({B}), got shape {tuple(keep.shape)}")
    keep = torch.minimum(keep, valid)
    positions = torch.arange(N).unsqueeze(0)  # new position j takes old position j + (valid - keep)
    source = (positions + (valid - keep).unsqueeze(1)).clamp(max=N - 1)
    inside = positions < keep.unsqueeze(1)
    out = dict(batch)
    for name, tensor in batch.items():
        per_position = tensor.dim() >= 2 and tensor.shape[:2] == (B, N) and (name in ("ids", "timestamps") or tensor.dim() == 3)
        if not per_position:
            continue
        index = source.view(B, N, *([1] * (tensor.dim() - 2))).expand_as(tensor)
        moved = tensor.gather(1, index)
        mask = inside.view(B, N, *([1] * (tensor.dim() - 2))).expand_as(tensor)
        fill = pad_id if name == "ids" else 0
        out[name] = torch.where(mask, moved, torch.full_like(moved, fill))
    return out
