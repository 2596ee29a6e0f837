"""Attention in a graph with no padding mask (GPT-style code: right padding and causality keep padded
keys away from real queries, by the data's convention only). Nothing can be packed, but a causal
attention is still exact to fuse over every position: it is fused where that pays — a written-out
attention (the ``[B, H, N, N]`` scores are never stored) or one with a learned bias — and left as
written where it does not (a library call with no bias is already one fused kernel; a non-causal
attention), with a reason. Values and gradients at *every* position equal eager, in train and eval.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import grcompile

N, D, H, VOCAB = 8, 8, 2, 30


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Causal(nn.Module):
    """A GPT block's attention over ``ids`` with no padding mask: written out (``spelling="manual"``,
    optionally with a learned relative-position bias), or ``F.scaled_dot_product_attention``."""

    def __init__(self, spelling: str = "manual", bias: bool = False, causal: bool = True) -> None:
        super().__init__()
        self.spelling, self.causal = spelling, causal
        self.emb = nn.Embedding(VOCAB, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.rel = nn.Parameter(torch.randn(2 * N - 1) * 0.1) if bias else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        x = self.emb(ids)
        q, k, v = (t.view(B, T, H, -1).transpose(1, 2) for t in self.qkv(x).split(D, dim=-1))
        if self.spelling == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5
            if self.rel is not None:
                pos = torch.arange(T, device=ids.device)
                scores = scores + self.rel[pos[None, :] - pos[:, None] + N - 1]
            if self.causal:
                future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=ids.device), diagonal=1)
                scores = scores.masked_fill(future, float("-inf"))
            y = torch.softmax(scores, dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(B, T, D))


def check(module: nn.Module, ids: torch.Tensor):
    """``optimize(module)`` equals ``module`` at every position (values and gradients), train and eval."""
    optimized = grcompile.optimize(module, lowering="eager")
    for mode in ("train", "eval"):
        module.train(mode == "train")
        module.zero_grad(set_to_none=True)
        got = optimized(ids)
        got.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        module.zero_grad(set_to_none=True)
        ref = module(ids)
        ref.square().sum().backward()
        torch.testing.assert_close(got, ref, msg=lambda m: f"{mode}: values differ\n{m}")
        for n, p in module.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, msg=lambda m, n=n: f"{mode}: {n}\n{m}")
    return grcompile.report(optimized)


def ids(B: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(1, VOCAB, (B, N), generator=g)
    out[0, 3:] = 0  # right padding the model does not know about: it attends to it like to any token
    return out


def fused(report) -> list[dict]:
    return [r for r in report.rewrites if r["pass"] == "fuse_attention"]


def reasons(report) -> list[str]:
    return [f["reason"] for f in report.fallbacks if f["pass"] == "fuse_attention"]


@pytest.mark.parametrize("bias", [False, True])
def test_written_out_causal_attention_fuses_over_every_position(bias):
    torch.manual_seed(0)
    report = check(Causal("manual", bias=bias).double(), ids())
    (rewrite,) = fused(report)
    assert rewrite["causal"] is True and rewrite["bias_tables"] == int(bias)
    assert not any(r["pass"] == "jagged_rewrite" for r in report.rewrites)  # nothing is packed
    assert report.counters.get("jagged_rewrite.token_ops", 0) == 0


def test_sdpa_with_no_mask_and_no_bias_is_kept_as_written():
    torch.manual_seed(0)
    report = check(Causal("sdpa").double(), ids())
    assert not fused(report)
    (why,) = reasons(report)
    assert "F.scaled_dot_product_attention kept as written" in why and "already one fused kernel" in why


@pytest.mark.parametrize("spelling", ["manual", "sdpa"])
def test_non_causal_attention_with_no_mask_is_kept_as_written(spelling):
    torch.manual_seed(0)
    report = check(Causal(spelling, causal=False).double(), ids())
    assert not fused(report)
    (why,) = reasons(report)
    assert "no padding mask and no causal mask" in why


def test_float_inputs_without_ids_are_left_alone():
    """No ``[B, N]`` integer input to root the layouts at: nothing is rewritten, still exact."""
    torch.manual_seed(0)

    class Features(Causal):
        def forward(self, x):  # noqa: D102 - x: [B, N, D] features
            B, T, _ = x.shape
            q, k, v = (t.view(B, T, H, -1).transpose(1, 2) for t in self.qkv(x).split(D, dim=-1))
            future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
            scores = (q @ k.transpose(-1, -2)).masked_fill(future, float("-inf"))
            return self.out((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, T, D))

    module = Features().double()
    x = torch.randn(3, N, D, dtype=torch.float64)
    optimized = grcompile.optimize(module, lowering="eager")
    torch.testing.assert_close(optimized(x), module(x))
    assert not fused(grcompile.report(optimized))


def test_batch_and_length_change():
    torch.manual_seed(0)
    module = Causal("manual", bias=True).double()
    optimized = grcompile.optimize(module, lowering="eager")
    for B, T in ((4, N), (2, N), (3, 5)):
        x = ids(B, seed=B)[:, :T]
        torch.testing.assert_close(optimized(x), module(x))
    assert fused(grcompile.report(optimized))


class MaskInput(nn.Module):
    """A causal attention whose key mask is an ``attention_mask`` input (HF style), not derived from
    the ids: with left padding a padded query may have every key masked."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(VOCAB, D)
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        q, k, v = (t.view(B, T, H, -1).transpose(1, 2) for t in self.qkv(self.emb(ids)).split(D, dim=-1))
        future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        if self.how == "sdpa_additive":  # -1e9 for the future and for padded keys, one float mask
            mask = torch.zeros(T, T, dtype=q.dtype).masked_fill(future, -1e9) \
                + (1.0 - attention_mask)[:, None, None, :] * -1e9
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        scores = q @ k.transpose(-1, -2)
        if self.how == "finfo_min":
            low = torch.finfo(scores.dtype).min
            scores = scores.masked_fill(future, low).masked_fill(attention_mask[:, None, None, :] < 0.5, low)
        else:  # "-inf": a row with every key masked is NaN in eager
            scores = scores.masked_fill(~attention_mask.bool()[:, None, None, :], float("-inf")) \
                .masked_fill(future, float("-inf"))
        return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("how", ["sdpa_additive", "finfo_min", "-inf"])
def test_a_mask_input_with_left_padding_is_not_fused(how):
    """The user's own mask may empty a row (left padding): eager then spreads the softmax over every
    key, or gives NaN, where a fused op would skip the future keys or give 0 — so it stays as
    written, exact at every position (NaN where eager has NaN)."""
    torch.manual_seed(0)
    module = MaskInput(how).double()
    x = ids(3)
    attention_mask = torch.ones(3, N, dtype=torch.float64)
    attention_mask[0, :2] = 0  # left padding: queries 0 and 1 of row 0 see only masked keys
    optimized = grcompile.optimize(module, lowering="eager")
    torch.testing.assert_close(optimized(x, attention_mask), module(x, attention_mask), equal_nan=True)
    report = grcompile.report(optimized)
    assert not fused(report)
    (why,) = reasons(report)
    assert "may mask every key of a query" in why
