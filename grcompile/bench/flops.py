"""Analytic model FLOPs of one training step, counted over **valid tokens only**.

A FLOP is one multiply or one add (a multiply-accumulate is 2). Only the matrix products are
counted (projections, attention scores, attention × values, FFNs, the retrieval logits);
normalisations, activations, masks, biases, embeddings and the optimizer are ignored (they are
O(T·D) or O(pairs) and negligible next to the products, but they are *not* negligible in
memory traffic, so achieved TFLOP/s understates the work a padded implementation does).

Notation: ``T = Σ_b L_b`` valid tokens of the batch (``L_b`` = non-padding ids of row ``b``),
``P = Σ_b L_b (L_b + 1) / 2`` causal (query, key) pairs among valid tokens, ``D`` embedding
dim, ``H`` heads, ``dqk`` / ``dv`` q-k / v width per head, ``F`` ffn_dim, ``R`` negatives.

Per block, forward:

* HSTU (models/hstu.py)
    - uvqk projection   ``2·T·D·H·(2·dqk + 2·dv)``
    - scores q·kᵀ       ``2·P·H·dqk``
    - attention · v     ``2·P·H·dv``
    - output projection ``2·T·H·dv·D``
* FuXi-α (models/fuxi.py)
    - uvqk projection   ``2·T·D·H·(4·dv + 2·dqk)``   (u is 3·H·dv wide: one slice per channel)
    - semantic scores   ``2·P·H·dqk``
    - three channels    ``3 · 2·P·H·dv``              (positional, temporal, semantic) · v
    - output projection ``2·T·3·H·dv·D``
    - SwiGLU FFN        ``3 · 2·T·D·F``               (gate, up, down)
* SASRec (models/sasrec.py)
    - q, k, v           ``2·T·D·H·(2·dqk + dv)``
    - scores q·kᵀ       ``2·P·H·dqk``
    - attention · v     ``2·P·H·dv``
    - output projection ``2·T·H·dv·D``
    - point-wise FFN    ``2 · 2·T·D·F``

Loss (models/retrieval.py, sampled softmax with R shared negatives): ``2·T·(R + 1)·D``.

Training step = ``3 ×`` forward (backward ≈ 2 × forward: gradients w.r.t. inputs and weights).
"""
from __future__ import annotations

from typing import Any, Iterable

TRAINING_MULTIPLIER = 3


def valid_lengths(ids: Any, pad_id: int = 0) -> list[int]:
    """Per-row count of non-padding ids of a ``[B, N]`` tensor (or nested list)."""
    try:
        import torch

        if isinstance(ids, torch.Tensor):
            return [int(x) for x in (ids != pad_id).sum(dim=1).tolist()]
    except ImportError:  # pragma: no cover
        pass
    return [sum(1 for x in row if x != pad_id) for row in ids]


def _get(config: Any, name: str) -> Any:
    return config[name] if isinstance(config, dict) else getattr(config, name)


def forward_flops(config: Any, lengths: Iterable[int], num_negatives: int) -> dict[str, int]:
    """Forward FLOPs by component for one batch with per-row valid ``lengths``.

    ``config`` is a ModelConfig (or its ``to_dict()``). Returns integer FLOPs keyed
    ``projections``, ``attention``, ``ffn``, ``loss`` and ``total`` (all blocks summed).
    """
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"negative length in {lengths}")
    model = _get(config, "model")
    D, H = _get(config, "embedding_dim"), _get(config, "num_heads")
    dqk, dv, F = _get(config, "attention_dim"), _get(config, "linear_dim"), _get(config, "ffn_dim")
    blocks = _get(config, "num_blocks")
    T = sum(lengths)
    P = sum(n * (n + 1) // 2 for n in lengths)

    if model == "hstu":
        proj = 2 * T * D * H * (2 * dqk + 2 * dv) + 2 * T * H * dv * D
        attn = 2 * P * H * dqk + 2 * P * H * dv
        ffn = 0
    elif model == "fuxi":
        proj = 2 * T * D * H * (4 * dv + 2 * dqk) + 2 * T * 3 * H * dv * D
        attn = 2 * P * H * dqk + 3 * 2 * P * H * dv
        ffn = 3 * 2 * T * D * F
    elif model == "sasrec":
        proj = 2 * T * D * H * (2 * dqk + dv) + 2 * T * H * dv * D
        attn = 2 * P * H * dqk + 2 * P * H * dv
        ffn = 2 * 2 * T * D * F
    else:
        raise ValueError(f"unknown model {model!r}")

    out = {"projections": blocks * proj, "attention": blocks * attn, "ffn": blocks * ffn,
           "loss": 2 * T * (int(num_negatives) + 1) * D}
    out["total"] = sum(out.values())
    return out


def training_flops(config: Any, lengths: Iterable[int], num_negatives: int) -> int:
    """FLOPs of one training step (forward + backward) = 3 × forward."""
    return TRAINING_MULTIPLIER * forward_flops(config, lengths, num_negatives)["total"]


def sequence_cost_coefficients(config: Any, num_negatives: int) -> tuple[float, float]:
    """``(a, b)`` with ``training_flops(config, [n], R) == a·n + b·n²`` for every length ``n``.

    Every term above is linear in ``T`` or in ``P = n(n+1)/2``, so two evaluations fix the
    coefficients exactly: ``f(1) = a + b`` and ``f(2) = 2a + 4b``. Used to balance sequences
    across ranks by estimated cost (grcompile/data/balance.py).
    """
    f1 = training_flops(config, [1], num_negatives)
    f2 = training_flops(config, [2], num_negatives)
    b = (f2 - 2 * f1) / 2
    return float(f1 - b), float(b)


def sequence_cost(config: Any, num_negatives: int = 128):
    """``data.balance.SequenceCost`` of a ``ModelConfig`` (or its dict): training FLOPs per sequence."""
    from ..data.balance import SequenceCost

    return SequenceCost(*sequence_cost_coefficients(config, num_negatives))


def preset_sequence_cost(model: str, preset: str, num_negatives: int = 128, **overrides: Any):
    """``sequence_cost`` of ``models.make_config(model, preset, ...)`` (the item count does not enter)."""
    from models import make_config

    return sequence_cost(make_config(model, preset, 1, **overrides), num_negatives)
