"""fuse_norm_gate: ``u ⊙ Norm(x)`` and bare non-affine norms become ``grcompile::gated_norm``;
affine / multi-dim norms are left alone (counted); values and gradients equal (half precision: the
forward bit for bit, gradients within the dtype's rounding)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import grcompile
from grcompile.passes.fuse_norm_gate import FuseNormGate
from grcompile.passes import jagged_pipeline
from models import build_encoder

from .test_fuse_attention import assert_same, random_batch


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("model,expected", [
    ("hstu", {"norm": 2, "gated_norm": 2}),  # per block: the input layer_norm, u * layer_norm(out)
    ("fuxi", {"norm": 4, "gated_norm": 2}),  # per block: two input rms_norms, rms_norm(out) * u
    ("sasrec", {}),  # LayerNorm modules with weight and bias: left to the compiler
])
def test_models_match_counts_and_exact(model, expected):
    torch.manual_seed(0)
    enc = build_encoder(model, "ml1m", num_items=50, max_len=16, num_blocks=2, dropout=0.0).double()
    ids, ts = random_batch([0, 1, 16, 9], 16)
    report = assert_same(enc, (ids, ts), ids != 0, passes=jagged_pipeline())
    fused = [r for r in report.rewrites if r["pass"] == "fuse_norm_gate"]
    assert {op: sum(r["op"] == op for r in fused) for op in {r["op"] for r in fused}} == expected
    assert all(r["site"].startswith(f"{model}.py:") for r in fused)
    if model == "sasrec":
        assert report.counters["fuse_norm_gate.skipped_affine"] == 5


@pytest.mark.parametrize("model,expected", [("hstu", {"norm": 2, "gated_norm": 2}),
                                            ("fuxi", {"norm": 4, "gated_norm": 2})])
def test_training_dropout_keeps_the_norm_fusions(model, expected):
    """A training-mode dropout on jagged values cannot be evaluated on example values (it guards
    on the data-dependent numel); the norms after it must still be analysed and fused."""
    torch.manual_seed(0)
    enc = build_encoder(model, "ml1m", num_items=50, max_len=16, num_blocks=2, dropout=0.3).train()
    ids, ts = random_batch([0, 1, 16, 9], 16)
    optimized = grcompile.optimize(enc, lowering="eager")
    optimized(ids, ts).sum().backward()
    fused = [r["op"] for r in grcompile.report(optimized).rewrites if r["pass"] == "fuse_norm_gate"]
    assert {op: fused.count(op) for op in set(fused)} == expected


class NormVariants(nn.Module):
    """Norms a user might write: gate on the left, a broadcast gate (not fused: shapes differ),
    an affine LayerNorm, a norm over two dims, an rms_norm with the default eps."""

    def __init__(self, D=6):
        super().__init__()
        self.D = D
        self.proj = nn.Linear(D, 2 * D)
        self.affine = nn.LayerNorm(D)

    def forward(self, x):
        u, h = self.proj(x).chunk(2, dim=-1)
        a = u * F.layer_norm(h, (self.D,), eps=1e-5)  # fused: gated_norm(h, u)
        b = F.rms_norm(h, (self.D,)) * u[:, :1]  # broadcast gate: only the norm is fused
        c = self.affine(h)  # affine: skipped
        d = F.layer_norm(h, h.shape[-2:])  # two dims: skipped
        return a + b + c + d


def test_variants_fused_or_skipped_and_exact():
    torch.manual_seed(0)
    m = NormVariants().double()
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    optimized = grcompile.optimize(m, passes=[FuseNormGate()], lowering="eager")
    out = optimized(x)
    out.square().sum().backward()
    fused = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    ref = m(x)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    for n, p in m.named_parameters():
        torch.testing.assert_close(fused[n], p.grad, msg=n)
    report = grcompile.report(optimized)
    assert sorted(r["op"] for r in report.rewrites) == ["gated_norm", "norm"]
    assert report.counters["fuse_norm_gate.skipped_affine"] == 1
    assert report.counters["fuse_norm_gate.skipped_not_last_dim"] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_fused_bit_equal(dtype):
    """A half-precision model is fused too: the op rounds where the user's norm and multiply
    round, so the forward is bit-equal; gradients (float32 inside) within the dtype's rounding."""
    torch.manual_seed(0)
    m = NormVariants().to(dtype)
    x = torch.randn(3, 5, 6, dtype=dtype, requires_grad=True)
    optimized = grcompile.optimize(m, passes=[FuseNormGate()], lowering="eager")
    out = optimized(x)
    g = torch.randn_like(out)
    out.backward(g)
    fused = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad()
    ref = m(x)
    ref.backward(g)
    assert torch.equal(out, ref)
    for got, want in zip(fused, [x.grad] + [p.grad for p in m.parameters()]):
        # summed branch gradients round differently near zero: tolerance against the tensor's scale
        ulp = torch.finfo(dtype).eps
        torch.testing.assert_close(got, want, rtol=2 * ulp, atol=2 * ulp * want.abs().max().item())
    report = grcompile.report(optimized)
    assert sorted(r["op"] for r in report.rewrites) == ["gated_norm", "norm"]
