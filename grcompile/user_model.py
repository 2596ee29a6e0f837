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

__all__ = ["UserModel", "UserModelSpecError", "StepLoss", "load_user_model", "load_factory", "is_user_spec",
           "default_loss", "as_tuple"]


class UserModelSpecError(Exception):
    """A ``--model file.py:factory`` spec that does not name a usable factory (the CLIs print it
    as a usage error; it is also the matching built-in error: FileNotFoundError, AttributeError, ...)."""


class _SpecValueError(UserModelSpecError, ValueError):
    pass


class _SpecFileError(UserModelSpecError, FileNotFoundError):
    pass


class _SpecAttributeError(UserModelSpecError, AttributeError):
    pass


class _SpecTypeError(UserModelSpecError, TypeError):
    pass


def is_user_spec(model: str) -> bool:
    """A ``--model`` value naming a user's factory (``file.py:factory``) rather than a built-in model."""
    return ":" in model


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


class StepLoss(torch.nn.Module):
    """``StepLoss(user)(*args) == user.step_loss(user.module(*args), args)``: the forward and the
    loss of one training step as one module, so that a compiler captures both (the user's module
    is the submodule ``model``)."""

    def __init__(self, user: UserModel) -> None:
        super().__init__()
        self.model = user.module
        self._user = user  # a plain attribute: not a submodule, its module is already ``model``

    def forward(self, *args: Any) -> torch.Tensor:
        return self._user.step_loss(self.model(*args), args)


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


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable a ``"path/to/file.py:factory"`` or ``"package.module:factory"`` spec names.

    A file is executed as a fresh module with its own directory at the front of ``sys.path`` while
    it runs, so that it can import the files beside it, as ``python file.py`` would."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise _SpecValueError(f"--model {spec!r}: expected 'path/to/file.py:factory' or 'package.module:factory'")
    path = Path(where)
    if where.endswith(".py") or path.is_file():
        if not path.is_file():
            raise _SpecFileError(f"--model {spec!r}: no file {where}")
        mod_name = f"grcompile_user_model_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise _SpecFileError(f"--model {spec!r}: {where} is not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        directory = str(path.resolve().parent)
        sys.path.insert(0, directory)
        try:
            module_spec.loader.exec_module(module)  # errors in the user's file keep their traceback
        except BaseException:
            sys.modules.pop(mod_name, None)
            raise
        finally:
            sys.path.remove(directory)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (where == exc.name or where.startswith(exc.name + ".")):
                raise  # the module exists; something it imports does not
            raise _SpecFileError(f"--model {spec!r}: no file {where} and no module {where!r} "
                                 f"(a file path must end in .py)") from None
    factory = getattr(module, name, None)
    if factory is None:
        raise _SpecAttributeError(f"--model {spec!r}: {where} has no attribute {name!r}")
    if not callable(factory):
        raise _SpecTypeError(f"--model {spec!r}: {name!r} in {where} is a {type(factory).__name__} object, "
                             f"not a callable factory")
    return factory


def load_user_model(spec: str, **kwargs: Any) -> UserModel:
    """``"path/to/file.py:factory"`` (or ``"package.module:factory"``) -> ``UserModel``.

    ``kwargs`` are passed to the factory when it accepts them (e.g. ``max_len``)."""
    factory = load_factory(spec)
    where, _, name = spec.rpartition(":")
    try:
        accepted = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # some builtins and C callables have no signature: pass nothing
        accepted = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    made = factory(**{k: v for k, v in kwargs.items() if takes_any or k in accepted})
    if isinstance(made, UserModel):
        user = made
    elif isinstance(made, (tuple, list)) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        user = UserModel(made[0], made[1])
    else:
        raise _SpecTypeError(f"--model {spec!r}: the factory must return a grcompile.user_model.UserModel "
                             f"or a (module, make_batch) pair, got {_describe(made)}")
    if not isinstance(user.module, torch.nn.Module):
        raise _SpecTypeError(f"--model {spec!r}: UserModel.module must be a torch.nn.Module, "
                             f"got {_describe(user.module)}")
    for field in ("make_batch", "valid", "loss"):
        value = getattr(user, field)
        if (field == "make_batch" or value is not None) and not callable(value):
            raise _SpecTypeError(f"--model {spec!r}: UserModel.{field} must be callable, got {_describe(value)}")
    if not user.name:
        user.name = f"{Path(where).stem}:{name}"
    return user


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__
