"""The op library the compiler's passes emit, and the registry that picks a kernel per device.

Each op lives in its own module with a plain-torch *reference* implementation beside the kernel
slots (``triton`` for CUDA, ``ascend`` for NPU, filled in by later milestones). The custom op's
implementation asks :func:`lookup` for the callable, so a device without a kernel runs the
reference and every backend is checked against the same reference by the property tests in
``tests/lowering``.

    register_op("jagged_attention", reference=fn, triton=None, ascend=None)
    lookup("jagged_attention", "cpu")   # -> fn (cuda -> triton, npu -> ascend, else reference)
    OPS                                 # name -> OpEntry

Ops (``torch.ops.grcompile.*``): ``jagged_attention`` (+ its ``jagged_attention_backward``),
``gated_norm``. Helpers: :mod:`.jagged` (packing), :mod:`.score_mod` (bias registry).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

# device type -> kernel slot; anything else runs the reference
_DEVICE_SLOT = {"cuda": "triton", "xpu": "triton", "npu": "ascend"}


@dataclass
class OpEntry:
    name: str
    reference: Callable
    triton: Optional[Callable] = None
    ascend: Optional[Callable] = None

    def kernel_for(self, device_type: str) -> Callable:
        slot = _DEVICE_SLOT.get(device_type)
        kernel = getattr(self, slot) if slot else None
        return kernel if kernel is not None else self.reference

    def backends(self) -> list[str]:
        return ["reference"] + [s for s in ("triton", "ascend") if getattr(self, s) is not None]


OPS: dict[str, OpEntry] = {}


def register_op(name: str, reference: Callable, triton: Optional[Callable] = None,
                ascend: Optional[Callable] = None) -> OpEntry:
    """Register (or update the kernels of) op ``name``. ``reference`` is required: it is the
    CPU implementation and the fallback of every device without a kernel."""
    if not callable(reference):
        raise TypeError(f"register_op({name!r}): reference must be callable, got {type(reference).__name__}")
    for slot, fn in (("triton", triton), ("ascend", ascend)):
        if fn is not None and not callable(fn):
            raise TypeError(f"register_op({name!r}): {slot} must be callable or None")
    entry = OPS.get(name)
    if entry is None:
        entry = OPS[name] = OpEntry(name, reference, triton, ascend)
    else:
        entry.reference = reference
        entry.triton = triton if triton is not None else entry.triton
        entry.ascend = ascend if ascend is not None else entry.ascend
    return entry


def lookup(name: str, device_type: str) -> Callable:
    """The implementation of op ``name`` for ``device_type`` ("cpu", "cuda", "npu", ...)."""
    try:
        entry = OPS[name]
    except KeyError:
        raise KeyError(f"grcompile.lowering: no op named {name!r}; registered: {sorted(OPS)}") from None
    return entry.kernel_for(device_type)


# Registering the ops (import order matters: the registry above must exist first).
from . import jagged, score_mod  # noqa: E402,F401
from .score_mod import get_score_mod, register_score_mod  # noqa: E402,F401
from .attention import (  # noqa: E402,F401
    fuxi_attention, hstu_attention, jagged_attention, jagged_softmax_attention)
from .norm import gated_norm  # noqa: E402,F401

__all__ = ["OPS", "OpEntry", "register_op", "lookup", "register_score_mod", "get_score_mod",
           "jagged_attention", "hstu_attention", "fuxi_attention", "jagged_softmax_attention",
           "gated_norm", "jagged", "score_mod"]
