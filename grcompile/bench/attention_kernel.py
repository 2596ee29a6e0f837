"""Time the Triton attention kernels alone: forward and backward TF/s and MFU at a given row length.

    python -m grcompile.bench.attention_kernel --tokens 8192 --heads 4 --head-dim 128 --dtype bf16 \\
        --bias hstu --activation silu --json attn.json

On a CUDA device this is the measurement the issue's H100 targets name (fused attention with the
HSTU relative attention bias, bf16, 8K tokens per row): CUDA events around each kernel call, the
FLOPs of :func:`grcompile.lowering.aot.attention_cost` (the two / five useful matmuls; the
backward is given the forward's output and log-sum-exp, as training's autograd gives it), the MFU
against the device's dense bf16 peak. On CPU it runs the same kernels in Triton's
interpreter (set ``TRITON_INTERPRET=1``) at whatever size you ask — a smoke test, **not a speed**:
the JSON says ``"interpreter": true`` and no MFU is computed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional

import torch

from grcompile.lowering import triton_interpreting

# dense bf16 tensor-core peaks (FLOP/s) by device name fragment; an unknown GPU gets no MFU
PEAKS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _peak(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAKS.items() if k in name), None)


def _inputs(args, device: torch.device) -> tuple[tuple, dict]:
    from grcompile.lowering.score_mod import hstu_rab_key, relative_position_bias_key

    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    N, B, H = args.tokens, args.rows, args.heads
    T = N * B
    dtype = DTYPES[args.dtype]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)
    q, k, v = rnd(T, H, args.head_dim, scale=0.3), rnd(T, H, args.head_dim, scale=0.3), rnd(T, H, args.head_dim)
    offsets = torch.arange(0, T + 1, N, dtype=torch.int64, device=device)
    positions = torch.arange(N, dtype=torch.int64).repeat(B).to(device)
    q_side, k_side, tables, key = [], [], [], ""
    if args.bias in ("hstu", "position"):
        position_table = (torch.randn(2 * N - 1, generator=gen) * 0.1).to(device)
        if args.bias == "hstu":
            # epoch seconds: the kernels' int32-gap variant; milliseconds: the int64 one (side_ranges.py)
            stamps = 1_700_000_000 + torch.cumsum(torch.randint(1, 600, (T,), generator=gen), 0)
            stamps = (stamps * (1000 if args.timestamps == "milliseconds" else 1)).to(device)
            q_side, k_side = [stamps], [stamps]
            tables = [position_table, (torch.randn(129, generator=gen) * 0.1).to(device)]
            key = hstu_rab_key(N, 128)
        else:
            tables, key = [position_table], relative_position_bias_key(N)
    seed = torch.tensor([args.seed], dtype=torch.int64, device=device) if args.dropout else None
    kwargs = dict(score_mod=key, use_qk=True, activation=args.activation,
                  scale=1.0 if args.activation == "silu" else args.head_dim ** -0.5,
                  out_scale=1.0 / N if args.activation == "silu" else 1.0, causal=True, max_len=N,
                  dropout_p=args.dropout)
    return (q, k, v, offsets, positions, q_side, k_side, tables, seed), kwargs


def _time(fn, iters: int, warmup: int, device: torch.device, back_to_back: int = 1) -> float:
    """Median seconds of ``fn()``; ``back_to_back`` calls between two events, divided (a call shorter
    than its host launch time is then timed as the GPU runs it when the host is ahead)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(back_to_back):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3 / back_to_back)
        else:
            t0 = time.perf_counter()
            for _ in range(back_to_back):
                fn()
            times.append((time.perf_counter() - t0) / back_to_back)
    times.sort()
    return times[len(times) // 2]


def run(args) -> dict[str, Any]:
    from grcompile.lowering.aot import attention_cost
    from grcompile.lowering.attention.triton import attention_backward_triton, attention_triton

    device = torch.device(args.device)
    interpreting = device.type == "cpu"
    if interpreting and not triton_interpreting():
        raise SystemExit("on CPU the Triton kernels run only in the interpreter: set TRITON_INTERPRET=1 "
                         "(a smoke test, not a speed)")
    inputs, kwargs = _inputs(args, device)
    out, lse = attention_triton(*inputs, **kwargs, with_lse=True)
    grad = torch.randn_like(out)
    fwd_s = _time(lambda: attention_triton(*inputs, **kwargs), args.iters, args.warmup, device)
    # as training calls it: with the forward's output and log-sum-exp (softmax: no forward rerun)
    bwd_s = _time(lambda: attention_backward_triton(grad, *inputs, out, lse, **kwargs), args.iters, args.warmup,
                  device)
    cost = attention_cost(args.tokens, args.heads, args.head_dim, args.head_dim, causal=True,
                          dtype_bytes=out.element_size())
    rows = args.rows
    peak = None if interpreting else _peak(device)
    result: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "json"},
                              "device": str(device) if interpreting else torch.cuda.get_device_name(device),
                              "interpreter": interpreting, "date": time.strftime("%Y-%m-%d"),
                              "torch": torch.__version__}
    for name, seconds in (("fwd", fwd_s), ("bwd", bwd_s)):
        flops = cost[name]["flops"] * rows
        tflops = flops / seconds / 1e12
        result[name] = {"ms": seconds * 1e3, "useful_tflop": flops / 1e12, "tflops": tflops,
                        "mfu": None if peak is None else flops / seconds / peak}
    result["peak_tflops"] = None if peak is None else peak / 1e12
    return result


