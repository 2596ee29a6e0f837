"""The attention-dropout hash (grcompile/lowering/attention/dropout.py); its equality with a dense
model's dropout under the same mask is tested on the op, tests/lowering/test_jagged_ops.py."""
from __future__ import annotations

import torch

from grcompile.lowering.attention.dropout import dropout_keep


def test_dropout_mask_rate_and_independence() -> None:
    """keep ≈ Bernoulli(1 − p): the rate, and no correlation between neighbours, seeds or heads."""
    tok = torch.arange(300)[None]
    a = dropout_keep(torch.tensor([1]), tok, tok, 2, 0.3).float()
    b = dropout_keep(torch.tensor([2]), tok, tok, 2, 0.3).float()
    assert abs(a.mean().item() - 0.7) < 0.005  # 180k draws: sd 0.001
    for x, y in [(a, b), (a[:, 0], a[:, 1]), (a[..., 1:], a[..., :-1]), (a[..., 1:, :], a[..., :-1, :])]:
        assert abs((x * y).mean().item() - 0.49) < 0.006, "correlated dropout decisions"
    assert dropout_keep(torch.tensor([1]), tok, tok, 2, 0.0).all()
