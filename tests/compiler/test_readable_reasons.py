"""Fallback reasons read as sentences: ops are named as the user wrote them (``torch.where``,
``Tensor.masked_fill``, ``F.softmax``, ``+``), never as object reprs, and a pass that raises is
reported as which pass, what error, and what happened to the graph."""
from __future__ import annotations

import operator
import re

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import grcompile
from grcompile import GraphPass, PassContext
from grcompile.passes.pass_manager import error_text
from grcompile.passes.op_semantics import describe_op, describe_target
from models import SampledSoftmaxRetrieval, build_encoder

RAW = re.compile(r"<built-in|<function|<method|<class | at 0x[0-9a-fA-F]|OpOverload")
B, N, D, V = 3, 6, 8, 20


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def reasons(optimized) -> list[str]:
    rep = grcompile.report(optimized)
    return [f["reason"] for f in rep.fallbacks] + [str(u.get("error", "")) for u in rep.unoptimized]


def assert_readable(texts: list[str]) -> None:
    raw = [t for t in texts if RAW.search(t)]
    assert not raw, f"reasons with raw object reprs: {raw}"


# --- describe_op --------------------------------------------------------------------------------

def test_describe_op_names_ops_as_written() -> None:
    def fn(x, m):
        a = torch.where(m, x, 0.0)
        b = a.masked_fill(m, 1.0)
        c = F.softmax(b, dim=-1) + torch.softmax(b, -1)
        d = c @ c.transpose(0, 1)
        return d[0].sum(), torch.ops.aten.relu.default(d), -d

    gm = fx.symbolic_trace(fn)
    names = {n.name: describe_op(n) for n in gm.graph.nodes if n.op != "output"}
    assert names == {"x": "an input", "m": "an input", "where": "torch.where", "masked_fill": "Tensor.masked_fill",
                     "softmax": "F.softmax", "softmax_1": "torch.softmax", "add": "+", "transpose": "Tensor.transpose",
                     "matmul": "@", "getitem": "indexing", "sum_1": "Tensor.sum", "relu_default": "torch.ops.aten.relu",
                     "neg": "unary -"}
    assert describe_target(torch.Tensor.masked_fill) == "Tensor.masked_fill"  # called as a function
    assert describe_target(torch._C._nn.linear) == "F.linear"
    assert describe_target(torch.linalg.norm) == "torch.linalg.norm"
    assert describe_target(operator.iadd) == "+="


def test_error_text_replaces_object_reprs_by_names() -> None:
    assert error_text(KeyError(torch.where)) == "KeyError: torch.where"
    assert error_text(TypeError(f"cannot handle {F.softmax} or {torch.Tensor.masked_fill}")) == \
        "TypeError: cannot handle softmax or Tensor.masked_fill"


# --- a pass that raises -------------------------------------------------------------------------

class LooksUpWhere(GraphPass):
    """Fails the way a pass with a missing table entry would (``KeyError(<built-in method where>)``)."""

    name = "looks_up_where"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        raise KeyError({}.get(torch.where, torch.where))


def test_rollback_reason_is_a_sentence() -> None:
    fn = lambda x: torch.where(x > 0, x, 0.0) * 2  # noqa: E731
    optimized = grcompile.optimize(fn, passes=[LooksUpWhere()], lowering="eager")
    x = torch.randn(4)
    torch.testing.assert_close(optimized(x), fn(x))
    (reason,) = reasons(optimized)
    assert reason == ("the looks_up_where pass raised KeyError (torch.where), an internal grcompile error; its "
                      "changes were undone and the graph was left as it was before looks_up_where")


# --- no raw reprs in the reports of the project's models and of user-style functions --------------

@pytest.mark.parametrize("model", ["hstu", "fuxi", "sasrec"])
def test_model_reasons_are_readable(model: str) -> None:
    torch.manual_seed(0)
    enc = build_encoder(model, "ml1m", num_items=V, max_len=N, embedding_dim=8, num_blocks=1, num_heads=2,
                        attention_dim=4, linear_dim=4, dropout=0.0)
    optimized = grcompile.optimize(SampledSoftmaxRetrieval(enc, temperature=0.05), lowering="eager")
    ids, ts = user_batch(), torch.cumsum(torch.ones(B, N, dtype=torch.long), 1)
    optimized(ids, ts, torch.randint(1, V, (B, 4), generator=torch.Generator().manual_seed(1))).backward()
    assert_readable(reasons(optimized))


def user_batch() -> torch.Tensor:
    lengths = torch.tensor([N, 0, 2])
    ids = torch.randint(1, V, (B, N), generator=torch.Generator().manual_seed(0))
    return ids * (torch.arange(N)[None] < lengths[:, None])


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv = nn.Embedding(V, D, padding_idx=0), nn.Linear(D, 3 * D)

    def parts(self, ids):
        x = self.emb(ids)
        return (x, *self.qkv(x).chunk(3, dim=-1))


class CumsumInScores(_Attention):  # a non-pointwise method inside the scores: not fused
    def forward(self, ids):
        _, q, k, v = self.parts(ids)
        s = (q @ k.transpose(1, 2)).masked_fill((ids == 0)[:, None, :], -1e9)
        return torch.softmax(s + s.cumsum(-1), dim=-1) @ v


class QueryRowsMasked(_Attention):  # padded keys are not masked: stays dense
    def forward(self, ids):
        _, q, k, v = self.parts(ids)
        s = (q @ k.transpose(1, 2)).masked_fill((ids == 0)[:, :, None], -1e9)
        return F.softmax(s, dim=-1) @ v


class SequenceMixing(_Attention):  # cumsum over positions and a sort inside the row-wise block
    def forward(self, ids):
        x, q, k, v = self.parts(ids)
        valid = ids != 0
        s = torch.where(valid[:, None, :], q @ k.transpose(1, 2), float("-inf"))
        out = torch.softmax(s, -1) @ v
        return torch.cumsum(out, dim=1) * valid[..., None] + x.sort(dim=-1).values


@pytest.mark.parametrize("cls", [CumsumInScores, QueryRowsMasked, SequenceMixing])
def test_user_function_reasons_are_readable(cls) -> None:
    torch.manual_seed(0)
    model = cls()
    optimized = grcompile.optimize(model, lowering="eager")
    ids = user_batch()
    valid = (ids != 0)[..., None]
    torch.testing.assert_close(torch.where(valid, optimized(ids), 0.0), torch.where(valid, model(ids), 0.0))
    texts = reasons(optimized)
    assert texts, "these spellings are expected to make a pass fall back"
    assert_readable(texts)
    if cls is CumsumInScores:
        assert any(t.startswith("Tensor.cumsum (") for t in texts), texts  # the op as the user wrote it
