"""jagged_rewrite on code written the way outside projects write it (issue 10, part 2, items 3, 5, 6, 7):
the validity mask computed after the first row-wise ops, any validity pattern (left padding, holes,
a mask token inside a row, empty rows), outputs read at the last valid position or pooled over the
positions (jagged exits), feature-axis slices, head splits, hand-written LayerNorms and point-wise
Conv1d feed-forwards. Every case: values and parameter gradients equal eager (float64) at the
positions that count, in train and eval mode; the rewrite (and the expected exits) must fire."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import grcompile
from grcompile.passes import jagged_pipeline

N, D, V = 8, 8, 40
MASK_ID = V - 1  # a BERT4Rec-style [mask] token: a real (valid) position


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_ids(lengths, pattern="right", seed=0, n=N):
    """``[B, n]`` ids with ``lengths`` real items per row: ``right`` / ``left`` padded, ``holes``
    (padding inside rows, the last real position kept), or ``mask_token`` (right padded, some real
    positions hold the mask id)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    ids = torch.randint(1, MASK_ID, (len(lengths), n), generator=g)
    pos = torch.arange(n)[None, :]
    inside = pos >= (n - lengths)[:, None] if pattern == "left" else pos < lengths[:, None]
    if pattern == "holes":
        hole = torch.rand(len(lengths), n, generator=g) < 0.3
        hole[torch.arange(len(lengths)), (lengths - 1).clamp(min=0)] = False
        inside &= ~hole
    if pattern == "mask_token":
        ids = torch.where(torch.rand(len(lengths), n, generator=g) < 0.3, torch.full_like(ids, MASK_ID), ids)
    return torch.where(inside, ids, torch.zeros_like(ids))


def check(module, args, counts, train=True, lowering="eager", optimized=None):
    """Optimized vs eager on ``args``: outputs where ``counts(outputs, args)`` says they count, the
    loss built from them, and every parameter gradient. Returns ((optimized, its module), report);
    pass the first back as ``optimized`` to reuse the compiled module."""
    module.train(train)
    if optimized is None:
        twin = copy.deepcopy(module)
        optimized = (grcompile.optimize(twin, passes=jagged_pipeline(), lowering=lowering), twin)
    fast, twin = optimized
    fast.train(train)
    ref, got = module(*args), fast(*args)
    ref, got = (ref,) if torch.is_tensor(ref) else ref, (got,) if torch.is_tensor(got) else got
    masks = counts(ref, args)
    loss = {}
    for name, outs in (("ref", ref), ("got", got)):
        loss[name] = sum((torch.where(m, o, torch.zeros((), dtype=o.dtype)) ** 2).sum() for o, m in zip(outs, masks))
    for i, (a, b, m) in enumerate(zip(got, ref, masks)):
        torch.testing.assert_close(torch.where(m, a, 0.0), torch.where(m, b, 0.0), msg=lambda s: f"output {i}: {s}")
    module.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    loss["ref"].backward()
    loss["got"].backward()
    mine = dict(twin.named_parameters())
    for name, p in module.named_parameters():
        if p.grad is None:
            assert mine[name].grad is None or not mine[name].grad.any(), name
        else:
            torch.testing.assert_close(mine[name].grad, p.grad, msg=lambda s: f"grad {name}: {s}")
    return optimized, grcompile.report(fast)


def tokens(valid_of):
    """Outputs ``[B, N, ...]`` count at the valid positions."""
    def counts(outs, args):
        v = valid_of(*args)
        return [v.reshape(*v.shape, *[1] * (o.dim() - 2)).expand_as(o) for o in outs]
    return counts


def rows(nonempty_of):
    """Outputs ``[B, ...]`` count on the rows ``nonempty_of(*args)`` (the empty-row rule)."""
    def counts(outs, args):
        r = nonempty_of(*args)
        return [r.reshape(-1, *[1] * (o.dim() - 1)).expand_as(o) for o in outs]
    return counts


def jagged_ops(report):
    return [r["op"] for r in report.rewrites if r["pass"] == "jagged_rewrite"]


