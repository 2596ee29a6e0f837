"""What an op of this library means to the passes, declared by the op when it registers.

The passes match nodes on a canonical name (``passes/op_semantics.canonical``), whatever spelling
the user's code used. Torch's own ops get theirs in ``op_semantics``; a custom op declares its
name here, beside its schema, so neither this layer nor the runtime imports the passes:

    declare("embedding", torch.ops.grcompile.sparse_lookup.default)   # at registration
    declared(target) -> "embedding" | None                              # what op_semantics reads

Only the names in ``MEANINGS`` can be declared: each is a contract the passes rely on.

An op whose implementation acts outside the graph (a runtime's collectives and state) but whose
schema is functional declares that too — ``declare_effects(op)`` / ``has_effects(target)`` — so
that nothing runs it more often than the user's code does (rematerialisation must save its
output, never recompute it).
"""
from __future__ import annotations

from typing import Any, Optional

MEANINGS = {
    "embedding": "op(ids, ...) -> [*ids.shape, D], row-wise in the ids: layout and the jagged rewrite "
                 "treat it as F.embedding (ids first)",
    "fused_attention": "score_mod_attention(q, k, v, valid, ...) -> [B, N, H, dv] like v, zero at padding: "
                       "the attention fuse_attention emits, which the jagged rewrite runs on packed values",
}

_DECLARED: dict[Any, str] = {}


def declare(meaning: str, *targets: Any) -> None:
    """Declare that ``targets`` (op overloads or packets) have the canonical name ``meaning``."""
    if meaning not in MEANINGS:
        raise ValueError(f"declare: unknown meaning {meaning!r}; one of {sorted(MEANINGS)}")
    for target in targets:
        _DECLARED[target] = meaning


def declared(target: Any) -> Optional[str]:
    """The canonical name an op declared for ``target``, or None (raises TypeError if unhashable)."""
    return _DECLARED.get(target)


_EFFECTS: set[Any] = set()


def declare_effects(*targets: Any) -> None:
    """Declare that calling ``targets`` (op overloads or packets) acts outside the graph: each call
    the user's code makes must run exactly once."""
    _EFFECTS.update(targets)


def has_effects(target: Any) -> bool:
    """Whether an op declared effects for ``target`` (False for unhashable targets)."""
    try:
        return target in _EFFECTS
    except TypeError:
        return False


__all__ = ["MEANINGS", "declare", "declared", "declare_effects", "has_effects"]
