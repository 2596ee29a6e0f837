"""Padded batches as users build them: right padded ``[B, max_len]`` int64 ids (0 = padding) and
timestamps, the most recent ``max_len`` items of each sequence; uniform negatives per row."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from .dataset import EvalExample, Sequence


def pad_batch(sequences: list[Sequence], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad the last ``max_len`` items of each sequence to ``[B, max_len]``."""
    ids = np.zeros((len(sequences), max_len), dtype=np.int64)
    ts = np.zeros((len(sequences), max_len), dtype=np.int64)
    for row, seq in enumerate(sequences):
        items, times = seq.items[-max_len:], seq.timestamps[-max_len:]
        ids[row, : len(items)] = items
        ts[row, : len(times)] = times
    return torch.from_numpy(ids), torch.from_numpy(ts)


class TrainLoader:
    """Shuffled padded training batches, deterministic in (seed, epoch, step).

    Yields ``dict(ids=[B, N], timestamps=[B, N], negatives=...)`` with R negatives uniform over
    1..num_items: ``[B, R]`` shared by a row's positions, or ``[B, N, R]`` per position when
    ``per_position`` (the HSTU setup; see SampledSoftmaxRetrieval for the cost of each).
    """

    def __init__(self, sequences: list[Sequence], batch_size: int, max_len: int, num_items: int,
                 num_negatives: int = 128, seed: int = 0, drop_last: bool = True,
                 per_position: bool = False) -> None:
        sequences = [s for s in sequences if len(s) >= 2]  # one item gives no (input, target) pair
        if not sequences:
            raise ValueError("no training sequence has two or more items")
        self.sequences, self.batch_size, self.max_len = sequences, batch_size, max_len
        self.num_items, self.num_negatives, self.seed, self.drop_last = num_items, num_negatives, seed, drop_last
        self.per_position = per_position

    def __len__(self) -> int:
        n = len(self.sequences)
        return max(1, n // self.batch_size) if self.drop_last else -(-n // self.batch_size)

    def iterate(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        order = np.random.default_rng((self.seed, epoch)).permutation(len(self.sequences))
        for step in range(start_step, len(self)):
            rows = order[step * self.batch_size:(step + 1) * self.batch_size]
            ids, ts = pad_batch([self.sequences[r] for r in rows], self.max_len)
            rng = np.random.default_rng((self.seed, epoch, step, 1))
            shape = (len(rows), self.max_len, self.num_negatives) if self.per_position else (len(rows), self.num_negatives)
            negatives = torch.from_numpy(rng.integers(1, self.num_items + 1, size=shape))
            yield {"ids": ids, "timestamps": ts, "negatives": negatives}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.iterate(0)


class EvalLoader:
    """Evaluation batches: the history padded like training, the target, and every item of the
    history (``history_ids`` [B, H], 0-padded, not truncated) for filtering from the ranking."""

    def __init__(self, examples: list[EvalExample], batch_size: int, max_len: int) -> None:
        self.examples, self.batch_size, self.max_len = examples, batch_size, max_len

    def __len__(self) -> int:
        return -(-len(self.examples) // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for start in range(0, len(self.examples), self.batch_size):
            chunk = self.examples[start:start + self.batch_size]
            ids, ts = pad_batch([e.history for e in chunk], self.max_len)
            H = max(len(e.history) for e in chunk)
            history = np.zeros((len(chunk), H), dtype=np.int64)
            for row, e in enumerate(chunk):
                history[row, : len(e.history)] = e.history.items
            yield {"ids": ids, "timestamps": ts,
                   "targets": torch.tensor([e.target for e in chunk]),
                   "target_timestamps": torch.tensor([e.target_timestamp for e in chunk]),
                   "history_ids": torch.from_numpy(history)}
