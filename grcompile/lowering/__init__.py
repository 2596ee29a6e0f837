"""The op library the compiler's passes emit, and the registry that picks a kernel per device.

Each op lives in its own module with a plain-torch *reference* implementation beside the kernel
slots (``triton`` for CUDA, ``ascend`` for NPU). The custom op's implementation asks
:func:`lookup` for the callable, so a device without a kernel runs the reference and every
backend is checked against the same reference by the property tests in ``tests/lowering``.

    register_op("jagged_attention", reference=fn, triton="pkg.module:attr")   # slots: callable or lazy path
    lookup("jagged_attention", "cpu")   # -> fn (cuda -> triton, npu -> ascend, else reference)
    OPS                                 # name -> OpEntry (with per-backend call counts)

Backend choice (:func:`use_backend` scopes, else :func:`set_backend` / ``optimize(backend=)``, else
``GRCOMPILE_BACKEND``): ``auto`` (default) picks the
device's kernel slot; ``reference`` forces the reference everywhere; ``triton`` also runs the
Triton kernels on CPU tensors, which needs ``TRITON_INTERPRET=1`` set before Triton is imported
(tests, and anyone without a GPU). A kernel slot given as ``"module:attr"`` is imported on first
use (``import torch`` itself imports the Triton package when it is installed, to probe it, so
set ``TRITON_INTERPRET=1`` before importing torch).

Importing this package registers every op (``torch.ops.grcompile.*``): ``jagged_attention`` (+ its
``jagged_attention_backward``), ``gated_norm`` (+ ``gated_norm_backward``, used by the Triton
backend), ``score_mod_attention`` (+ backward), ``pack_index``, ``check_index``,
``check_unchanged``, ``sparse_lookup`` (+ backward; its implementation is the sparse runtime's,
bound by ``grcompile.runtime.lookup_op``); ops declare what they mean to the passes in :mod:`.semantics`. Every compute
op runs through :func:`lookup` (``pack_index`` and the composite ``score_mod_attention`` with their
one implementation as the reference); the input checks ``check_index`` / ``check_unchanged`` are
not kernels and call plain torch. Each module
exports the overload the passes emit by name (``JAGGED_ATTENTION``, ``PACK_INDEX``, ...). Helpers:
:mod:`.jagged` (packing), :mod:`.score_mod` (bias registry). This layer imports no other part of
grcompile (docs/DESIGN.md, "Layers").
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

# device type -> kernel slot; anything else runs the reference
_DEVICE_SLOT = {"cuda": "triton", "xpu": "triton", "npu": "ascend"}
BACKENDS = ("auto", "reference", "triton", "ascend")
Kernel = Union[Callable, str, None]  # a callable, a lazy "module:attr" path, or empty


@functools.lru_cache(maxsize=1)
def _triton_mode() -> Optional[str]:
    """``"interpreter"`` or ``"compiled"`` as Triton decided when it was imported (its own
    ``@triton.jit`` library functions are interpreted or not); None: Triton is not importable."""
    try:
        import triton.language.standard as standard
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return None
    return "interpreter" if isinstance(standard.sum, InterpretedFunction) else "compiled"


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter in this process, whatever ``TRITON_INTERPRET``
    says now: set after Triton was imported (``torch._dynamo`` imports it) it would only make
    Triton crash."""
    return _triton_mode() == "interpreter"


def _resolve(kernel: Kernel) -> Optional[Callable]:
    if isinstance(kernel, str):
        module, _, attr = kernel.partition(":")
        return getattr(importlib.import_module(module), attr)
    return kernel


@dataclass
class OpEntry:
    name: str
    reference: Callable
    triton: Kernel = None
    ascend: Kernel = None
    calls: Counter = field(default_factory=Counter)  # backend -> calls (what report() shows)
    fallbacks: dict = field(default_factory=dict)  # key (e.g. a score_mod) -> why the kernel did not run

    def kernel_for(self, device_type: str, backend: Optional[str] = None) -> tuple[str, Callable]:
        """``(backend name, callable)`` for a tensor on ``device_type``."""
        backend = preferred_backend() if backend is None else backend
        if backend == "reference":
            return "reference", self.reference
        slot = _DEVICE_SLOT.get(device_type) if backend == "auto" else backend
        why = None
        if slot == "triton" and device_type == "cpu" and not triton_interpreting():
            slot, why = None, ("Triton is not installed" if _triton_mode() is None else
                               "Triton runs CPU tensors only in its interpreter, which is off in this process "
                               "(set TRITON_INTERPRET=1 before importing torch)")
        kernel = _resolve(getattr(self, slot)) if slot else None
        if kernel is None:
            if backend != "auto" and (self.triton is not None or self.ascend is not None):  # asked for by name
                self.fallbacks[f"backend {backend}"] = why or f"the op has no {backend} kernel"
            return "reference", self.reference
        setattr(self, slot, kernel)
        return slot, kernel

    def backends(self) -> list[str]:
        return ["reference"] + [s for s in ("triton", "ascend") if getattr(self, s) is not None]


OPS: dict[str, OpEntry] = {}
_OVERRIDE: list[str] = []  # innermost use_backend() last


_PROCESS: list[str] = []  # set_backend()'s choice


