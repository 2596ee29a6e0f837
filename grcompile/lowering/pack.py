"""``grcompile::pack_index(valid [B, N]) -> [T]``: flat indices ``b·N + n`` of the valid tokens.

The one data-dependent step of the jagged rewrite. As an opaque op whose fake implementation
allocates an unbacked size, the compiled graph keeps running on ``[T, ...]`` values for any
length mix without recompiling; everything else (gather with the index, scatter back, offsets,
positions) is ordinary traceable torch.
"""
from __future__ import annotations

import torch

from . import lookup, register_op


def _pack_index_reference(valid: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(valid.reshape(-1)).reshape(-1)


# no kernel slots: torch.nonzero is the device's own compaction on every backend
register_op("pack_index", reference=_pack_index_reference)


@torch.library.custom_op("grcompile::pack_index", mutates_args=())
def pack_index(valid: torch.Tensor) -> torch.Tensor:
    if valid.dtype != torch.bool or valid.dim() != 2:
        raise ValueError(f"pack_index: valid must be a bool [B, N] mask, got {valid.dtype} {tuple(valid.shape)}")
    return lookup("pack_index", valid.device.type)(valid)


@pack_index.register_fake
def _(valid):
    ctx = torch.library.get_ctx()
    n = valid.numel()
    if isinstance(n, int):
        T = ctx.new_dynamic_size(max=n)
    else:  # symbolic B or N: the bound is an expression, which new_dynamic_size cannot take
        T = ctx.new_dynamic_size()
        torch._check(T <= n)
    return valid.new_empty(T, dtype=torch.int64)


PACK_INDEX = torch.ops.grcompile.pack_index.default  # what the jagged rewrite emits

__all__ = ["pack_index", "PACK_INDEX"]
