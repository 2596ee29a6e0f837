"""Test-only stand-ins for Ascend RecSDK's ``torch.ops.mxrec`` ops (no NPU, no torch_npu here).

:func:`install` defines the schemas exactly as RecSDK declares them (sources in
``grcompile/lowering/attention/ascend.py``) in a ``torch.library.Library("mxrec", "DEF")`` with CPU
kernels that (1) check the arguments the way RecSDK's C++ wrappers do (``TORCH_CHECK`` → a
``RuntimeError``) and (2) compute the math RecSDK's own golden tests define, in plain torch, so a
lowered call's values can be compared with grcompile's reference. Every call is appended to
:data:`CALLS` as ``(op name, {argument: value})``. :func:`uninstall` removes the schemas again.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from grcompile.lowering.attention import _autograd_reenabled

CALLS: list[tuple[str, dict]] = []
_LIB: list[torch.library.Library] = []

_HSTU_ARGS = ("Tensor? mask=None, Tensor? attn_bias=None, int mask_type=0, int max_seq_len=0, "
              "float silu_scale=0.0, Tensor seq_offset=None, Tensor? num_context=None, Tensor? num_target=None, "
              "int? target_group_size=0, float? alpha=1.0")
SCHEMAS = {  # RecSDK hstu/hstu_jagged.cpp @ ee7d6b389e5a, relative_attn_bias/*.cpp @ 0a926f4
    "hstu_jagged.equal": f"hstu_jagged.equal(Tensor q, Tensor k, Tensor v, {_HSTU_ARGS}) -> Tensor",
    "hstu_jagged_backward.equal": f"hstu_jagged_backward.equal(Tensor grad, Tensor q, Tensor k, Tensor v, "
                                  f"{_HSTU_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)",
    "relative_attn_bias_pos": "relative_attn_bias_pos(Tensor rel_pos_bias, Tensor identity, int[] past_valid_lens)"
                              " -> Tensor",
    "relative_attn_bias_time": "relative_attn_bias_time(Tensor timestamps, Tensor timestamps_weights, "
                               "float bucket_divisor) -> Tensor",
}
NUM_BUCKETS, BUCKET_DIVISOR = 128, 0.301  # RecSDK's test constants


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"mxrec stub: {msg}")


def _check_hstu(q, k, v, mask, attn_bias, mask_type, max_seq_len, seq_offset, grad=None) -> None:
    """The TORCH_CHECKs of hstu_jagged.cpp / hstu_common.h (forward and backward)."""
    for name, t in (("q", q), ("k", k), ("v", v)) + ((("grad", grad),) if grad is not None else ()):
        _check(t.dim() == 3, f"The {name} should be 3D in jagged layout")
        _check(t.dtype in (torch.float16, torch.float32, torch.bfloat16), f"{name} dtype {t.dtype}")
        _check(t.shape == q.shape and t.dtype == q.dtype, f"{name} shape/dtype differs from q")
    _check(seq_offset is not None and seq_offset.dim() == 1 and seq_offset.shape[0] >= 2,
           "seq_offset should have at least two elements")
    B, H, D = seq_offset.shape[0] - 1, q.shape[1], q.shape[2]
    _check(1 <= B <= 2048, f"batchSize expect in [1, 2048], but value is {B}")
    _check(1 <= max_seq_len <= 20480, f"maxSeqLen expect in [1, 20480], but value is {max_seq_len}")
    _check(1 <= H <= 16, f"headNum expect in [1, 16], but value is {H}")
    _check(16 <= D <= 512 and D % 16 == 0, f"headDim expect in [16, 512] and a multiple of 16, got {D}")
    _check(mask_type in (0, 2, 3), f"maskType {mask_type} (0, 2, 3 supported; 1 is not)")
    _check(mask_type != 3 or mask is not None, "use custome mask must have valide mask tensor")
    lengths = (seq_offset[1:] - seq_offset[:-1]).tolist()
    _check(min(lengths) >= 0 and int(seq_offset[0]) == 0 and int(seq_offset[-1]) == q.shape[0], "bad seq_offset")
    _check(max(lengths) <= max_seq_len, f"a row of {max(lengths)} tokens > max_seq_len {max_seq_len}")
    for name, t in (("mask", mask if mask_type == 3 else None), ("attnBias", attn_bias)):
        if t is not None:
            _check(tuple(t.shape) == (B, H, max_seq_len, max_seq_len),
                   f"The {name} should be [B, H, S, S] = {(B, H, max_seq_len, max_seq_len)}, got {tuple(t.shape)}")
            _check(t.dtype == q.dtype, f"{name} dtype should be the same as q dtype")


def _golden(q, k, v, mask, attn_bias, mask_type, max_seq_len, silu_scale, seq_offset, alpha):
    """RecSDK's golden: silu(alpha·(q·kᵀ + bias)) · silu_scale · mask @ v per row, float32."""
    scale = 1.0 / max_seq_len if silu_scale == 0 else silu_scale
    out = []
    offs = seq_offset.tolist()
    for b, (s, e) in enumerate(zip(offs[:-1], offs[1:])):
        L = e - s
        if L == 0:
            continue
        qb, kb, vb = (t[s:e].float().transpose(0, 1) for t in (q, k, v))  # [H, L, d]
        a = qb @ kb.transpose(-1, -2)
        if attn_bias is not None:
            a = a + attn_bias[b, :, :L, :L].float()
        a = F.silu(a * alpha) * scale
        if mask_type == 0:
            a = a * torch.ones(L, L).tril()
        elif mask_type == 3:
            a = a * mask[b, :, :L, :L].float()
        out.append((a @ vb).transpose(0, 1))
    return torch.cat(out) if out else q.new_zeros(0, q.shape[1], v.shape[2]).float()


