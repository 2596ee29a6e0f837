"""The three models' attentions as calls of ``grcompile::jagged_attention`` on jagged values: how
the property tests call the op (the passes emit the op directly, with a captured score_mod).

Known: ``hstu_attention`` / ``fuxi_attention`` pass HSTU's ``1 / N`` as the option ``out_scale``,
so every distinct ``N`` is an option set the compiled chunk compiles again (docs/lowering.md).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from grcompile.lowering.score_mod import hstu_rab_key, relative_position_bias_key, relative_time_bias_key


def hstu_attention(q, k, v, offsets, positions, *, N: int, query_timestamps=None, timestamps=None,
                   position_table=None, time_table=None, table_max_len: Optional[int] = None,
                   num_buckets: int = 128, causal: bool = True, dropout_p: float = 0.0,
                   seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """HSTU: ``silu(q·kᵀ + rab) / N`` under the causal mask, ``rab`` = relative position table
    (``[2·table_max_len − 1]``) + log time-bucket table (``[num_buckets + 1]``, query side
    ``query_timestamps`` = the next valid timestamp, key side ``timestamps``), either optional;
    ``dropout_p`` > 0 drops attention weights with the mask hashed from ``seed``."""
    table_max_len = N if table_max_len is None else table_max_len
    tables, q_side, k_side = [], [], []
    if time_table is not None:
        q_side, k_side = [query_timestamps], [timestamps]
    if position_table is not None and time_table is not None:
        key, tables = hstu_rab_key(table_max_len, num_buckets), [position_table, time_table]
    elif position_table is not None:
        key, tables = relative_position_bias_key(table_max_len), [position_table]
    elif time_table is not None:
        key, tables = relative_time_bias_key(num_buckets), [time_table]
    else:
        key = ""
    return torch.ops.grcompile.jagged_attention(
        q, k, v, offsets, positions, q_side, k_side, tables, seed, score_mod=key, use_qk=True, activation="silu",
        scale=1.0, out_scale=1.0 / N, causal=causal, max_len=N, dropout_p=dropout_p)


def fuxi_attention(q, k, v, offsets, positions, *, N: int, query_timestamps, timestamps, position_table,
                   time_table, table_max_len: Optional[int] = None, num_buckets: int = 128,
                   causal: bool = True) -> torch.Tensor:
    """FuXi-α's three channels ``[positional, temporal, semantic]`` concatenated on the last dim:
    ``pos_table[j − i] @ v``, ``time_table[bucket] @ v``, ``silu(q·kᵀ)/N @ v``, all causal."""
    table_max_len = N if table_max_len is None else table_max_len
    common = dict(causal=causal, max_len=N)
    positional = torch.ops.grcompile.jagged_attention(
        q, k, v, offsets, positions, [], [], [position_table], None,
        score_mod=relative_position_bias_key(table_max_len),
        use_qk=False, activation="identity", scale=1.0, out_scale=1.0, **common)
    temporal = torch.ops.grcompile.jagged_attention(
        q, k, v, offsets, positions, [query_timestamps], [timestamps], [time_table], None,
        score_mod=relative_time_bias_key(num_buckets), use_qk=False, activation="identity", scale=1.0,
        out_scale=1.0, **common)
    semantic = torch.ops.grcompile.jagged_attention(
        q, k, v, offsets, positions, [], [], [], None, score_mod="", use_qk=True, activation="silu", scale=1.0,
        out_scale=1.0 / N, **common)
    return torch.cat([positional, temporal, semantic], dim=-1)


def jagged_softmax_attention(q, k, v, offsets, positions, *, N: int, scale: Optional[float] = None,
                             causal: bool = True, dropout_p: float = 0.0,
                             seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SASRec: ``softmax(q·kᵀ · scale)`` over the allowed keys, ``scale`` = 1/sqrt(dqk) by default;
    ``dropout_p`` > 0 drops attention weights after the softmax (mask hashed from ``seed``)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.grcompile.jagged_attention(
        q, k, v, offsets, positions, [], [], [], seed, score_mod="", use_qk=True, activation="softmax",
        scale=scale, out_scale=1.0, causal=causal, max_len=N, dropout_p=dropout_p)
