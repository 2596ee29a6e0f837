"""The attention-dropout hash (grcompile/lowering/attention/dropout.py); its equality with a dense
model's dropout under the same mask is tested on the op, tests/lowering/test_jagged_ops.py."""
from __future__ import annotations

import torch

from grcompile.lowering.attention.dropout import dropout_keep, dropout_keep_rows, dropout_rows


def test_dropout_mask_rate_and_independence() -> None:
    """keep ≈ Bernoulli(1 − p): the rate, and no correlation between neighbours, seeds or heads."""
    tok = torch.arange(300)[None]
    a = dropout_keep(torch.tensor([1]), tok, tok, 2, 0.3).float()
    b = dropout_keep(torch.tensor([2]), tok, tok, 2, 0.3).float()
    assert abs(a.mean().item() - 0.7) < 0.005  # 180k draws: sd 0.001
    for x, y in [(a, b), (a[:, 0], a[:, 1]), (a[..., 1:], a[..., :-1]), (a[..., 1:, :], a[..., :-1, :])]:
        assert abs((x * y).mean().item() - 0.49) < 0.006, "correlated dropout decisions"
    assert dropout_keep(torch.tensor([1]), tok, tok, 2, 0.0).all()


def test_int32_hash_equals_the_definition_eager_and_compiled() -> None:
    """dropout_keep_rows (int32, wrapping multiplies) draws dropout_keep's bits: any seed, tokens up
    to 2³¹ − 1, every rate, key counts with and without a vector tail, eager and inductor-compiled."""
    compiled = torch.compile(dropout_keep_rows, dynamic=True)
    for trial in range(12):
        g = torch.Generator().manual_seed(trial)
        n, H, Lq = (int(x) for x in torch.randint(1, 6, (3,), generator=g))
        Lk = [1, 7, 8, 9, 16, 33][trial % 6]
        seed = torch.randint(-2**62, 2**62, (1,), generator=g)
        q_tok = torch.randint(0, 2**31 - 1, (n, Lq), generator=g)
        k_tok = torch.randint(0, 2**31 - 1, (n, Lk), generator=g)
        k_tok[0, 0] = 2**31 - 1
        p = [0.0, 0.1, 0.5, 0.9, float(torch.rand((), generator=g))][trial % 5]
        want = dropout_keep(seed, q_tok, k_tok, H, p)
        rows = dropout_rows(seed, q_tok, H)
        assert torch.equal(dropout_keep_rows(rows, k_tok, p), want)
        assert torch.equal(compiled(rows, k_tok, torch.tensor(p, dtype=torch.float64)), want)
