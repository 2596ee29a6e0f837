"""Bad input through optimize() on the dense path: out-of-range ids, an empty batch, N above the
model's max_len. Each gets eager's error (an IndexError) naming the input, the table and the
user's line — never a crash inside generated code — and an empty batch works like eager."""
from __future__ import annotations

import copy
import math
import operator
import warnings

import pytest
import torch
import torch.fx as fx

import grcompile
from grcompile import UnoptimizedWarning
from grcompile.lowering.checks import CHECK_INDEX, pin_checks
from grcompile.passes.guard_indices import value_range
from models import build_encoder

NUM_ITEMS, MAX_LEN = 100, 16


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def sasrec(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_encoder("sasrec", "tiny", num_items=NUM_ITEMS, max_len=MAX_LEN, dropout=0.0, embedding_dim=16,
                         num_blocks=1, num_heads=2, attention_dim=8, linear_dim=8, ffn_dim=16)


def batch(B: int, N: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    valid = torch.arange(N) < torch.tensor(lengths).unsqueeze(1)
    ids = torch.randint(1, NUM_ITEMS + 1, (B, N), generator=g) * valid
    return ids, torch.zeros_like(ids)


def assert_same_step(eager: torch.nn.Module, model: torch.nn.Module, fast: torch.nn.Module, ids, ts) -> None:
    for m in (eager, model):
        m.zero_grad(set_to_none=False)
    expected, actual = eager(ids, ts), fast(ids, ts)
    torch.testing.assert_close(actual, expected)
    w = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3))
    (expected * w).sum().backward()
    (actual * w).sum().backward()
    for (name, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


ITEM_LOOKUP = r"input 'ids', looked up at common\.py:\d+ in forward"


def test_out_of_range_ids_raise_indexerror_naming_input_table_and_line():
    """Inductor lowering: the check runs before the generated kernel that would abort on the id."""
    eager = sasrec()
    model = copy.deepcopy(eager)
    fast = grcompile.optimize(model)
    ids, ts = batch(4, MAX_LEN, [0, 1, 9, MAX_LEN])
    assert_same_step(eager, model, fast, ids, ts)
    for bad_value, shown in ((NUM_ITEMS + 1, NUM_ITEMS + 1), (-1, -1), (10**6, 10**6)):
        bad = ids.clone()
        bad[2, 3] = bad_value
        with pytest.raises(IndexError, match="index out of range"):
            eager(bad, ts)
        with pytest.raises(IndexError, match=rf"index {shown} out of range \[0, {NUM_ITEMS + 1}\) of item_embedding "
                                             rf"\({NUM_ITEMS + 1} rows\) in {ITEM_LOOKUP}"):
            fast(bad, ts)
    # an out-of-range id at a padded position is still an out-of-range id, as in eager
    bad = ids.clone()
    bad[0, -1] = NUM_ITEMS + 1
    with pytest.raises(IndexError, match="item_embedding"):
        fast(bad, ts)
    fast.eval()
    with torch.no_grad(), pytest.raises(IndexError, match="item_embedding"):
        fast(bad, ts)
    fast.train()
    assert_same_step(eager, model, fast, ids, ts)  # and the model still works
    report = grcompile.report(fast)
    assert report.counters["guard_indices.check_index"] >= 1 and report.unoptimized == []


def test_n_above_max_len_raises_like_eager_even_with_short_rows():
    """After the jagged rewrite only valid positions are looked up; the check runs on arange(N)
    as captured, so short rows do not hide what eager rejects."""
    eager = sasrec()
    fast = grcompile.optimize(copy.deepcopy(eager), lowering="eager")
    ids, ts = batch(3, MAX_LEN + 4, [2, 5, 0])
    with pytest.raises(IndexError, match="index out of range"):
        eager(ids, ts)
    with pytest.raises(IndexError, match=rf"index {MAX_LEN + 3} out of range \[0, {MAX_LEN}\) of position_embedding "
                                         rf"\({MAX_LEN} rows\) in index 'positions' \(computed at common\.py:\d+ "
                                         rf"in forward\), looked up at common\.py:\d+ in forward"):
        fast(ids, ts)
    assert grcompile.report(fast).counters["jagged_rewrite.embedding"] >= 1  # the rewrite did fire


@pytest.mark.parametrize("lowering", ["inductor", "eager"])
def test_empty_batch_works_like_eager(lowering):
    eager = sasrec()
    model = copy.deepcopy(eager)
    fast = grcompile.optimize(model, lowering=lowering)
    ids, ts = torch.zeros(0, MAX_LEN, dtype=torch.long), torch.zeros(0, MAX_LEN, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnoptimizedWarning)  # an empty batch is not a failure
        assert_same_step(eager, model, fast, ids, ts)
    fast.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(ids, ts), eager.eval()(ids, ts))
    report = grcompile.report(fast)
    assert [u["kind"] for u in report.unoptimized] == ["zero_size", "zero_size"]  # train and eval graphs
    entry = report.unoptimized[0]
    assert entry["error"] == f"input 'ids' (int64[0, {MAX_LEN}]) has a zero-size dimension"
    assert entry["site"].startswith("common.py:") and "passes and lowering skipped" in entry["ran"]
    assert "zero-size" in str(report)