def set_backend(backend: Optional[str]) -> None:
    """The kernel backend of this process (``optimize(..., backend=)``; ``None``: back to
    ``GRCOMPILE_BACKEND``); ``use_backend`` scopes win."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _PROCESS[:] = [backend] if backend is not None else []


def preferred_backend() -> str:
    """``use_backend``'s innermost choice, else ``set_backend``'s, else ``GRCOMPILE_BACKEND``,
    else ``auto``."""
    if _OVERRIDE:
        return _OVERRIDE[-1]
    if _PROCESS:
        return _PROCESS[0]
    backend = os.environ.get("GRCOMPILE_BACKEND", "auto") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"GRCOMPILE_BACKEND must be one of {BACKENDS}, got {backend!r}")
    return backend


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Run the ops of this scope with ``backend`` (see the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"use_backend: backend must be one of {BACKENDS}, got {backend!r}")
    _OVERRIDE.append(backend)
    try:
        yield
    finally:
        _OVERRIDE.pop()


def register_op(name: str, reference: Callable, triton: Kernel = None, ascend: Kernel = None) -> OpEntry:
    """Register (or update the kernels of) op ``name``. ``reference`` is required: it is the
    CPU implementation and the fallback of every device without a kernel."""
    if not callable(reference):
        raise TypeError(f"register_op({name!r}): reference must be callable, got {type(reference).__name__}")
    for slot, fn in (("triton", triton), ("ascend", ascend)):
        if fn is not None and not (callable(fn) or (isinstance(fn, str) and ":" in fn)):
            raise TypeError(f"register_op({name!r}): {slot} must be callable, a 'module:attr' path or None")
    entry = OPS.get(name)
    if entry is None:
        entry = OPS[name] = OpEntry(name, reference, triton, ascend)
    else:
        entry.reference = reference
        entry.triton = triton if triton is not None else entry.triton
        entry.ascend = ascend if ascend is not None else entry.ascend
    return entry


def note_fallback(name: str, key: str, why: str, kernel: str = "triton") -> bool:
    """Record that op ``name``'s ``kernel`` handed a call (for ``key``) to the reference; True the
    first time (the caller warns once). The call counts under "reference", not ``kernel``."""
    entry = OPS[name]
    first = key not in entry.fallbacks
    entry.fallbacks[key] = why
    _move_call(entry, kernel, "reference")
    return first


def _move_call(entry: OpEntry, counted: str, ran: str) -> None:
    """The call in progress, counted under ``counted``, ran with ``ran``. Only a call dispatched
    by :func:`lookup` was counted, and it moves once; a kernel function called directly adds its
    ``ran`` call and takes nothing back from earlier dispatched calls."""
    call = _DISPATCHED.get()
    if call is not None and call.op == entry.name and call.backend == counted and not call.moved:
        entry.calls[counted] -= 1
        call.moved = True
    entry.calls[ran] += 1


def note_library(name: str, library: str, kernel: str = "triton") -> None:
    """Record that op ``name``'s ``kernel`` handed a call to a vendor library (``library``, e.g.
    ``"cublas"``) computing the same thing: the call counts under ``library``."""
    _move_call(OPS[name], kernel, library)


def kernel_usage() -> dict[str, dict[str, int]]:
    """``{op: {backend: calls}}`` of the ops with a kernel slot run so far in this process (the
    others — ``pack_index``, the composite ``score_mod_attention`` — have nothing to choose)."""
    return {name: {b: n for b, n in entry.calls.items() if n > 0} for name, entry in sorted(OPS.items())
            if +entry.calls and (entry.triton is not None or entry.ascend is not None)}


def kernel_fallbacks() -> list[str]:
    """One sentence per (op, key) that ran the reference instead of a kernel, and why."""
    return [f"{name} ({key or 'no score_mod'}): {why}" for name, entry in sorted(OPS.items())
            for key, why in entry.fallbacks.items()]


def lookup(name: str, device_type: str) -> Callable:
    """The implementation of op ``name`` for ``device_type`` ("cpu", "cuda", "npu", ...): each call
    of what it returns counts under the backend it picked (a kernel's handoff to the reference or
    a library inside that call moves the count, see :func:`note_fallback`)."""
    try:
        entry = OPS[name]
    except KeyError:
        raise KeyError(f"grcompile.lowering: no op named {name!r}; registered: {sorted(OPS)}") from None
    backend, kernel = entry.kernel_for(device_type)
    if backend == "reference":
        entry.calls[backend] += 1
        return kernel
    return functools.partial(_dispatched_call, entry, backend, kernel)


@dataclass
class _Call:
    op: str
    backend: str
    moved: bool = False


# The kernel call lookup() dispatched and counted, while it runs (a fallback inside moves its count).
_DISPATCHED: contextvars.ContextVar[Optional[_Call]] = contextvars.ContextVar("grcompile_dispatched", default=None)


def _dispatched_call(entry: OpEntry, backend: str, kernel: Callable, /, *args: Any, **kwargs: Any) -> Any:
    entry.calls[backend] += 1
    token = _DISPATCHED.set(_Call(entry.name, backend))
    try:
        return kernel(*args, **kwargs)
    finally:
        _DISPATCHED.reset(token)


# Registering the ops (import order matters: the registry above must exist first).
from . import jagged, score_mod  # noqa: E402,F401
from .score_mod import get_score_mod, register_score_mod  # noqa: E402,F401
from .attention import jagged_attention  # noqa: E402,F401
from .norm import gated_norm  # noqa: E402,F401
from . import fp8  # noqa: E402,F401
from . import checks, constant_check, pack, score_mod_attention, sparse_lookup  # noqa: E402,F401

__all__ = ["OPS", "OpEntry", "BACKENDS", "register_op", "lookup", "use_backend", "preferred_backend",
           "note_fallback", "note_library", "kernel_usage", "kernel_fallbacks", "set_backend",
           "register_score_mod", "get_score_mod",
           "jagged_attention",
           "gated_norm", "jagged", "score_mod"]
