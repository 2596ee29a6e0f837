"""The compile modes the CLIs compare: ``eager`` (as written), ``inductor`` (plain
torch.compile) and ``grcompile`` (torch.compile with the grcompile backend and pipeline)."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["COMPILE_MODES", "apply_compile_mode", "describe_mode"]

COMPILE_MODES = ("eager", "inductor", "grcompile")


def apply_compile_mode(module: torch.nn.Module, mode: str, **options: Any) -> torch.nn.Module:
    if mode == "eager":
        if options:
            raise ValueError(f"mode 'eager' takes no options, got {sorted(options)}")
        return module
    if mode == "inductor":
        return torch.compile(module, **options)
    if mode == "grcompile":
        from . import optimize

        return optimize(module, **options)
    raise ValueError(f"unknown compile mode {mode!r}; choose from {COMPILE_MODES}")


def describe_mode(module: Any) -> str:
    """One line saying plainly what compilation ``module`` gets (and that no pass ran, if so)."""
    state = vars(module).get("_grcompile_state") if hasattr(module, "__dict__") else None
    if state is not None:
        from .capture import pass_name

        names = [pass_name(p) for p in state.passes]
        lowered = "by inductor" if state.lowering == "inductor" else "eagerly"
        if not names:
            return f"grcompile: 0 passes in pipeline (empty: graph lowered unchanged {lowered})"
        return f"grcompile: {len(names)} pass(es) in pipeline ({', '.join(names)}), lowered {lowered}"
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return "inductor: plain torch.compile, no grcompile passes"
    return "eager: not compiled"
