"""Whether a score_mod's integer arithmetic may overflow on a call's inputs — for the CPU
reference, which then runs its chunks uncompiled.

Eager PyTorch wraps an integer result that leaves its dtype (two's complement), and so do the
Triton kernels. The reference's inductor-compiled chunks (:mod:`.chunks`) are C++, where signed
overflow is undefined: the compiler may compute the unwrapped value (``(ts.int() + 1) > 0`` at
``ts = 2**31 - 1`` is true there, false in eager), and the optimized model would silently differ
from the user's. So each call proves, from its positions (``[0, max_len)``), heads and the exact
bounds of its integer sides (:func:`.side_ranges.integer_side_bounds`), that no integer node of the
score_mod leaves its dtype (:func:`..score_mod_ranges.may_wrap`). Where that fails — the
arithmetic may overflow, or the score_mod cannot be analysed — the call runs the eager chunk:
the values of the user's model, slower; a warning says so once per score_mod.

Bounds are rounded out to powers of two before the proof, so a few proofs per score_mod are
cached, not one per batch. A score_mod without integer arithmetic is not measured at all.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import torch

from ..score_mod import get_score_mod, live_state
from ..score_mod_codegen import Unsupported, graph_with_metas
from ..score_mod_ranges import Interval, _op_name, may_wrap, propagate
from ..source_site import node_site
from .side_ranges import INTEGER_DTYPES, integer_side_bounds, value_bounds
from .validation import _OP

_STATIC: dict[tuple, Any] = {}  # (score_mod, its live state, side dtypes, tables) -> (graph, metas) | reason it cannot be analysed
_PROOFS: dict[tuple, Optional[str]] = {}  # ... + rounded input bounds -> why it may overflow, or None
_WARNED: set[str] = set()


def _rounded_out(lo: int, hi: int) -> Interval:
    """``[lo, hi]`` widened to bounds of the form ``±2^k`` / ``2^k - 1`` (still inside any integer
    dtype that holds ``lo`` and ``hi``)."""
    lo_r = -(1 << (-lo - 1).bit_length()) if lo < 0 else (1 << (lo.bit_length() - 1) if lo > 0 else 0)
    hi_r = (1 << hi.bit_length()) - 1 if hi >= 0 else -(1 << ((-hi).bit_length() - 1))
    return lo_r, hi_r


def _static(key: tuple, score_mod: str, q_side: Sequence[torch.Tensor], k_side: Sequence[torch.Tensor],
            tables: Sequence[torch.Tensor]) -> Any:
    if key not in _STATIC:
        try:
            gm, metas = graph_with_metas(get_score_mod(score_mod), q_side, k_side, tables)
        except Unsupported as why:
            _STATIC[key] = f"it cannot be analysed for integer overflow ({why})"
        else:
            # with nothing proven, every integer op that could overflow is listed: none, no proof needed
            _STATIC[key] = (gm, metas) if may_wrap(gm, metas, {}) else None
    return _STATIC[key]


def overflow_reason(score_mod: str, q_side: Sequence[torch.Tensor], k_side: Sequence[torch.Tensor],
                    tables: Sequence[torch.Tensor], *, max_len: int, heads: int) -> Optional[str]:
    """Why this call's score_mod may compute an integer that leaves its dtype (a sentence naming the
    op and the user's line), or None when it provably does not."""
    if not score_mod:
        return None
    static_key = (score_mod, live_state(score_mod), tuple(t.dtype for t in q_side), tuple(t.dtype for t in k_side),
                  tuple((tuple(t.shape), t.dtype) for t in tables))
    static = _static(static_key, score_mod, q_side, k_side, tables)
    if static is None or isinstance(static, str):
        return static
    gm, metas = static
    sides = [*q_side, *k_side]
    # an empty side has no value to overflow with: any interval holds
    bounds = tuple(_rounded_out(*b) if b is not None else (0, 0) if t.numel() == 0 else None
                   for t, b in zip(sides, integer_side_bounds(q_side, k_side)))
    numbers = [i for i, t in enumerate(tables) if t.dim() == 0 and t.dtype in INTEGER_DTYPES]  # 0-d tables used as numbers
    table_bounds = dict(zip(numbers, (_rounded_out(*b) for b in value_bounds([tables[i] for i in numbers])))) \
        if numbers else {}
    given = (_rounded_out(0, max(max_len - 1, 0)), (0, max(heads - 1, 0)))
    key = (*static_key, bounds, tuple(sorted(table_bounds.items())), given)
    if key not in _PROOFS:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        head = get_score_mod(score_mod).head
        inputs = {placeholders[1]: given[0], placeholders[2]: given[0]}
        if head:
            inputs[placeholders[3]] = given[1]
        side_nodes = placeholders[3 + head:3 + head + len(bounds)]
        inputs.update({node: b for node, b in zip(side_nodes, bounds) if b is not None})
        table_nodes = placeholders[3 + head + len(bounds):]
        inputs.update({table_nodes[i]: b for i, b in table_bounds.items()})
        wraps = may_wrap(gm, metas, propagate(gm, metas, inputs))
        _PROOFS[key] = None if not wraps else (
            f"its integer `{_op_name(wraps[0])}` ({node_site(wraps[0])}) may overflow "
            f"{str(metas[wraps[0]].dtype).removeprefix('torch.')} on these inputs")
    return _PROOFS[key]


def warn_uncompiled(score_mod: str, reason: str) -> None:
    """Say once per score_mod that the reference runs it uncompiled, and why."""
    if score_mod not in _WARNED:
        _WARNED.add(score_mod)
        warnings.warn(f"{_OP}: score_mod {score_mod!r}: {reason}; the CPU reference runs it uncompiled, wrapping "
                      "around as eager PyTorch does (inductor's C++ need not): same values as your model, slower",
                      stacklevel=4)


__all__ = ["overflow_reason", "warn_uncompiled"]