def sdpa_baseline(args) -> dict[str, Any]:
    """torch's own fused attention (FlashAttention-2 in PyTorch's CUDA build) on the same shape:
    causal softmax, no bias, one ``[rows, heads, tokens, d]`` batch: the library kernel a user
    would otherwise call, timed the same way, FLOPs counted the same way."""
    import torch.nn.functional as F
    from grcompile.lowering.aot import attention_cost

    device = torch.device(args.device)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    shape = (args.rows, args.heads, args.tokens, args.head_dim)
    q, k, v = ((torch.randn(*shape, generator=gen) * 0.3).to(device=device, dtype=DTYPES[args.dtype])
               .requires_grad_() for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    fwd_s = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), args.iters, args.warmup, device)

    def fwd_bwd():
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)
    bwd_s = _time(fwd_bwd, args.iters, args.warmup, device) - fwd_s
    cost = attention_cost(args.tokens, args.heads, args.head_dim, args.head_dim, causal=True)
    peak = _peak(device)
    result = {}
    for name, seconds in (("fwd", fwd_s), ("bwd", bwd_s)):
        flops = cost[name]["flops"] * args.rows
        result[name] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12,
                        "mfu": None if peak is None else flops / seconds / peak}
    return result


# native tile candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) for --sweep: whole warpgroups,
# the tiles the AOT sweep found spill-free on sm_90 and the usual flash-attention shapes
SWEEP_TILES = [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3),
               (128, 128, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3), (64, 16, 8, 2), (32, 64, 4, 3), (16, 64, 8, 3),
               (64, 64, 8, 3), (64, 32, 8, 3), (32, 32, 4, 3), (128, 64, 8, 2)]


