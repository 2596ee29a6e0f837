"""Seeded KuaiRand-like synthetic sequences: the embedded default data of demo and benchmarks.

Items follow a Zipf popularity law inside topics; a user walks between topics (Markov) and often
follows an item's fixed successors, so the next item is learnable. Lengths are long-tailed
(min_length + exponential, capped at max_len) with the scale solved so that the mean padding at
``max_len`` is ``padding_fraction``. Timestamps are monotone with log-normal gaps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .dataset import Sequence, SequenceDataset


@dataclass(frozen=True)
class SyntheticConfig:
    num_users: int = 4000
    num_items: int = 3000
    max_len: int = 200
    padding_fraction: float = 0.5
    min_length: int = 3
    num_topics: int = 20
    zipf_exponent: float = 1.1
    topic_stay: float = 0.8
    follow_successor: float = 0.5
    seed: int = 0


def length_scale(config: SyntheticConfig) -> float:
    """Exponential scale s with E[min(m + Exp(s), M)] = (1 − padding) · M (bisection)."""
    m, M = config.min_length, config.max_len
    target = (1.0 - config.padding_fraction) * M
    if not m < target < M:
        raise ValueError(f"padding_fraction {config.padding_fraction} unreachable with min_length={m}, max_len={M}")
    lo, hi = 1e-6, 1e9
    for _ in range(200):
        s = math.sqrt(lo * hi)
        mean = m + s * (1.0 - math.exp(-(M - m) / s))
        lo, hi = (s, hi) if mean < target else (lo, s)
    return s


def generate(config: SyntheticConfig = SyntheticConfig()) -> SequenceDataset:
    rng = np.random.default_rng(config.seed)
    V, T = config.num_items, config.num_topics
    topic_of = rng.integers(0, T, size=V)
    topic_items = [np.flatnonzero(topic_of == t) for t in range(T)]
    topic_items = [items if len(items) else np.arange(V) for items in topic_items]
    topic_probs = []
    for items in topic_items:
        w = 1.0 / np.arange(1, len(items) + 1) ** config.zipf_exponent
        topic_probs.append(w / w.sum())
    successors = rng.integers(0, V, size=(V, 3))

    scale = length_scale(config)
    lengths = np.minimum(config.max_len, config.min_length + rng.exponential(scale, config.num_users).astype(np.int64))
    topic_cdfs = [np.cumsum(p) for p in topic_probs]
    sequences = []
    for length in lengths:
        follow, switch, pick, new_topic, u = (rng.random(length), rng.random(length),
                                                    rng.integers(0, 3, length), rng.integers(0, T, length),
                                                    rng.random(length))
        topic = int(rng.integers(T))
        items = np.empty(length, dtype=np.int64)
        prev = -1
        for i in range(length):
            if prev >= 0 and follow[i] < config.follow_successor:
                prev = int(successors[prev, pick[i]])
            else:
                if switch[i] > config.topic_stay:
                    topic = int(new_topic[i])
                cdf = topic_cdfs[topic]
                prev = int(topic_items[topic][min(int(np.searchsorted(cdf, u[i])), len(cdf) - 1)])
            items[i] = prev
        gaps = np.exp(rng.normal(7.0, 2.0, size=length)).astype(np.int64)
        timestamps = 1_600_000_000 + int(rng.integers(0, 10**7)) + np.cumsum(gaps)
        sequences.append(Sequence(items + 1, timestamps.astype(np.int64)))
    return SequenceDataset("synthetic", sequences, V)