def _record(op: str, **args) -> None:
    CALLS.append((op, {name: (t.detach().clone() if isinstance(t, torch.Tensor) else t) for name, t in args.items()}))


def hstu_jagged(q, k, v, mask=None, attn_bias=None, mask_type=0, max_seq_len=0, silu_scale=0.0, seq_offset=None,
                num_context=None, num_target=None, target_group_size=0, alpha=1.0):
    _check_hstu(q, k, v, mask, attn_bias, mask_type, max_seq_len, seq_offset)
    _record("hstu_jagged.equal", mask=mask, attn_bias=attn_bias, mask_type=mask_type, max_seq_len=max_seq_len,
            silu_scale=silu_scale, seq_offset=seq_offset, num_context=num_context, num_target=num_target,
            alpha=alpha)
    return _golden(q, k, v, mask, attn_bias, mask_type, max_seq_len, silu_scale, seq_offset,
                   1.0 if alpha is None else alpha).to(q.dtype)


def hstu_jagged_backward(grad, q, k, v, mask=None, attn_bias=None, mask_type=0, max_seq_len=0, silu_scale=0.0,
                         seq_offset=None, num_context=None, num_target=None, target_group_size=0, alpha=1.0):
    _check_hstu(q, k, v, mask, attn_bias, mask_type, max_seq_len, seq_offset, grad=grad)
    _record("hstu_jagged_backward.equal", mask=mask, attn_bias=attn_bias, mask_type=mask_type,
            max_seq_len=max_seq_len, silu_scale=silu_scale, seq_offset=seq_offset, alpha=alpha)
    with _autograd_reenabled():  # called from inside grcompile's backward op, below autograd
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        bias = attn_bias.detach().float().requires_grad_() if attn_bias is not None else None
        out = _golden(*leaves, mask, bias, mask_type, max_seq_len, silu_scale, seq_offset,
                      1.0 if alpha is None else alpha)
        wrt = leaves + ([bias] if bias is not None else [])
        grads = torch.autograd.grad(out, wrt, grad.float(), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, wrt)]
    dq, dk, dv = (g.to(q.dtype) for g in grads[:3])
    d_bias = grads[3].to(q.dtype) if bias is not None else q.new_empty(0)
    return dq, dk, dv, d_bias


