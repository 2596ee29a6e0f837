"""Mean / sum next-item losses computed inside ``forward`` whose padded positions are ignored
(``ignore_index``): the ignored-target loss exit (``passes/ignored_loss.py``) keeps the block
jagged to the loss and computes it on the valid positions only. Proved where the padded targets
can be evaluated, checked on each call otherwise (a call that fails the check runs as captured).
Every case: the loss and every parameter gradient equal eager (float64), train and eval, on
length mixes with empty, length-1 and full rows; and the exit fires where it should and not
where it must not."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.passes.test_jagged_spellings import check, counter, jagged_fallbacks, jagged_ops, make_ids

N, D, V = 8, 8, 40
PAD = 0


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class NextItem(nn.Module):
    """A SASRec-style block (padding-masked embedding, norm, feed-forward, optionally a causal
    attention masked by the padding) and a loss over every position, spelled ``spelling``."""

    def __init__(self, spelling: str, attention: bool = False):
        super().__init__()
        self.spelling, self.attention = spelling, attention
        self.item = nn.Embedding(V, D, padding_idx=PAD)
        self.pos = nn.Embedding(N, D)
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.ff = nn.Linear(D, D)
        self.head = nn.Linear(D, V)
        self.ce = nn.CrossEntropyLoss(ignore_index=PAD)
        self.ce_hf = nn.CrossEntropyLoss()
        self.register_buffer("w", torch.linspace(0.5, 1.5, V))

    def forward(self, ids, targets):
        B, n = ids.shape
        valid = ids != PAD
        x = (self.item(ids) + self.pos(torch.arange(n, device=ids.device))) * valid.unsqueeze(-1)
        h = self.norm(x)
        if self.attention:
            q, k, v = self.qkv(h).chunk(3, dim=-1)
            allowed = torch.tril(torch.ones(n, n, dtype=torch.bool, device=ids.device)) & valid[:, None, :]
            scores = (q @ k.transpose(1, 2) / D ** 0.5).masked_fill(~allowed, -1e9)
            h = h + torch.softmax(scores, dim=-1) @ v
        h = h + torch.relu(self.ff(h))
        logits = self.head(h)
        s = self.spelling
        shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # next item, PAD at the end
        flat = logits.view(-1, V)
        # ---- checked on each call: the targets' padded values are not known to the graph
        if s == "ce_mean":
            return F.cross_entropy(flat, targets.view(-1), ignore_index=PAD)
        if s == "ce_sum":
            return F.cross_entropy(flat, targets.reshape(-1), ignore_index=PAD, reduction="sum")
        if s == "module":
            return self.ce(logits.reshape(B * n, V), targets.reshape(B * n))
        if s == "nll_log_softmax":
            return F.nll_loss(F.log_softmax(flat, dim=-1), targets.view(-1), ignore_index=PAD)
        if s == "smoothing_weights":
            return F.cross_entropy(flat, targets.view(-1), weight=self.w, ignore_index=PAD, label_smoothing=0.1)
        if s == "hf_labels_input":  # labels with -100 at padded positions, the default ignore_index
            return F.cross_entropy(flat, targets.view(-1))
        if s == "shift_cat":
            return F.cross_entropy(flat, shifted.view(-1), ignore_index=PAD)
        if s == "shift_pad":
            return F.cross_entropy(flat, F.pad(ids[:, 1:], (0, 1), value=PAD).flatten(), ignore_index=PAD)
        if s == "shift_new_full":
            t = torch.cat([ids[:, 1:], ids.new_full((B, 1), PAD)], dim=1)
            return F.cross_entropy(flat, t.view(-1), ignore_index=PAD, reduction="sum", label_smoothing=0.2)
        if s == "kdim":
            return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=PAD)
        if s == "kdim_shift_smoothing":
            return F.cross_entropy(logits.permute(0, 2, 1), shifted, weight=self.w, ignore_index=PAD,
                                   label_smoothing=0.1, reduction="sum")
        if s == "kdim_nll":
            return F.nll_loss(F.log_softmax(logits, dim=-1).transpose(1, 2), shifted, ignore_index=PAD)
        if s == "roll_then_set":  # written in place: replayed by the check on its own copy
            t = torch.roll(ids, -1, 1)
            t[:, -1] = PAD
            return F.cross_entropy(flat, t.view(-1), ignore_index=PAD)
        if s == "hf_clone_set":
            labels = targets.clone()
            labels[~valid] = -100
            return F.cross_entropy(flat, labels.view(-1))
        if s == "hf_set_after_view":  # the loss's target is defined before the write: gathered at the loss
            labels = targets.clone().view(-1)
            labels[(labels == PAD) | (labels < 8)] = -100  # some valid positions ignored too
            return F.cross_entropy(flat, labels, reduction="sum")
        if s == "kdim_roll_set":
            t = ids.roll(-1, 1)
            t[:, -1:] = PAD
            return F.cross_entropy(logits.transpose(1, 2), t, ignore_index=PAD, label_smoothing=0.05)
        # ---- proved at compile time: the padded targets evaluate to ignore_index
        if s == "hf_masked_fill":  # HF-style labels built in the graph
            labels = targets.masked_fill(~valid, -100)
            return F.cross_entropy(flat, labels.view(-1))
        if s == "hf_where_module":
            return self.ce_hf(flat, torch.where(valid, shifted, -100).view(-1))
        if s == "ids_as_targets":  # the padding id itself is ignore_index
            return F.cross_entropy(flat, ids.view(-1), ignore_index=PAD, label_smoothing=0.1)
        if s == "roll_masked":
            t = torch.roll(ids, -1, 1) * valid
            return F.cross_entropy(flat, t.view(-1), ignore_index=PAD, reduction="sum")
        if s == "kdim_where":
            return F.cross_entropy(logits.transpose(1, 2), torch.where(valid, targets, -1), ignore_index=-1)
        # ---- padded positions that count: as today (dense), exact
        if s == "mean_no_ignore":
            return F.cross_entropy(flat, targets.view(-1))
        if s == "other_ignore_index":  # ignore_index is not what the padded targets hold
            return F.cross_entropy(flat, targets.view(-1), ignore_index=5)
        if s == "masked_targets_counted":  # the padded targets are 0, the ignore_index the default -100
            return F.cross_entropy(flat, (targets * valid).view(-1))
        if s == "input_written":  # the check cannot replay a write into the caller's tensor
            targets[~valid] = -100
            return F.cross_entropy(flat, targets.view(-1).clone())  # a copy: the next call writes targets again
        if s == "roll_wraps":  # the first item wraps round to the (padded) last position
            return F.cross_entropy(flat, torch.roll(ids, -1, 1).view(-1), ignore_index=PAD)
        raise ValueError(s)


def batch(lengths, seed=0, pattern="right", fill=PAD):
    """ids with ``lengths`` real items per row and targets: random items at the valid positions,
    ``fill`` at the padded ones (-100 for HF-style labels)."""
    ids = make_ids(lengths, pattern, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    targets = torch.randint(1, V, ids.shape, generator=g)
    if fill is not None:
        targets = torch.where(ids != PAD, targets, torch.full_like(targets, fill))
    return ids, targets


def _whole(outs, args):
    return [torch.ones_like(o, dtype=torch.bool) for o in outs]


MIXES = [[0, 1, N, 5, 3], [2, 0, 7, N, 1], [N, 4, 0]]  # empty, length-1 and full rows; B changes last

CHECKED = ["ce_mean", "ce_sum", "module", "nll_log_softmax", "smoothing_weights", "hf_labels_input", "shift_cat",
           "shift_pad", "shift_new_full", "kdim", "kdim_shift_smoothing", "kdim_nll", "roll_then_set", "hf_clone_set",
           "hf_set_after_view", "kdim_roll_set"]
PROVED = ["hf_masked_fill", "hf_where_module", "ids_as_targets", "roll_masked", "kdim_where"]


def _fill(spelling):
    return -100 if spelling == "hf_labels_input" else PAD


def _run(model, spelling, mixes=MIXES, pattern="right", **kw):
    optimized = None
    report = None
    for i, lengths in enumerate(mixes):
        args = batch(lengths, seed=i, pattern=pattern, fill=_fill(spelling))
        optimized, report = check(model, args, _whole, train=i != 1, optimized=optimized, **kw)
    return report


@pytest.mark.parametrize("spelling", CHECKED + PROVED)
def test_ignored_target_losses_stay_jagged(spelling):
    torch.manual_seed(0)
    model = NextItem(spelling).double()
    report = _run(model, spelling)
    assert {"embedding", "layer_norm", "linear"} <= set(jagged_ops(report)), report
    assert jagged_ops(report).count("ignored_target_loss") == report.compiles == 2, report
    assert jagged_fallbacks(report) == [], report
    assert counter(report, "dense_tail_ops") == 0 and counter(report, "exit_dense") == 0
    how = {r["target_at_padding"] for r in report.rewrites if r["op"] == "ignored_target_loss"}
    assert how == {"checked" if spelling in CHECKED else "proved"}, how
    assert counter(report, "checked_at_run_time") == (2 if spelling in CHECKED else 0)
    assert report.unoptimized == [], report.unoptimized  # every call passed its check: none ran as captured


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("spelling", ["ce_mean", "shift_new_full", "kdim_shift_smoothing", "hf_where_module",
                                      "roll_then_set"])
def test_random_length_mixes(spelling, seed):
    """Random lengths (an empty, a length-1 and a full row always among them), one compile."""
    torch.manual_seed(seed)
    model = NextItem(spelling).double()
    g = torch.Generator().manual_seed(100 + seed)
    mixes = [[0, 1, N] + torch.randint(0, N + 1, (3,), generator=g).tolist() for _ in range(3)]
    mixes = [[m[i] for i in torch.randperm(6, generator=g)] for m in mixes]
    report = _run(model, spelling, mixes=mixes)
    assert report.compiles == 1 and jagged_ops(report).count("ignored_target_loss") == 1, report
    assert jagged_fallbacks(report) == [] and report.unoptimized == [], report


@pytest.mark.parametrize("spelling,lowering", [("ce_mean", "eager"), ("hf_masked_fill", "eager"),
                                               ("kdim_roll_set", "eager"), ("kdim_shift_smoothing", "inductor")])
def test_with_a_fused_attention(spelling, lowering):
    """The attention's padded query rows (0 in the fused op, a softmax in eager) reach the loss only
    at positions it ignores: the attention fuses and the whole block stays jagged."""
    torch.manual_seed(1)
    model = NextItem(spelling, attention=True).double()
    report = _run(model, spelling, mixes=MIXES[:2], lowering=lowering)
    assert "jagged_attention" in jagged_ops(report) and "ignored_target_loss" in jagged_ops(report), report
    assert jagged_fallbacks(report) == [] and report.unoptimized == [], report
    checked = spelling != "hf_masked_fill"
    assert report.counters.get("fuse_attention.checked_at_run_time", 0) == checked, report.counters


@pytest.mark.parametrize("spelling", ["mean_no_ignore", "other_ignore_index", "masked_targets_counted", "roll_wraps"])
def test_padded_targets_that_count_stay_dense(spelling):
    """The padded positions count in eager's loss: the loss reads the dense logits, as before this
    exit existed, and the report says why at the loss's line."""
    torch.manual_seed(2)
    model = NextItem(spelling).double()
    report = _run(model, spelling, mixes=MIXES[:2])
    assert "ignored_target_loss" not in jagged_ops(report)
    assert counter(report, "checked_at_run_time") == 0 and report.unoptimized == []
    reasons = jagged_fallbacks(report)
    assert reasons and all("not provably zero at padding (the loss counts them" in r for r in reasons), reasons
    assert all("test_ignored_loss.py" in f["site"] for f in report.fallbacks if f["pass"] == "jagged_rewrite")
    if spelling == "masked_targets_counted":
        assert "their target is 0, not its ignore_index=-100" in reasons[0]


