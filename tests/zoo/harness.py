"""Eager vs ``grcompile.optimize`` on the zoo models: values at the positions that count and every
parameter gradient, in train and eval mode, across mode switches and shape changes.

A zoo model is a file ``tests/zoo/<name>.py`` with ``factory(max_len, num_items, dropout, **kw)
-> UserModel`` and ``EXPECT = {"fused_attention": n, "jagged": bool, "dense_reason": str}``: the
rewrites that are *legal* on it (the target), not what today's pipeline happens to deliver.
"""
from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import grcompile
from grcompile.user_model import UserModel, as_tuple

ZOO_DIR = Path(__file__).parent
_NOT_MODELS = {"__init__", "harness", "batches", "table", "test_zoo", "conftest"}
MODELS = sorted(p.stem for p in ZOO_DIR.glob("*.py") if p.stem not in _NOT_MODELS)

# float32 tolerances of the project's float32 equivalence tests (tests/compiler, tests/passes)
RTOL, ATOL = 1e-4, 1e-5
MAX_LEN, NUM_ITEMS, BATCH = 12, 40, 5


def load(name: str, max_len: int = MAX_LEN, num_items: int = NUM_ITEMS, dropout: float = 0.0,
         seed: int = 0) -> tuple[UserModel, dict[str, Any]]:
    """The model (seeded init, dropout 0 by default so train mode is deterministic) and its EXPECT."""
    module = importlib.import_module(f"tests.zoo.{name}")
    torch.manual_seed(seed)
    user = module.factory(max_len=max_len, num_items=num_items, dropout=dropout)
    user.name = user.name or name
    return user, dict(module.EXPECT)


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in _tensors(out[k])]
    return []


