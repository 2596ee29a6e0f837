"""User sequences, id remapping, k-core filtering and the leave-one-out split."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Sequence:
    """One user's chronological history: item ids in 1..num_items (0 is padding), timestamps."""

    items: np.ndarray  # int64 [L]
    timestamps: np.ndarray  # int64 [L], non-decreasing

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True)
class EvalExample:
    """Predict ``target`` after ``history`` (whose items are filtered from the ranking)."""

    history: Sequence
    target: int
    target_timestamp: int


@dataclass(frozen=True)
class Split:
    train: list[Sequence]
    valid: list[EvalExample]
    test: list[EvalExample]


@dataclass
class SequenceDataset:
    name: str
    sequences: list[Sequence]
    num_items: int
    item_names: list[str] | None = field(default=None, repr=False)

    @classmethod
    def from_interactions(cls, name: str, users: np.ndarray, items: np.ndarray, timestamps: np.ndarray,
                          k_core: int = 0) -> "SequenceDataset":
        """Group (user, item, timestamp) rows into chronological sequences (ties keep file order),
        optionally k-core filter, and remap items to 1..num_items by first appearance."""
        users, items, timestamps = np.asarray(users), np.asarray(items), np.asarray(timestamps)
        if not (len(users) == len(items) == len(timestamps)):
            raise ValueError("users, items and timestamps must have the same length")
        if np.isnan(timestamps.astype(np.float64)).any():
            raise ValueError(f"{name}: timestamps contain NaN")
        if k_core > 0:
            users, items, timestamps = _k_core(users, items, timestamps, k_core)
        order = np.lexsort((np.arange(len(users)), timestamps, _codes(users)))
        users, items, timestamps = users[order], items[order], timestamps[order].astype(np.int64)
        item_keys, item_first = np.unique(items, return_index=True)
        rank = np.empty(len(item_keys), dtype=np.int64)
        rank[np.argsort(item_first, kind="stable")] = np.arange(1, len(item_keys) + 1)
        item_ids = rank[np.searchsorted(item_keys, items)]
        names = [None] * len(item_keys)
        for key, r in zip(item_keys, rank):
            names[r - 1] = str(key)
        boundaries = np.flatnonzero(np.diff(_codes(users))) + 1
        sequences = [Sequence(i, t) for i, t in zip(np.split(item_ids, boundaries), np.split(timestamps, boundaries))
                     if len(i)]
        return cls(name, sequences, len(item_keys), names)

    def leave_one_out(self, min_length: int = 3) -> Split:
        """Last item → test, second to last → validation, the rest → training.

        Users with fewer than ``min_length`` items are dropped (they have nothing to train on).
        The test history includes the validation item, as in SASRec / HSTU.
        """
        train, valid, test = [], [], []
        for seq in self.sequences:
            if len(seq) < min_length:
                continue
            train.append(Sequence(seq.items[:-2], seq.timestamps[:-2]))
            valid.append(EvalExample(Sequence(seq.items[:-2], seq.timestamps[:-2]), int(seq.items[-2]),
                                     int(seq.timestamps[-2])))
            test.append(EvalExample(Sequence(seq.items[:-1], seq.timestamps[:-1]), int(seq.items[-1]),
                                    int(seq.timestamps[-1])))
        return Split(train, valid, test)

    def stats(self) -> dict[str, float]:
        lengths = np.array([len(s) for s in self.sequences])
        return {"users": len(lengths), "items": self.num_items, "interactions": int(lengths.sum()),
                "mean_length": float(lengths.mean()), "median_length": float(np.median(lengths)),
                "max_length": int(lengths.max())}


def _codes(values: np.ndarray) -> np.ndarray:
    return np.unique(values, return_inverse=True)[1].reshape(-1)


def _k_core(users: np.ndarray, items: np.ndarray, timestamps: np.ndarray, k: int):
    """Repeatedly drop users and items with fewer than k interactions."""
    while True:
        u_codes, i_codes = _codes(users), _codes(items)
        keep = (np.bincount(u_codes)[u_codes] >= k) & (np.bincount(i_codes)[i_codes] >= k)
        if keep.all():
            return users, items, timestamps
        users, items, timestamps = users[keep], items[keep], timestamps[keep]
