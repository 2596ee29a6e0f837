"""What an op of this library means to the passes, declared by the op when it registers.

The passes match nodes on a canonical name (``passes/op_semantics.canonical``), whatever spelling
the user's code used. Torch's own ops get theirs in ``op_semantics``; a custom op declares its
name here, beside its schema, so neither this layer nor the runtime imports the passes:

    declare("embedding", torch.ops.grcompile.sparse_lookup.default)   # at registration
    declared(target) -> "embedding" | None                              # what op_semantics reads

Only the names in ``MEANINGS`` can be declared: each is a contract the passes rely on.
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


__all__ = ["MEANINGS", "declare", "declared"]