def _masked(t: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``t`` with the positions that do not count set to 0 (``where``, not ``*``: padding may be NaN)."""
    if valid is None or t.shape[: valid.dim()] != valid.shape:
        return t
    m = valid.reshape(*valid.shape, *([1] * (t.dim() - valid.dim())))
    return torch.where(m, t, torch.zeros((), dtype=t.dtype))


def assert_outputs_close(got: Any, ref: Any, valid: torch.Tensor | None, what: str) -> None:
    g, r = _tensors(got), _tensors(ref)
    assert len(g) == len(r), f"{what}: {len(g)} output tensors, eager gives {len(r)}"
    for i, (a, b) in enumerate(zip(g, r)):
        assert a.shape == b.shape, f"{what}: output {i} has shape {tuple(a.shape)}, eager {tuple(b.shape)}"
        torch.testing.assert_close(_masked(a, valid), _masked(b, valid), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, i=i: f"{what}: output {i} differs from eager\n{m}")


@dataclass
class Pair:
    """One eager model and an optimized deep copy of it (same parameters, separate gradients)."""
    user: UserModel
    lowering: str
    options: dict[str, Any] = field(default_factory=dict)  # more optimize() options (remat=...)
    optimized: torch.nn.Module = field(init=False)
    copy: torch.nn.Module = field(init=False)
    steps: int = 0

    def __post_init__(self) -> None:
        self.copy = copy.deepcopy(self.user.module)
        self.optimized = grcompile.optimize(self.copy, lowering=self.lowering, **self.options)

    def report(self) -> grcompile.Report:
        return grcompile.report(self.optimized)

    def step(self, batch_size: int, max_len: int, seed: int, train: bool, grad: bool = True) -> None:
        """One forward (+ backward when ``grad``) on both; asserts equal outputs and gradients."""
        args = as_tuple(self.user.make_batch(batch_size, max_len, seed))
        valid = self.user.valid(*args) if self.user.valid is not None else None
        what = (f"{self.user.name} [{self.lowering} lowering, {'train' if train else 'eval'}"
                f"{'' if grad else ' no_grad'}, B={batch_size} N={max_len} seed={seed}, step {self.steps}]")
        self.steps += 1
        self.user.module.train(train)
        self.optimized.train(train)
        if not grad:
            with torch.no_grad():
                ref = self.user.module(*args)
                got = self.optimized(*args)
            assert_outputs_close(got, ref, valid, what)
            return
        for m in (self.user.module, self.copy):
            m.zero_grad(set_to_none=True)
        ref = self.user.module(*args)
        ref_loss = self.user.step_loss(ref, args)
        assert torch.isfinite(ref_loss), f"{what}: the eager loss is not finite (a zoo model bug)"
        ref_loss.backward()
        got = self.optimized(*args)
        got_loss = self.user.step_loss(got, args)
        assert_outputs_close(got, ref, valid, what)
        torch.testing.assert_close(got_loss, ref_loss, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: loss\n{m}")
        got_loss.backward()
        ref_params = dict(self.user.module.named_parameters())
        for n, p in self.copy.named_parameters():
            r = ref_params[n].grad
            if r is None:
                assert p.grad is None or not p.grad.any(), f"{what}: {n} has a gradient, eager none"
                continue
            assert p.grad is not None, f"{what}: {n} has no gradient, eager has one"
            torch.testing.assert_close(p.grad, r, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=n: f"{what}: gradient of {n} differs from eager\n{m}")


SHAPES = ((3, 9), (6, MAX_LEN))          # (B, N) after the first shape: both change, then B alone
MORE_SHAPES = ((4, 7), (2, 11), (5, 10))  # the slow profile goes on with these


def run_sequence(name: str, lowering: str, shapes: tuple[tuple[int, int], ...] = SHAPES,
                 eval_grad: bool = True) -> tuple[grcompile.Report, grcompile.Report]:
    """train -> eval (with gradients, ``eval_grad``) -> eval (no_grad) -> train on one optimized
    module, then train steps at the other ``(B, N)`` in ``shapes``. Returns the report after the
    first step (what the first compile did) and the one at the end."""
    user, _ = load(name)
    pair = Pair(user, lowering)
    pair.step(BATCH, MAX_LEN, seed=0, train=True)
    first = copy.deepcopy(pair.report())
    _FIRST_REPORTS.setdefault((name, lowering), first)
    if eval_grad:
        pair.step(BATCH, MAX_LEN, seed=1, train=False)
    before = fused_count(pair.report())
    pair.step(BATCH, MAX_LEN, seed=2, train=False, grad=False)
    _EVAL_FUSED.setdefault((name, lowering), fused_count(pair.report()) - before)
    pair.step(BATCH, MAX_LEN, seed=3, train=True)
    for i, (b, n) in enumerate(shapes):
        pair.step(b, n, seed=10 + i, train=True)
    return first, pair.report()


def run_with_dropout(name: str, lowering: str, dropout: float = 0.3) -> None:
    """Train steps with dropout on (the random masks differ from eager's, so only the shape, the
    finiteness and the set of parameters with gradients are compared), then an exact eval step on
    the same optimized module."""
    user, _ = load(name, dropout=dropout)
    pair = Pair(user, lowering)
    user.module.train()
    pair.optimized.train()
    for seed in (0, 1):
        args = as_tuple(user.make_batch(BATCH, MAX_LEN, seed))
        pair.copy.zero_grad(set_to_none=True)
        user.module.zero_grad(set_to_none=True)
        ref, got = user.module(*args), pair.optimized(*args)
        ref_loss, got_loss = user.step_loss(ref, args), user.step_loss(got, args)
        assert torch.isfinite(got_loss), f"{name}: loss {got_loss} with dropout {dropout}"
        assert [t.shape for t in _tensors(got)] == [t.shape for t in _tensors(ref)], name
        ref_loss.backward()
        got_loss.backward()
        with_grad = lambda m: sorted(n for n, p in m.named_parameters() if p.grad is not None and p.grad.any())
        assert with_grad(pair.copy) == with_grad(user.module), f"{name}: parameters with gradients differ"
        assert all(torch.isfinite(p.grad).all() for p in pair.copy.parameters() if p.grad is not None), name
    pair.step(BATCH, MAX_LEN, seed=2, train=False, grad=False)


def run_fp8(name: str, lowering: str = "eager") -> grcompile.Report:
    """One training step of ``optimize(model, precision="fp8")`` against the eager model with its
    linears in emulated FP8 (tests/fp8_emulation.py): outputs at the positions that count and every
    parameter gradient. Returns the report."""
    from tests.fp8_emulation import assert_fp8_close, emulated_fp8_linears

    user, _ = load(name)
    twin = copy.deepcopy(user.module)
    optimized = grcompile.optimize(twin, lowering=lowering, precision="fp8")
    args = as_tuple(user.make_batch(BATCH, MAX_LEN, 0))
    valid = user.valid(*args) if user.valid is not None else None
    user.module.train()
    optimized.train()
    got = optimized(*args)
    report = grcompile.report(optimized)
    whole = any(f["pass"] == "fp8_linear" and "projections stay" in f["reason"] for f in report.fallbacks)
    with emulated_fp8_linears(whole_attention_modules=whole):
        ref = user.module(*args)
        user.step_loss(ref, args).backward()
    user.step_loss(got, args).backward()
    for i, (a, b) in enumerate(zip(_tensors(got), _tensors(ref))):
        assert_fp8_close(_masked(a, valid), _masked(b, valid), RTOL, ATOL, f"{name} fp8: output {i}")
    ref_params = dict(user.module.named_parameters())
    for n, p in twin.named_parameters():
        if ref_params[n].grad is not None:
            assert p.grad is not None, f"{name} fp8: {n} has no gradient, eager has one"
            assert_fp8_close(p.grad, ref_params[n].grad, RTOL, ATOL, f"{name} fp8: gradient of {n}")
    return report


def run_bf16(name: str) -> tuple[dict, dict]:
    """One training step under ``torch.autocast(bfloat16)``: float32 eager is the truth; returns the
    rewrites of the float32 and the bf16 optimized model, and asserts that the optimized bf16
    outputs and parameter gradients are as close to the truth as eager bf16's (relative error at
    most twice eager's + 1e-3, the bar of tests/compiler/test_bf16.py)."""
    from collections import Counter

    def rewrites(optimized) -> dict:
        return dict(Counter((r["pass"], r["op"]) for r in grcompile.report(optimized).rewrites))

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()

    def step(module, params, autocast: bool):
        params.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = module(*args)
            loss = user.step_loss(out, args)
        loss.float().backward()
        outs = [_masked(t, valid).float() for t in _tensors(out) if t.is_floating_point()]
        return outs, {n: p.grad.float().clone() for n, p in params.named_parameters() if p.grad is not None}

    user, _ = load(name)
    args = as_tuple(user.make_batch(BATCH, MAX_LEN, 0))
    valid = user.valid(*args) if user.valid is not None else None
    user.module.train()
    truth, truth_grads = step(user.module, user.module, autocast=False)
    eager, eager_grads = step(user.module, user.module, autocast=True)
    twin32, twin16 = copy.deepcopy(user.module), copy.deepcopy(user.module)
    optimized32 = grcompile.optimize(twin32, lowering="eager")
    step(optimized32, twin32, autocast=False)
    torch._dynamo.reset()
    optimized16 = grcompile.optimize(twin16, lowering="eager")
    got, got_grads = step(optimized16, twin16, autocast=True)
    for i, (g, e, t) in enumerate(zip(got, eager, truth)):
        assert error(g, t) <= 2 * error(e, t) + 1e-3, f"{name} bf16: output {i} error {error(g, t):.3g}, eager {error(e, t):.3g}"
    # a gradient that is ~0 in float32 (a bias a softmax cancels) is all rounding noise in bf16:
    # there its error is measured against the model's largest gradient instead of its own size
    scale = max(t.norm().item() for t in truth_grads.values())
    for n, t in truth_grads.items():
        assert n in got_grads, f"{name} bf16: {n} has no gradient, eager has one"
        g_err, e_err = error(got_grads[n], t), error(eager_grads[n], t)
        g_abs, e_abs = (got_grads[n] - t).norm().item(), (eager_grads[n] - t).norm().item()
        assert g_err <= 2 * e_err + 1e-3 or g_abs <= 2 * e_abs + 1e-3 * scale, \
            f"{name} bf16: gradient of {n} error {g_err:.3g} ({g_abs:.3g}), eager {e_err:.3g} ({e_abs:.3g})"
    return rewrites(optimized32), rewrites(optimized16)


_FIRST_REPORTS: dict[tuple[str, str], grcompile.Report] = {}
_EVAL_FUSED: dict[tuple[str, str], int] = {}


def first_report(name: str, lowering: str = "eager") -> grcompile.Report:
    """The report of one compiled (and checked) training step: what the pipeline does to the first
    graph. Reuses the first step of ``run_sequence`` when it ran in this process."""
    if (name, lowering) not in _FIRST_REPORTS:
        user, _ = load(name)
        pair = Pair(user, lowering)
        pair.step(BATCH, MAX_LEN, seed=0, train=True)
        _FIRST_REPORTS[(name, lowering)] = copy.deepcopy(pair.report())
    return _FIRST_REPORTS[(name, lowering)]


def eval_fused_count(name: str, lowering: str = "eager") -> int:
    """Attentions fused in the ``no_grad`` eval graph (inference: nothing requires a gradient).
    Reuses ``run_sequence``'s eval step when it ran in this process."""
    if (name, lowering) not in _EVAL_FUSED:
        user, _ = load(name)
        pair = Pair(user, lowering)
        pair.step(BATCH, MAX_LEN, seed=2, train=False, grad=False)
        _EVAL_FUSED[(name, lowering)] = fused_count(pair.report())
    return _EVAL_FUSED[(name, lowering)]


def fused_count(report: grcompile.Report) -> int:
    return report.counters.get("fuse_attention.score_mod_attention", 0)


def jagged_status(report: grcompile.Report) -> str:
    """"y": the row-wise block runs on values ``[T, ...]`` (jagged_rewrite rewrote ops and gave up
    nowhere); "partial": it rewrote ops but reported a fallback too; "n": it rewrote nothing."""
    if not any(r["pass"] == "jagged_rewrite" for r in report.rewrites):
        return "n"
    return "partial" if any(f["pass"] == "jagged_rewrite" for f in report.fallbacks) else "y"


def jagged(report: grcompile.Report) -> bool:
    return jagged_status(report) == "y"
