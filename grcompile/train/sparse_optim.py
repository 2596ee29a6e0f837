"""Torch optimizers for the sparse tables that do exactly what fbgemm's fused table kernels do, so a
table trains the same in one process, on the native backend's shards and in a fused kernel.

* ``ADAGRAD_EPS``: fbgemm's default epsilon (1e-8; ``torch.optim.Adagrad`` defaults to 1e-10), used
  by every Adagrad of the tables here and by the dynamic hash tables' row-wise update.
* ``RowWiseAdagrad``: fbgemm's ``EXACT_ROWWISE_ADAGRAD`` — one accumulator per row, adding the row's
  mean of g², the row stepped by ``lr / (sqrt(accumulator) + eps)`` times its gradient. A row whose
  gradient is zero keeps its weight and accumulator, so stepping a dense gradient equals the fused
  kernel's update of the rows the step looked up.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

ADAGRAD_EPS = 1e-8


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad for 2-D tables (see module docstring); no weight decay, like the other
    sparse optimizers of the trainer."""

    # a row without gradient adds 0 to its accumulator and moves by 0 (what DBP's refresh relies on)
    moves_only_rows_with_gradient = True

    def __init__(self, params: Iterable[torch.Tensor], lr: float, eps: float = ADAGRAD_EPS) -> None:
        if lr <= 0:
            raise ValueError(f"RowWiseAdagrad: lr must be > 0, got {lr}")
        if eps < 0:
            raise ValueError(f"RowWiseAdagrad: eps must be >= 0, got {eps}")
        super().__init__(params, {"lr": lr, "eps": eps})
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"RowWiseAdagrad steps 2-D tables (rows x dim), got a parameter of shape "
                                     f"{tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    grad = grad.coalesce().to_dense()
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
                state["sum"].add_(grad.pow(2).mean(dim=1))
                multiplier = group["lr"] / (state["sum"].sqrt() + group["eps"])
                p.sub_(grad * multiplier.unsqueeze(1))
        return loss


__all__ = ["ADAGRAD_EPS", "RowWiseAdagrad"]