@pytest.mark.parametrize("spelling,pattern", [("other_ignore_index", "right"), ("shift_cat", "left"),
                                              ("shift_pad", "holes"), ("kdim_shift_smoothing", "left"),
                                              ("roll_then_set", "left"), ("kdim_roll_set", "holes")])
@pytest.mark.parametrize("attention", [False, True])
def test_a_call_that_fails_the_check_runs_as_captured(spelling, pattern, attention):
    """Compiled on full rows (nothing padded: the check holds), then called with padded positions
    whose targets are not ignore_index: a shifted target is the next real item under left padding
    or holes, and ``ignore_index=5`` is not the padding's target. Those calls run as captured."""
    torch.manual_seed(3)
    model = NextItem(spelling, attention=attention).double()
    optimized, report = check(model, batch([N, N, N, N, N]), _whole, train=True)
    assert jagged_ops(report).count("ignored_target_loss") == 1 and report.unoptimized == []
    assert ("jagged_attention" in jagged_ops(report)) == attention
    for i, lengths in enumerate([[0, 1, N, 5, 3], [2, 6, 7, N, 1]]):
        optimized, report = check(model, batch(lengths, seed=i, pattern=pattern), _whole, train=i == 0,
                                  optimized=optimized)
    (entry,) = report.unoptimized
    assert entry["kind"] == "runtime_check" and entry["calls"] == 2, entry
    assert "ignore_index" in entry["error"] and "test_ignored_loss.py" in entry["site"], entry
    assert report.compiles == 1


