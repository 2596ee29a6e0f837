"""``torch.library.opcheck`` on every grcompile custom op, with inputs laid out as user code hands
them over: contiguous, transposed strides, non-contiguous slices, expanded (stride 0) and zero-size.

opcheck runs the op for real, under fake tensors (the fake kernel must promise the real output's
shape, dtype *and strides*: inductor asserts them), through autograd, and through AOTAutograd with
dynamic shapes. ``test_every_custom_op_is_covered`` fails when an op is added without a case here.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import grcompile
from grcompile.lowering.constant_check import digest
from grcompile.lowering import jagged as J
from grcompile.lowering.score_mod import hstu_rab_key, register_score_mod
from grcompile.runtime import shard_embeddings

F64 = torch.float64
H, DQK, DV = 2, 3, 2


def transposed(t: torch.Tensor) -> torch.Tensor:
    """Same values, the strides of a transpose of the last two dims."""
    return t.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_(t.requires_grad)


def strided(t: torch.Tensor) -> torch.Tensor:
    """Same values, every other element of a wider buffer (not contiguous, not dense)."""
    out = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., ::2]
    return out.copy_(t.detach()).requires_grad_(t.requires_grad)


def expanded(t: torch.Tensor) -> torch.Tensor:
    """The first slice broadcast over dim 0 (stride 0)."""
    return t.detach()[:1].expand_as(t).requires_grad_(t.requires_grad)


LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda t: t, "transposed": transposed, "strided": strided, "expanded": expanded}


def opcheck(op, args, kwargs=None) -> None:
    torch.library.opcheck(op, args, kwargs or {})


def randn(*shape, dtype=F64, requires_grad=False, seed=0) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed)).requires_grad_(requires_grad)


# --- gated_norm ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("kind,dtype", [("layer", F64), ("rms", torch.float32), ("layer", torch.bfloat16)])
def test_gated_norm(layout: str, gated: bool, kind: str, dtype: torch.dtype) -> None:
    f = LAYOUTS[layout]
    x = f(randn(3, 4, 5, dtype=dtype, requires_grad=True))
    u = f(randn(3, 4, 5, dtype=dtype, requires_grad=True, seed=1)) if gated else None
    opcheck(torch.ops.grcompile.gated_norm.default, (x, u), dict(kind=kind, eps=1e-6))


@pytest.mark.parametrize("shape", [(0, 5), (3, 0, 5), (3, 0)])
def test_gated_norm_zero_size(shape) -> None:
    x, u = randn(*shape, requires_grad=True), randn(*shape, requires_grad=True, seed=1)
    opcheck(torch.ops.grcompile.gated_norm.default, (x, u), dict(kind="layer", eps=1e-6))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("kind,dtype", [("layer", F64), ("rms", torch.float32), ("layer", torch.bfloat16)])
def test_gated_norm_backward(layout: str, gated: bool, kind: str, dtype: torch.dtype) -> None:
    f = LAYOUTS[layout]
    grad, x = f(randn(3, 4, 5, dtype=dtype, seed=2)), f(randn(3, 4, 5, dtype=dtype))
    u = f(randn(3, 4, 5, dtype=dtype, seed=1)) if gated else None
    opcheck(torch.ops.grcompile.gated_norm_backward.default, (grad, x, u), dict(kind=kind, eps=1e-6))


@pytest.mark.parametrize("shape", [(0, 5), (3, 0, 5), (3, 0)])
def test_gated_norm_backward_zero_size(shape) -> None:
    args = randn(*shape, seed=2), randn(*shape), randn(*shape, seed=1)
    opcheck(torch.ops.grcompile.gated_norm_backward.default, args, dict(kind="rms", eps=1e-6))


def test_gated_norm_on_a_transposed_input_compiles() -> None:
    """The issue's reproduction: a non-affine norm over a Conv1d-style transposed tensor."""
    torch._dynamo.reset()
    x = randn(2, 8, 5, dtype=torch.float32, requires_grad=True)
    fn = lambda x: F.layer_norm(x.transpose(1, 2), (x.shape[1],))  # noqa: E731
    optimized = grcompile.optimize(fn)
    actual = optimized(x)
    assert [r["op"] for r in grcompile.report(optimized).rewrites] == ["norm"]  # gated_norm is in the graph
    expected = fn(x)
    torch.testing.assert_close(actual, expected)
    w = torch.linspace(-1, 1, expected.numel()).view_as(expected)
    torch.testing.assert_close(torch.autograd.grad((actual * w).sum(), x),
                               torch.autograd.grad((expected * w).sum(), x), rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


# --- pack_index ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_pack_index(layout: str) -> None:
    valid = torch.rand(4, 6, generator=torch.Generator().manual_seed(0)) > 0.4
    opcheck(torch.ops.grcompile.pack_index.default, (LAYOUTS[layout](valid),))


@pytest.mark.parametrize("shape", [(0, 6), (4, 0)])
def test_pack_index_zero_size(shape) -> None:
    opcheck(torch.ops.grcompile.pack_index.default, (torch.zeros(shape, dtype=torch.bool),))


# --- score_mod_attention (+ backward) -----------------------------------------------------------

def _score_mod(score, q_pos, k_pos, q_side, k_side, table):
    return score + table[(k_pos - q_pos).clamp(-4, 4) + 4] + 0.01 * (q_side - k_side).abs()


SCORE_MOD = register_score_mod(_score_mod, name="opcheck_score_mod")


def score_mod_args(B: int, N: int, layout: str = "contiguous", dtype=F64, requires_grad=True):
    f = LAYOUTS[layout]
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, N + 1, (B,), generator=g)
    valid = torch.arange(N)[None] < lengths[:, None]
    q, k, v = (f(randn(B, N, H, DQK, dtype=dtype, requires_grad=requires_grad, seed=s)) for s in range(3))
    ts = torch.cumsum(torch.randint(1, 9, (B, N), generator=g), 1).to(dtype)
    table = randn(9, dtype=dtype, requires_grad=requires_grad, seed=4)
    return q, k, v, f(valid), [f(ts)], [f(ts.clone())], [table]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("normalize", ["softmax", "none"])
