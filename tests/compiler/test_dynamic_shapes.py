"""Shapes change and optimization keeps going (issue 10, 1.5 and 2.9).

Training steps where the batch size (1 included), the padded length and the length mix all vary:
the optimized model compiles twice (the first call statically, then once with the row axes
unbacked-symbolic and the position axes symbolic: ``capture/shapes.py``), the second graph gets
every rewrite the first one got (the passes reason on layouts, not sizes), no pass guards on a
symbolic size, and values and gradients equal eager (every step of the zoo models, every third of
HSTU's). The default run does 30-50 steps per model with the eager lowering (the passes and
Dynamo's shape handling are the same; the attention op's CPU chunks run uncompiled); the ``slow``
profile does 1,000 steps with inductor.
"""
from __future__ import annotations

import copy
import random
from collections import Counter

import pytest
import torch

import grcompile
from models import SampledSoftmaxRetrieval, build_encoder
from tests.zoo.harness import Pair, load

TINY = dict(embedding_dim=16, num_blocks=1, num_heads=2, attention_dim=8, linear_dim=8, dropout=0.0)
ITEMS, MAX_LEN = 40, 16


@pytest.fixture(autouse=True)
def _fresh_dynamo(request, monkeypatch):
    torch._dynamo.reset()
    if request.node.get_closest_marker("slow") is None:
        # the attention op's CPU chunks run eagerly: compiling them again after each reset would
        # dominate the default run, and they are not what these tests count (backend compiles)
        from grcompile.lowering.attention import chunks

        monkeypatch.setattr(chunks, "COMPILE_CHUNKS", False)
    yield
    torch._dynamo.reset()


def shape_schedule(steps: int, max_len: int, seed: int = 0, min_len: int = 3) -> list[tuple[int, int]]:
    """(B, N) per step: a first shape, then B in [1, 8] (batches of 1 included, and one of 0 rows)
    and N in [min_len, max_len], both changing, with repeats (as a loader padding to each batch's
    longest row produces them)."""
    rng = random.Random(seed)
    shapes = [(4, max_len), (1, max_len - 3), (6, min_len), (0, max_len - 1)]
    while len(shapes) < steps:
        shapes.append((rng.randint(1, 8), rng.randint(min_len, max_len)))
    return shapes[:steps]


