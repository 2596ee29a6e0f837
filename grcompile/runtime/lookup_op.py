"""The sparse runtime's implementation of ``grcompile::sparse_lookup`` (+ its backward).

The op itself — schema, fake, autograd formula, the embedding meaning it declares to the passes —
is defined in the op layer (``grcompile.lowering.sparse_lookup``). This module binds it to the
runtime: a ``handle`` names a live runtime of this process (:func:`register_runtime`), the forward
runs that runtime's lookup (id all-to-all, sharded table lookup, embedding all-to-all) with its own
autograd graph kept, and the backward hands the gradient to it (embedding all-to-all backward,
fused table update) and returns a zero gradient for ``anchor``.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Iterator

import torch

from ..lowering.sparse_lookup import bind_sparse_runtime, sparse_lookup

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


def _lookup(ids: torch.Tensor, anchor: torch.Tensor, handle: int, feature: str, keep_graph: bool) -> torch.Tensor:
    with _autograd_inside_op():
        return runtime_of(handle).forward(feature, ids, keep_graph=keep_graph)


def _lookup_backward(ids: torch.Tensor, grad: torch.Tensor, anchor: torch.Tensor, handle: int,
                     feature: str) -> torch.Tensor:
    with _autograd_inside_op():
        runtime_of(handle).backward(feature, ids, grad)
    return torch.zeros_like(anchor)


def _feature_dim(handle: int, feature: str) -> int:
    return runtime_of(handle).plan.features[feature].dim


bind_sparse_runtime(forward=_lookup, backward=_lookup_backward, feature_dim=_feature_dim)

__all__ = ["register_runtime", "runtime_of", "sparse_lookup"]
