"""Checks of ``grcompile::jagged_attention``'s arguments, shared by the op's fake implementation,
the reference and the kernels: shapes, dtypes and devices (valid on fake tensors too), then the
data checks a real call adds (offsets, positions)."""
from __future__ import annotations

from typing import Optional

import torch

from ..score_mod import get_score_mod

ACTIVATIONS = ("silu", "softmax", "identity")

_OP = "grcompile::jagged_attention"


def _fail(msg: str) -> None:
    raise ValueError(f"{_OP}: {msg}")


def _check_meta(q, k, v, offsets, positions, q_side, k_side, tables, score_mod, activation, max_len) -> None:
    """Shape / dtype / device checks (valid on fake tensors too)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            _fail(f"{name} must be [T, H, d] (rank 3), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            _fail(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.shape[0] != k.shape[0] or q.shape[0] != v.shape[0]:
        _fail(f"q, k, v must have the same number of tokens T, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if q.shape[1] != k.shape[1] or q.shape[1] != v.shape[1]:
        _fail(f"q, k, v must have the same number of heads H, got {q.shape[1]}, {k.shape[1]}, {v.shape[1]}")
    if q.shape[2] != k.shape[2]:
        _fail(f"q and k must have the same head width dqk, got {q.shape[2]} and {k.shape[2]}")
    if offsets.dim() != 1 or offsets.shape[0] < 1:
        _fail(f"offsets must be 1-D [B + 1] with B >= 0, got shape {tuple(offsets.shape)}")
    if offsets.dtype != torch.int64:
        _fail(f"offsets must be int64, got {offsets.dtype}")
    if positions.dim() != 1 or positions.shape[0] != q.shape[0]:
        _fail(f"positions must be 1-D [T] with T = {q.shape[0]}, got shape {tuple(positions.shape)}")
    if positions.dtype != torch.int64:
        _fail(f"positions must be int64, got {positions.dtype}")
    for group, tensors in (("q_side", q_side), ("k_side", k_side)):
        for i, t in enumerate(tensors):
            if t.dim() != 1 or t.shape[0] != q.shape[0]:
                _fail(f"{group}[{i}] must be 1-D [T] with T = {q.shape[0]}, got shape {tuple(t.shape)}")
    for group, tensors in (("k", [k]), ("v", [v]), ("offsets", [offsets]), ("positions", [positions]),
                           ("q_side", q_side), ("k_side", k_side), ("tables", tables)):
        for t in tensors:
            if t.device != q.device:
                _fail(f"{group} is on {t.device} but q is on {q.device}")
    if activation not in ACTIVATIONS:
        _fail(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if max_len < 1:
        _fail(f"max_len must be >= 1, got {max_len}")
    if score_mod:
        get_score_mod(score_mod)  # raises a KeyError naming the key


def _check_dropout(seed: Optional[torch.Tensor], dropout_p: float, device: torch.device) -> None:
    if not 0.0 <= dropout_p < 1.0:
        _fail(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and seed is None:
        _fail("dropout_p > 0 needs a seed (an int64 tensor of one element)")
    if seed is not None:
        if seed.dtype != torch.int64 or seed.numel() != 1:
            _fail(f"seed must be an int64 tensor of one element, got {seed.dtype} {tuple(seed.shape)}")
        if seed.device != device:
            _fail(f"seed is on {seed.device} but q is on {device}")


def _check_values(offsets: torch.Tensor, positions: torch.Tensor, T: int, max_len: int) -> list[int]:
    """Data checks (real tensors only); returns the offsets as a list."""
    offs = offsets.tolist()
    if offs[0] != 0:
        _fail(f"offsets must start at 0, got offsets[0] = {offs[0]}")
    if offs[-1] != T:
        _fail(f"offsets must end at T = {T} (the number of tokens of q), got offsets[-1] = {offs[-1]}")
    lengths = [b - a for a, b in zip(offs[:-1], offs[1:])]
    if lengths and min(lengths) < 0:
        row = min(range(len(lengths)), key=lengths.__getitem__)
        _fail(f"offsets must be non-decreasing, but offsets[{row + 1}] = {offs[row + 1]} < offsets[{row}] = {offs[row]}")
    if lengths and max(lengths) > max_len:
        row = max(range(len(lengths)), key=lengths.__getitem__)
        _fail(f"row {row} has length {lengths[row]} > max_len = {max_len}")
    if T:
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= max_len:
            _fail(f"positions must lie in [0, max_len = {max_len}), got values in [{lo}, {hi}]")
        if T > 1:
            starts = offsets[1:-1]
            same_row = torch.ones(T - 1, dtype=torch.bool, device=positions.device)
            inner = starts[(starts > 0) & (starts < T)]
            same_row[inner - 1] = False  # token t and t + 1 straddle a row start
            if bool(((positions[1:] <= positions[:-1]) & same_row).any()):
                _fail("positions must increase strictly within each row (padded-row coordinates "
                      "of a row-major packing)")
    return offs