def relative_attn_bias_pos(rel_pos_bias, identity, past_valid_lens):
    """RecSDK's rab_pos_golden: rows past each past_valid_len copy that row; identity → rel[0, 0]."""
    _check(rel_pos_bias.dim() == 2 and rel_pos_bias.shape[0] == rel_pos_bias.shape[1], "rel_pos_bias must be [n, n]")
    _check(identity.shape == rel_pos_bias.shape, "identity must be shaped like rel_pos_bias")
    _check(rel_pos_bias.dtype in (torch.float32, torch.float16), "relative_attn_bias_pos: float32 / float16 only")
    # README "(2s, 2s), 0 < s <= 4300", "0 < b <= 512"; the kernel reads rows with stride 2·(n // 2),
    # so an odd n would be read skewed on an NPU: rejected here
    n = rel_pos_bias.shape[0]
    _check(n % 2 == 0 and 0 < n <= 8600, f"rel_pos_bias must be (2s, 2s) with 0 < s <= 4300, got ({n}, {n})")
    _check(0 < len(past_valid_lens) <= 512, f"batch {len(past_valid_lens)} outside (0, 512]")
    _record("relative_attn_bias_pos", rel_pos_bias=rel_pos_bias, identity=identity,
            past_valid_lens=list(past_valid_lens))
    out = rel_pos_bias.unsqueeze(0).repeat(len(past_valid_lens), 1, 1)
    for i, valid_len in enumerate(past_valid_lens):
        out[i, valid_len:, :] = rel_pos_bias[valid_len, :]  # IndexError past the end, like the golden
    return out * (1 - identity) + identity * out[0, 0, 0]


def relative_attn_bias_time(timestamps, timestamps_weights, bucket_divisor):
    """RecSDK's rab_time_golden: [layers, B, 2s, 2s], each timestamp twice."""
    _check(timestamps.dim() == 2 and timestamps_weights.dim() == 2, "timestamps [B, s], weights [layers, buckets + 1]")
    _check(not timestamps.is_floating_point(), "integer timestamps")
    _record("relative_attn_bias_time", timestamps=timestamps, timestamps_weights=timestamps_weights,
            bucket_divisor=bucket_divisor)
    bs, s = timestamps.shape
    _check(0 < bs <= 512 and 0 < s <= 4300, f"timestamps (b, s) = ({bs}, {s}): 0 < b <= 512, 0 < s <= 4300")
    layers = timestamps_weights.shape[0]
    ts = timestamps.unsqueeze(-1).repeat(1, 1, 2).reshape(bs, 2 * s)
    diff = ts.reshape(bs, 2 * s, 1) - ts.reshape(bs, 1, 2 * s)
    clamp_max = torch.exp(torch.tensor(NUM_BUCKETS * bucket_divisor))
    buckets = (torch.log(torch.abs(diff).clamp(1, clamp_max)) / bucket_divisor).long().view(-1)
    result = torch.index_select(timestamps_weights.t(), 0, buckets)
    return result.t().reshape(layers, bs, 2 * s, 2 * s)


_KERNELS = {"hstu_jagged.equal": hstu_jagged, "hstu_jagged_backward.equal": hstu_jagged_backward,
            "relative_attn_bias_pos": relative_attn_bias_pos, "relative_attn_bias_time": relative_attn_bias_time}


def install(ops: Optional[tuple[str, ...]] = None) -> torch.library.Library:
    """Define (a subset of) the mxrec schemas with the CPU kernels above; idempotent per process."""
    uninstall()
    lib = torch.library.Library("mxrec", "DEF")
    for name in ops or tuple(SCHEMAS):
        lib.define(SCHEMAS[name])
        lib.impl(name, _KERNELS[name], "CPU")
    _LIB.append(lib)
    CALLS.clear()
    return lib


def uninstall() -> None:
    while _LIB:
        _LIB.pop()._destroy()
    CALLS.clear()


def calls(op: str) -> list[dict]:
    return [args for name, args in CALLS if name == op]


__all__ = ["install", "uninstall", "calls", "CALLS", "SCHEMAS"]
