"""optimize(remat=...): activation rematerialisation (issue 12). ``remat=True`` is the per-block
selective policy (passes/remat_policy.py: a block keeps its input and its attention's output, the
norm → input projection → split chain is recomputed in the backward); a float is a budget for
AOTAutograd's partitioner. Either way the saved activations shrink and values and gradients stay
those of the eager model (and of the optimized model without remat, dropout masks included)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

import grcompile
from grcompile.passes import default_pipeline
from grcompile.passes.pass_manager import GraphPass
from grcompile.passes.remat_policy import RematPolicy, tag_recompute
from models import build_encoder
from tests.passes.test_fuse_attention import random_batch

LENGTHS = [0, 1, 32, 17, 9, 32]


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _saved_bytes_and_grads(module, params, ids, ts, valid):
    """Bytes the forward saves for the backward (every saved tensor, counted once per save), the
    masked output and the parameter gradients."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    params.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(ids, ts)
    masked = out * valid[..., None]
    masked.square().sum().backward()
    return sum(saved), masked.detach(), {n: p.grad.clone() for n, p in params.named_parameters() if p.grad is not None}


def _hstu(**kw):
    torch.manual_seed(0)
    return build_encoder("hstu", "ml1m", num_items=50, max_len=32, num_blocks=2, **{"dropout": 0.0, **kw})


@pytest.mark.parametrize("lowering", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_remat_saves_less_and_keeps_values_and_gradients(lowering):
    enc = _hstu()
    ids, ts = random_batch(LENGTHS, 32)
    valid = (ids != 0).float()
    _, want, want_grads = _saved_bytes_and_grads(enc, enc, ids, ts, valid)
    saved = {}
    for remat in (None, True, 0.4):
        torch._dynamo.reset()
        model = copy.deepcopy(enc)
        optimized = grcompile.optimize(model, remat=remat, lowering=lowering)
        _saved_bytes_and_grads(optimized, model, ids, ts, valid)  # compiles forward and backward
        saved[remat], out, grads = _saved_bytes_and_grads(optimized, model, ids, ts, valid)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        for name, g in want_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)
        report = grcompile.report(optimized)
        assert ("remat: per block" in str(report)) == (remat is True)
        assert ("remat: saved activations capped at 0.4" in str(report)) == (remat == 0.4)
        assert report.unoptimized == []
    # the policy saves each block's input and attention output; the normed input, uvqk, u/q/k/v
    # and the gated norm's output are recomputed
    assert saved[True] < 0.35 * saved[None], saved
    assert saved[0.4] < 0.7 * saved[None], saved


def test_remat_with_dropout_keeps_the_random_stream():
    """Dropout is never recomputed (its mask would be drawn again): with dropout on in training,
    remat=True gives exactly the outputs and gradients of the optimized model without remat."""
    enc = _hstu(dropout=0.3)
    ids, ts = random_batch(LENGTHS, 32, seed=3)
    valid = (ids != 0).float()
    results = {}
    for remat in (None, True):
        torch._dynamo.reset()
        model = copy.deepcopy(enc).train()
        optimized = grcompile.optimize(model, remat=remat, lowering="eager")
        torch.manual_seed(7)
        _saved_bytes_and_grads(optimized, model, ids, ts, valid)
        torch.manual_seed(8)
        results[remat] = _saved_bytes_and_grads(optimized, model, ids, ts, valid)
    (plain_saved, plain_out, plain_grads), (saved, out, grads) = results[None], results[True]
    assert saved < 0.6 * plain_saved, (saved, plain_saved)
    torch.testing.assert_close(out, plain_out, rtol=1e-5, atol=1e-6)
    for name, g in plain_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    # and train -> eval -> train on the same module still agrees with eager in eval
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(optimized(ids, ts) * valid[..., None], enc.eval()(ids, ts) * valid[..., None],
                                   rtol=1e-4, atol=1e-5)


