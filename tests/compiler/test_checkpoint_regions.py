"""Attention inside ``torch.utils.checkpoint`` (grcompile/capture/checkpoints.py): the region is
opened for the passes (fused, jagged), values and gradients equal eager, and its activations are
still recomputed in the backward, not saved. A selective-checkpoint policy leaves it closed, with
a reason."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint_module

import grcompile
from tests.passes.test_jagged_spellings import check, make_ids, tokens

N, D, V = 8, 8, 40


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class CheckpointedBlock(nn.Module):
    """Embedding, then a causal softmax (``explicit``) or SDPA (``sdpa``) attention block, run
    under ``checkpoint`` (``mode``: "plain", "selective" with a context_fn, or "none")."""

    def __init__(self, spelling: str = "explicit", mode: str = "plain", dropout: float = 0.0):
        super().__init__()
        self.spelling, self.mode, self.dropout = spelling, mode, dropout
        self.item = nn.Embedding(V, D, padding_idx=0)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.mha = nn.MultiheadAttention(D, 2, dropout=dropout, batch_first=True)

    def block(self, h, valid):
        q, k, v = self.qkv(h).chunk(3, -1)
        n = h.shape[1]
        allowed = torch.tril(torch.ones(n, n, dtype=torch.bool, device=h.device)) & valid[:, None, :]
        # -1e9, not -inf: eager's gradients stay finite on an empty row (every logit masked)
        if self.spelling == "mha":  # a padded query row attends to itself: no row is empty
            blocked = ~(allowed | torch.eye(n, dtype=torch.bool, device=h.device))
            a = self.mha(h, h, h, attn_mask=blocked.repeat_interleave(2, 0), need_weights=False)[0]
        elif self.spelling == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(allowed, 0.0, -1e9).to(q.dtype))
        else:
            s = (q @ k.transpose(-1, -2) / D ** 0.5).masked_fill(~allowed, -1e9)
            w = F.dropout(torch.softmax(s, -1), self.dropout, self.training)
            a = w @ v
        return F.dropout(self.out(a), self.dropout, self.training) * valid[..., None]

    def forward(self, ids):
        valid = ids != 0
        h = self.item(ids)
        if self.mode == "none":
            return h + self.block(h, valid)
        kwargs = {"use_reentrant": False}
        if self.mode == "selective":
            policy = functools.partial(checkpoint_module.create_selective_checkpoint_contexts,
                                       [torch.ops.aten.mm.default])
            kwargs["context_fn"] = policy
        return h + checkpoint_module.checkpoint(self.block, h, valid, **kwargs)


LENGTHS = [[0, 1, N, 5], [3, N, 2, 7]]


@pytest.mark.parametrize("spelling", ["explicit", "sdpa"])
def test_checkpointed_attention_is_fused_and_exact(spelling) -> None:
    torch.manual_seed(0)
    model = CheckpointedBlock(spelling).double()
    optimized = None
    for train in (True, False, True):
        for lengths in LENGTHS:
            ids = make_ids(lengths, seed=len(lengths))
            optimized, report = check(model, (ids,), tokens(lambda i: i != 0), train=train, lowering="inductor",
                                      optimized=optimized)
    assert report.counters["capture.checkpoints_inlined"] >= 1
    assert report.counters["fuse_attention.score_mod_attention"] >= 1
    assert report.counters["jagged_rewrite.jagged_attention"] >= 1


def _saved_bytes(fn, *args) -> int:
    """Bytes saved for the backward, without a replayed draw's CPU generator state (a 5 KB byte
    tensor per random op, whatever the activations' size: it dwarfs these tiny ones)."""
    total = 0

    def pack(t):
        nonlocal total
        if not (t.dtype == torch.uint8 and t.dim() == 1 and t.numel() == torch.get_rng_state().numel()):
            total += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return total


@pytest.mark.parametrize("spelling,lowering", [("explicit", "inductor"), ("explicit", "eager-remat"), ("mha", "inductor")])
def test_checkpointed_region_is_still_recomputed(spelling, lowering) -> None:
    """The opened region keeps the checkpoint's recompute tags through the passes — on what they
    emit in its place too (an expanded ``nn.MultiheadAttention``), and under the eager lowering
    with remat (the graph is partitioned; without remat it is not, see backend.py): the optimized
    model saves less for the backward with the checkpoint than without it."""
    torch.manual_seed(0)
    ids = make_ids([N] * 6 + [3, 1], seed=1, n=N)
    saved = {}
    for mode in ("none", "plain"):
        torch._dynamo.reset()
        model = CheckpointedBlock(spelling, mode=mode)
        options = {"lowering": "eager", "remat": True} if lowering == "eager-remat" else {"lowering": lowering}
        fast = grcompile.optimize(model, **options)
        fast(ids)
        saved[mode] = _saved_bytes(fast, ids)
        assert grcompile.report(fast).counters.get("fuse_attention.score_mod_attention", 0) >= 1
    assert saved["plain"] < 0.6 * saved["none"], saved


@pytest.mark.parametrize("options", [{}, {"lowering": "eager"}, {"lowering": "eager", "remat": True}],
                         ids=["inductor", "eager", "eager-remat"])
