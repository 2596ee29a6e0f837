"""Where eager and the fused / jagged forms differ only at padding, nothing of it may reach a valid
output (found in review, session 15). Each model here used to come back silently wrong; now each
is exact, fused or jagged where that is provable and as written (with a reason) where not:

* an unmasked mean over the positions of an attention output (the fused op gives 0 at padded
  queries, eager an average over that position's keys) — and the masked mean, which fuses;
* a second per-token mask spelled like the validity (``keep != 0``) is per-token data, not the
  validity;
* a mask that thresholds the scores themselves (``where(s > t, s, -1e9)``);
* a selection that reads an empty row, before a graph break whose next frame mixes rows.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import grcompile
from grcompile.passes import attention_pipeline, jagged_pipeline

D, V = 8, 30
IDS = torch.tensor([[3, 4, 5, 0, 0, 0], [1, 2, 3, 4, 5, 6], [7, 8, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Model(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(V, D, padding_idx=0)
        self.qkv = nn.Linear(D, 3 * D)
        self.ff = nn.Linear(D, D)

    def forward(self, ids, keep):
        n = ids.shape[1]
        valid = ids != 0
        x = self.emb(ids)
        q, k, v = self.qkv(x).chunk(3, -1)
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        if self.how in ("unmasked_mean", "masked_mean"):
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=causal & valid[:, None, :])
            if self.how == "masked_mean":
                m = valid[..., None].to(a.dtype)
                return (a * m).sum(1) / m.sum(1).clamp(min=1)
            return a.mean(1)
        if self.how == "second_mask":
            s = (q @ k.transpose(1, 2) / math.sqrt(D)).masked_fill(~(causal & valid[:, None, :] & (keep != 0)[:, None, :]),
                                                                   -1e9)
            return torch.softmax(s, -1) @ v
        if self.how == "score_threshold":
            s = q @ k.transpose(1, 2) / math.sqrt(D)
            s = torch.where(s > -0.05, s, -1e9).masked_fill(~(causal & valid[:, None, :]), -1e9)
            return torch.softmax(s, -1) @ v
        if self.how == "second_mask_pool":
            h = torch.relu(self.ff(x * valid[..., None]))  # not zero at padding (bias)
            return (h * (keep != 0)[..., None]).sum(1)
        raise ValueError(self.how)


def _compare(how, keep, pipeline, rows_only=False):
    torch.manual_seed(0)
    model = Model(how).double()
    twin = copy.deepcopy(model)
    fast = grcompile.optimize(twin, passes=pipeline)
    ref, got = model(IDS, keep), fast(IDS, keep)
    if ref.dim() == 3:  # [B, N, D]: the valid positions count
        m = (IDS != 0)[..., None]
        ref, got = torch.where(m, ref, 0), torch.where(m, got, 0)
    torch.testing.assert_close(got, ref)
    ref.square().sum().backward()
    got.square().sum().backward()
    mine = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(mine[name].grad, p.grad, msg=name)
    return grcompile.report(fast)


def _fused(report) -> int:
    return report.counters.get("fuse_attention.score_mod_attention", 0)


def _keep(hide: bool) -> torch.Tensor:
    keep = torch.ones(IDS.shape, dtype=torch.long)
    if hide:
        keep[1, :2] = 0  # row 1's first two queries lose every key
        keep[0, 4:] = 1
    return keep


def test_unmasked_mean_over_attention_output_stays_as_written():
    report = _compare("unmasked_mean", _keep(False), attention_pipeline())
    assert _fused(report) == 0
    (reason,) = [f["reason"] for f in report.fallbacks if f["pass"] == "fuse_attention"]
    assert "Tensor.mean" in reason and "padded" in reason, reason


@pytest.mark.parametrize("pipeline", [attention_pipeline, jagged_pipeline])
def test_masked_mean_over_attention_output_fuses(pipeline):
    assert _fused(_compare("masked_mean", _keep(False), pipeline())) == 1


def test_second_mask_spelled_like_the_validity_is_not_the_validity():
    report = _compare("second_mask", _keep(True), attention_pipeline())
    # fused behind the own-key check, which this call fails: it ran as written
    assert _fused(report) == 1 and report.counters.get("fuse_attention.checked_at_run_time") == 1
    assert [u["kind"] for u in report.unoptimized] == ["runtime_check"]
    # keep = 1 at padded positions: not zero there, whatever its spelling
    _compare("second_mask_pool", torch.ones(IDS.shape, dtype=torch.long), jagged_pipeline())


def test_mask_that_thresholds_the_scores_stays_as_written():
    report = _compare("score_threshold", _keep(False), attention_pipeline())
    assert _fused(report) == 0
    (reason,) = [f["reason"] for f in report.fallbacks if f["pass"] == "fuse_attention"]
    assert "depends on the scores themselves" in reason, reason


class SelectThenBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=0)
        self.ff = nn.Linear(D, D)

    def forward(self, ids, lengths):
        h = torch.relu(self.ff(self.emb(ids)))
        z = h.gather(1, (lengths - 1).clamp(min=0)[:, None, None].expand(-1, 1, D)).squeeze(1)
        torch._dynamo.graph_break()
        return z - z.mean(0)  # mixes rows: an empty row's value reaches every row


def test_selection_of_an_empty_row_before_a_graph_break_is_exact():
    torch.manual_seed(0)
    model = SelectThenBreak().double()
    twin = copy.deepcopy(model)
    fast = grcompile.optimize(twin, passes=jagged_pipeline())
    lengths = (IDS != 0).sum(1)
    torch.testing.assert_close(fast(IDS, lengths), model(IDS, lengths))
