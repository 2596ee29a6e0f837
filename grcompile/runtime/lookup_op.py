"""``grcompile::sparse_lookup``: the op a rewritten ``nn.Embedding`` calls, opaque to torch.compile.

The sparse part (id all-to-all, sharded table lookup, embedding all-to-all, fused optimizer
update in the backward) runs in the runtime, outside any compiled graph, yet the model stays
one graph: Dynamo records this op like ``F.embedding`` (ids first; it declares itself an
embedding to the passes, ``grcompile.lowering.semantics``), so ``detect_padding`` still sees ``ids != pad`` beside the attention and
``jagged_rewrite`` packs the ids *before* the op — the lookup then receives only valid ids
(TurboGR's jagged lookup) and returns ``[T, D]``.

Autograd: the op's output depends on ``anchor`` (a zero-size-free scalar parameter of the
rewritten module) so it requires grad; the backward is a second opaque op,
``grcompile::sparse_lookup_backward(ids, grad, ...)``, which hands the gradient to the runtime
(it runs the lookup's own autograd graph: embedding all-to-all backward, table update) and
returns a zero gradient for ``anchor``. Both ops are called in the same order on every rank
(one graph, one schedule), which is what their collectives need.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Iterator

import torch

from ..lowering.semantics import declare

# Weak: a runtime lives as long as the model whose SparseFeatures hold it. A strong registry kept
# TorchRec modules (and their process-group work objects) alive into interpreter teardown, where
# destroying them aborted a gloo rank at exit now and then.
_RUNTIMES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count()


def register_runtime(runtime: object) -> int:
    handle = next(_NEXT_HANDLE)
    _RUNTIMES[handle] = runtime
    return handle


def runtime_of(handle: int):
    try:
        return _RUNTIMES[handle]
    except KeyError:
        raise RuntimeError(f"grcompile::sparse_lookup: no sparse runtime {handle} in this process") from None


@contextlib.contextmanager
def _autograd_inside_op() -> Iterator[None]:
    """A custom op's impl runs below the Autograd dispatch keys; the runtime's lookup needs its own
    autograd graph (kept for the backward), so put those keys back for the duration."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for key in (C.DispatchKey.AutogradFunctionality, C.DispatchKey.AutogradOther,
                C.DispatchKey.AutogradNestedTensor, C.DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


@torch.library.custom_op("grcompile::sparse_lookup", mutates_args=())
def sparse_lookup(ids: torch.Tensor, anchor: torch.Tensor, handle: int, feature: str, keep_graph: bool) -> torch.Tensor:
    with _autograd_inside_op():
        return runtime_of(handle).forward(feature, ids, keep_graph=keep_graph)


@sparse_lookup.register_fake
def _(ids, anchor, handle, feature, keep_graph):
    spec = runtime_of(handle).plan.features[feature]
    return ids.new_empty(*ids.shape, spec.dim, dtype=anchor.dtype)


@torch.library.custom_op("grcompile::sparse_lookup_backward", mutates_args=())
def sparse_lookup_backward(ids: torch.Tensor, grad: torch.Tensor, anchor: torch.Tensor, handle: int,
                           feature: str) -> torch.Tensor:
    with _autograd_inside_op():
        runtime_of(handle).backward(feature, ids, grad)
    return torch.zeros_like(anchor)


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

__all__ = ["register_runtime", "runtime_of", "sparse_lookup"]