class _TwoDropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = F.dropout(F.gelu(self.a(x)), 0.3, self.training)
        h = F.dropout(torch.tanh(self.b(h)), 0.3, self.training)
        return self.c(h)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_remat_budget_never_redraws_a_dropout(lowering):
    """``remat=<budget>``: AOTAutograd's budget solver may recompute the ops its min-cut bans,
    random ones among them — a dropout recomputed in the backward drew a second mask (gradients
    off by up to 6). Random draws are saved under a budget, and inductor runs them as aten ops:
    values and gradients are exactly eager's, same seed."""
    x = torch.randn(4, 8, 8, dtype=torch.float64)
    results = {}
    for mode in ("eager", "optimized"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _TwoDropouts().double().train()
        run = model if mode == "eager" else grcompile.optimize(model, lowering=lowering, remat=0.3)
        torch.manual_seed(1)
        out = run(x)
        out.pow(2).sum().backward()
        results[mode] = (out.detach(), {n: p.grad for n, p in model.named_parameters()})
        if mode == "optimized":
            assert grcompile.report(run).counters.get("capture.random_draws_saved", 0) >= 2
    torch.testing.assert_close(results["optimized"][0], results["eager"][0])
    for name, g in results["eager"][1].items():
        torch.testing.assert_close(results["optimized"][1][name], g, msg=lambda s: f"{name}: {s}")


class _Block(nn.Module):
    """An HSTU-shaped block plus a feed-forward and a training-mode dropout: what is tagged."""

    def __init__(self, d=16):
        super().__init__()
        self.uvqk, self.out = nn.Linear(d, 4 * d), nn.Linear(d, d)
        self.ff1, self.ff2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        u, v, q, k = torch.split(F.silu(self.uvqk(F.layer_norm(x, x.shape[-1:]))), x.shape[-1], dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        x = x + self.out(F.dropout(u * F.layer_norm(attn, attn.shape[-1:]), 0.5, training=True))
        return x + self.ff2(F.relu(self.ff1(F.layer_norm(x, x.shape[-1:]))))


class _Grab(GraphPass):
    def __init__(self, into: dict) -> None:
        self.into = into

    def __call__(self, gm, ctx) -> None:
        self.into["gm"] = gm


def test_policy_tags_the_norm_projection_chain_and_nothing_random_or_second():
    captured = {}
    grcompile.optimize(_Block(), passes=[*default_pipeline(), RematPolicy(), _Grab(captured)],
                       lowering="eager")(torch.randn(2, 5, 16))
    tagged = [n for n in captured["gm"].graph.nodes if n.meta.get("recompute") is CheckpointPolicy.MUST_RECOMPUTE]
    assert tag_recompute(captured["gm"].graph) == tagged  # the pass tagged what the analysis finds
    names = {str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", str(n.target)) for n in tagged}
    assert {"gated_norm.default", "linear", "silu", "split", "getitem", "relu"} <= names, names
    linears = [n for n in tagged if getattr(n.target, "__name__", "") == "linear"]
    # uvqk and ff1 (each reads a norm), never ff2 (its input came out of ff1: one GEMM per chain)
    # nor the output projection (it reads a training-mode dropout)
    weights = sorted(str(n.args[1]) for n in linears)
    assert len(linears) == 2 and any("uvqk" in w for w in weights) and any("ff1" in w for w in weights), weights
    for n in captured["gm"].graph.nodes:
        if "dropout" in str(n.target) or "softmax" in str(n.target) or "matmul" in str(n.target):
            assert n not in tagged, n.format_node()


def test_remat_with_fp8_recomputes_the_fused_norm_gemm():
    """precision="fp8" + remat: the fused norm + FP8 GEMM is the recomputed projection; the values
    are exactly those of FP8 without remat (quantisation is deterministic)."""
    enc = _hstu(embedding_dim=64, linear_dim=32, attention_dim=32, num_heads=2)
    ids, ts = random_batch(LENGTHS, 32, seed=5)
    valid = (ids != 0).float()
    results = {}
    for remat in (None, True):
        torch._dynamo.reset()
        model = copy.deepcopy(enc)
        optimized = grcompile.optimize(model, remat=remat, lowering="eager", precision="fp8")
        _saved_bytes_and_grads(optimized, model, ids, ts, valid)  # compiles (saves fake tensors)
        results[remat] = _saved_bytes_and_grads(optimized, model, ids, ts, valid)
        counters = grcompile.report(optimized).counters
        assert counters["fp8_linear.fp8_linear"] == 4
        assert counters.get("remat_policy.recompute.projections", 0) == (4 if remat else 0)
    assert results[True][0] < 0.6 * results[None][0], (results[True][0], results[None][0])
    torch.testing.assert_close(results[True][1], results[None][1], rtol=0, atol=0)
    for name, g in results[None][2].items():
        torch.testing.assert_close(results[True][2][name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_remat_option_is_checked():
    for bad in (1.5, 0, "budget", 1.0):
        with pytest.raises(ValueError, match="budget in"):
            grcompile.optimize(torch.nn.Linear(2, 2), remat=bad)
    for good in (True, "selective", 0.5, None, False):
        grcompile.optimize(torch.nn.Linear(2, 2), remat=good)


@pytest.mark.parametrize("remat", [0.05, True])
def test_sparse_lookups_run_once_per_forward(remat, monkeypatch):
    """A partitioner budget may recompute any op it takes for functional; the sparse lookup runs
    the runtime's exchange, so it is saved (MUST_SAVE), never recomputed in the backward (without
    the tag a budget of 0.05 ran every lookup a second time there)."""
    from grcompile.runtime import shard_embeddings
    from grcompile.runtime.sparse import TABLES_ATTR, SparseRuntime
    from tests.runtime.test_embedding_rewrite import V, length_mix, make_task

    calls = []
    forward = SparseRuntime.forward
    monkeypatch.setattr(SparseRuntime, "forward", lambda self, feature, ids, *, keep_graph:
                        calls.append(feature) or forward(self, feature, ids, keep_graph=keep_graph))
    reference = make_task()
    task = copy.deepcopy(reference)
    shard_embeddings(task)
    compiled = grcompile.optimize(task, remat=remat, lowering="eager")
    for seed in range(2):
        ids, ts, negatives = length_mix(10 + seed)
        calls.clear()
        got, expected = compiled(ids, ts, negatives), reference(ids, ts, negatives)
        lookups = len(calls)
        got.backward()
        expected.backward()
        assert lookups > 0 and len(calls) == lookups, (lookups, len(calls))
        torch.testing.assert_close(got, expected)
        table = getattr(task, TABLES_ATTR).weights["merged_float64_d16"]
        torch.testing.assert_close(table.grad[:V + 1], reference.encoder.item_embedding.weight.grad)
        task.zero_grad()
        reference.zero_grad()
    assert grcompile.report(compiled).counters["remat_policy.must_save.effects"] > 0
