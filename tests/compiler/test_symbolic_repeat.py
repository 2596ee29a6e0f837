"""``repeat`` / ``tile`` by the batch size keeps a model optimized after a new batch size (issue 10).

After a shape change the rows are an unbacked symbol (``capture/shapes.py``), and autograd's
``repeat_backward`` guards on its counts (``Eq(u0, 0)``, ``Ne(u0, 1)``): without the
``symbolic_repeat`` rewrite AOTAutograd cannot trace the joint graph and the model runs eagerly.
The model here spells ``repeat`` the ways outside code does (BERT4Rec's position table and mask,
a new leading axis, a tiled axis, ``torch.tile``; an in-place op on the repeated tensor in the
per-spelling test).
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn as nn

import grcompile

SHAPES = [(5, 12), (3, 9), (1, 7), (6, 12), (2, 4)]  # the first compiles statically, then B and N vary


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Repeats(nn.Module):
    def __init__(self, items: int = 40, max_len: int = 12, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.d = heads, d
        self.token = nn.Embedding(items, d, padding_idx=0)
        self.position = nn.Embedding(max_len, d)
        self.proj = nn.Linear(d, d)
        self.prefix = nn.Parameter(torch.randn(2, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n = x.shape
        mask = (x > 0).unsqueeze(1).repeat(1, n, 1).unsqueeze(1).repeat(1, self.heads, 1, 1)
        pe = self.position.weight[:n].unsqueeze(0).repeat(b, 1, 1)  # a size-1 axis, by the batch
        pe2 = self.position.weight[:n].repeat(b, 1, 1)              # a new leading axis
        h = self.token(x) + pe + 0.5 * pe2
        q = self.proj(h).view(b, n, self.heads, -1).transpose(1, 2)
        p = (q @ q.transpose(-1, -2)).masked_fill(mask == 0, -1e9).softmax(-1)
        out = (p @ q).transpose(1, 2).reshape(b, n, self.d)
        tiled = self.prefix.repeat(b, 1).view(b, 2, self.d)          # a tiled axis [2, d] -> [2b, d]
        tiles = torch.tile(self.prefix, (b, 1, 1))                   # tile's spelling, a new axis
        return out + tiled.sum(1, keepdim=True) * tiles.mean(1, keepdim=True)


def batch(b: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 40, (b, n), generator=g)
    x[torch.rand(b, n, generator=g) < 0.25] = 0  # padding and holes
    x[:, 0] = 1
    return x


def train(lowering: str, options: dict) -> grcompile.Report:
    """Train steps at ``SHAPES``; the loss, the outputs at valid positions and every parameter
    gradient equal eager's at each step."""
    torch.manual_seed(0)
    # float64: the position table's gradient sums terms of ~100 that cancel to ~0.1, so float32
    # rounding alone (eps x 148 ~ 2e-5) exceeds any tolerance meant to catch a wrong gradient
    eager = Repeats().double()
    model = copy.deepcopy(eager)
    optimized = grcompile.optimize(model, lowering=lowering, strict=True, **options)
    for i, (b, n) in enumerate(SHAPES):
        x = batch(b, n, seed=i)
        valid = (x > 0).unsqueeze(-1)
        outs = []
        for m, run in ((eager, eager), (model, optimized)):
            m.zero_grad(set_to_none=True)
            out = run(x)
            torch.where(valid, out, 0.0).pow(2).sum().backward()
            outs.append(torch.where(valid, out, 0.0).detach())
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5, msg=lambda m: f"at {(b, n)}: {m}")
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"{name}.grad at {(b, n)}: {m}")
    return grcompile.report(optimized)


def assert_optimized_after_new_batch_sizes(report: grcompile.Report) -> None:
    assert report.compiles <= 2 and not report.unoptimized, str(report)
    assert "passes.size_guards" not in report.counters, str(report)
    fired = Counter((r["graph"], r.get("written")) for r in report.rewrites if r["pass"] == "symbolic_repeat")
    # only in the symbolic graph (the static graph's counts are ints), after the passes: pe, pe2,
    # tiled and tile (the mask's repeats feed the fused attention, which replaced them)
    assert fired == Counter({(1, "repeat"): 3, (1, "tile"): 1}), fired


def test_repeat_by_batch_traces_the_joint_graph():
    """``remat`` makes the eager lowering split the graph with AOTAutograd (the joint trace that
    guarded); ``strict`` raises instead of running unoptimized."""
    assert_optimized_after_new_batch_sizes(train("eager", {"remat": True}))


@pytest.mark.slow
def test_repeat_by_batch_lowers_with_inductor():
    assert_optimized_after_new_batch_sizes(train("inductor", {}))


def test_rewrite_is_exact_per_spelling():
    """Each spelling alone, traced with an unbacked count (the pass + AOTAutograd's joint trace,
    as grcompile lowers): values, gradient and a fresh (non-aliasing) result equal ``repeat``'s."""
    from torch._dynamo.backends.common import aot_autograd
    from functorch.compile import nop

    from grcompile.passes.pass_manager import PassContext, run_pipeline
    from grcompile.passes.symbolic_repeat import SymbolicRepeat

    ctx = PassContext()

    def backend(gm, example_inputs):
        run_pipeline(gm, [SymbolicRepeat()], ctx)
        return aot_autograd(fw_compiler=nop, bw_compiler=nop)(gm, example_inputs)

    cases = {
        "size-1 axis": lambda w, b: w.unsqueeze(0).repeat(b, 1, 1),
        "new axes": lambda w, b: w.repeat(2, b, 1, 1),
        "tiled axis": lambda w, b: w.repeat(b, 2),
        "tile, fewer counts": lambda w, b: w.tile((b,)),
        "torch.tile": lambda w, b: torch.tile(w, (1, b, 3)),
        "repeats keyword": lambda w, b: w.repeat(repeats=(b, 1)),
    }
    for name, spell in cases.items():
        for b in (3, 1):
            torch._dynamo.reset()
            w = torch.randn(3, 4, dtype=torch.float64)
            x = torch.zeros(b, 2)
            torch._dynamo.decorators.mark_unbacked(x, 0)

            def f(w, x):
                out = spell(w, x.shape[0])
                out.mul_(2)  # writes a repeat's fresh tensor, never w
                return out

            ref_w, got_w = w.clone().requires_grad_(), w.clone().requires_grad_()
            ref = f(ref_w * 1, x)
            got_in = got_w * 1
            got = torch.compile(f, backend=backend, fullgraph=True)(got_in, x)
            torch.testing.assert_close(got_in, w, rtol=0, atol=0, msg=lambda m: f"{name}, b={b} wrote w: {m}")
            torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=lambda m: f"{name}, b={b}: {m}")
            grad = torch.randn_like(ref)
            (ref * grad).sum().backward()
            (got * grad).sum().backward()
            torch.testing.assert_close(got_w.grad, ref_w.grad, msg=lambda m: f"{name} grad, b={b}: {m}")
            assert got.is_contiguous()
    assert ctx.counters["symbolic_repeat.repeat_as_expand"] >= len(cases), ctx.counters