# --- gathers on tables other than nn.Embedding -------------------------------------------------

class Gathers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(7))
        self.rows = torch.nn.Parameter(torch.randn(5, 3))

    def forward(self, idx: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        a = self.bias[idx]                               # Python indexing: -7 .. 6
        b = self.rows[:, cols]                           # second dim: -3 .. 2
        c = torch.index_select(self.rows, 0, idx.clamp(0, 4))  # proved in range: no check
        return a.sum() + b.sum() + c.sum()


def test_tensor_indexed_gathers_are_checked_with_python_semantics():
    torch.manual_seed(0)
    eager = Gathers()
    model = copy.deepcopy(eager)
    fast = grcompile.optimize(model, lowering="eager")
    idx, cols = torch.tensor([0, 6, -7, 3]), torch.tensor([-3, 2])
    out, expected = fast(idx, cols), eager(idx, cols)
    torch.testing.assert_close(out, expected)
    out.backward()
    expected.backward()
    torch.testing.assert_close(model.bias.grad, eager.bias.grad)
    with pytest.raises(IndexError, match=r"index 7 out of range \[-7, 7\) of bias \(size 7\) in input 'idx', "
                                         r"looked up at test_bad_inputs\.py:\d+ in forward"):
        fast(torch.tensor([0, 7, 1, 1]), cols)
    with pytest.raises(IndexError, match=r"index -4 out of range \[-3, 3\) of rows \(size 3\) in input 'cols'"):
        fast(idx, torch.tensor([-4, 0]))
    counters = grcompile.report(fast).counters
    assert counters["guard_indices.check_index"] == 2 and counters["guard_indices.proved"] == 1


class PairGather(torch.nn.Module):
    """A [B, N, N] index computed in the graph from unbounded inputs: not materialised to check."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(64))

    def forward(self, ts: torch.Tensor) -> torch.Tensor:
        delta = (ts.unsqueeze(2) - ts.unsqueeze(1)).abs()
        return self.table[delta].sum(-1)


def test_large_unprovable_index_is_counted_not_checked():
    fast = grcompile.optimize(PairGather(), lowering="eager")
    ts = torch.tensor([[0, 3, 9], [1, 2, 4]])
    torch.testing.assert_close(fast(ts), PairGather.forward(fast._orig_mod, ts))
    report = grcompile.report(fast)
    assert report.counters["guard_indices.unchecked"] == 1 and "guard_indices.check_index" not in report.counters
    assert not any(x["pass"] == "guard_indices" for x in report.fallbacks + report.rewrites)


class T5Bias(torch.nn.Module):
    """A bucketed relative-position bias (T5 style): the index depends on positions only."""

    def __init__(self, buckets: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.buckets = buckets
        self.bias = torch.nn.Embedding(buckets, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        N = x.shape[1]
        pos = torch.arange(N)
        rel = pos[None, :] - pos[:, None]
        n = rel.abs()
        exact = self.buckets // 2
        large = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(32 / exact)
                         * (self.buckets - exact)).long()
        large = torch.min(large, torch.full_like(large, self.buckets - 1))
        bucket = torch.where(n < exact, n, large)
        return x[:, None, :, None] + self.bias(bucket).permute(2, 0, 1).unsqueeze(0)


def test_index_of_constants_only_is_proved_by_evaluation():
    torch.manual_seed(0)
    model = T5Bias()
    fast = grcompile.optimize(model, lowering="eager")
    x = torch.randn(3, 24)
    torch.testing.assert_close(fast(x), model(x))
    report = grcompile.report(fast)
    assert report.counters["guard_indices.proved"] == 1 and "guard_indices.check_index" not in report.counters
    assert not any(f["pass"] == "guard_indices" for f in report.fallbacks)


# --- the pieces -------------------------------------------------------------------------------

def test_compile_time_ranges():
    def f(n: torch.Tensor):
        pos = torch.arange(n.shape[1])
        rel = pos.unsqueeze(0) - pos.unsqueeze(1) + 7          # 0 .. 14
        buckets = (n.float().log() / 0.3).long().clamp(0, 5)  # 0 .. 5
        return rel, buckets, n % 4, torch.where(n > 0, pos[:1], -1), n.clamp(min=2), rel * -2

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(f, backend=capture, dynamic=False)(torch.ones(2, 8, dtype=torch.long))
    out = next(n for n in graphs[0].graph.nodes if n.op == "output").args[0]
    assert [value_range(x) for x in out] == [(0, 14), (0, 5), (0, 3), (-1, 7), None, (-28, 0)]


def test_pin_checks_makes_every_reader_wait_for_the_check():
    def f(ids, w):
        valid = ids != 0
        return torch.nn.functional.embedding(ids, w) * valid.unsqueeze(-1)

    gm = fx.symbolic_trace(f)
    emb = next(n for n in gm.graph.nodes if n.target is torch.nn.functional.embedding)
    ids = emb.args[0]
    with gm.graph.inserting_before(emb):
        gm.graph.call_function(CHECK_INDEX, (ids, 0, 5, "of w"))
    gm.recompile()
    assert pin_checks(gm) == 1
    check = next(n for n in gm.graph.nodes if n.target is CHECK_INDEX)
    assert set(ids.users) == {check}  # every other reader now reads the checked copy
    ne = next(n for n in gm.graph.nodes if n.target is operator.ne)
    assert ne.args[0] is check
    w = torch.randn(5, 2)
    torch.testing.assert_close(gm(torch.tensor([[1, 0, 4]]), w), f(torch.tensor([[1, 0, 4]]), w))
    with pytest.raises(IndexError, match=r"index 5 out of range \[0, 5\) of w"):
        gm(torch.tensor([[1, 5]]), w)


@pytest.mark.parametrize("write", ["add_", "masked_fill_"])
def test_pin_checks_leaves_an_index_written_through_a_view(write):
    """``flat = ids.view(-1); flat.<write>(...)`` then a lookup of ``ids``: moved above the write,
    the check would raise on ids the user fixed (``masked_fill_``) or its copy would be looked
    up stale (``add_``, in range)."""
    def f(ids, w):
        flat = ids.view(-1)
        if write == "add_":
            flat.add_(1)
        else:
            flat.masked_fill_(flat >= 5, 0)
        return torch.nn.functional.embedding(ids, w)

    gm = fx.symbolic_trace(f)
    emb = next(n for n in gm.graph.nodes if n.target is torch.nn.functional.embedding)
    with gm.graph.inserting_before(emb):
        gm.graph.call_function(CHECK_INDEX, (emb.args[0], 0, 5, "of w"))
    gm.recompile()
    assert pin_checks(gm) == 0
    w, ids = torch.randn(5, 2), torch.tensor([[1, 3], [7, 0]] if write == "masked_fill_" else [[1, 3], [2, 0]])
    got_ids, want_ids = ids.clone(), ids.clone()
    torch.testing.assert_close(gm(got_ids, w), f(want_ids, w))
    assert torch.equal(got_ids, want_ids)  # the caller's ids are written as in eager


def test_check_index_opcheck():
    for index in (torch.tensor([[1, 2], [3, 0]]), torch.tensor([[1, 2], [3, 0]]).t(),
                  torch.tensor([2]).expand(3, 4), torch.zeros(0, 5, dtype=torch.long),
                  torch.tensor([1, -2], dtype=torch.int32)):
        torch.library.opcheck(CHECK_INDEX, (index, -2, 4, "of t"))
