"""The eager reference of ``optimize(model, precision="fp8")``: the user's own model with each
``F.linear`` the pass would convert computed in emulated FP8 (row-wise e4m3 operands, float32
accumulation, straight-through backward) — the model the optimized one must equal."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from grcompile.lowering.fp8 import dequantize, quantize_rowwise
from grcompile.passes.fp8_linear import ALIGN

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _EmulatedFp8Linear(torch.autograd.Function):
    """dx = dy @ W, dW = dyᵀ @ x: straight through, both on the unquantised operands (what the
    pass promises: torchao's rowwise_with_gw_hp)."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        y = dequantize(*quantize_rowwise(x)) @ dequantize(*quantize_rowwise(weight)).t()
        return (y if bias is None else y + bias.float()).to(out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        g = dy.float()
        rows = g.reshape(-1, g.shape[-1])
        dweight = rows.t() @ x.float().reshape(rows.shape[0], x.shape[-1])
        return (g @ weight.float()).to(x.dtype), dweight.to(weight.dtype), \
            rows.sum(0) if ctx.has_bias else None, None


def converts(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fp8_linear pass converts a linear of these operands."""
    return x.dtype in _DTYPES and weight.dtype in _DTYPES and weight.dim() == 2 and \
        all(d % ALIGN == 0 for d in weight.shape)


@contextlib.contextmanager
def emulated_fp8_linears(whole_attention_modules: bool = False,
                         only: Callable[[torch.Tensor], bool] | None = None) -> Iterator[None]:
    """Every ``F.linear`` (``nn.Linear`` and ``F.multi_head_attention_forward`` call it) that the
    pass converts, computed in emulated FP8 while the context is open. Convolutions stay as they
    are; ``whole_attention_modules``: ``F.multi_head_attention_forward``'s own projections stay too
    (what the pass does where the attention was not fused and the call stays whole); ``only(weight)``:
    just the linears of those weights (an ``fp8_filter``'s choice)."""
    original, original_mha = F.linear, F.multi_head_attention_forward
    inside_mha = []

    def mha(*args, **kwargs):
        inside_mha.append(True)
        try:
            return original_mha(*args, **kwargs)
        finally:
            inside_mha.pop()

    def linear(x, weight, bias=None):
        if not converts(x, weight) or (whole_attention_modules and inside_mha) or (only and not only(weight)):
            return original(x, weight, bias)
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        out_dtype = torch.get_autocast_dtype(device) if autocast else torch.promote_types(x.dtype, weight.dtype)
        with torch.autocast(device, enabled=False):
            return _EmulatedFp8Linear.apply(x, weight, bias, out_dtype)

    F.linear, F.multi_head_attention_forward = linear, mha
    try:
        yield
    finally:
        F.linear, F.multi_head_attention_forward = original, original_mha


def assert_fp8_close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str = "",
                     flips: float = 0.005) -> None:
    """``got`` equals ``want`` within (rtol, atol) except at a few elements: float32 summation order
    (jagged vs dense) can move a value across an e4m3 rounding midpoint, which changes that element
    by a whole e4m3 step. At most ``flips`` of the elements may differ, and by no more than such a
    step could (2⁻³ of the tensor's largest magnitude)."""
    got, want = got.float(), want.float()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    off = ~torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    worst = (got - want).abs().nan_to_num(0).max().item() if got.numel() else 0.0
    bound = 2.0 ** -3 * want.abs().nan_to_num(0).max().item() if want.numel() else 0.0
    assert off.float().mean().item() <= flips if got.numel() else True, \
        f"{what}: {int(off.sum())} of {got.numel()} elements differ (max |diff| {worst:.3g})"
    assert worst <= bound + atol, f"{what}: max |diff| {worst:.3g} over {bound:.3g}"
