"""The softmax backward reads the forward's log-sum-exp and output (``jagged_attention_fwd``
returns them, its autograd saves them) instead of recomputing the row's normaliser (reference) or
rerunning the forward (Triton): the same gradients either way, eager and through AOTAutograd."""
from __future__ import annotations

import pytest
import torch

from grcompile.lowering import OPS, use_backend
from grcompile.lowering.attention import reference as ref
from grcompile.lowering.score_mod import register_score_mod

F64 = torch.float64


def _time_bias(score, q_pos, k_pos, q_side_0, k_side_0, table_0):
    return score + table_0[torch.clamp((k_side_0 - q_side_0).abs() // 7, 0, 5)] + (k_pos - q_pos) * 0.01


TIME_BIAS = register_score_mod(_time_bias, name="test_saved_statistics_bias")


def _inputs(dtype=F64, lengths=(9, 0, 1, 6), dropout=0.0, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, H = sum(lengths), 2
    q, k, v = (torch.randn(T, H, 4, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(n) for n in lengths])
    stamps = torch.randint(0, 100, (T,), generator=g)
    table = torch.randn(6, generator=g, dtype=dtype).requires_grad_()
    sides = ([stamps], [stamps.flip(0)], [table]) if bias else ([], [], [])
    seed_t = torch.tensor([seed + 3]) if dropout else None
    kwargs = dict(score_mod=TIME_BIAS if bias else "", use_qk=True, activation="softmax", scale=0.5, out_scale=1.0,
                  causal=True, max_len=max(lengths), dropout_p=dropout)
    return (q, k, v, offsets, positions, *sides, seed_t), kwargs


def _grads(args, kwargs, grad):
    q, k, v, *_, tables, _seed = args
    out = torch.ops.grcompile.jagged_attention(*args, **kwargs)
    return torch.autograd.grad(out, [q, k, v, *tables], grad)


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_reference_backward_with_statistics_equals_recomputing(dtype, dropout):
    args, kwargs = _inputs(dtype, dropout=dropout)
    plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    plain[7] = [t.detach() for t in args[7]]
    out, lse = ref._attention_reference(*plain, **kwargs, with_lse=True)
    assert lse.shape == (out.shape[0], out.shape[1])
    assert lse.dtype == (F64 if dtype == F64 else torch.float32)
    grad = torch.randn_like(out)
    want = ref._attention_backward_reference(grad, *plain, **kwargs)
    got = ref._attention_backward_reference(grad, *plain, out, lse, **kwargs)
    tol = dict(rtol=2 ** -7, atol=1e-2) if dtype == torch.bfloat16 else {}
    for a, b in zip([*got[:3], *got[5]], [*want[:3], *want[5]]):
        torch.testing.assert_close(a, b, **tol)


def _record_backward_statistics(monkeypatch) -> list[tuple[bool, bool]]:
    """From now on, ``(fwd_out given, fwd_lse given)`` for each call of the backward's reference."""
    entry = OPS["jagged_attention_backward"]
    original, seen = entry.reference, []

    def recording(*args, **kwargs):
        seen.append((kwargs.get("fwd_out") is not None, kwargs.get("fwd_lse") is not None))
        return original(*args, **kwargs)
    monkeypatch.setattr(entry, "reference", recording)
    return seen


def test_the_op_hands_its_statistics_to_the_backward(monkeypatch):
    """Eagerly and under torch.compile (AOTAutograd partitions what is saved) the backward is called
    with the forward's output and log-sum-exp; the gradients equal a recomputing backward's."""
    entry = OPS["jagged_attention_backward"]
    original = entry.reference

    def without_statistics(*args, fwd_out=None, fwd_lse=None, **kwargs):
        return original(*args, **kwargs)
    args, kwargs = _inputs(dropout=0.2)
    grad = torch.randn(args[0].shape[0], 2, 4, dtype=F64)
    with use_backend("reference"):
        monkeypatch.setattr(entry, "reference", without_statistics)
        want = _grads(args, kwargs, grad)  # the backward called without the statistics
        monkeypatch.setattr(entry, "reference", original)
        seen = _record_backward_statistics(monkeypatch)
        eager = _grads(args, kwargs, grad)
        torch._dynamo.reset()
        compiled_op = torch.compile(lambda *a: torch.ops.grcompile.jagged_attention(*a, **kwargs), backend="aot_eager",
                                    fullgraph=True)
        q, k, v, *_, tables, _seed = args
        compiled = torch.autograd.grad(compiled_op(*args), [q, k, v, *tables], grad)
    assert seen == [(True, True), (True, True)]
    for got in (eager, compiled):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_an_in_place_write_to_the_output_is_legal_eagerly(monkeypatch):
    """Eager PyTorch allows ``out += residual`` after ``attn @ v`` (its backward needs no output);
    the op run eagerly (``lowering="eager"``) must too."""
    args, kwargs = _inputs(dropout=0.2)
    q, k, v, *_, tables, _seed = args
    residual = torch.randn(q.shape[0], 2, 4, dtype=F64)
    out = torch.ops.grcompile.jagged_attention(*args, **kwargs)
    out += residual
    with use_backend("reference"):
        seen = _record_backward_statistics(monkeypatch)
        got = torch.autograd.grad(out.pow(2).sum(), [q, k, v, *tables])
        monkeypatch.undo()
    # the written output is not used: the backward sums its row term itself
    assert [out_given for out_given, _ in seen] == [False]
    plain = torch.ops.grcompile.jagged_attention(*args, **kwargs) + residual
    want = torch.autograd.grad(plain.pow(2).sum(), [q, k, v, *tables])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_silu_keeps_no_statistics():
    args, kwargs = _inputs()
    kwargs["activation"] = "silu"
    out, lse = torch.ops.grcompile.jagged_attention_fwd(*args, **kwargs)
    assert lse.numel() == 0 and not lse.requires_grad
    assert out.requires_grad


def test_a_compiled_softmax_model_runs_optimized_with_statistics(monkeypatch):
    """Through grcompile's whole pipeline, where the token count is unbacked (a setup that read
    ``lse.numel()`` raised a data-dependent guard and the model silently ran unoptimized): the
    model stays optimized, its backward gets the statistics, and its gradients equal eager's."""
    import importlib.util
    from pathlib import Path

    import grcompile

    path = Path(__file__).parents[3] / "examples" / "sasrec_mha.py"
    spec = importlib.util.spec_from_file_location("sasrec_mha_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    user = example.factory(max_len=16, embedding_dim=16, num_blocks=1)
    seen = _record_backward_statistics(monkeypatch)
    torch._dynamo.reset()
    eager = user.module
    optimized = grcompile.optimize(eager)
    ids, = user.make_batch(5, 16, 3)
    valid = (ids != 0)[..., None]
    want = torch.autograd.grad((eager(ids) * valid).pow(2).sum(), list(eager.parameters()))
    got = torch.autograd.grad((optimized(ids) * valid).pow(2).sum(), list(eager.parameters()))
    assert grcompile.report(optimized).unoptimized == []
    assert seen and all(out_given and lse_given for out_given, lse_given in seen)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
