"""Jagged (padding-free) layout helpers, in plain differentiable torch with no Python loop over
rows, so that Dynamo / Inductor trace them as ordinary graph code.

Layout: a padded ``[B, N, *F]`` tensor with a boolean validity mask ``valid [B, N]`` (any
pattern: right padding, left padding, holes) is stored as *values* ``[T, *F]``, the valid
positions in row-major order, addressed by ``valid_index [T]`` (the flat index ``b·N + n`` of each
value) or by ``offsets [B + 1]`` (row ``b`` owns values ``offsets[b]:offsets[b+1]``).

Two position notions coexist and both stay available:

* the *padded* position ``n = valid_index % N`` (:func:`padded_positions`): what user code that
  indexes ``arange(N)`` means (relative position bias, causal masks in padded coordinates);
* the *jagged* position ``t − offsets[row]`` (:func:`positions_in_row`): the index among the row's
  valid items. The two agree for right padding only.
"""
from __future__ import annotations

import torch


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` lengths -> ``[B + 1]`` int64 offsets (0, l0, l0 + l1, ...)."""
    if lengths.dim() != 1:
        raise ValueError(f"lengths_to_offsets: lengths must be 1-D [B], got shape {tuple(lengths.shape)}")
    lengths = lengths.to(torch.int64)
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def valid_lengths(valid: torch.Tensor) -> torch.Tensor:
    """``valid [B, N]`` bool -> ``[B]`` int64 number of valid positions per row (any other dtype:
    its nonzero entries, as :func:`jagged_index` packs them)."""
    return (valid if valid.dtype == torch.bool else valid != 0).sum(dim=1, dtype=torch.int64)


def valid_to_offsets(valid: torch.Tensor) -> torch.Tensor:
    """``valid [B, N]`` bool -> ``[B + 1]`` int64 offsets of the row-major packed values."""
    return lengths_to_offsets(valid_lengths(valid))


def jagged_index(valid: torch.Tensor) -> torch.Tensor:
    """``valid [B, N]`` bool -> ``[T]`` int64 flat indices ``b·N + n`` of the valid positions,
    row-major (so the values of row ``b`` are contiguous and in increasing ``n``).

    The output size is data-dependent (a ``nonzero``)."""
    if valid.dim() != 2:
        raise ValueError(f"jagged_index: valid must be [B, N], got shape {tuple(valid.shape)}")
    if valid.dtype != torch.bool:
        valid = valid != 0
    return torch.nonzero(valid.reshape(-1)).reshape(-1)


def dense_to_jagged(x: torch.Tensor, valid_index: torch.Tensor) -> torch.Tensor:
    """``x [B, N, *F]`` -> values ``[T, *F]`` at ``valid_index`` (from :func:`jagged_index`)."""
    if x.dim() < 2:
        raise ValueError(f"dense_to_jagged: x must be [B, N, *F], got shape {tuple(x.shape)}")
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).index_select(0, valid_index)


def jagged_to_dense(values: torch.Tensor, valid_index: torch.Tensor, B: int, N: int,
                    padding_value: float = 0.0) -> torch.Tensor:
    """values ``[T, *F]`` -> ``[B, N, *F]`` with ``padding_value`` at the invalid positions."""
    if values.dim() < 1 or values.shape[0] != valid_index.shape[0]:
        raise ValueError(f"jagged_to_dense: values {tuple(values.shape)} and valid_index "
                         f"{tuple(valid_index.shape)} disagree on T")
    flat = values.new_full((B * N, *values.shape[1:]), padding_value)
    return flat.index_copy(0, valid_index.long(), values).reshape(B, N, *values.shape[1:])


def padded_positions(valid_index: torch.Tensor, N: int) -> torch.Tensor:
    """``[T]`` padded-row coordinate ``n`` of each value."""
    return torch.remainder(valid_index, N)


def row_of(offsets: torch.Tensor, T: int) -> torch.Tensor:
    """``[T]`` int64 row of each value (empty rows own nothing)."""
    tokens = torch.arange(T, device=offsets.device, dtype=offsets.dtype)
    # the last b with offsets[b] <= t: with empty rows, repeated offsets resolve to the later row,
    # which is the non-empty one holding t
    return torch.searchsorted(offsets, tokens, right=True) - 1


def positions_in_row(offsets: torch.Tensor, T: int) -> torch.Tensor:
    """``[T]`` int64 jagged position of each value: its index among its row's valid values."""
    offsets = offsets.long()
    tokens = torch.arange(T, device=offsets.device, dtype=offsets.dtype)
    return tokens - offsets.index_select(0, row_of(offsets, T))


def segment_softmax(values: torch.Tensor, rows: torch.Tensor, B: int, log: bool = False) -> torch.Tensor:
    """Softmax of ``values [T, *F]`` over the values of each row (``rows [T]``), per feature: the
    padded ``softmax(x, dim=seq)`` when the padded logits are masked out (−inf). A row whose
    values are all −inf gives NaN, as the dense softmax does. Half-precision values are
    normalised in float32 (as torch's softmax accumulates them) and returned in their dtype."""
    out_dtype = values.dtype
    if out_dtype in (torch.float16, torch.bfloat16):
        values = values.float()
    shape = (B, *values.shape[1:])
    idx = rows.reshape(-1, *[1] * (values.dim() - 1)).expand_as(values)
    # the shift only guards exp() against overflow; the result does not depend on it
    top = values.new_full(shape, float("-inf")).scatter_reduce(0, idx, values.detach(), "amax", include_self=True)
    shifted = values - top.index_select(0, rows)
    e = shifted.exp()
    total = values.new_zeros(shape).index_add(0, rows, e).index_select(0, rows)
    return (shifted - total.log() if log else e / total).to(out_dtype)


def pack(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Convenience: ``(values, valid_index, offsets)`` of ``x [B, N, *F]`` under ``valid``."""
    index = jagged_index(valid)
    return dense_to_jagged(x, index), index, valid_to_offsets(valid)


__all__ = ["lengths_to_offsets", "valid_lengths", "valid_to_offsets", "jagged_index", "dense_to_jagged",
           "jagged_to_dense", "padded_positions", "row_of", "positions_in_row", "pack", "segment_softmax"]
