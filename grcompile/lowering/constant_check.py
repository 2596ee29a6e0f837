"""``grcompile::check_unchanged(x, digest, what) -> x'``: raise when a tensor a pass proved
something about at compile time (a mask kept in a buffer, say) has another value at run time.

``fuse_attention`` evaluates per-pair masks built from buffers or tensor attributes (a minGPT-style
``tril`` buffer) at compile time to prove causality and that padded keys are masked; Dynamo does
not guard on tensor values, so the compiled graph checks the value on every call against the
digest of the proved one (one pass over an ``[N, N]`` tensor; the digest is a string argument, so
the graph holds no extra constant) and feeds the fused op through this check, which returns a
copy (a custom op's output may not alias its input).
"""
from __future__ import annotations

import hashlib

import torch

__all__ = ["check_unchanged", "CHECK_UNCHANGED", "digest"]


def digest(t: torch.Tensor) -> str:
    """A content digest of ``t`` (dtype, shape and bytes)."""
    t = t.detach().contiguous().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    head = f"{t.dtype};{tuple(t.shape)};".encode()
    return hashlib.sha256(head + t.numpy().tobytes()).hexdigest()


@torch.library.custom_op("grcompile::check_unchanged", mutates_args=())
def check_unchanged(x: torch.Tensor, expected: str, what: str) -> torch.Tensor:
    if digest(x) != expected:
        raise RuntimeError(f"{what} changed after grcompile compiled the attention that reads it (its value "
                           f"was proved at compile time); call torch._dynamo.reset() and optimize the model again")
    return x.clone()


@check_unchanged.register_fake
def _(x, expected, what):
    return torch.empty_like(x)


CHECK_UNCHANGED = torch.ops.grcompile.check_unchanged.default
