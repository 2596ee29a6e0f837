"""The pass pipeline, in order.

``DEFAULT_PIPELINE`` is empty for now: grcompile captures, dumps and lowers the graph unchanged.
The passes of the next issues register here, one file per pass, in the order they must run
(padding detection -> jagged rewrite -> fused attention + relative bias -> norm fusion -> ...),
each a ``grcompile.capture.GraphPass`` whose docstring says what it matches, what it emits and
which invariant it keeps.
"""
from __future__ import annotations

from ..capture.pass_manager import GraphPass

__all__ = ["DEFAULT_PIPELINE", "default_pipeline"]

DEFAULT_PIPELINE: list[GraphPass] = []


def default_pipeline() -> list[GraphPass]:
    """A fresh list (the pass objects are shared: passes keep no per-graph state)."""
    return list(DEFAULT_PIPELINE)
