"""Losses over flattened tokens (issue 10): ``logits.view(-1, C)`` / ``flatten(0, 1)`` before a
per-position ``cross_entropy`` / ``nll_loss``, masked after the loss, sometimes unflattened back to
``[B, N]``; and token-local ``einsum``s with a per-row operand (sampled negatives). The ``Flat``
layout follows the merged (row, position) axis, so the block stays jagged to the loss. Spellings
whose padded positions do count (an unmasked mean, a column-major flatten) stay dense, exactly.
Every case: values and parameter gradients equal eager (float64), train and eval."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.passes.layout import Flat, Token
from tests.passes.test_jagged_spellings import check, counter, jagged_fallbacks, jagged_ops, make_ids

N, D, V, R = 8, 8, 40, 5


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class FlatLoss(nn.Module):
    """A row-wise block (embedding, norm, feed-forward) and a loss over its flattened tokens."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.item = nn.Embedding(V, D, padding_idx=0)
        self.norm = nn.LayerNorm(D)
        self.ff = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids, targets, negatives):
        B, n = ids.shape
        h = self.norm(self.item(ids))
        h = h + torch.relu(self.ff(h))
        valid = ids != 0
        s = self.spelling
        if s == "ce_none_masked":
            loss = F.cross_entropy(self.head(h).view(-1, V), targets.view(-1), reduction="none")
            return (loss * valid.view(-1).float()).sum() / valid.sum().clamp(min=1)
        if s == "ce_unflatten_per_row":  # back to [B, N], then a per-row masked sum (a segment exit)
            loss = F.cross_entropy(self.head(h).reshape(B * n, V), targets.reshape(-1), reduction="none")
            return (loss.view(B, n) * valid).sum(1)
        if s == "nll_masked_fill":
            logp = F.log_softmax(self.head(h).flatten(0, 1), dim=-1)
            loss = F.nll_loss(logp, targets.flatten(), reduction="none")
            return loss.masked_fill(~valid.flatten(), 0.0).sum()
        if s == "constant_target_weights":  # a [B·N] target built in the graph, class weights
            logits = self.head(h).flatten(0, 1)
            target = torch.zeros(B * n, dtype=torch.long, device=ids.device)
            w = torch.linspace(0.5, 1.5, V, dtype=h.dtype, device=ids.device)
            loss = F.cross_entropy(logits, target, weight=w, reduction="none", label_smoothing=0.1)
            return torch.where(valid.reshape(-1), loss, 0.0).sum()
        if s == "per_row_negatives":  # scores against each row's own sampled negatives
            neg = torch.einsum("bnd,brd->bnr", h, self.item(negatives))
            pos = (h * self.item(targets)).sum(-1, keepdim=True)
            logits = torch.cat([pos, neg], dim=-1).flatten(0, 1)
            loss = F.cross_entropy(logits, torch.zeros(B * n, dtype=torch.long, device=ids.device), reduction="none")
            return (loss * valid.flatten()).sum()
        if s == "flat_output":  # the per-token loss vector is the output (its padded entries do not count)
            return F.cross_entropy(self.head(h).view(-1, V), targets.view(-1), reduction="none") * valid.view(-1)
        # spellings whose padded positions count or cannot be followed: dense, exact
        if s == "unmasked_mean":  # the block is masked, but the mean runs over padded positions too
            h = h * valid.unsqueeze(-1)
            return F.cross_entropy(self.head(h).view(-1, V), targets.view(-1))
        if s == "column_major":  # positions outer, rows inner: not the (row, position) order
            logits = self.head(h).transpose(0, 1).reshape(n * B, V)
            loss = F.cross_entropy(logits, targets.t().reshape(-1), reduction="none")
            return (loss * valid.t().reshape(-1)).sum()
        raise ValueError(s)


def _batch(lengths, seed=0, pattern="right"):
    ids = make_ids(lengths, pattern, seed=seed)
    g = torch.Generator().manual_seed(seed + 3)
    targets = torch.randint(1, V, ids.shape, generator=g)
    negatives = torch.randint(1, V, (len(lengths), R), generator=g)
    return ids, targets, negatives


def _whole(outs, args):
    return [torch.ones_like(o, dtype=torch.bool) for o in outs]


def _flat_tokens(outs, args):
    return [(args[0] != 0).reshape(-1)]


JAGGED = ["ce_none_masked", "ce_unflatten_per_row", "nll_masked_fill", "constant_target_weights",
          "per_row_negatives", "flat_output"]


@pytest.mark.parametrize("pattern", ["right", "holes"])
@pytest.mark.parametrize("spelling", JAGGED)
def test_losses_over_flattened_tokens_stay_jagged(spelling, pattern):
    torch.manual_seed(0)
    model = FlatLoss(spelling).double()
    counts = _flat_tokens if spelling == "flat_output" else _whole
    optimized, report = check(model, _batch([0, 1, N, 5, 3], pattern=pattern), counts, train=True)
    check(model, _batch([2, 0, 7, N, 1], seed=1, pattern=pattern), counts, train=False, optimized=optimized)
    check(model, _batch([N, 4, 0], seed=2, pattern=pattern), counts, train=True, optimized=optimized)
    assert {"embedding", "layer_norm", "linear"} <= set(jagged_ops(report))
    assert jagged_fallbacks(report) == [], report
    assert counter(report, "dense_tail_ops") == 0
    if spelling == "per_row_negatives":
        assert counter(report, "einsum_through_dense") == 1
    if spelling == "ce_unflatten_per_row":
        assert counter(report, "exit_segment_sum") == 1


