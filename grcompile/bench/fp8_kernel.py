"""Time the FP8 kernels of one HSTU block's two large GEMMs against the bf16 path they replace,
and check them against their references on the same device.

    python -m grcompile.bench.fp8_kernel --tokens 32768 --dim 1024 --heads 8 --head-dim 128 --json fp8.json

Per block (HSTU: ``uvqk = linear(norm(x))``, then ``x + output(norm(a) ⊙ u)``):

- **input projection** ``[T, D] -> [T, 4·H·d]``: bf16 path ``gated_norm`` (Triton) then ``F.linear``
  (cuBLAS); FP8 path ``norm_quant_fp8`` (norm + row-wise e4m3 in one kernel) then
  ``scaled_linear_fp8`` (Triton e4m3 GEMM);
- **output projection** ``[T, H·d] -> [T, D]`` with the gate and the residual: bf16 path
  ``gated_norm(a, u)``, ``F.linear``, ``+ x``; FP8 path the gated ``norm_quant_fp8`` and the GEMM with
  the residual in its epilogue.

Each is timed whole and by parts (the GEMM alone with a quantised weight, and torch's
``_scaled_mm`` with row-wise scales on the same codes where this torch and GPU run it: cuBLAS's FP8
GEMM, the ceiling a Triton GEMM is compared with). Checks run first, on the device: the fused norm +
quantisation equals ``quantize_rowwise`` of the Triton norm bit for bit; the GEMM equals the
reference up to float32 summation order (both rounded to bf16); its distance to the bf16 linear is printed. CUDA only
(sm_89+ multiplies e4m3; sm_80 decodes the codes to fp16): on CPU the kernels run only in Triton's
interpreter, which says nothing about speed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from grcompile.bench.attention_kernel import _peak, _time
from grcompile.lowering import triton_interpreting


def _inputs(T: int, D: int, width: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=torch.bfloat16)
    return dict(x=rnd(T, D), w_in=rnd(4 * width, D, scale=D ** -0.5), a=rnd(T, width), u=rnd(T, width),
                w_out=rnd(D, width, scale=width ** -0.5))


def _scaled_mm(q: torch.Tensor, scale: torch.Tensor, wq: torch.Tensor, wscale: torch.Tensor) -> Optional[Callable]:
    """cuBLAS's row-wise FP8 GEMM on the same codes, or None where this torch / GPU refuses it."""
    try:
        fn = lambda: torch._scaled_mm(q, wq.t(), scale_a=scale, scale_b=wscale.reshape(1, -1),  # noqa: E731
                                      out_dtype=torch.bfloat16)
        fn()
        return fn
    except Exception as err:  # noqa: BLE001 - an unsupported layout or version: report and go on
        print(f"  torch._scaled_mm unavailable: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
        return None


def _projection(name: str, x: torch.Tensor, u: Optional[torch.Tensor], w: torch.Tensor,
                residual: Optional[torch.Tensor], iters: int, warmup: int, back_to_back: int = 1) -> dict[str, Any]:
    from grcompile.lowering.fp8 import _scaled_linear_reference, quantize_rowwise
    from grcompile.lowering.fp8.triton import (norm_quant_fp8_triton, quantize_rows_triton, scaled_linear_fp8_launch,
                                               scaled_linear_fp8_triton)
    from grcompile.lowering.norm.triton import gated_norm_triton

    device = x.device
    interpreted = triton_interpreting()
    M, K, N = x.shape[0], x.shape[1], w.shape[0]
    kw = dict(kind="layer", eps=1e-6)
    gemm = dict(out_dtype=torch.bfloat16, gemm_dtype=torch.bfloat16)

    def fp8_auto(q, scale):  # the op's own choice (cuBLAS where it computes the same thing, see _cublas_route)
        return scaled_linear_fp8_triton(q, scale, w, None, residual, **gemm)

    def fp8_triton(q, scale):
        return scaled_linear_fp8_launch(q, scale, w, None, residual, **gemm, fp8_dot=True, interpreted=interpreted)

    # checks on the device
    q, scale = norm_quant_fp8_triton(x, u, **kw)
    normed = gated_norm_triton(x, u, **kw)
    want_q, want_scale = quantize_rowwise(normed)
    wq, wscale = quantize_rowwise(w)
    got_wq, got_wscale = quantize_rows_triton(w)
    ref = _scaled_linear_reference(q, scale, w, None, residual, **gemm)
    bf16 = F.linear(normed, w) + (0 if residual is None else residual)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))  # noqa: E731
    checks: dict[str, Any] = {
        "norm_quant_bit_equal": bool(torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
                                     and torch.equal(scale, want_scale)),
        "weight_quant_bit_equal": bool(torch.equal(got_wq.view(torch.uint8), wq.view(torch.uint8))
                                       and torch.equal(got_wscale, wscale))}
    for route, fn in (("triton", fp8_triton), ("auto", fp8_auto)):
        y = fn(q, scale)
        checks[f"{route}_vs_reference_rel"] = rel(y, ref)
        checks[f"{route}_vs_reference_max_abs"] = float((y.float() - ref.float()).abs().max())
        checks[f"{route}_ulp_mismatch_fraction"] = float((y != ref).float().mean())
        checks[f"{route}_vs_bf16_linear_rel"] = rel(y, bf16)
    res = residual
    with_res = "+residual" if res is not None else ""
    paths: list[tuple[str, Callable, bool]] = [  # (label, call, counts the GEMM's FLOPs)
        (f"bf16 norm+linear{with_res}", (lambda: F.linear(gated_norm_triton(x, u, **kw), w) + res)
         if res is not None else (lambda: F.linear(gated_norm_triton(x, u, **kw), w)), True),
        (f"fp8 norm_quant+gemm{with_res} (op's route)", lambda: fp8_auto(*norm_quant_fp8_triton(x, u, **kw)), True),
        (f"fp8 norm_quant+gemm{with_res} (Triton GEMM)", lambda: fp8_triton(*norm_quant_fp8_triton(x, u, **kw)), True),
        ("bf16 linear (cuBLAS)", lambda: F.linear(normed, w), True),
        (f"fp8 gemm{with_res} (op's route, weight quantised)", lambda: fp8_auto(q, scale), True),
        (f"fp8 gemm{with_res} (Triton, weight quantised)", lambda: fp8_triton(q, scale), True),
        ("weight quantisation (Triton)", lambda: quantize_rows_triton(w), False),
        ("weight quantisation (torch)", lambda: quantize_rowwise(w), False),
        ("bf16 gated_norm (Triton)", lambda: gated_norm_triton(x, u, **kw), False),
        ("fp8 norm_quant (Triton)", lambda: norm_quant_fp8_triton(x, u, **kw), False),
    ]
    cublas_fp8 = _scaled_mm(q.reshape(M, K), scale.reshape(M, 1), wq, wscale) if device.type == "cuda" else None
    if cublas_fp8 is not None:
        paths.append(("fp8 gemm (_scaled_mm alone, quantised weight)", cublas_fp8, True))
    flops = 2 * M * N * K
    timings = {}
    for label, fn, is_gemm in paths:
        s = _time(fn, iters, warmup, device, back_to_back)
        tf = flops / s / 1e12 if is_gemm else None
        timings[label] = {"ms": s * 1e3, "gemm_tflops": tf}
        print(f"  {name:<7} {label:<52} {s * 1e3:8.3f} ms" + (f"  {tf:7.1f} TF/s (GEMM FLOPs)" if tf else ""))
    return {"M": M, "K": K, "N": N, "gemm_flops": flops, "checks": checks, "timings": timings}


