"""A compiled graph that is exact only where its passes' run-time checks hold.

Some rewrites are exact for the inputs a check accepts and not provably so for others (a jagged
exit whose reads the compile-time proof cannot bound: ``passes/exit_checks.py``). The backend
then hands Dynamo ``GuardedGraph``: on each call it runs the checks on the call's inputs (small
integer work, before any kernel), and runs the optimized graph where all hold, the graph as
captured where one does not. The first such call adds a ``report().unoptimized`` entry (kind
``runtime_check``, warned once) that counts the calls; ``strict`` raises instead.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .failures import describe_error

log = logging.getLogger("grcompile")


class GuardedGraph:
    """``optimized(*args)`` where every check holds, else ``fallback(*args)`` (``ran`` says what
    that is, for the report)."""

    def __init__(self, optimized: Callable[..., Any], fallback: Callable[..., Any], ran: str,
                 checks: list[dict[str, Any]], state: Any, graph: int, frame: str) -> None:
        self.optimized, self.fallback, self.ran, self.checks = optimized, fallback, ran, checks
        self.state, self.graph, self.frame = state, graph, frame
        self._entry: dict[str, Any] | None = None  # the report entry, from the first failed call

    def __call__(self, *args: Any) -> Any:
        failed = self._failed_check(args)
        if failed is None:
            return self.optimized(*args)
        if self.state.strict:
            raise RuntimeError(f"grcompile (strict): graph {self.graph} cannot run optimized on this call: "
                               f"{failed['reason']} — and the check failed at {failed['site']}")
        if self._entry is None:
            self._entry = {"kind": "runtime_check", "graph": self.graph, "frame": self.frame, "calls": 0,
                           "error": failed["reason"], "site": failed["site"],
                           "ran": f"{self.ran}, for the calls whose inputs fail the check"}
            self.state.unoptimized.append(self._entry)
        self._entry["calls"] += 1
        return self.fallback(*args)

    def _failed_check(self, args: tuple) -> dict[str, Any] | None:
        with torch.no_grad():
            for check in self.checks:
                try:
                    ok = bool(check["check"](*args))
                except Exception as exc:  # noqa: BLE001 - eager raises on such inputs too: let it say so
                    log.debug("grcompile graph %d: run-time check raised %s", self.graph, describe_error(exc))
                    ok = False
                if not ok:
                    return check
        return None