def test_per_row_negatives_with_inductor():
    torch.manual_seed(2)
    model = FlatLoss("per_row_negatives").double()
    optimized, report = check(model, _batch([0, 1, N, 5, 3]), _whole, train=True, lowering="inductor")
    check(model, _batch([2, 0, 7, N, 1], seed=1), _whole, train=False, optimized=optimized)
    assert counter(report, "einsum_through_dense") == 1 and jagged_fallbacks(report) == []


@pytest.mark.parametrize("spelling", ["unmasked_mean", "column_major"])
def test_padded_positions_that_count_stay_dense(spelling):
    torch.manual_seed(1)
    model = FlatLoss(spelling).double()
    optimized, report = check(model, _batch([0, 1, N, 5, 3]), _whole, train=True)
    check(model, _batch([2, 0, 7, N, 1], seed=1), _whole, train=False, optimized=optimized)
    reasons = jagged_fallbacks(report)
    assert reasons and all("not provably zero at padding" in r for r in reasons), reasons


def test_layout_rules_merge_only_rows_then_positions():
    import torch.fx as fx
    from grcompile.passes.layout import propagate

    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["example_value"] = torch.empty(4, 6, 3)
    env = {x: Token(0, 1, 3)}

    def node(method, *args, shape):
        n = g.call_method(method, (x, *args))
        n.meta["example_value"] = torch.empty(shape)
        return propagate(n, env)

    assert node("flatten", 0, 1, shape=(24, 3)) == Flat(0, 2)
    assert node("reshape", -1, shape=(72,)) is None  # features merged in: not one token per index
    assert node("view", 2, 12, 3, shape=(2, 12, 3)) is None  # rows split: neither layout
    env[x] = Token(1, 0, 3)  # [N, B, D]: flattening gives position-major order
    assert node("flatten", 0, 1, shape=(24, 3)) is None
    env[x] = Flat(0, 2, 6)
    x.meta["example_value"] = torch.empty(24, 3)
    assert node("view", 4, 6, 3, shape=(4, 6, 3)) == Token(0, 1, 3)
    assert node("view", 6, 4, 3, shape=(6, 4, 3)) is None  # not (rows, positions)


class Adversarial(nn.Module):
    """Spellings that look row-wise but are not, or that broadcast the flattened tokens against
    other axes (found in review): each must be exact, jagged or not."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.item = nn.Embedding(V, D, padding_idx=0)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        h = self.norm(self.item(ids))  # not zero at padding
        valid = ids != 0
        target = (ids * 7 + 3) % V
        s = self.spelling
        if s == "einsum_across_rows":  # row b reads every row c at its position n
            return (torch.einsum("bnd,cnd->bn", h, self.head(h)[..., :D]) * valid).sum()
        loss = F.cross_entropy(self.head(h).view(-1, V), target.view(-1), reduction="none")
        if s == "row_mask_expanded":  # one flag per row, broadcast over its positions
            return (loss * valid[:, -1:].expand_as(valid).reshape(-1)).sum()
        if s == "column_major_mask":
            return (loss * valid.transpose(0, 1).reshape(-1)).sum()
        if s == "flat_axis_second":  # [V, B·N] times a per-token weight
            x = self.head(h).flatten(0, 1).transpose(0, 1)
            w = (target.flatten() % 3).to(h.dtype)
            return ((x * w * valid.flatten()).sum(0) * valid.flatten()).sum()
        if s == "layoutless_leading_axis":  # [3, B·N] without a layout, gathered on the flat axis
            w = torch.arange(3 * loss.shape[0], dtype=h.dtype).view(3, -1)
            return ((loss * w) * valid.view(-1)).sum()
        if s == "expand_leading":
            return (loss.expand(3, -1) * valid.view(-1)).sum()
        if s == "both_orientations":  # one [B·N, B·N] tensor read along either axis
            m = torch.arange(loss.shape[0] ** 2, dtype=h.dtype).view(loss.shape[0], -1) / loss.shape[0] ** 2
            z = loss[:, None] * m + (loss[None, :] * m.transpose(0, 1)).transpose(0, 1)
            return (z.sum(-1) * valid.flatten()).sum()
        raise ValueError(s)


@pytest.mark.parametrize("lengths", [[0, 1, N, 5, 3], [N, N, N, N, N, 0], [1, 2, 0]])
@pytest.mark.parametrize("spelling", ["einsum_across_rows", "row_mask_expanded", "column_major_mask",
                                      "flat_axis_second", "layoutless_leading_axis", "expand_leading",
                                      "both_orientations"])
def test_adversarial_spellings_stay_exact(spelling, lengths):
    torch.manual_seed(3)
    model = Adversarial(spelling).double()
    check(model, (make_ids(lengths, "left" if spelling == "row_mask_expanded" else "right"),), _whole, train=True)
