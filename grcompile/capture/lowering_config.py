"""The inductor settings grcompile's own lowering runs under (and only it: they are handed to
``compile_fx(..., config_patches=INDUCTOR_CONFIG)``, which applies them to this compile and to
its lazily compiled backward, and leaves ``torch._inductor.config`` as it found it, so a plain
``torch.compile`` elsewhere in the process is unaffected).

Why each entry (details and the full audit of what stays on: docs/lowering.md):

``pattern_matcher=False`` — inductor's graph pattern rewrites (pre-grad, joint-graph and
post-grad ``PatternMatcherPass`` es) are off. The one that forced this is the scaled-dot-product
attention family (``torch/_inductor/fx_passes/fuse_attention.py``, ``_sfdp_pattern_1..30``,
registered in ``joint_graph.patterns``): the serialized patterns match the decomposed softmax
with its reduction dim ``Ignored()``, so ``softmax(q @ k^T, dim=-2) @ v`` is rewritten into
``scaled_dot_product_attention`` (a softmax over the last axis) and returns wrong values
(tests/compiler/test_lowering_safety.py). torch 2.13 has no switch for those patterns alone;
``pattern_matcher`` is the narrowest one. grcompile fuses attention itself (``fuse_attention``,
which proves the softmax axis and the mask), so nothing it relies on is lost; the other rewrites
behind the switch are peepholes (views, casts, mm/addmm forms) whose speed matters little next
to grcompile's fused ops, and without them the lowering performs only decompositions, fusion
and codegen, never a rewrite it has not proven.
"""
from __future__ import annotations

from typing import Any

__all__ = ["INDUCTOR_CONFIG"]

INDUCTOR_CONFIG: dict[str, Any] = {
    "pattern_matcher": False,
}
