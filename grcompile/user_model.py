"""A user's own model, as the CLIs and the zoo tests take it: ``--model path/to/file.py:factory``.

The factory is any callable returning a ``UserModel`` (or a ``(module, make_batch)`` pair)::

    def factory(max_len: int = 50, num_items: int = 1000) -> UserModel:
        model = MySASRec(num_items, max_len)
        def make_batch(batch_size: int, max_len: int, seed: int) -> tuple:
            ...  # padded ids [B, N] (random lengths: empty, length-1 and full rows), ...
            return (ids, timestamps)
        return UserModel(model, make_batch, valid=lambda ids, ts: ids != 0)

``module(*make_batch(B, N, seed))`` must run eagerly. ``loss(output, *args)`` turns the output into
a scalar for a training step (default: the output itself when it is a scalar, else the sum of
squares of the output at the valid positions). ``valid(*args)`` gives the ``[B, N]`` positions
whose outputs count (compared by tests, used by the default loss); ``None`` means every output
element counts (pooled or last-position outputs).
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["UserModel", "load_user_model", "default_loss", "as_tuple"]


@dataclass
class UserModel:
    module: torch.nn.Module
    make_batch: Callable[[int, int, int], Any]  # (batch_size, max_len, seed) -> args of module(*args)
    valid: Callable[..., torch.Tensor] | None = None  # (*args) -> bool [B, N]; None: every output counts
    loss: Callable[..., torch.Tensor] | None = None  # (output, *args) -> scalar
    name: str = ""

    def batch(self, batch_size: int, max_len: int, seed: int = 0) -> tuple:
        return as_tuple(self.make_batch(batch_size, max_len, seed))

    def step_loss(self, output: Any, args: tuple) -> torch.Tensor:
        if self.loss is not None:
            return self.loss(output, *args)
        return default_loss(output, None if self.valid is None else self.valid(*args))


def as_tuple(batch: Any) -> tuple:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def default_loss(output: Any, valid: torch.Tensor | None) -> torch.Tensor:
    """A scalar from ``output`` that only depends on the positions that count."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    if output.dim() == 0:
        return output
    out = output.float()
    if valid is not None:
        mask = valid.reshape(*valid.shape, *([1] * (out.dim() - valid.dim()))).to(out.dtype)
        out = out * mask
    return out.pow(2).sum() / max(out.numel(), 1)


def load_user_model(spec: str, **kwargs: Any) -> UserModel:
    """``"path/to/file.py:factory"`` (or ``"package.module:factory"``) -> ``UserModel``.

    ``kwargs`` are passed to the factory when it accepts them (e.g. ``max_len``)."""
    if ":" not in spec:
        raise ValueError(f"--model {spec!r}: expected 'path/to/file.py:factory' or 'package.module:factory'")
    where, name = spec.rsplit(":", 1)
    path = Path(where)
    if where.endswith(".py") or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"--model {spec!r}: no file {where}")
        mod_name = f"grcompile_user_model_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise AttributeError(f"--model {spec!r}: {where} has no callable {name!r}")
    accepted = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    made = factory(**{k: v for k, v in kwargs.items() if takes_any or k in accepted})
    if isinstance(made, UserModel):
        user = made
    elif isinstance(made, (tuple, list)) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        user = UserModel(made[0], made[1])
    else:
        raise TypeError(f"--model {spec!r}: the factory must return a grcompile.user_model.UserModel "
                        f"or a (module, make_batch) pair, got {type(made).__name__}")
    if not user.name:
        user.name = f"{Path(where).stem}:{name}"
    return user