def test_score_mod_attention(layout: str, normalize: str) -> None:
    args = score_mod_args(3, 5, layout)
    opcheck(torch.ops.grcompile.score_mod_attention.default, (*args, None, SCORE_MOD, normalize, True, 0.0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_score_mod_attention_backward(layout: str) -> None:
    args = score_mod_args(3, 5, layout, requires_grad=False)
    grad = LAYOUTS[layout](randn(3, 5, H, DQK, seed=7))
    opcheck(torch.ops.grcompile.score_mod_attention_backward.default,
            (grad, *args, SCORE_MOD, "softmax", True, None, 0.0))


@pytest.mark.parametrize("B,N", [(0, 5), (3, 0)])
def test_score_mod_attention_zero_size(B: int, N: int) -> None:
    opcheck(torch.ops.grcompile.score_mod_attention.default,
            (*score_mod_args(B, N), None, SCORE_MOD, "softmax", True, 0.0))
    opcheck(torch.ops.grcompile.score_mod_attention_backward.default,
            (randn(B, N, H, DQK), *score_mod_args(B, N, requires_grad=False), SCORE_MOD, "softmax", True, None, 0.0))


def test_score_mod_attention_float32_dropout_and_bias_only() -> None:
    args = score_mod_args(3, 5, dtype=torch.float32)
    opcheck(torch.ops.grcompile.score_mod_attention.default, (*args, torch.tensor([5]), SCORE_MOD, "softmax", True, 0.3))
    _, _, v, *rest = score_mod_args(3, 5)
    opcheck(torch.ops.grcompile.score_mod_attention.default, (None, None, v, *rest, None, SCORE_MOD, "none", True, 0.0))


# --- jagged_attention (+ backward) --------------------------------------------------------------

VALID = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
JAGGED_KWARGS = dict(score_mod=hstu_rab_key(5, 128), use_qk=True, activation="silu", scale=1.0, out_scale=0.2,
                     causal=True, max_len=5)


def jagged_args(valid: torch.Tensor, layout: str = "contiguous", requires_grad=True):
    f = LAYOUTS[layout]
    index = J.jagged_index(valid)
    T, N = index.numel(), valid.shape[1]
    q, k = (f(randn(T, H, DQK, requires_grad=requires_grad, seed=s)) for s in range(2))
    v = f(randn(T, H, DV, requires_grad=requires_grad, seed=2))
    ts = torch.cumsum(torch.randint(0, 10**4, (T,), generator=torch.Generator().manual_seed(1)), 0)
    tables = [randn(2 * N - 1, requires_grad=requires_grad, seed=3), randn(129, requires_grad=requires_grad, seed=4)]
    return q, k, v, J.valid_to_offsets(valid), J.padded_positions(index, N), [ts + 7], [ts], tables


@pytest.mark.parametrize("layout", LAYOUTS)
def test_jagged_attention(layout: str) -> None:
    opcheck(torch.ops.grcompile.jagged_attention.default, (*jagged_args(VALID, layout), None), JAGGED_KWARGS)
    args = jagged_args(VALID, layout, requires_grad=False)
    grad = LAYOUTS[layout](randn(args[0].shape[0], H, DV, seed=9))
    opcheck(torch.ops.grcompile.jagged_attention_backward.default, (grad, *args), JAGGED_KWARGS)


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_jagged_attention_fwd_and_its_statistics(activation: str) -> None:
    """The op under the composite: (out, lse); the backward given the softmax's out and lse."""
    kwargs = dict(JAGGED_KWARGS, activation=activation)
    opcheck(torch.ops.grcompile.jagged_attention_fwd.default, (*jagged_args(VALID, "contiguous"), None), kwargs)
    args = jagged_args(VALID, "contiguous", requires_grad=False)
    out, lse = torch.ops.grcompile.jagged_attention_fwd(*args, None, **kwargs)
    assert lse.shape == ((out.shape[0], H) if activation == "softmax" else (0,))
    grad = randn(args[0].shape[0], H, DV, seed=9)
    opcheck(torch.ops.grcompile.jagged_attention_backward.default, (grad, *args, None, out, lse), kwargs)


@pytest.mark.parametrize("valid", [torch.zeros(3, 5, dtype=torch.bool), torch.zeros(0, 5, dtype=torch.bool)],
                         ids=["empty_rows", "no_rows"])
def test_jagged_attention_zero_tokens(valid: torch.Tensor) -> None:
    opcheck(torch.ops.grcompile.jagged_attention.default, (*jagged_args(valid), None), JAGGED_KWARGS)
    opcheck(torch.ops.grcompile.jagged_attention_backward.default,
            (randn(0, H, DV), *jagged_args(valid, requires_grad=False)), JAGGED_KWARGS)


# --- check_index --------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_check_index(layout: str) -> None:
    index = LAYOUTS[layout](torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(0)))
    opcheck(torch.ops.grcompile.check_index.default, (index, 0, 10, "of the test table"))
    opcheck(torch.ops.grcompile.check_index.default, (index[:0], 0, 10, "of the test table"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_check_unchanged(layout: str) -> None:
    mask = LAYOUTS[layout](torch.ones(5, 5).tril().bool())
    opcheck(torch.ops.grcompile.check_unchanged.default, (mask, digest(mask), "the test mask"))
    opcheck(torch.ops.grcompile.check_unchanged.default, (mask[:0], digest(mask[:0]), "the test mask"))
    with pytest.raises(RuntimeError, match="changed after grcompile compiled"):
        torch.ops.grcompile.check_unchanged(mask, digest(~mask), "the test mask")


# --- FP8: quantize_fp8, norm_quant_fp8, scaled_linear_fp8, fp8_linear ---------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_ops(layout: str, dtype: torch.dtype) -> None:
    x, u = (LAYOUTS[layout](randn(3, 4, 16, dtype=dtype, requires_grad=True, seed=s)) for s in (1, 2))
    weight, bias = (randn(*shape, dtype=torch.float32, requires_grad=True, seed=s) for shape, s in (((32, 16), 3), ((32,), 4)))
    residual = LAYOUTS[layout](randn(3, 4, 32, dtype=torch.float32, requires_grad=True, seed=5))
    opcheck(torch.ops.grcompile.quantize_fp8.default, (x.detach(),))
    opcheck(torch.ops.grcompile.norm_quant_fp8.default, (x.detach(), u.detach()), {"kind": "layer", "eps": 1e-6})
    q, scale = torch.ops.grcompile.quantize_fp8(x.detach())
    # test_schema compares inputs before/after with allclose, which has no float8 kernel on CPU
    torch.library.opcheck(torch.ops.grcompile.scaled_linear_fp8.default,
                          (q, scale, weight.detach(), bias.detach(), residual.detach()), {"out_dtype": dtype},
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    for norm, gate in (("layer", u), ("rms", None), ("none", None)):
        opcheck(torch.ops.grcompile.fp8_linear.default, (x, gate, weight, bias, residual),
                {"norm": norm, "eps": 1e-6, "out_dtype": torch.float32})


def test_fp8_ops_zero_size() -> None:
    x, weight = (randn(*shape, dtype=torch.float32, requires_grad=True) for shape in ((0, 16), (16, 16)))
    opcheck(torch.ops.grcompile.fp8_linear.default, (x, None, weight, None, None),
            {"norm": "rms", "eps": 1e-6, "out_dtype": torch.float32})
    opcheck(torch.ops.grcompile.quantize_fp8.default, (randn(3, 0, dtype=torch.float32),))


# --- sparse_lookup (+ backward), on a one-process runtime ---------------------------------------

@pytest.fixture(scope="module")
def sparse():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4, padding_idx=0)

    model = Model().double()
    runtime = shard_embeddings(model)
    return runtime, model.emb.anchor


@pytest.mark.parametrize("layout", [*LAYOUTS, "zero_size"])
def test_sparse_lookup(sparse, layout: str) -> None:
    runtime, anchor = sparse
    ids = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(0))
    ids = ids[:0] if layout == "zero_size" else LAYOUTS[layout](ids)
    runtime.new_step()
    opcheck(torch.ops.grcompile.sparse_lookup.default, (ids, anchor, runtime.handle, "emb", True))
    # the backward hands the gradient to a lookup in flight: opcheck calls it several times
    runtime.new_step()
    for _ in range(6):
        torch.ops.grcompile.sparse_lookup(ids, anchor, runtime.handle, "emb", True)
    grad = randn(*ids.shape, 4)
    grad = grad if layout == "zero_size" else LAYOUTS[layout](grad)
    opcheck(torch.ops.grcompile.sparse_lookup_backward.default, (ids, grad, anchor.detach(), runtime.handle, "emb"))
    runtime.new_step()


# --- coverage -----------------------------------------------------------------------------------

COVERED = {"quantize_fp8", "norm_quant_fp8", "scaled_linear_fp8", "fp8_linear", "gated_norm", "gated_norm_backward", "pack_index", "score_mod_attention", "score_mod_attention_backward",
           "jagged_attention", "jagged_attention_fwd", "jagged_attention_backward", "check_index", "check_unchanged", "sparse_lookup",
           "sparse_lookup_backward"}


def test_every_custom_op_is_covered() -> None:
    root = Path(grcompile.__file__).parent
    defined = {name for path in root.rglob("*.py")
               for name in re.findall(r'(?:custom_op|define)\(\s*"grcompile::(\w+)"', path.read_text())}
    assert defined == COVERED, f"ops without an opcheck case: {sorted(defined - COVERED)}"
