"""Shape coincidences never decide a layout (issue 10, 2.8).

Which graph inputs are token tensors comes from dataflow (``passes/axes.py``: axis unification),
not from their shapes: a ``[B, R]`` negatives tensor with ``R == N``, or a batch with ``B == N``,
gets exactly the layouts and rewrites of the same model without the coincidence, and the model
stays exact.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx

import grcompile
from grcompile.passes.detect_padding import analyse
from grcompile.passes.layout import Token
from models import SampledSoftmaxRetrieval, build_encoder

TINY = dict(embedding_dim=16, num_blocks=1, num_heads=2, attention_dim=8, linear_dim=8, dropout=0.0)
ITEMS = 40


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def capture(module: torch.nn.Module, *args) -> fx.GraphModule:
    """The graph Dynamo hands a backend for ``module(*args)`` (static shapes)."""
    graphs: list[fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(module, backend=backend, dynamic=False)(*args)
    assert len(graphs) == 1
    return graphs[0]


def batch(B: int, N: int, R: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, N + 1, (B,), generator=g)
    lengths[: 3] = torch.tensor([0, 1, N])[: B]  # an empty, a length-1 and a full row
    valid = torch.arange(N)[None] < lengths[:, None]
    ids = torch.randint(1, ITEMS + 1, (B, N), generator=g) * valid
    ts = torch.cumsum(torch.randint(1, 5000, (B, N), generator=g), dim=1) * valid
    return ids, ts, torch.randint(1, ITEMS + 1, (B, R), generator=g)


def retrieval(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return SampledSoftmaxRetrieval(build_encoder("hstu", "ml1m", num_items=ITEMS, max_len=16, **TINY))


def input_layouts(gm: fx.GraphModule) -> dict[str, object]:
    info = analyse(gm)
    assert info is not None
    return {n.name: info.layouts[n] for n in gm.graph.nodes if n.op == "placeholder" and "parameters" not in n.name}


def rewrites(report: grcompile.Report) -> list[tuple[str, str]]:
    return sorted((r["pass"], r["op"]) for r in report.rewrites)


def optimized_step(B: int, N: int, R: int) -> grcompile.Report:
    """One training step, optimized vs eager: same loss and gradients; the report."""
    model = retrieval()
    reference = copy.deepcopy(model)
    fast = grcompile.optimize(model, lowering="eager")
    args = batch(B, N, R)
    loss = fast(*args)
    loss.backward()
    expected = reference(*args)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    return grcompile.report(fast)


@pytest.mark.parametrize("R", [16, 5])
def test_negatives_are_per_row_whatever_their_length(R):
    """``negatives [B, R]`` is combined with the rows only (it is compared with the targets of each
    row): a per-row input, never a token tensor, also when ``R == N``."""
    layouts = input_layouts(capture(retrieval(), *batch(4, 16, R)))
    assert layouts["l_ids_"] == Token(0, 1, 2)
    assert layouts["l_timestamps_"] == Token(0, 1, 2)  # tied to the positions by the time bias
    assert layouts["l_negatives_"] == Token(0, None, 2)


def test_negatives_with_r_equal_n_do_not_stop_the_jagged_rewrite():
    """The explain CLI's case (``--max-len 16``, 16 negatives): the same rewrites as with R != N,
    no fallback, exact."""
    coincident, distinct = optimized_step(4, 16, 16), optimized_step(4, 16, 5)
    assert not coincident.fallbacks, coincident.fallbacks
    assert rewrites(coincident) == rewrites(distinct)
    assert ("jagged_rewrite", "jagged_attention") in rewrites(coincident)


def test_batch_equal_to_length():
    """B == N: rows and positions stay two axis classes; layouts and rewrites as for B != N."""
    same, other = capture(retrieval(), *batch(8, 8, 5)), capture(retrieval(), *batch(4, 8, 5))
    assert input_layouts(same) == input_layouts(other)
    square = optimized_step(8, 8, 5)
    assert not square.fallbacks
    assert {("fuse_attention", "score_mod_attention"), ("jagged_rewrite", "jagged_attention"),
            ("jagged_rewrite", "embedding")} <= set(rewrites(square))


class TwoInputs(torch.nn.Module):
    """``weights [B, N]`` scales the tokens position-wise (a token tensor); ``noise [B, N]`` only
    enters a global sum (not tied to the positions: no layout)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(ITEMS + 1, 8, padding_idx=0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, ids, weights, noise):
        valid = ids != 0
        x = self.proj(self.emb(ids)) * weights.unsqueeze(-1) * valid.unsqueeze(-1)
        return x.sum() + noise.sum()


def test_inputs_of_token_shape_are_tokens_only_when_combined_with_tokens():
    ids = batch(4, 6, 1)[0]
    layouts = input_layouts(capture(TwoInputs(), ids, torch.rand(4, 6), torch.rand(4, 6)))
    assert layouts["l_ids_"] == Token(0, 1, 2) and layouts["l_weights_"] == Token(0, 1, 2)
    assert layouts["l_noise_"] is None


class LastPosition(torch.nn.Module):
    """The output at each row's last valid position, read with ``lengths`` (a ``[B]`` input tied
    to the rows by the advanced index ``out[arange(B), lengths - 1]``)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(ITEMS + 1, 8, padding_idx=0)

    def forward(self, ids, lengths):
        out = self.emb(ids) * (ids != 0).unsqueeze(-1)
        return out[torch.arange(ids.shape[0]), (lengths - 1).clamp(min=0)]


def test_lengths_are_per_row_through_an_advanced_index():
    ids = batch(5, 5, 1)[0]  # B == N == 5 as well
    layouts = input_layouts(capture(LastPosition(), ids, (ids != 0).sum(1)))
    assert layouts["l_lengths_"] == Token(0, None, 1) and layouts["l_ids_"] == Token(0, 1, 2)


@pytest.mark.parametrize("spelling, dim, keepdim", [
    ("x.var(1, False, True)", 1, True),
    ("x.std(1, True)", 1, False),
    ("x.var(False)", None, False),
    ("torch.var(x, 1, True, True)", 1, True),
    ("x.var(1, correction=0, keepdim=True)", 1, True),
    ("x.sum(1, True)", 1, True),
    ("x.amax(dim=1)", 1, False),
])
def test_reduce_options_read_unbiased_before_keepdim(spelling, dim, keepdim):
    from grcompile.passes.op_semantics import reduce_options

    gm = fx.symbolic_trace(eval(f"lambda x: {spelling}"))
    (node,) = [n for n in gm.graph.nodes if n.op in ("call_method", "call_function")]
    assert reduce_options(node) == (dim, keepdim)