@pytest.mark.parametrize("attention", [False, True])
def test_left_padding_with_shifted_targets_stays_dense(attention):
    """Left padding: the position before a row's first item is padded, and its shifted target is
    that item. The call being compiled shows it; the block stays dense (the attention unfused),
    exact."""
    torch.manual_seed(4)
    model = NextItem("shift_cat", attention=attention).double()
    report = _run(model, "shift_cat", mixes=[[0, 1, N, 5, 3], [2, 0, 7, N, 1]], pattern="left")
    assert "ignored_target_loss" not in jagged_ops(report) and report.unoptimized == []
    assert "jagged_attention" not in jagged_ops(report)
    why = "reads flat at padded positions, and flat is not provably zero at padding (the loss counts them in the call"
    assert any(why in r and "a target at a padded position is not its ignore_index=0" in r
               for r in jagged_fallbacks(report)), report.fallbacks
    if attention:
        (fused,) = [f["reason"] for f in report.fallbacks if f["pass"] == "fuse_attention"]
        assert "F.cross_entropy (test_ignored_loss.py" in fused and "not its ignore_index=0" in fused, fused


def test_probabilities_and_per_position_losses_are_not_this_exit():
    """``reduction='none'`` stays the per-row loss of the region; float (probability) targets have
    no ignore_index."""
    import torch.fx as fx
    from grcompile.passes.ignored_loss import match_loss
    from grcompile.passes.layout import Flat

    g = fx.Graph()
    x, t, p = g.placeholder("x"), g.placeholder("t"), g.placeholder("p")
    x.meta["example_value"] = torch.empty(12, V)
    t.meta["example_value"] = torch.zeros(12, dtype=torch.long)
    p.meta["example_value"] = torch.empty(12, V)
    layouts = {x: Flat(0, 2)}
    none = g.call_function(F.cross_entropy, (x, t), {"reduction": "none"})
    probs = g.call_function(F.cross_entropy, (x, p), {"ignore_index": 0})
    legacy = g.call_function(F.nll_loss, (x, t, None, None, 0, False))
    ok = g.call_function(F.nll_loss, (x, t), {"ignore_index": 3, "reduction": "sum"})
    assert match_loss(none, x, layouts, 3, 4) is None
    assert "probabilities" in match_loss(probs, x, layouts, 3, 4)
    assert "deprecated" in match_loss(legacy, x, layouts, 3, 4)
    m = match_loss(ok, x, layouts, 3, 4)
    assert m.target is t and m.ignore_index == 3 and m.aligned == Flat(0, 1)


def test_a_write_into_an_input_keeps_the_loss_dense():
    """``targets[~valid] = -100`` writes into the caller's tensor: a check run before the graph
    cannot replay it, and nothing proves the padded targets, so the loss reads the dense logits."""
    torch.manual_seed(5)
    model = NextItem("input_written").double()
    report = _run(model, "input_written", mixes=MIXES[:2])
    assert "ignored_target_loss" not in jagged_ops(report) and report.unoptimized == []
    (reason,) = jagged_fallbacks(report)
    assert "may write into an input of the graph" in reason and "test_ignored_loss.py" in reason, reason