def jagged_fallbacks(report):
    return [f["reason"] for f in report.fallbacks if f["pass"] == "jagged_rewrite"]


def counter(report, key):
    return report.counters.get(f"jagged_rewrite.{key}", 0)


# ------------------------------------------------------------------ item 3 + 5: mask after the block starts

class LateMask(nn.Module):
    """The embedding, a projection and a hand-written LayerNorm run before the mask is built (the
    RecBole / SASRec.pytorch order); causal attention masked with it; a std-based LayerNorm after.
    Position embeddings index ``arange(N)``: the *padded* coordinate, whatever the padding.
    ``positional_moments``: ``x.var(-1, False, True)`` / ``h.std(-1, True, True)`` (unbiased and
    keepdim by position: the third argument of var/std is ``unbiased``, not ``keepdim``)."""

    def __init__(self, positional_moments: bool = False):
        super().__init__()
        self.positional_moments = positional_moments
        self.item = nn.Embedding(V, D, padding_idx=0)
        self.pos = nn.Embedding(N, D)
        self.inp = nn.Linear(D, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.drop = nn.Dropout(0.0)

    def forward(self, ids):
        n = ids.shape[1]
        x = self.item(ids) * math.sqrt(D) + self.pos(torch.arange(n, device=ids.device))
        x = F.gelu(self.inp(self.drop(x)))
        mu = x.mean(-1, keepdim=True)
        var = x.var(-1, False, True) if self.positional_moments else x.var(-1, unbiased=False, keepdim=True)
        x = (x - mu) / torch.sqrt(var + 1e-6)
        valid = ids != 0                       # the mask, only now
        x = x * valid.unsqueeze(-1)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        allowed = torch.tril(torch.ones(n, n, dtype=torch.bool, device=ids.device)) & valid[:, None, :]
        a = torch.softmax((q @ k.transpose(1, 2) / math.sqrt(D)).masked_fill(~allowed, -1e9), dim=-1) @ v
        h = x + self.out(a)
        std = h.std(-1, True, True) if self.positional_moments else h.std(-1, keepdim=True)
        h = (h - h.mean(-1, keepdim=True)) / (std + 1e-6)
        return h * valid.unsqueeze(-1)


@pytest.mark.parametrize("pattern", ["right", "left", "holes", "mask_token"])
def test_mask_computed_late_any_validity_pattern(pattern):
    torch.manual_seed(0)
    model = LateMask().double()
    ids = make_ids([0, 1, N, 5, 3], pattern)
    valid = lambda ids: ids != 0  # noqa: E731
    optimized, report = check(model, (ids,), tokens(valid), train=True)
    check(model, (make_ids([2, 0, 7, N, 1], pattern, seed=1),), tokens(valid), train=False, optimized=optimized)
    assert counter(report, "validity_hoisted_ops") >= 1  # the mask moved in front of the block
    assert {"embedding", "linear", "jagged_attention"} <= set(jagged_ops(report))
    assert jagged_fallbacks(report) == []
    assert report.compiles == 1


def test_positional_var_std_options_read_as_unbiased_then_keepdim():
    torch.manual_seed(0)
    model = LateMask(positional_moments=True).double()
    valid = lambda ids: ids != 0  # noqa: E731
    optimized, report = check(model, (make_ids([0, 1, N, 5, 3], "right"),), tokens(valid), train=True)
    check(model, (make_ids([2, 0, 7, N, 1], "right", seed=1),), tokens(valid), train=False, optimized=optimized)
    assert {"embedding", "linear", "jagged_attention"} <= set(jagged_ops(report))
    assert jagged_fallbacks(report) == []


# ------------------------------------------------------------------ item 6: exits

class Exits(nn.Module):
    """An encoder whose last value (a LayerNorm: not 0 at padding) leaves the block through the
    exits people write. ``validity``: ``"lengths"`` (``arange(N) < lengths``), ``"left"``
    (``arange(N) >= N - lengths``) or ``"ids"`` (``ids != 0``)."""

    def __init__(self, exit: str, validity: str = "lengths"):
        super().__init__()
        self.exit, self.validity = exit, validity
        self.item = nn.Embedding(V, D, padding_idx=0)
        self.ff = nn.Linear(D, 2 * D)
        self.back = nn.Linear(2 * D, D)
        self.norm = nn.LayerNorm(D)
        self.score = nn.Linear(D, 1)

    def forward(self, ids, lengths):
        B, n = ids.shape
        pos = torch.arange(n, device=ids.device)
        if self.validity == "lengths":
            valid = pos[None, :] < lengths[:, None]
        elif self.validity == "left":
            valid = pos[None, :] >= (n - lengths)[:, None]
        else:
            valid = ids != 0
        x = self.item(ids) * valid.unsqueeze(-1)
        x = x + self.back(F.relu(self.ff(x)))
        h = self.norm(x)
        if self.exit == "gather":
            index = (lengths - 1).clamp(min=0)[:, None, None].expand(-1, 1, h.shape[-1])
            return h.gather(1, index).squeeze(1)
        if self.exit == "gather_cat":  # the last item beside the masked mean, along the features
            index = (lengths - 1).clamp(min=0)[:, None, None].expand(-1, 1, h.shape[-1])
            m = valid.unsqueeze(-1).to(h.dtype)
            return torch.cat([(h * m).sum(1) / m.sum(1).clamp(min=1), h.gather(1, index)[:, 0]], -1)
        if self.exit == "arange_index":
            return h[torch.arange(B, device=ids.device), valid.sum(1) - 1]
        if self.exit == "last":
            return h[:, -1, :]
        m = valid.unsqueeze(-1).to(h.dtype)
        if self.exit == "masked_mean":
            return (h * m).sum(1) / m.sum(1).clamp(min=1)
        if self.exit == "softmax_pool":
            w = self.score(h).squeeze(-1).masked_fill(~valid, float("-inf"))
            w = torch.nan_to_num(torch.softmax(w, dim=1), nan=0.0)
            return (w.unsqueeze(-1) * h).sum(1)
        if self.exit == "softmax_pool_additive":
            w = torch.softmax(self.score(h).squeeze(-1) + (1.0 - m.squeeze(-1)) * -1e9, dim=-1)
            return (w[..., None] * h).sum(dim=1)
        if self.exit == "unmasked_mean":
            return h.mean(1)
        raise ValueError(self.exit)


def _lengths_batch(lengths, left=False, seed=0):
    lengths = torch.tensor(lengths)
    return make_ids(lengths.tolist(), "left" if left else "right", seed), lengths


CASES = [  # exit, validity, left padding, counter that must fire, rows that count
    ("gather", "lengths", False, "exit_row_select", "nonempty"),
    ("gather_cat", "lengths", False, "exit_row_select", "nonempty"),
    ("arange_index", "lengths", False, "exit_row_select", "nonempty"),
    ("last", "left", True, "exit_row_select", "nonempty"),
    ("masked_mean", "ids", False, "exit_segment_sum", "all"),
    ("softmax_pool", "ids", False, "segment_softmax", "all"),
    ("softmax_pool_additive", "lengths", False, "segment_softmax", "nonempty"),
]


@pytest.mark.parametrize("exit,validity,left,fires,which", CASES, ids=[c[0] for c in CASES])
def test_exits_are_jagged_and_exact(exit, validity, left, fires, which):
    torch.manual_seed(1)
    model = Exits(exit, validity).double()
    counts = rows(lambda ids, lengths: lengths > 0) if which == "nonempty" else rows(
        lambda ids, lengths: torch.ones_like(lengths, dtype=torch.bool))
    optimized, report = check(model, _lengths_batch([0, 1, N, 4, 6], left), counts, train=True)
    check(model, _lengths_batch([3, N, 0, 1, 2], left, seed=2), counts, train=False, optimized=optimized)
    assert counter(report, fires) >= 1, report.counters
    assert counter(report, "exit_dense") == 0  # no dense unpack
    assert {"embedding", "linear", "layer_norm"} <= set(jagged_ops(report))
    assert jagged_fallbacks(report) == []
    assert report.unoptimized == []  # no run-time check failed (the cat stays within each row)


def test_empty_row_reads_padding_and_gives_zero():
    """The empty-row rule: ``lengths - 1 = -1`` reads position N - 1 of an empty row (padding);
    that output row is at an invalid position, and the jagged exit gives 0 there."""
    torch.manual_seed(2)
    model = Exits("arange_index").double()
    ids, lengths = _lengths_batch([0, 3, N])
    fast = grcompile.optimize(copy.deepcopy(model), passes=jagged_pipeline(), lowering="eager")
    out = fast(ids, lengths)
    assert model(ids, lengths)[0].abs().sum() > 0  # eager reads the LayerNorm of a padded position
    assert torch.equal(out[0], torch.zeros(D, dtype=out.dtype))
    torch.testing.assert_close(out[1:], model(ids, lengths)[1:])


def _hole_at_the_read(exit: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch whose row 1 is non-empty but has padding exactly where the exit reads it (the
    last position under left padding; position lengths - 1 for the gather)."""
    ids, lengths = _lengths_batch([0, 3, N, 5], left=exit == "last", seed=4)
    read = N - 1 if exit == "last" else int(lengths[1]) - 1
    ids[1, read] = 0
    return ids, lengths


@pytest.mark.parametrize("exit", ["gather", "last"])
def test_exit_that_may_read_padding_is_checked_on_each_call(exit, monkeypatch):
    """``ids != 0`` says nothing about where a row's last real item is (holes, left or right
    padding), so the proof cannot bound the read: the exit goes jagged under a check run before
    each call (every read on a valid position, or in an empty row's own output). A call that
    fails it runs the graph as captured — exact — and the report counts it; without the check
    that call would be wrong (the negative control)."""
    torch.manual_seed(3)
    model = Exits(exit, "ids").double()
    counts = rows(lambda ids, lengths: (ids != 0).any(1))
    optimized, report = check(model, _lengths_batch([0, 1, N, 5], left=exit == "last"), counts)
    assert jagged_fallbacks(report) == [] and counter(report, "exit_dense") == 0, jagged_fallbacks(report)
    assert counter(report, "checked_at_run_time") == 1 and counter(report, "exit_row_select") == 1
    assert {"embedding", "linear", "layer_norm"} <= set(jagged_ops(report))
    assert report.unoptimized == []

    bad = _hole_at_the_read(exit)
    with pytest.warns(grcompile.UnoptimizedWarning, match="fail a run-time check"):
        _, report = check(model, bad, counts, optimized=optimized)  # exact: the captured graph ran
    entry, = report.unoptimized
    assert entry["kind"] == "runtime_check" and entry["calls"] == 1 and "each call checks" in entry["error"]
    check(model, _lengths_batch([2, N, 0, 1], left=exit == "last", seed=5), counts, optimized=optimized)
    assert grcompile.report(optimized[0]).unoptimized[0]["calls"] == 1  # a good batch runs optimized again

    from grcompile.capture.guarded import GuardedGraph
    monkeypatch.setattr(GuardedGraph, "_failed_check", lambda self, args: None)
    torch._dynamo.reset()
    unchecked = grcompile.optimize(copy.deepcopy(model), passes=jagged_pipeline(), lowering="eager")
    with torch.no_grad():
        assert not torch.allclose(unchecked(*bad)[1], model(*bad)[1])  # the jagged exit reads a zero row


class GatherIndexWrittenInPlace(Exits):
    """The index is moved in place after it is computed (to the first padded position here): a
    check run before the graph would see it unmoved — valid — so the exit must not be checked
    that way."""

    def forward(self, ids, lengths):
        valid = ids != 0
        x = self.item(ids) * valid.unsqueeze(-1)
        h = self.norm(x + self.back(F.relu(self.ff(x))))
        index = lengths - 1
        index.add_(1)
        return h.gather(1, index[:, None, None].expand(-1, 1, h.shape[-1])).squeeze(1)


def test_an_index_written_in_place_is_not_checked_before_the_graph():
    torch.manual_seed(3)
    model = GatherIndexWrittenInPlace("gather", "ids").double()
    _, report = check(model, _lengths_batch([1, 5, 3, 2]), rows(lambda ids, lengths: (ids != 0).any(1)))
    assert counter(report, "checked_at_run_time") == 0
    reasons = jagged_fallbacks(report)
    assert len(reasons) == 1 and "written in place" in reasons[0], reasons


def test_strict_raises_where_a_run_time_check_fails():
    torch.manual_seed(3)
    model = Exits("gather", "ids").double()
    fast = grcompile.optimize(copy.deepcopy(model), passes=jagged_pipeline(), lowering="eager", strict=True)
    fast(*_lengths_batch([0, 1, N, 5]))
    with pytest.raises(RuntimeError, match="cannot run optimized on this call"):
        fast(*_hole_at_the_read("gather"))


def test_unmasked_mean_stays_dense_with_reason():
    torch.manual_seed(4)
    model = Exits("unmasked_mean", "ids").double()
    _, report = check(model, _lengths_batch([0, 2, N, 5]), rows(lambda ids, lengths: torch.ones_like(lengths) > 0))
    assert jagged_ops(report) == ["embedding"]
    reasons = jagged_fallbacks(report)
    assert len(reasons) == 1 and "mean" in reasons[0] and "not provably zero at padding" in reasons[0], reasons


class MaskedThenTail(nn.Module):
    """A masked block whose output goes through one more LayerNorm and a linear before an
    unmasked sum over positions: only that tail stays dense; the block before is jagged."""

    def __init__(self):
        super().__init__()
        self.item = nn.Embedding(V, D, padding_idx=0)
        self.ff = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, D)

    def forward(self, ids):
        valid = (ids != 0).unsqueeze(-1)
        x = torch.relu(self.ff(self.item(ids))).masked_fill(~valid, 0.0)
        return self.head(self.norm(x)).sum(1)


def test_dense_tail_after_the_last_masked_value():
    torch.manual_seed(5)
    model = MaskedThenTail().double()
    _, report = check(model, (make_ids([0, 1, N, 3]),), rows(lambda ids: torch.ones(ids.shape[0], dtype=torch.bool)))
    assert {"embedding", "linear"} <= set(jagged_ops(report))
    assert counter(report, "dense_tail_ops") >= 2 and counter(report, "exit_dense") == 1
    reasons = jagged_fallbacks(report)
    assert len(reasons) == 1 and "stay dense" in reasons[0]


# ------------------------------------------------------------------ item 7: row-wise spellings

class Spellings(nn.Module):
    """Feature slices of a fused projection, heads split with view + permute (and merged back with
    transpose + reshape), a hand-written LayerNorm (mean / var and std spelled out) and a
    point-wise Conv1d feed-forward on transposed tensors."""

    def __init__(self, heads=2):
        super().__init__()
        self.h = heads
        self.item = nn.Embedding(V, D, padding_idx=0)
        self.uvqk = nn.Linear(D, 4 * D)
        self.conv1 = nn.Conv1d(D, 2 * D, kernel_size=1)
        self.conv2 = nn.Conv1d(2 * D, D, kernel_size=1)
        self.gamma = nn.Parameter(torch.ones(D))
        self.beta = nn.Parameter(torch.zeros(D))

    def forward(self, ids):
        B, n = ids.shape
        x = self.item(ids)
        p = self.uvqk(x)
        u, v = p[..., :D], p[:, :, D:2 * D]
        q = p[..., 2 * D:3 * D].view(B, n, self.h, D // self.h).permute(0, 2, 1, 3)   # [B, H, N, d]
        q = F.normalize(q, dim=-1)
        q = q.transpose(1, 2).reshape(B, n, D)
        y = torch.sigmoid(u) * v + q
        mean = y.mean(dim=-1, keepdim=True)
        var = ((y - mean) ** 2).mean(dim=-1, keepdim=True)
        y = self.gamma * (y - mean) / torch.sqrt(var + 1e-5) + self.beta
        y = y + y.std(-1, keepdim=True) * 0.1
        z = self.conv2(F.relu(self.conv1(y.transpose(1, 2)))).transpose(1, 2)
        return (y + z) * (ids != 0).unsqueeze(-1)


def test_row_wise_spellings_go_jagged():
    torch.manual_seed(6)
    model = Spellings().double()
    valid = lambda ids: ids != 0  # noqa: E731
    optimized, report = check(model, (make_ids([0, 1, N, 3, 6], "holes"),), tokens(valid), train=True)
    check(model, (make_ids([N, 2, 0, 5, 1], "left", seed=3),), tokens(valid), train=False, optimized=optimized)
    assert counter(report, "conv1x1_as_linear") == 2
    assert jagged_ops(report).count("linear") == 3  # uvqk and the two 1x1 convolutions
    assert jagged_fallbacks(report) == [] and counter(report, "dense_tail_ops") == 0


class TiledPositions(nn.Module):
    """Positions tiled over the batch before the lookup (``arange(N).unsqueeze(0).expand_as(ids)``,
    the BERT / TransformerEncoder style): the same for every row, packed from one row."""

    def __init__(self):
        super().__init__()
        self.item = nn.Embedding(V, D, padding_idx=0)
        self.pos = nn.Embedding(N, D)
        self.ff = nn.Linear(D, D)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        x = self.item(ids) + self.pos(positions)
        return F.gelu(self.ff(x)) * (ids != 0).unsqueeze(-1)


def test_positions_tiled_over_rows():
    torch.manual_seed(9)
    model = TiledPositions().double()
    _, report = check(model, (make_ids([0, 1, N, 3], "left"),), tokens(lambda ids: ids != 0))
    assert {"embedding", "linear"} <= set(jagged_ops(report)) and jagged_fallbacks(report) == []


class HFSpellings(nn.Module):
    """HuggingFace spellings (zoo: gpt2_buffer_mask, hf_extended_mask, alibi_bias): validity as
    ``ids.bool()``, positions ``arange(0, N, dtype=long)``, token types ``zeros_like(ids)``, GPT-2's
    ``Conv1D`` (``torch.addmm(b, x.view(-1, nx), w).view(...)``), a causal buffer sliced
    ``[:, :N, :N]`` and compared ``== 0``, and sentence-transformers' mean pooling over
    ``mask.long().unsqueeze(-1).expand(h.size()).float()``."""

    def __init__(self):
        super().__init__()
        self.item, self.pos, self.types = nn.Embedding(V, D, padding_idx=0), nn.Embedding(N, D), nn.Embedding(2, D)
        self.w_attn = nn.Parameter(torch.randn(D, 3 * D) * 0.3)
        self.b_attn = nn.Parameter(torch.randn(3 * D) * 0.1)
        self.register_buffer("bias", torch.tril(torch.ones(N, N)).view(1, N, N))

    def forward(self, ids):
        valid = ids.bool()
        n = ids.shape[1]
        x = self.item(ids) + self.pos(torch.arange(0, n, dtype=torch.long)) + self.types(torch.zeros_like(ids))
        qkv = torch.addmm(self.b_attn, x.view(-1, D), self.w_attn).view(ids.shape[0], n, 3 * D)
        q, k, v = qkv.split(D, dim=2)
        att = (q @ k.transpose(-2, -1)).masked_fill(self.bias[:, :n, :n] == 0, float("-inf"))
        att = att.masked_fill(~valid[:, None, :], torch.finfo(att.dtype).min)
        h = x + torch.softmax(att, dim=-1) @ v
        m = valid.long().unsqueeze(-1).expand(h.size()).float()
        return torch.sum(h * m, 1) / torch.clamp(m.sum(1), min=1e-9)


def test_hf_spellings_fuse_and_go_jagged():
    """Regression (zoo review): addmm had no layout (the attention behind GPT-2's Conv1D was never
    matched, silently), ``ids.bool()`` was no validity, ``arange(0, N)`` no positions,
    ``zeros_like(ids)`` no token tensor, and a mask reshaped from outside the region was not
    0 at padding: each kept the model dense."""
    torch.manual_seed(11)
    model = HFSpellings().double()
    nonempty = lambda ids: (ids != 0).any(1)  # noqa: E731
    optimized, report = check(model, (make_ids([0, 1, N, 3, 6]),), rows(nonempty), train=True)
    check(model, (make_ids([N, 2, 0, 5, 1], seed=3),), rows(nonempty), train=False, optimized=optimized)
    assert report.counters.get("fuse_attention.score_mod_attention") == 1, str(report)
    assert counter(report, "addmm_as_linear") == 1 and "linear" in jagged_ops(report), str(report)
    assert counter(report, "exit_segment_sum") == 2  # the masked sum and the mask's count
    assert jagged_fallbacks(report) == [] and not report.fallbacks, report.fallbacks


class ShortBatchPositions(nn.Module):
    """Position tables longer than the batch's N (max_len 2N): BERT's ``position_ids`` buffer
    sliced ``[:, :N]`` and a table sliced ``weight[:N]``."""

    def __init__(self):
        super().__init__()
        self.item, self.pos, self.pos2 = nn.Embedding(V, D, padding_idx=0), nn.Embedding(2 * N, D), nn.Embedding(2 * N, D)
        self.register_buffer("position_ids", torch.arange(2 * N).expand((1, -1)), persistent=False)
        self.ff = nn.Linear(D, D)

    def forward(self, ids):
        n = ids.shape[1]
        x = self.item(ids) + self.pos(self.position_ids[:, :n]) + self.pos2.weight[:n]
        return F.gelu(self.ff(x)) * (ids != 0).unsqueeze(-1)


def test_position_tables_longer_than_the_batch():
    """Regression (zoo review): with N below the tables' length the sliced table had no layout
    (its axis is not the positions' by size), so the block stayed dense whenever the first batch
    was shorter than max_len (every zoo model with a position table)."""
    torch.manual_seed(12)
    model = ShortBatchPositions().double()
    _, report = check(model, (make_ids([0, 1, N, 3]),), tokens(lambda ids: ids != 0))
    assert {"embedding", "linear"} <= set(jagged_ops(report)) and jagged_fallbacks(report) == [], str(report)


class RowVarying(nn.Module):
    """A position term plus a value that varies over the rows through an op without a layout
    (``flip`` over the batch): the sum has no batch axis in its layout, but one row may not
    stand for all of them."""

    def __init__(self):
        super().__init__()
        self.item = nn.Embedding(V, D, padding_idx=0)
        self.ff = nn.Linear(D, D)

    def forward(self, ids):
        valid = (ids != 0).unsqueeze(-1)
        x = self.item(ids) * valid
        w = torch.arange(ids.shape[1], device=ids.device)[None, :, None] * 0.1 + x.flip(0)
        return self.ff(x) * valid + w * valid


def test_row_varying_operand_is_not_packed_from_one_row():
    torch.manual_seed(10)
    model = RowVarying().double()
    _, report = check(model, (make_ids([0, 1, N, 3], "holes"),), tokens(lambda ids: ids != 0))
    assert any("flip" in r or "varies along the rows" in r for r in jagged_fallbacks(report)), \
        jagged_fallbacks(report)


def test_tiled_along_follows_the_values():
    """The check behind packing one row for all: tiled by expand / repeat of a size-1 axis and
    what embeddings and pointwise ops compute from such; not a flip or any unknown op."""
    from grcompile.passes.jagged_region import tiled_along

    class F_(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(V, D))

        def forward(self, ids):
            pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
            tiled = F.embedding(pos, self.table) * 2.0 + 1.0
            mixed = tiled + F.embedding(ids.flip(0), self.table)
            repeated = torch.arange(ids.shape[1])[None, :, None].repeat(ids.shape[0], 1, D)
            return pos, tiled, mixed, repeated, ids.flip(0)

    gm = torch.fx.symbolic_trace(F_())

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            n.meta["example_value"] = out
            return out

    Record(gm).run(make_ids([3, 0, N, 5]))
    out = {n.name: n for n in gm.graph.nodes}["output"].args[0]
    pos, tiled, mixed, repeated, flipped = out
    assert tiled_along(pos, 0) and tiled_along(tiled, 0) and tiled_along(repeated, 0)
    assert not tiled_along(mixed, 0) and not tiled_along(flipped, 0)
    assert not tiled_along(pos, 1)  # positions differ along the sequence


# ------------------------------------------------------------------ random length mixes

@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(0, N), min_size=1, max_size=5),
       pattern=st.sampled_from(["right", "left", "holes", "mask_token"]),
       exit=st.sampled_from(["gather", "masked_mean", "softmax_pool"]))
def test_random_length_mixes(lengths, pattern, exit):
    torch._dynamo.reset()
    torch.manual_seed(7)
    late = LateMask().double()
    check(late, (make_ids(lengths, pattern),), tokens(lambda ids: ids != 0))
    torch._dynamo.reset()
    validity = "lengths" if exit == "gather" else "ids"
    model = Exits(exit, validity).double()
    counts = rows(lambda ids, lengths: lengths > 0) if exit == "gather" else rows(
        lambda ids, lengths: torch.ones_like(lengths, dtype=torch.bool))
    _, report = check(model, _lengths_batch(lengths), counts)
    if not (len(lengths) == 1 and exit == "softmax_pool"):
        # one row: Dynamo specialises B=1 and the row axis reads as a broadcast, so the
        # softmax-pooling exit keeps a dense tail there (exact: checked above) -- a known gap
        assert jagged_fallbacks(report) == []


def test_exits_with_inductor_one_compile():
    """Inductor lowering (AOTAutograd with the data-dependent T): row selection, segment sum and
    segment softmax; one compile over several length mixes, training."""
    torch.manual_seed(8)
    for exit, validity in (("arange_index", "lengths"), ("softmax_pool", "ids")):
        torch._dynamo.reset()
        model = Exits(exit, validity)
        counts = rows(lambda ids, lengths: lengths > 0)
        optimized = None
        for seed, lengths in enumerate([[0, 1, N, 4], [N, N, 2, 3], [5, 0, 0, 1]]):
            optimized, report = check(model, _lengths_batch(lengths, seed=seed), counts, lowering="inductor",
                                      optimized=optimized)
        assert report.compiles == 1 and not report.unoptimized
        assert jagged_fallbacks(report) == []


# ------------------------------------------------------------------ the zoo (tests/zoo): the exits people write

ZOO_EXITS = {  # model -> counters (jagged_rewrite.<key> >= 1) its first compile must show
    "hstu_slices_left": ["exit_row_select"],                        # h[:, -1] under left padding from lengths
    "pooling_heads": ["segment_softmax", "exit_segment_sum"],        # masked mean + softmax pooling
    "sasrec_pmixer": ["conv1x1_as_linear", "validity_hoisted_ops"],  # Conv1d FFN, mask after the embedding
    "hstu_gather_holes": ["exit_row_select"],
    "sdpa_bool_meanpool": ["exit_segment_sum"],
    "conv_ffn_nonaffine": ["conv1x1_as_linear", "validity_hoisted_ops"],
    "bert4rec_torch_encoder": ["validity_hoisted_ops"],
}
_ZOO_DEFAULT = {"hstu_slices_left", "pooling_heads", "sasrec_pmixer"}


@pytest.mark.parametrize("name", [n if n in _ZOO_DEFAULT else pytest.param(n, marks=pytest.mark.slow)
                                  for n in ZOO_EXITS])
def test_zoo_models_exit_jagged(name):
    from tests.zoo.harness import first_report, jagged_status

    report = first_report(name)  # one checked training step (values + gradients vs eager)
    assert jagged_status(report) == "y", report
    for key in ZOO_EXITS[name]:
        assert counter(report, key) >= 1, (key, report.counters)


def test_zoo_recbole_gather_is_jagged_under_a_run_time_check():
    """RecBole reads ``hidden`` at ``item_seq_len - 1`` (an input) under ``item_seq != 0``: nothing
    in the graph ties the two, so each call checks that the read lands on a valid position."""
    from tests.zoo.harness import first_report, jagged_status

    report = first_report("recbole_sasrec")
    assert jagged_fallbacks(report) == [] and jagged_status(report) == "y", jagged_fallbacks(report)
    assert counter(report, "checked_at_run_time") == 1 and report.unoptimized == []