def sweep(args, kernels: tuple[str, ...] = ("fwd", "bwd_kv", "bwd_q")) -> list[dict[str, Any]]:
    """Time each kernel under each of ``SWEEP_TILES`` (``GRCOMPILE_TILES_<KERNEL>``), the other
    kernels at their table tiles: fwd through the forward call, bwd_kv and bwd_q through the
    backward call. A tile that does not compile, or that the launcher had to shrink (over the
    shared memory), is recorded as failed."""
    from grcompile.lowering.attention.triton import _FITTED, attention_backward_triton, attention_triton

    device = torch.device(args.device)
    inputs, kwargs = _inputs(args, device)
    out, lse = attention_triton(*inputs, **kwargs, with_lse=True)
    grad = torch.randn_like(out)
    rows = []
    for kernel in kernels:
        call = (lambda: attention_triton(*inputs, **kwargs)) if kernel == "fwd" else \
            (lambda: attention_backward_triton(grad, *inputs, out, lse, **kwargs))
        for tile in SWEEP_TILES:
            os.environ[f"GRCOMPILE_TILES_{kernel.upper()}"] = ",".join(map(str, tile))
            fitted = dict(_FITTED)
            try:
                ms = _time(call, args.iters, args.warmup, device) * 1e3
                shrunk = [v for k, v in _FITTED.items() if k not in fitted and k[1] == kernel]
                rows.append({"kernel": kernel, "tile": tile, "ms": ms} if not shrunk else
                            {"kernel": kernel, "tile": tile, "error": f"over shared memory (ran shrunk: {shrunk[0]})"})
            except Exception as exc:  # a tile over the shared memory, or a compile failure
                rows.append({"kernel": kernel, "tile": tile, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            finally:
                del os.environ[f"GRCOMPILE_TILES_{kernel.upper()}"]
            r = rows[-1]
            print(f"  sweep {kernel} {tile}: " + (f"{r['ms']:.3f} ms" if "ms" in r else r["error"]), flush=True)
    for kernel in kernels:
        timed = sorted((r for r in rows if r["kernel"] == kernel and "ms" in r), key=lambda r: r["ms"])
        print(f"  {kernel} fastest: " + ", ".join(f"{r['tile']} {r['ms']:.3f} ms" for r in timed[:4]))
        if timed:
            print(f"  best GRCOMPILE_TILES_{kernel.upper()}={','.join(map(str, timed[0]['tile']))}")
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m grcompile.bench.attention_kernel", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens per row (every row full)")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--bias", choices=("none", "position", "hstu"), default="hstu")
    p.add_argument("--activation", choices=("silu", "softmax"), default="silu")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--timestamps", choices=("seconds", "milliseconds"), default="seconds",
                   help="the HSTU bias's timestamps (seconds: time gaps computed in int32)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--baseline", action="store_true",
                   help="also time torch's scaled_dot_product_attention (causal softmax, no bias) on CUDA")
    p.add_argument("--sweep", default="", metavar="fwd,bwd_kv,bwd_q",
                   help="time these kernels under each SWEEP_TILES tile (CUDA)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    result = run(args)
    if args.baseline and not result["interpreter"]:
        result["sdpa_baseline"] = sdpa_baseline(args)
    if args.sweep and not result["interpreter"]:
        result["sweep"] = sweep(args, tuple(k for k in args.sweep.split(",") if k))
    from grcompile.lowering.attention.triton import tuned_tiles
    result["tuned_tiles"] = tuned_tiles()
    what = "interpreter (not a speed)" if result["interpreter"] else result["device"]
    print(f"grcompile attention kernels, {args.rows} x {args.tokens} tokens, {args.heads} heads x {args.head_dim}, "
          f"{args.dtype}, bias {args.bias}, {args.activation}, on {what}")
    for name in ("fwd", "bwd"):
        r = result[name]
        mfu = "" if r["mfu"] is None else f", MFU {r['mfu']:.1%}"
        print(f"  {name}: {r['ms']:.3f} ms, {r['tflops']:.2f} TFLOP/s useful{mfu}")
    for name, r in result.get("sdpa_baseline", {}).items():
        mfu = "" if r["mfu"] is None else f", MFU {r['mfu']:.1%}"
        print(f"  torch sdpa {name} (causal softmax, no bias): {r['ms']:.3f} ms, {r['tflops']:.2f} TFLOP/s{mfu}")
    for tuned in result["tuned_tiles"]:
        print(f"  autotuned {tuned['key'][1]} (length bucket {tuned['key'][-1]}): {tuned['chosen']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
