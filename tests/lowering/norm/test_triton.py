"""The Triton kernels of ``grcompile::gated_norm`` (forward and backward) against the reference,
run on CPU tensors by Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py
before Triton is imported), through the custom op with ``use_backend("triton")``: values and
gradients on random shapes (no rows, one row, D of 1 ... 100), layouts (transposed / strided ``x``,
expanded ``u``, ``u`` None) and dtypes. One kernel config is also compiled for sm_90 (no GPU needed).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grcompile.lowering import OPS, use_backend
from grcompile.lowering.norm import triton as norm_triton
from grcompile.lowering.norm import gated_norm_backward

from tests.lowering import PROFILE

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1 set before Triton is imported")

SETTINGS = settings(parent=settings.get_profile(PROFILE))
SLOW = settings(parent=settings.get_profile("lowering-slow"))
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16]


def transposed(t: torch.Tensor) -> torch.Tensor:
    """Same values, the strides of a transpose of the last two dims (1-d: unchanged)."""
    return t if t.dim() < 2 else t.transpose(-1, -2).contiguous().transpose(-1, -2)


def strided(t: torch.Tensor) -> torch.Tensor:
    """Same values, every other element of a wider buffer."""
    return torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., ::2].copy_(t)


def expanded(t: torch.Tensor) -> torch.Tensor:
    """The first slice broadcast over dim 0 (stride 0); 1-d or 0 rows: unchanged."""
    return t if t.dim() < 2 or t.shape[0] == 0 else t[:1].expand_as(t)


LAYOUTS = {"contiguous": lambda t: t, "transposed": transposed, "strided": strided, "expanded": expanded}


def run(backend: str, x: torch.Tensor, u, kind: str, eps: float, w: torch.Tensor):
    """Output and ``(dx, du)`` of ``sum(gated_norm(x, u) * w)`` under ``backend``."""
    x = x.detach().requires_grad_()
    u = None if u is None else u.detach().requires_grad_()
    with use_backend(backend):
        y = torch.ops.grcompile.gated_norm(x, u, kind=kind, eps=eps)
        grads = torch.autograd.grad((y.float() * w).sum(), [x] if u is None else [x, u])
    return y, grads


def check(shape, D, dtype, kind, gated, x_layout, u_layout, eps, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    full = (*shape, D)
    x = LAYOUTS[x_layout]((torch.randn(full, generator=g) * 3 + 1).to(dtype))
    u = LAYOUTS[u_layout](torch.randn(full, generator=g).to(dtype)) if gated else None
    w = torch.randn(full, generator=g)
    handed = OPS["gated_norm"].calls["reference"], OPS["gated_norm_backward"].calls["reference"]
    y, grads = run("triton", x, u, kind, eps, w)
    if D <= norm_triton.MAX_D:  # the kernels ran (a handoff would match the reference by construction)
        assert (OPS["gated_norm"].calls["reference"], OPS["gated_norm_backward"].calls["reference"]) == handed
    y_ref, grads_ref = run("reference", x, u, kind, eps, w)
    assert y.is_contiguous() and y.shape == x.shape and y.dtype == x.dtype
    # half precision: the reference is torch's own half norm (the user's op), whose statistics can
    # differ from the kernel's float32 ones by a rounding (D = 1: 3e-5 where the kernel gives 0)
    half = dtype in (torch.bfloat16, torch.float16)
    torch.testing.assert_close(y, y_ref, **(dict(rtol=1.6e-2, atol=1e-3) if half else {}))
    assert len(grads) == len(grads_ref)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, **(dict(rtol=2e-2, atol=1e-2) if half else {}))


shapes = st.lists(st.sampled_from([0, 1, 2, 3, 5]), min_size=0, max_size=3)
layouts = st.sampled_from(list(LAYOUTS))
common = dict(shape=shapes, D=st.sampled_from([1, 3, 64, 100]), dtype=st.sampled_from(DTYPES),
              kind=st.sampled_from(["layer", "rms"]), gated=st.booleans(), x_layout=layouts, u_layout=layouts,
              eps=st.sampled_from([1e-5, 1e-6, 0.1]), seed=st.integers(0, 2**16))


@given(**common)
@SETTINGS
def test_gated_norm_triton_matches_reference(**kw) -> None:
    check(**kw)


@pytest.mark.slow
@given(**common)
@SLOW
def test_gated_norm_triton_matches_reference_slow(**kw) -> None:
    check(**kw)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("D", [8192, norm_triton.MAX_D + 1])
def test_wide_rows(kind: str, D: int) -> None:
    """The widest rows the kernels hold (8192), and beyond MAX_D (the reference runs instead)."""
    check((2,), D, torch.float32, kind, True, "contiguous", "expanded", 1e-5, 0)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (2, 0, 4), (0,)])
def test_zero_size(shape) -> None:
    """Empty inputs launch nothing and give empty outputs and gradients of the right shape."""
    x, u = torch.randn(shape), torch.randn(shape)
    assert norm_triton.gated_norm_triton(x, u, kind="layer", eps=1e-5).shape == x.shape
    dx, du = norm_triton.gated_norm_backward_triton(x, x, u, kind="rms", eps=1e-5)
    assert dx.shape == du.shape == x.shape
    check(shape[:-1], shape[-1], torch.float32, "layer", True, "contiguous", "contiguous", 1e-5, 0)


def test_triton_backend_runs_the_kernels() -> None:
    """Under use_backend("triton") both kernels ran (the registry counts them); under the
    reference the backward stays the plain-torch formula (no backward op call at all)."""
    fwd, bwd = OPS["gated_norm"].calls, OPS["gated_norm_backward"].calls
    x, u, w = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 6)
    before = fwd["triton"], bwd["triton"], bwd["reference"]
    run("triton", x, u, "layer", 1e-5, w)
    assert (fwd["triton"], bwd["triton"], bwd["reference"]) == (before[0] + 1, before[1] + 1, before[2])
    before = fwd["reference"], sum(bwd.values())
    run("reference", x, u, "layer", 1e-5, w)
    assert (fwd["reference"], sum(bwd.values())) == (before[0] + 1, before[1])


def test_backward_matches_the_analytic_formula_on_noncontiguous_grad() -> None:
    """The backward kernel reads a transposed incoming gradient in place."""
    g = torch.Generator().manual_seed(1)
    x, u = torch.randn(3, 7, 5, generator=g), torch.randn(3, 7, 5, generator=g)
    grad = transposed(torch.randn(3, 7, 5, generator=g))
    for kind in ("layer", "rms"):
        dx, du = norm_triton.gated_norm_backward_triton(grad, x, u, kind=kind, eps=1e-6)
        want = gated_norm_backward(grad, x, u, kind, 1e-6)
        torch.testing.assert_close(dx, want[0])
        torch.testing.assert_close(du, want[1])


_AOT = """
import json, triton
from triton.backends.compiler import GPUTarget
from grcompile.lowering.norm.triton import aot_configs
configs = aot_configs()
c = next(c for c in configs if c["kernel"] == "gated_norm_bwd" and c["config"]["dtype"] == "bf16")
k = triton.compile(triton.compiler.ASTSource(fn=c["fn"], signature=c["signature"], constexprs=c["constexprs"]),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=c["num_warps"], num_stages=c["num_stages"]))
print(json.dumps(dict(n=len(configs), keys=sorted(c), kernels=sorted({c["kernel"] for c in configs}),
                      ptx=".target sm_90" in k.asm["ptx"], cubin=len(k.asm["cubin"]), json=json.dumps(c["config"]))))
