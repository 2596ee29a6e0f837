"""The pass pipeline, in order.

``default_pipeline()`` is the jagged pipeline. Passes, one file each, in order:

* ``guard_indices`` — a ``check_index`` before every table lookup whose index range is not proved
  (an out-of-range id raises eager's IndexError, naming the input, the table and the line);
* ``detect_padding`` — validity mask and Token / Pair layouts (analysis, rewrites nothing);
* ``fuse_attention`` — dense masked attention → padding-free ``score_mod_attention`` with the
  user's bias math captured as a score_mod and the mask proved;
* ``jagged_rewrite`` — the row-wise block on ``[T, ...]`` values (one data-dependent pack, no
  recompiles), ``jagged_attention`` inside, scattered back where values leave the block;
* ``fuse_norm_gate`` — ``u ⊙ Norm(x)`` and the non-affine input norms → ``gated_norm``;
* ``fp8_linear`` (only with ``optimize(precision="fp8")``, appended last) — linears → FP8 GEMMs,
  the norm before and the residual after fused in.

``attention_pipeline()`` stops after the fusion; ``passes=[]`` lowers the captured graph unchanged.
Every pass is exact at valid positions or falls back with a reason (see docs/DESIGN.md).
"""
from __future__ import annotations

from .pass_manager import GraphPass

__all__ = ["PIPELINES", "attention_pipeline", "default_pipeline", "jagged_pipeline"]

def default_pipeline() -> list[GraphPass]:
    """A fresh list of the default passes (they keep no per-graph state)."""
    return jagged_pipeline()


def jagged_pipeline() -> list[GraphPass]:
    """Padding detection, fused attention, the whole row-wise block on jagged values, fused norms."""
    from .fuse_norm_gate import FuseNormGate
    from .jagged_rewrite import JaggedRewrite

    return [*attention_pipeline(), JaggedRewrite(), FuseNormGate()]


def attention_pipeline() -> list[GraphPass]:
    """Index guards, padding detection + fused padding-free attention (exact; opt in)."""
    from .detect_padding import DetectPadding
    from .fuse_attention import FuseAttention
    from .guard_indices import GuardIndices

    return [GuardIndices(), DetectPadding(), FuseAttention()]


PIPELINES = {"default": default_pipeline, "attention": attention_pipeline, "jagged": jagged_pipeline}
