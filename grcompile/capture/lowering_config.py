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

``reorder_for_peak_memory=False`` — inductor's scheduler reorder that keeps the cheapest of
three topological orders by *estimated* peak memory (``torch/_inductor/memory.py``). The estimate
sizes every buffer whose shape has an unbacked symbol at 0 bytes (``get_dep_size_hint``,
``optimization_hint(fallback=0)``), and every jagged tensor has one (the token count comes from
``pack_index``): it sees only the few static buffers (the loss's ``[B, N-1, 1+negatives]``,
weight gradients) and picks an order for a few KB of those. With ``remat`` that order hoisted
every block's recomputed norm → ``uvqk`` → split to the start of the backward, all alive at once:
the backward's live tensors went *up* (HSTU small, N = 512, B = 8: 250 MB vs 192 MB without
remat); kept in the partitioner's order: 130 MB (156 MB without remat).

``post_grad_custom_post_pass`` — a pass that changes nothing, there for its ``uuid()``: a hash of
grcompile's op layer (``grcompile/lowering/**.py``). Inductor's FX-graph cache and AOTAutograd's
cache key a compiled graph by the graph and the config, but a grcompile op's *autograd formula*
(Python, traced into the backward at compile time) is in neither: after an upgrade that changes
one, a cache on disk handed back the old backward — silently wrong gradients (it happened here:
the FP8 weight gradient of a changed formula came back as the old one under inductor, not under
the eager lowering). With the op layer's hash in the key, changed ops miss the cache.

A post-grad pass the user configured (``torch._inductor.config.post_grad_custom_post_pass``, when
grcompile compiles) is kept, not replaced: :func:`inductor_config` hands inductor the list
``[user's pass(es)..., OpsVersion]``, which inductor runs in order and keys by every pass's uuid
(``FxGraphHashDetails._get_custom_pass_detail``); a user pass without a uuid (a plain callable, or
``uuid()`` None) makes inductor and AOTAutograd bypass their caches for that graph, exactly as
without grcompile (``FxGraphCache._check_custom_passes``).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch._inductor.config as inductor_settings
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

try:
    from torch._inductor.custom_graph_pass import get_custom_graph_passes
    _PASS_LISTS = True
except ImportError:  # torch < 2.12 (GPU images carry older torch): one custom pass, no lists
    _PASS_LISTS = False

    def get_custom_graph_passes(custom_pass: Any) -> tuple:
        return () if custom_pass is None else tuple(custom_pass) if isinstance(custom_pass, (list, tuple)) \
            else (custom_pass,)

__all__ = ["INDUCTOR_CONFIG", "OpsVersion", "inductor_config"]


@lru_cache(1)
def _op_layer_sources() -> tuple[str, ...]:
    from .. import lowering

    return tuple(sorted(str(p) for p in Path(lowering.__file__).parent.rglob("*.py")))


class OpsVersion(CustomGraphPass):
    """A post-grad pass that leaves the graph as it is; its ``uuid`` (the op layer's source hash)
    keys inductor's and AOTAutograd's caches (module docstring)."""

    def __call__(self, graph: fx.Graph) -> None:
        return None

    def uuid(self) -> bytes:
        return get_hash_for_files(_op_layer_sources(), extra="grcompile op layer")


class _Chained(CustomGraphPass):
    """Several post-grad passes as one, for a torch that takes a single pass: each runs in order,
    the cache key combines their uuids."""

    def __init__(self, passes: tuple) -> None:
        self.passes = passes

    def __call__(self, graph: fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> bytes:
        parts = [p.uuid() if hasattr(p, "uuid") else None for p in self.passes]
        if any(u is None for u in parts):
            return None  # a pass without a uuid: no cache key (inductor then does not cache)
        return repr([u if isinstance(u, (bytes, str)) else str(u) for u in parts]).encode()


INDUCTOR_CONFIG: dict[str, Any] = {
    "pattern_matcher": False,
    "reorder_for_peak_memory": False,
    "post_grad_custom_post_pass": OpsVersion(),
}


def inductor_config() -> dict[str, Any]:
    """:data:`INDUCTOR_CONFIG` for a compile that starts now: if a ``post_grad_custom_post_pass``
    is configured (by the user, in ``torch._inductor.config`` or a ``config.patch`` around the
    call), it runs first and :class:`OpsVersion` after it, in one list whose cache key combines
    their uuids (module docstring); otherwise OpsVersion alone."""
    ours = INDUCTOR_CONFIG["post_grad_custom_post_pass"]
    # an OpsVersion already configured is grcompile's own (a compile nested in one of ours): not twice
    users = [p for p in get_custom_graph_passes(inductor_settings.post_grad_custom_post_pass)
             if not isinstance(p, OpsVersion)]
    if users and not _PASS_LISTS:  # this torch takes one pass: theirs and ours chained in one
        return {**INDUCTOR_CONFIG, "post_grad_custom_post_pass": _Chained((*users, ours))}
    return {**INDUCTOR_CONFIG, "post_grad_custom_post_pass": [*users, ours] if users else ours}