def retrieval_batch(B: int, N: int, seed: int, R: int = 8) -> tuple[torch.Tensor, ...]:
    """ids / timestamps [B, N] with a random length mix (empty, length-1 and full rows when they
    fit) and negatives [B, R]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, N + 1, (B,), generator=g)
    lengths[: 3] = torch.tensor([N, 0, 1])[: B]
    valid = torch.arange(N)[None] < lengths[:, None]
    ids = torch.randint(1, ITEMS + 1, (B, N), generator=g) * valid
    ts = torch.cumsum(torch.randint(1, 5000, (B, N), generator=g), dim=1) * valid
    return ids, ts, torch.randint(1, ITEMS + 1, (B, R), generator=g)


class Trainer:
    """The HSTU retrieval task, optimized and eager side by side: one training step at a time,
    the loss and every parameter gradient compared."""

    def __init__(self, lowering: str, model: str = "hstu") -> None:
        torch.manual_seed(0)
        self.eager = SampledSoftmaxRetrieval(build_encoder(model, "ml1m", num_items=ITEMS, max_len=MAX_LEN, **TINY))
        self.copy = copy.deepcopy(self.eager)
        self.optimized = grcompile.optimize(self.copy, lowering=lowering)

    def step(self, args: tuple, check: bool = True) -> None:
        for m in (self.eager, self.copy):
            m.zero_grad(set_to_none=True)
        loss = self.optimized(*args)
        loss.backward()
        if not check:
            return
        expected = self.eager(*args)
        expected.backward()
        shapes = [tuple(a.shape) for a in args]
        torch.testing.assert_close(loss, expected, msg=lambda m: f"loss at {shapes}: {m}")
        for (name, p), q in zip(self.copy.named_parameters(), self.eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"{name} at {shapes}: {m}")


def per_graph(report: grcompile.Report, graph: int) -> Counter:
    return Counter((r["pass"], r["op"]) for r in report.rewrites if r["graph"] == graph)


def assert_one_dynamic_recompile(report: grcompile.Report, must_fire: set[tuple[str, str]]) -> None:
    """Two compiles; the second (symbolic) graph got every rewrite of the first (static) one and
    no fallback the first did not have; no pass guarded on a symbolic size."""
    assert report.compiles == 2, str(report)
    assert [r["graph"] for r in report.recompiles] == [1], report.recompiles
    assert "input shapes changed" in report.recompiles[0]["reason"]
    assert "unbacked-symbolic" in report.recompiles[0]["reason"]
    static, dynamic = per_graph(report, 0), per_graph(report, 1)
    assert dynamic == static, f"rewrites differ: static {static}, dynamic {dynamic}"
    assert must_fire <= set(dynamic), f"{must_fire - set(dynamic)} did not fire in the dynamic graph"
    fallbacks = [Counter(f["pass"] for f in report.fallbacks if f["graph"] == g) for g in (0, 1)]
    assert fallbacks[1] == fallbacks[0], report.fallbacks
    assert "passes.size_guards" not in report.counters, str(report)
    assert report.graph_breaks == 0 and not report.unoptimized, str(report)


HSTU_FIRES = {("fuse_attention", "score_mod_attention"), ("jagged_rewrite", "jagged_attention"),
              ("jagged_rewrite", "embedding"), ("jagged_rewrite", "linear"), ("fuse_norm_gate", "gated_norm")}


def run_hstu(steps: int, lowering: str, check_every: int = 1) -> grcompile.Report:
    trainer = Trainer(lowering)
    for i, (B, N) in enumerate(shape_schedule(steps, MAX_LEN)):
        trainer.step(retrieval_batch(B, N, seed=i), check=i % check_every == 0 or i < 4)
    return grcompile.report(trainer.optimized)


def run_zoo(name: str, steps: int, lowering: str) -> grcompile.Report:
    user, expect = load(name)
    pair = Pair(user, lowering)
    for i, (B, N) in enumerate(shape_schedule(steps, 12)):
        if B > 0:  # (a batch of 0 rows is HSTU's test: library attention code may not take one eagerly)
            pair.step(B, N, seed=i, train=True)  # asserts outputs, loss and gradients against eager
    return pair.report()


ZOO = {"mha_batch_first": {("fuse_attention", "score_mod_attention"), ("jagged_rewrite", "jagged_attention")},
       "recbole_sasrec": {("fuse_attention", "score_mod_attention"), ("jagged_rewrite", "jagged_attention")}}


def test_hstu_training_compiles_twice():
    assert_one_dynamic_recompile(run_hstu(50, "eager", check_every=3), HSTU_FIRES)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_outside_style_models_compile_twice(name):
    """A SASRec on ``nn.MultiheadAttention`` and a RecBole-style SASRec (additive -10000 mask,
    ``gather`` at ``item_seq_len - 1``) from tests/zoo."""
    assert_one_dynamic_recompile(run_zoo(name, 30, "eager"), ZOO[name])


def test_user_jagged_ops_do_not_recompile_per_batch():
    """A model calling fbgemm's ``dense_to_jagged`` (a data-dependent size T) in its forward: the
    op stays in the graph with an unbacked T (no graph break before it), so new length mixes at
    one shape reuse the graph and new shapes cost one recompile in all."""
    user, _ = load("fbgemm_user_jagged")
    pair = Pair(user, "eager")
    for seed in range(4):  # one shape, four length mixes (four different T)
        pair.step(5, 12, seed=seed, train=True)
    assert pair.report().compiles == 1, str(pair.report())
    for i, (B, N) in enumerate(shape_schedule(12, 12)):
        if B > 0:  # its view(B, N, 3, h, -1) cannot take 0 rows, eagerly either
            pair.step(B, N, seed=10 + i, train=True)
    report = pair.report()
    assert report.compiles == 2 and report.graph_breaks == 0, str(report)
    assert "passes.size_guards" not in report.counters


def test_duck_sizing_does_not_tie_negatives_to_positions():
    """At the recompile the negatives' R equals N (both changed): they must not share a symbol,
    or the next batch with R != N would recompile (a guard R == N)."""
    trainer = Trainer("eager")
    trainer.step(retrieval_batch(4, 12, seed=0, R=6))
    trainer.step(retrieval_batch(3, 10, seed=1, R=10))  # recompile; R == N here
    for i, (B, N, R) in enumerate([(5, 7, 12), (2, 9, 3), (1, 12, 12)]):
        trainer.step(retrieval_batch(B, N, seed=2 + i, R=R))
    report = grcompile.report(trainer.optimized)
    assert report.compiles == 2, str(report)


def test_first_call_with_one_row():
    """A first batch of one row compiles statically; the next shape makes the rows symbolic and
    every later B (1 again included) reuses that graph."""
    trainer = Trainer("eager")
    for i, (B, N) in enumerate([(1, 9), (4, 12), (1, 5), (7, 16), (2, 3)]):
        trainer.step(retrieval_batch(B, N, seed=i))
    report = grcompile.report(trainer.optimized)
    assert report.compiles == 2 and "passes.size_guards" not in report.counters, str(report)


def test_short_positions_compile_once_more_and_say_why():
    """Position sizes stay backed symbols (unbacked ones make library code break the graph), so a
    batch whose N - 1 (the next-item loss slices ids[:, 1:]) is 1 gets its own graph: reported
    with the reason, exact, and reused by the next such batch."""
    trainer = Trainer("eager")
    for i, (B, N) in enumerate([(4, 12), (3, 9), (5, 2), (2, 2), (6, 11)]):
        trainer.step(retrieval_batch(B, N, seed=i))
    report = grcompile.report(trainer.optimized)
    assert report.compiles == 3, str(report)
    reason = report.recompiles[-1]["reason"]
    assert report.recompiles[-1]["graph"] == 2 and "dim 1 = 2" in reason and "own graph" in reason, reason
    assert f"recompile graph 2: {reason}" in str(report)


@pytest.mark.slow
def test_hstu_thousand_steps_inductor():
    assert_one_dynamic_recompile(run_hstu(1000, "inductor", check_every=25), HSTU_FIRES)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ZOO))
def test_outside_style_models_thousand_steps_inductor(name):
    assert_one_dynamic_recompile(run_zoo(name, 1000, "inductor"), ZOO[name])


# --- user code that needs rows >= 1 in the symbolic graph ---------------------------------------

class SplitHeadsLoop(torch.nn.Module):
    """``t.reshape(B, N, H, -1)`` of a ``split`` projection inside a ModuleList loop."""

    class Layer(torch.nn.Module):
        def __init__(self, d: int = 16, heads: int = 2) -> None:
            super().__init__()
            self.heads, self.qkv = heads, torch.nn.Linear(d, 3 * d)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            B, N, D = x.shape
            q, k, v = (t.reshape(B, N, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(D, -1))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return x + a.transpose(1, 2).reshape(B, N, D)

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(31, 16, padding_idx=0)
        self.layers = torch.nn.ModuleList(self.Layer() for _ in range(2))

    def forward(self, ids: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
        N = ids.shape[1]
        mask = torch.ones(N, N, dtype=torch.bool).tril() & (ids != 0)[:, None, None, :]
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, mask)
        return x


class TimeBiasMergeHeads(torch.nn.Module):
    """HSTU-style time bias, heads merged back with ``permute(0, 2, 1, 3).reshape(B, N, -1)``."""

    def __init__(self, d: int = 16, heads: int = 2, buckets: int = 12) -> None:
        super().__init__()
        self.heads, self.buckets = heads, buckets
        self.emb = torch.nn.Embedding(31, d, padding_idx=0)
        self.wq, self.wk, self.wv = (torch.nn.Linear(d, d) for _ in range(3))
        self.tt = torch.nn.Parameter(torch.randn(buckets + 1, heads) * 0.3)

    def forward(self, ids: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
        B, N = ids.shape
        valid = ids != 0
        x = self.emb(ids)
        q, k, v = (w(x).view(B, N, self.heads, -1).permute(0, 2, 1, 3) for w in (self.wq, self.wk, self.wv))
        gap = (ts[:, :, None] - ts[:, None, :]).abs().clamp(min=1).float()
        bucket = (torch.log(gap) / 1.5).long().clamp(0, self.buckets)
        allowed = torch.ones(N, N, dtype=torch.bool).tril() & valid[:, None, None, :]
        scores = q @ k.transpose(-1, -2) + self.tt[bucket].permute(0, 3, 1, 2)
        a = scores.masked_fill(~allowed, -1e9).softmax(-1) @ v
        return a.permute(0, 2, 1, 3).reshape(B, N, -1)


def ids_ts(B: int, N: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, N + 1, (B,), generator=g)
    lengths[:2] = torch.tensor([N, 1])[:B]
    ids = torch.randint(1, 31, (B, N), generator=g) * (torch.arange(N)[None] < lengths[:, None])
    return ids, 1_700_000_000 + torch.cumsum(torch.randint(0, 10**6, (B, N), generator=g), 1)


def step_like_eager(eager: torch.nn.Module, model: torch.nn.Module, fast, args: tuple) -> None:
    """One training step on both; outputs (at valid positions) and every gradient equal."""
    valid = (args[0] != 0)[..., None]
    for m in (eager, model):
        m.zero_grad(set_to_none=True)
    out, ref = fast(*args), eager(*args)
    (out * valid).square().sum().backward()
    (ref * valid).square().sum().backward()
    torch.testing.assert_close(out * valid, ref * valid, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("cls", [SplitHeadsLoop, TimeBiasMergeHeads])
def test_reshape_minus_one_after_shape_change_stays_optimized(cls):
    """``reshape(B, N, H, -1)`` / ``reshape(B, N, -1)`` in the graph compiled after a shape change:
    the -1 is inferred (the rows are >= 1), no graph break, every rewrite of the static graph again
    (was: "Could not guard on data-dependent expression Ne(7*u1, 0)", the frame or the attention
    unoptimized while the report said 0 graph breaks)."""
    torch.manual_seed(0)
    eager = cls()
    model = copy.deepcopy(eager)
    fast = grcompile.optimize(model, lowering="eager")
    for i, (B, N) in enumerate([(3, 8), (2, 7), (1, 5), (4, 6), (0, 6), (2, 8)]):
        if B == 0:  # an empty batch runs the user's code eagerly: the -1 is ambiguous there too
            for m in (eager, fast):
                with pytest.raises(RuntimeError, match="cannot reshape tensor of 0 elements"):
                    m(*ids_ts(0, N, seed=i))
            continue
        step_like_eager(eager, model, fast, ids_ts(B, N, seed=i))
    report = grcompile.report(fast)
    assert_one_dynamic_recompile(report, {("fuse_attention", "score_mod_attention"),
                                          ("jagged_rewrite", "jagged_attention")})
    assert report.counters["shapes.empty_batch_eager"] == 1


@pytest.mark.parametrize("spelling", ["sdpa", "mha"])
def test_attention_dropout_after_shape_change_stays_fused(spelling):
    """Training-mode attention dropout (SDPA's ``dropout_p``, ``nn.MultiheadAttention(dropout=)``):
    the graph compiled after a shape change fuses it too (was: fuse_attention raised
    GuardOnDataDependentSymNode on dropout's ``numel() == 0`` and the attention stayed dense)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        from sasrec_mha import SASRecMHA
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    if spelling == "mha":
        eager = SASRecMHA(num_items=30, max_len=8, embedding_dim=16, num_blocks=1, num_heads=2, dropout=0.2)
        call = lambda m, ids, ts: m(ids)  # noqa: E731
    else:
        eager = SDPADropout()
        call = lambda m, ids, ts: m(ids)  # noqa: E731
    model = copy.deepcopy(eager)
    fast = grcompile.optimize(model, lowering="eager")
    for i, (B, N) in enumerate([(3, 8), (2, 6), (4, 7)]):
        ids, ts = ids_ts(B, N, seed=i)
        out = call(fast, ids, ts)
        (out * (ids != 0)[..., None]).square().sum().backward()
    report = grcompile.report(fast)
    assert report.compiles == 2 and not report.unoptimized, str(report)
    fused = [r for r in report.rewrites if (r["pass"], r["op"]) == ("fuse_attention", "score_mod_attention")]
    assert [r["graph"] for r in fused] == [0, 1] and all(r["dropout_p"] > 0 for r in fused), str(report)
    assert not [f for f in report.fallbacks if f["pass"] == "fuse_attention"], str(report)
    # without dropout the symbolic graph computes eager's values
    eager.eval(), model.eval()
    ids, ts = ids_ts(3, 5, seed=9)
    with torch.no_grad():
        valid = (ids != 0)[..., None]
        torch.testing.assert_close(call(fast, ids, ts) * valid, call(eager, ids, ts) * valid, rtol=1e-4, atol=1e-5)


class SDPADropout(torch.nn.Module):
    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(31, d, padding_idx=0)
        self.wq, self.wk, self.wv = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, N = ids.shape
        D = self.emb.embedding_dim
        x = self.emb(ids)
        q, k, v = (w(x).view(B, N, self.heads, D // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        m = torch.where(torch.ones(N, N, dtype=torch.bool).tril() & (ids != 0)[:, None, None, :], 0.0, -1e4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                             dropout_p=0.25 if self.training else 0.0)
        return a.transpose(1, 2).reshape(B, N, D)