"""


def test_aot_config_compiles_for_sm90() -> None:
    """One declared config compiles to a cubin for sm_90 on this CPU machine (in a fresh process:
    under TRITON_INTERPRET=1 ``@triton.jit`` builds interpreter functions that cannot compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["n"] >= 8 and res["kernels"] == ["gated_norm_bwd", "gated_norm_fwd"]
    assert res["keys"] == sorted(["kernel", "fn", "signature", "int_args", "constexprs", "num_warps", "num_stages", "config",
                                  "uses_dot"])
    assert res["ptx"] and res["cubin"] > 0


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_compiled_graph_runs_the_backward_kernel() -> None:
    """grcompile.optimize under use_backend("triton"): the fused norm's backward in the compiled
    graph is the kernel op (caches off: a graph traced under another backend may be cached)."""
    import torch.nn.functional as F

    import grcompile

    torch._dynamo.reset()
    x = torch.randn(2, 8, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    fn = lambda x: F.layer_norm(x.transpose(1, 2), (x.shape[1],))  # noqa: E731
    w = torch.linspace(-1, 1, x.numel()).view(2, 5, 8)
    bwd = OPS["gated_norm_backward"].calls
    before = bwd["triton"]
    try:
        with use_backend("triton"), torch._inductor.config.patch(force_disable_caches=True):
            optimized = grcompile.optimize(fn)
            actual = optimized(x)
            (grad,) = torch.autograd.grad((actual * w).sum(), x)
    finally:
        torch._dynamo.reset()
    assert bwd["triton"] == before + 1
    expected = fn(x)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(grad, torch.autograd.grad((expected * w).sum(), x)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["transposed", "expanded"])
def test_opcheck_with_the_kernels(layout: str) -> None:
    """opcheck (fake vs real strides, autograd, AOTAutograd) with the Triton kernels running."""
    f = LAYOUTS[layout]
    x, u, grad = (f(torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(s))) for s in range(3))
    with use_backend("triton"):
        torch.library.opcheck(torch.ops.grcompile.gated_norm.default, (x.requires_grad_(), u.requires_grad_()),
                              dict(kind="layer", eps=1e-6))
        torch.library.opcheck(torch.ops.grcompile.gated_norm_backward.default, (grad, x.detach(), None),
                              dict(kind="rms", eps=1e-6))


def test_rows_too_wide_for_the_kernel_are_reported(monkeypatch) -> None:
    """Rows wider than MAX_D run the reference, counted there, with the reason in the registry."""
    monkeypatch.setattr(norm_triton, "MAX_D", 8)
    for op in ("gated_norm", "gated_norm_backward"):
        monkeypatch.setattr(OPS[op], "fallbacks", {})
    before = OPS["gated_norm"].calls["reference"], OPS["gated_norm_backward"].calls["reference"]
    with pytest.warns(UserWarning, match="rows of D = 9 > 8 do not fit in registers"):
        check((3,), 9, torch.float32, "layer", True, "contiguous", "contiguous", 1e-5, 0)
    assert (OPS["gated_norm"].calls["reference"], OPS["gated_norm_backward"].calls["reference"]) == \
        (before[0] + 2, before[1] + 1)  # the forward: this check's reference run and the Triton call handed over
    assert OPS["gated_norm_backward"].fallbacks == {"D=9": "rows of D = 9 > 8 do not fit in registers"}


def test_a_float8_input_is_refused_by_name() -> None:
    x = torch.randn(2, 4).to(torch.float8_e4m3fn)
    for backend in ("triton", "reference"):
        with use_backend(backend), pytest.raises(ValueError, match="x must be float16, bfloat16, float32 or float64"):
            torch.ops.grcompile.gated_norm(x, None, kind="rms", eps=1e-6)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_double_backward_under_the_triton_backend(kind: str) -> None:
    """A backward that is differentiated itself (a gradient penalty) uses the plain-torch formula:
    the kernel's backward op has no derivative of its own."""
    g = torch.Generator().manual_seed(4)
    x0, u0, w = (torch.randn(3, 16, generator=g, dtype=torch.float64) for _ in range(3))
    results = []
    for backend in ("triton", "reference"):
        x, u = x0.clone().requires_grad_(), u0.clone().requires_grad_()
        with use_backend(backend):
            y = torch.ops.grcompile.gated_norm(x, u, kind=kind, eps=1e-5)
            dx, du = torch.autograd.grad((y * w).sum(), [x, u], create_graph=True)
            penalty = dx.pow(2).sum() + du.pow(2).sum()
            results.append(torch.autograd.grad(penalty, [x, u]))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
