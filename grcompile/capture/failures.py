"""The failure policy: what runs when a frame cannot be optimized, and how the user hears of it.

By default a frame that Dynamo cannot trace (an error, not a graph break: fake-tensor failures,
``InternalTorchDynamoError``, ``Unsupported`` at the frame level) runs the user's code eagerly, and
so does a graph the lowering cannot compile (the backend's own retries: see ``backend.py``). Each
such event becomes a ``report().unoptimized`` entry and an :class:`UnoptimizedWarning` naming the
error and the user's line. ``strict=True`` raises instead. Also reported: Dynamo's recompile limit
— past it, every new input shape of that frame runs eagerly, and the report counts them.

Mechanism (scoped to calls of the optimized module, not process-wide): around each call
:class:`CallScope` sets ``torch._dynamo.config.suppress_errors`` (Dynamo then runs the frame
unmodified; ``convert_frame.py`` logs "WON'T CONVERT ..." with the exception) and a filter on the
``torch._dynamo.convert_frame`` logger that turns those records, and "torch._dynamo hit
config.recompile_limit", into report entries instead of tracebacks on stderr. Soft failures
(a frame skipped at a graph break Dynamo cannot resume from) are logged at INFO only; Dynamo's
frame counters (``counters["frames"]``: total vs ok) reveal them.
"""
from __future__ import annotations

import logging
import re
import sys
import traceback
import warnings
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch
from torch._dynamo.utils import counters

if TYPE_CHECKING:
    from .backend import GrcompileState

__all__ = ["CallScope", "UnoptimizedWarning", "describe_error", "error_site", "input_signature"]

log = logging.getLogger("grcompile")
_DYNAMO_LOG = logging.getLogger("torch._dynamo.convert_frame")
_IN_LIBRARY = re.compile(r"[/\\](torch|grcompile|functorch|_pytest|pluggy)[/\\]|[/\\]site-packages[/\\]")
_MAX_ERROR = 400


class UnoptimizedWarning(UserWarning):
    """Part of an optimized model runs without grcompile (the user's code, eagerly, or the
    captured graph without grcompile's passes); ``grcompile.report(model).unoptimized`` says why."""


def describe_error(exc: BaseException) -> str:
    """One readable line: ``TypeName: first line of the message (Dynamo's explanation)``."""
    inner = getattr(exc, "inner_exception", None)  # BackendCompilerFailed wraps the backend's error
    if isinstance(inner, BaseException):
        exc = inner
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    explanation = next((line.split(":", 1)[1].strip() for line in lines[1:] if line.startswith("Explanation:")), "")
    text = f"{type(exc).__name__}: {first}" + (f" ({explanation})" if explanation and explanation not in first else "")
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)  # object addresses say nothing to a reader
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 1] + "…"


def _describe_unimplemented(text: str) -> str:
    """Dynamo's graph-break record -> ``what happened (why it could not go on)``."""
    parts = text.split("*** While handling this graph break")
    title = next((line.strip() for line in parts[0].splitlines() if line.strip()), "")
    last = [line.strip() for line in parts[-1].splitlines()]
    why = next((line.split(":", 1)[1].strip() for line in last if line.startswith("Explanation:")), "")
    text = title + (f" ({why})" if why else "")
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 1] + "…"


def _frame_site(filename: str, lineno: int | None, name: str) -> str:
    return f"{filename.replace(chr(92), '/').rsplit('/', 1)[-1]}:{lineno} in {name}"


def error_site(exc: BaseException, code: CodeType | None = None) -> str:
    """The user's line the error points at: Dynamo's ``real_stack`` (the user frames it was
    tracing), else the innermost traceback frame outside torch and grcompile, else the frame."""
    for e in (exc, exc.__cause__, exc.__context__, getattr(exc, "inner_exception", None)):
        stack = getattr(e, "real_stack", None) if e is not None else None
        if stack:
            frame = stack[-1]
            return _frame_site(frame.filename, frame.lineno, frame.name)
    user = [f for f in traceback.extract_tb(exc.__traceback__) if not _IN_LIBRARY.search(f.filename)]
    if user:
        return _frame_site(user[-1].filename, user[-1].lineno, user[-1].name)
    if code is not None:
        return _frame_site(code.co_filename, code.co_firstlineno, code.co_name)
    return "<unknown>"


_PATCHES: dict[bool, Any] = {}


