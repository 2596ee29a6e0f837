"""The pass pipeline, in order.

``DEFAULT_PIPELINE`` is still empty: until the jagged rewrite lands, grcompile lowers the captured
graph unchanged (and says so). Passes that exist today, one file each:

* ``detect_padding`` — validity mask and Token / Pair layouts (analysis, rewrites nothing);
* ``fuse_attention`` — dense masked attention → padding-free ``score_mod_attention`` with the
  user's bias math captured as a score_mod and the mask proved;
* ``jagged_rewrite`` — the row-wise block on ``[T, ...]`` values (one data-dependent pack, no
  recompiles), ``jagged_attention`` inside, scattered back where values leave the block.

``attention_pipeline()`` / ``jagged_pipeline()`` run them (opt in:
``grcompile.optimize(m, passes=jagged_pipeline())``);
they join the default once the jagged rewrite makes the whole block padding-free and the benchmark
shows the win (see docs/DESIGN.md, "Compiler core").
"""
from __future__ import annotations

from ..capture.pass_manager import GraphPass

__all__ = ["DEFAULT_PIPELINE", "PIPELINES", "attention_pipeline", "default_pipeline", "jagged_pipeline"]

DEFAULT_PIPELINE: list[GraphPass] = []


def default_pipeline() -> list[GraphPass]:
    """A fresh list (the pass objects are shared: passes keep no per-graph state)."""
    return list(DEFAULT_PIPELINE)


def jagged_pipeline() -> list[GraphPass]:
    """Padding detection, fused attention, then the whole row-wise block on jagged values."""
    from .jagged_rewrite import JaggedRewrite

    return [*attention_pipeline(), JaggedRewrite()]


def attention_pipeline() -> list[GraphPass]:
    """Padding detection + fused padding-free attention (exact; opt in)."""
    from .detect_padding import DetectPadding
    from .fuse_attention import FuseAttention

    return [DetectPadding(), FuseAttention()]


PIPELINES = {"default": default_pipeline, "attention": attention_pipeline, "jagged": jagged_pipeline}
