"""``grcompile::sparse_lookup``: the op a rewritten ``nn.Embedding`` calls, opaque to torch.compile.

    sparse_lookup(ids, anchor, handle: int, feature: str, keep_graph: bool) -> [*ids.shape, D]  (anchor's dtype)
    sparse_lookup_backward(ids, grad [*ids.shape, D], anchor, handle, feature) -> zeros like anchor

This module owns the op's *definition*: schema, fake, autograd formula and the meaning it declares
to the passes (an embedding: ids first, row-wise in the ids — ``detect_padding`` sees ``ids != pad``
beside the attention and ``jagged_rewrite`` packs the ids before the op, so the lookup receives
only valid ids and returns ``[T, D]``). The *implementation* is the sparse runtime's
(``grcompile.runtime.lookup_op``): the id all-to-all, sharded table lookup, embedding all-to-all
and the fused optimizer update in the backward run outside any compiled graph. The runtime binds
itself with :func:`bind_sparse_runtime`, which registers both ops' references in the op registry
(``handle`` names a runtime object of that process, ``feature`` one of its features); until it
has, calling the op raises.

Autograd: the output depends on ``anchor`` (a scalar parameter of the rewritten module) so it
requires grad; the backward is the second opaque op, which hands the gradient to the runtime and
returns a zero gradient for ``anchor``. Both ops are called in the same order on every rank (one
graph, one schedule), which is what the runtime's collectives need.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import lookup, register_op
from .semantics import declare, declare_effects

# (handle, feature) -> the feature's embedding dim D: what the fake needs to size the output
_FEATURE_DIM: list[Callable[[int, str], int]] = []


def _unbound(op: str) -> Callable:
    def raise_unbound(*args, **kwargs):
        raise RuntimeError(f"grcompile::{op}: no sparse runtime bound in this process "
                           "(grcompile.runtime.lookup_op binds it; shard_embeddings creates the runtimes)")
    return raise_unbound


# the references are the runtime's (bind_sparse_runtime); no kernel slots: the op runs on the host
register_op("sparse_lookup", reference=_unbound("sparse_lookup"))
register_op("sparse_lookup_backward", reference=_unbound("sparse_lookup_backward"))


def bind_sparse_runtime(forward: Callable[..., torch.Tensor], backward: Callable[..., torch.Tensor],
                        feature_dim: Callable[[int, str], int]) -> None:
    """Give the ops their implementation: ``forward(ids, anchor, handle, feature, keep_graph)`` and
    ``backward(ids, grad, anchor, handle, feature)`` with the ops' signatures, ``feature_dim(handle,
    feature)`` the output's last dim (for the fake). Called by the sparse runtime when it is imported."""
    register_op("sparse_lookup", reference=forward)
    register_op("sparse_lookup_backward", reference=backward)
    _FEATURE_DIM[:] = [feature_dim]


@torch.library.custom_op("grcompile::sparse_lookup", mutates_args=())
def sparse_lookup(ids: torch.Tensor, anchor: torch.Tensor, handle: int, feature: str, keep_graph: bool) -> torch.Tensor:
    return lookup("sparse_lookup", ids.device.type)(ids, anchor, handle, feature, keep_graph)


@sparse_lookup.register_fake
def _(ids, anchor, handle, feature, keep_graph):
    if not _FEATURE_DIM:
        _unbound("sparse_lookup")()
    return ids.new_empty(*ids.shape, _FEATURE_DIM[0](handle, feature), dtype=anchor.dtype)


@torch.library.custom_op("grcompile::sparse_lookup_backward", mutates_args=())
def sparse_lookup_backward(ids: torch.Tensor, grad: torch.Tensor, anchor: torch.Tensor, handle: int,
                           feature: str) -> torch.Tensor:
    return lookup("sparse_lookup_backward", ids.device.type)(ids, grad, anchor, handle, feature)


@sparse_lookup_backward.register_fake
def _(ids, grad, anchor, handle, feature):
    return torch.empty_like(anchor)


def _setup_context(ctx, inputs, output) -> None:
    ids, anchor, handle, feature, _ = inputs
    ctx.save_for_backward(ids, anchor)
    ctx.handle, ctx.feature = handle, feature


def _backward(ctx, grad):
    ids, anchor = ctx.saved_tensors
    return None, torch.ops.grcompile.sparse_lookup_backward(ids, grad.contiguous(), anchor, ctx.handle,
                                                            ctx.feature), None, None, None


sparse_lookup.register_autograd(_backward, setup_context=_setup_context)
declare("embedding", torch.ops.grcompile.sparse_lookup.default, torch.ops.grcompile.sparse_lookup)
# the lookup runs the runtime's collectives and keeps state for its backward: never run twice
declare_effects(torch.ops.grcompile.sparse_lookup.default, torch.ops.grcompile.sparse_lookup)

SPARSE_LOOKUP = torch.ops.grcompile.sparse_lookup.default

__all__ = ["sparse_lookup", "sparse_lookup_backward", "bind_sparse_runtime", "SPARSE_LOOKUP"]