def _config_patch(strict: bool) -> Any:
    """One reusable (re-entrant, thread-local) Dynamo config patch per policy."""
    if strict not in _PATCHES:
        _PATCHES[strict] = torch._dynamo.config.patch(suppress_errors=not strict,
                                                      fail_on_recompile_limit_hit=strict)
    return _PATCHES[strict]


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel of the innermost caller outside torch and grcompile."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _IN_LIBRARY.search(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """Shapes and dtypes of the top-level tensor arguments, values of Python scalars (Dynamo
    specialises on them): what a recompile is keyed on here."""
    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), v.dtype
        return v if isinstance(v, (bool, int, float, str)) else None
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


class CallScope(logging.Filter):
    """``with CallScope(state, signature):`` around one call of the optimized model."""

    def __init__(self, state: GrcompileState, signature: tuple, where: str = "the optimized model") -> None:
        super().__init__()
        self.state = state
        self.signature = signature
        self.where = where

    def __enter__(self) -> CallScope:
        self.first_new = len(self.state.unoptimized)
        frames = counters["frames"]
        self._frames = frames["total"] - frames["ok"]  # frames Dynamo failed to convert, so far
        self._unimplemented = sum(counters["unimplemented"].values())
        self._patch = _config_patch(self.state.strict)
        self._patch.__enter__()
        _DYNAMO_LOG.addFilter(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _DYNAMO_LOG.removeFilter(self)
        self._patch.__exit__(*exc_info)
        state = self.state
        if exc_info[0] is not None:  # the call raised (strict, or the user's own error): that is what they see
            return
        if state.recompile_limit is not None:
            if self.signature not in state.compiled_signatures:
                state.unoptimized_signatures.add(self.signature)
                state.recompile_limit["calls"] += 1
                state.recompile_limit["shapes"] = len(state.unoptimized_signatures)
        else:
            state.compiled_signatures.add(self.signature)
        frames = counters["frames"]
        failed = frames["total"] - frames["ok"] - self._frames
        if failed > len(state.unoptimized) - self.first_new:
            # A soft failure (logged by Dynamo at INFO, so not seen by the filter): a graph break it
            # cannot resume from makes it skip the whole frame.
            reasons = counters["unimplemented"]
            why = _describe_unimplemented(next(reversed(reasons))) \
                if sum(reasons.values()) > self._unimplemented else "reason not recorded"
            state.unoptimized.append({
                "kind": "trace_error", "graph": None, "frame": self.where, "site": self.where,
                "error": f"Dynamo skipped a frame at a graph break it cannot resume from: {why} "
                         "(TORCH_LOGS=graph_breaks gives the line)",
                "ran": "the user's code for that frame, eagerly"})
        if state.compiles == 0 and not state.unoptimized:
            # Dynamo never called the backend: it skips this code (an earlier error in it — here or
            # in another model of the same class — marks the code to run eagerly process-wide).
            state.unoptimized.append({
                "kind": "no_graph", "graph": None, "frame": self.where, "site": self.where,
                "error": "Dynamo handed no graph to grcompile for this call",
                "ran": "the user's code, eagerly (Dynamo skips this code, e.g. after an earlier error in it in this "
                       "or another model of the same class; torch._dynamo.reset() clears that)"})
        # an empty batch is expected, not a failure: reported, not warned about
        new = [e for e in state.unoptimized[self.first_new:] if e.get("kind") != "zero_size"]
        if new and state.strict:  # what Dynamo skipped has run already; strict still says so loudly
            raise RuntimeError("grcompile (strict): " + "; ".join(unoptimized_message(e) for e in new))
        for entry in new:
            warnings.warn(unoptimized_message(entry), UnoptimizedWarning, stacklevel=_user_stacklevel())

    # logging.Filter: False drops Dynamo's record (it became a report entry)
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg.startswith("torch._dynamo hit config."):
            self._recompile_limit(record)
            return False
        exc = record.exc_info[1] if record.exc_info else None
        if msg.startswith("WON'T CONVERT") and exc is not None:
            if "recompile limit" not in str(exc).lower():  # already reported from the warning above
                self._frame_failed(exc, msg)
            log.debug("grcompile: Dynamo could not compile a frame; it runs eagerly", exc_info=record.exc_info)
            return False
        return True

    def _frame_failed(self, exc: BaseException, msg: str) -> None:
        m = re.match(r"WON'T CONVERT (\S+) (.+?) line (\d+)", msg)
        frame = f"{m.group(1)} ({_frame_site(m.group(2), int(m.group(3)), m.group(1)).split(' in ')[0]})" if m else "?"
        self.state.unoptimized.append({
            "kind": "trace_error", "graph": None, "frame": frame, "error": describe_error(exc), "site": error_site(exc),
            "ran": "the user's code for this frame, eagerly (Dynamo could not trace it)"})

    def _recompile_limit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        limit_type, limit, function, reason = (list(args) + ["recompile_limit", "?", "?", "?"])[:4]
        m = re.match(r"'(\S+)' \((.+):(\d+)\)", str(function))
        frame = f"{m.group(1)} ({_frame_site(m.group(2), int(m.group(3)), m.group(1)).split(' in ')[0]})" if m \
            else str(function)
        entry = {"kind": "recompile_limit", "graph": None, "frame": frame, "calls": 0, "shapes": 0,
                 "error": f"Dynamo's {limit_type} ({limit}) was reached (last recompile reason: "
                          f"{str(reason).strip()})",
                 "site": frame,
                 "ran": "nothing: strict=True raised" if self.state.strict else
                        "the user's code, eagerly, for every input shape not compiled before the limit"}
        self.state.recompile_limit = entry
        self.state.unoptimized.append(entry)


def unoptimized_message(entry: dict[str, Any]) -> str:
    """The warning / report line for one ``unoptimized`` entry."""
    where = f"graph {entry['graph']}" if entry.get("graph") is not None else f"frame {entry.get('frame', '?')}"
    if entry.get("kind") == "runtime_check":
        return (f"grcompile: {entry['calls']} call(s) of graph {entry['graph']} ran unoptimized because their "
                f"inputs fail a run-time check: {entry['error']} at {entry['site']}; ran: {entry['ran']}")
    if entry.get("kind") == "recompile_limit":
        return (f"grcompile: {entry['calls']} call(s) with {entry['shapes']} new input shape(s) of {where} ran "
                f"unoptimized because {entry['error']}; ran: {entry['ran']}")
    return f"grcompile: {where} runs unoptimized: {entry['error']} at {entry['site']}; ran: {entry['ran']}"
