"""Run-time check for fused softmax attentions whose mask reads per-token data other than the padding.

Matches what ``attention_capture.prove`` leaves open in ``Capture.unknown_own_key``: a softmax
attention whose mask also reads an extra per-token input (an ``attention_mask`` or ``keep``
tensor beside the ids, a learned per-position value) that the proof cannot evaluate. Where such a
mask hides every key of a valid query, eager's softmax spreads over all ``N`` positions (every
logit equally masked) or gives NaN; the fused op skips padded and later keys and cannot do either.
Where each valid query keeps its own key, there is at least one unmasked key and the two agree.

Emits a small graph over the captured graph's inputs that recomputes the validity, the side values
and the tables (cheap, deterministic ops only: ``exit_checks.recompute_before``) and evaluates the
captured score_mod on every token's own (query, key) pair, with a zero score (the proof's stand-in
for a finite ``q·k``): True when each valid token's logit is finite and above the masked
threshold. O(B·N·H) work, no activation. The backend runs the optimized graph where it holds and
the graph as captured where it does not (``capture/guarded.py``), and reports that call.

Invariant: a call that runs optimized has, for every valid query, its own key unmasked.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from ..lowering.score_mod import get_score_mod
from .attention_capture import MASKED_LOGIT
from .exit_checks import recompute_before

__all__ = ["build_own_key_check", "own_keys_kept"]


def own_keys_kept(valid: torch.Tensor, q_sides: list[torch.Tensor], k_sides: list[torch.Tensor],
                  tables: list[torch.Tensor], key: str, heads: int) -> bool:
    """Every valid token's score_mod on its own pair (zero score; ``[B, N]`` sides) is a finite
    logit above ``MASKED_LOGIT``, for every head."""
    B, N = valid.shape
    tokens = B * N
    if tokens == 0:
        return True
    pos = torch.arange(N, device=valid.device).expand(B, N).reshape(tokens, 1, 1, 1)
    qs = tuple(s.reshape(tokens, 1, 1, 1) for s in q_sides)
    ks = tuple(s.reshape(tokens, 1, 1, 1) for s in k_sides)
    logit = get_score_mod(key)(torch.zeros(()), pos, pos, qs, ks, tuple(tables), heads=heads)
    logit = torch.as_tensor(logit).broadcast_to(tokens, heads, 1, 1).reshape(tokens, heads)
    kept = (torch.isfinite(logit) & (logit > MASKED_LOGIT)).all(dim=1)
    return bool((kept | ~valid.reshape(-1).bool()).all())


def build_own_key_check(gm: fx.GraphModule, valid: fx.Node, negate: bool, starts: list[fx.Node],
                        operands: Callable[[fx.Graph, Callable[[fx.Node], fx.Node], fx.Node],
                                           tuple[list[fx.Node], list[fx.Node], list[fx.Node]]],
                        key: str, heads: int, writes_to: dict) -> fx.GraphModule | str:
    """A graph over ``gm``'s inputs returning ``own_keys_kept`` for this call, or why none can be
    built (a sentence). ``valid``: the validity (``negate``: a padding mask); ``starts``: the side
    values and tables the check reads; ``operands(g, env, valid)`` emits the op's dense sides and
    table inputs in ``g`` from copied nodes (``env``), as the fused op receives them."""
    copied = recompute_before(gm, [valid, *starts], None, writes_to)
    if isinstance(copied, str):
        return copied
    g, env = copied
    ok = env[valid] if not negate else g.call_function(torch.logical_not, (env[valid],))
    q_sides, k_sides, tables = operands(g, env.__getitem__, ok)
    g.output(g.call_function(own_keys_kept, (ok, q_sides, k_sides, tables, key, heads)))
    return fx.GraphModule(gm, g, class_name="OwnKeyCheck")