def test_dropout_in_a_checkpointed_region_draws_once(options) -> None:
    """Attention dropout (fused: its seed is saved) and an output dropout (recomputed: AOTAutograd
    replays its draw) inside the region: the optimized checkpointed model's gradients equal the
    optimized model's without the checkpoint, same seed — a mask drawn again in the backward would
    differ. The dropout does not cost the checkpoint its saving."""
    ids = make_ids([0, 1, N, 5], seed=2)
    grads, saved = {}, {}
    for mode in ("none", "plain"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = CheckpointedBlock(mode=mode, dropout=0.3).double().train()
        fast = grcompile.optimize(model, **options)
        torch.manual_seed(1)
        loss = (fast(ids) * (ids != 0)[..., None]).pow(2).sum()
        loss.backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert grcompile.report(fast).counters.get("fuse_attention.score_mod_attention", 0) >= 1
        saved[mode] = _saved_bytes(fast, ids)
        unsplit = [f for f in grcompile.report(fast).fallbacks if "activations are saved, not recomputed" in f["reason"]]
        assert len(unsplit) == (mode == "plain" and options == {"lowering": "eager"}), unsplit
    assert grads["plain"].keys() == grads["none"].keys()
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads["plain"][name], g, msg=lambda s: f"{name}: {s}")
    if options != {"lowering": "eager"}:  # the eager lowering partitions only with remat
        assert saved["plain"] < 0.6 * saved["none"], saved


def test_region_policy_saves_only_what_torch_cannot_replay() -> None:
    """torch's random ops are recomputed (AOTAutograd replays their draws); a custom op that may
    draw, or one with effects, is saved."""
    from torch.utils.checkpoint import CheckpointPolicy

    from grcompile.passes.pass_manager import region_policy

    g = torch.fx.Graph()
    x = g.placeholder("x")
    torch_dropout = g.call_function(F.dropout, (x, 0.3, True))
    method = g.call_method("bernoulli_", (x, 0.5))
    aten = g.call_function(torch.ops.aten.native_dropout.default, (x, 0.3, True))
    custom = g.call_function(torch.ops.grcompile_test_rng.noisy_dropout.default, (x,))
    plain = g.call_function(torch.relu, (x,))
    recompute, save = CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE
    assert [region_policy(n) for n in (torch_dropout, method, aten, plain)] == [recompute] * 4
    assert region_policy(custom) == save


@torch.library.custom_op("grcompile_test_rng::noisy_dropout", mutates_args=())
def _noisy_dropout(x: torch.Tensor) -> torch.Tensor:
    return x * (torch.rand_like(x) > 0.5)


def test_library_attention_with_dropout_keeps_its_region_closed_in_training_only() -> None:
    """An ``nn.MultiheadAttention`` with dropout draws its mask inside one op: opened and left
    unfused, its backward would draw it again, so the region stays closed, with a reason. In eval
    its dropout is off: the region opens, and the model is exact."""
    torch.manual_seed(0)
    model = CheckpointedBlock("mha", dropout=0.3).double()
    fast = grcompile.optimize(model.train())
    fast(make_ids(LENGTHS[0], seed=3))
    report = grcompile.report(fast)
    assert report.counters.get("capture.checkpoints_inlined", 0) == 0
    assert any(f["pass"] == "capture" and "library attention with dropout" in f["reason"] for f in report.fallbacks)
    torch._dynamo.reset()
    optimized = None
    for lengths in LENGTHS:
        optimized, report = check(model, (make_ids(lengths, seed=4),), tokens(lambda i: i != 0), train=False,
                                  lowering="inductor", optimized=optimized)
    assert report.counters["capture.checkpoints_inlined"] >= 1


def test_selective_checkpoint_stays_closed_with_a_reason() -> None:
    torch.manual_seed(0)
    model = CheckpointedBlock(mode="selective").double()
    optimized = None
    for lengths in LENGTHS:
        optimized, report = check(model, (make_ids(lengths),), tokens(lambda i: i != 0), lowering="inductor",
                                  optimized=optimized)
    reasons = [f["reason"] for f in report.fallbacks if f["pass"] == "capture"]
    assert reasons and "context_fn" in reasons[0], report.fallbacks
    assert "capture.checkpoints_inlined" not in report.counters


class NestedCheckpoints(CheckpointedBlock):
    """A checkpointed function returning a tuple, which checkpoints the attention block inside."""

    def pair(self, h, valid):
        a = checkpoint_module.checkpoint(self.block, h, valid, use_reentrant=False)
        return a, a * 2

    def forward(self, ids):
        valid = ids != 0
        h = self.item(ids)
        a, b = checkpoint_module.checkpoint(self.pair, h, valid, use_reentrant=False)
        return h + a + b


def test_nested_checkpoints_with_tuple_results() -> None:
    torch.manual_seed(0)
    model = NestedCheckpoints().double()
    optimized = None
    for lengths in LENGTHS:
        optimized, report = check(model, (make_ids(lengths),), tokens(lambda i: i != 0), lowering="inductor",
                                  optimized=optimized)
    assert report.counters["capture.checkpoints_inlined"] == 2
    assert report.counters["jagged_rewrite.jagged_attention"] == 1


class InPlaceBody(nn.Module):
    """An in-place op inside the region whose result is not used: it still writes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def body(self, h):
        s = self.lin(h)
        s.mul_(2.0)
        return s

    def forward(self, x):
        return checkpoint_module.checkpoint(self.body, x, use_reentrant=False)


def test_an_unused_in_place_write_in_the_region_is_kept() -> None:
    torch.manual_seed(0)
    model, x = InPlaceBody(), torch.randn(2, 3, 4)
    torch.testing.assert_close(grcompile.optimize(model)(x), model(x))