def run(args) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type != "cuda" and not triton_interpreting():
        raise SystemExit("on CPU the Triton kernels run only in the interpreter: set TRITON_INTERPRET=1 "
                         "(a smoke test, not a speed)")
    cuda = device.type == "cuda"
    width = args.heads * args.head_dim
    t = _inputs(args.tokens, args.dim, width, args.seed, device)
    result: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "json"},
                              "device": torch.cuda.get_device_name(device) if cuda else "cpu (interpreter)",
                              "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
                              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    import triton
    result["triton"] = triton.__version__
    peak = _peak(device) if cuda else None
    result["peak_bf16_tflops"] = None if peak is None else peak / 1e12
    print(f"{result['device']} torch {torch.__version__} triton {triton.__version__}: T={args.tokens} "
          f"D={args.dim} width={width}")
    timing = (args.iters, args.warmup, args.back_to_back)
    result["input_projection"] = _projection("uvqk", t["x"], None, t["w_in"], None, *timing)
    result["output_projection"] = _projection("output", t["a"], t["u"], t["w_out"], t["x"], *timing)
    for side in ("input_projection", "output_projection"):
        times = result[side]["timings"]
        bf16 = next(v["ms"] for k, v in times.items() if k.startswith("bf16 norm+linear"))
        fp8 = next(v["ms"] for k, v in times.items() if k.startswith("fp8 norm_quant+gemm") and "route" in k)
        result[side]["fp8_speedup_whole"] = bf16 / fp8
        print(f"  {side}: checks {result[side]['checks']}; fp8 path {bf16 / fp8:.2f}x the bf16 path")
    return result


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m grcompile.bench.fp8_kernel", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768, help="jagged tokens T (rows × lengths)")
    p.add_argument("--dim", type=int, default=1024, help="embedding width D (HSTU-large: 1024)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--back-to-back", type=int, default=1,
                   help="calls between two CUDA events (divided): >1 hides the host launch time of short kernels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
