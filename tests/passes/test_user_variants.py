"""Models written the ways users write them, run through the default pipeline: each one is either
rewritten (asserted) or falls back with a reason naming the user's line — and is always exact
(values at valid positions and every gradient, float64)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from grcompile.passes import default_pipeline

from .test_fuse_attention import assert_same, random_batch


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Attention(nn.Module):
    """One attention layer; ``rab`` picks how the relative position bias is gathered and
    ``validity`` where the mask comes from."""

    def __init__(self, rab="index", validity="ids", N=10, D=8):
        super().__init__()
        self.rab, self.validity, self.N = rab, validity, N
        self.emb = nn.Embedding(40, D, padding_idx=0)
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.table = nn.Parameter(torch.randn(2 * N - 1))
        self.rel = nn.Embedding(2 * N - 1, 1)

    def forward(self, ids, lengths):
        B, N = ids.shape
        if self.validity == "ids":
            valid = ids != 0
        else:  # validity from a lengths tensor
            valid = torch.arange(N, device=ids.device)[None, :] < lengths[:, None]
        x = self.norm(self.emb(ids))
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        pos = torch.arange(N, device=ids.device)
        rel = pos[None, :] - pos[:, None] + N - 1  # [N, N]: j − i
        if self.rab == "index":
            bias = self.table[rel]
        elif self.rab == "embedding":
            bias = self.rel(rel).squeeze(-1)
        else:  # one-hot matmul
            bias = F.one_hot(rel, 2 * N - 1).to(self.table.dtype) @ self.table
        scores = torch.einsum("bid,bjd->bij", q, k) / math.sqrt(q.shape[-1]) + bias
        mask = torch.tril(torch.ones(N, N, dtype=torch.bool, device=ids.device))[None] & valid[:, None, :]
        attn = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out = attn @ v
        return out * valid[..., None]


@pytest.mark.parametrize("rab,validity,fused", [
    ("index", "ids", True),
    ("index", "lengths", True),
    ("embedding", "ids", None),  # fused or a reason: both are acceptable, silence is not
    ("one_hot", "ids", None),
])
def test_rab_spellings_and_validity_sources(rab, validity, fused):
    torch.manual_seed(0)
    m = Attention(rab, validity).double()
    # no empty row: this user's -inf mask makes the eager softmax NaN on a row without keys
    ids, _ = random_batch([10, 1, 4, 7], 10, num_items=40)
    lengths = (ids != 0).sum(dim=1)
    report = assert_same(m, (ids, lengths), ids != 0, passes=default_pipeline())
    did_fuse = any(r["op"] == "score_mod_attention" for r in report.rewrites)
    if fused is not None:
        assert did_fuse == fused, report
    if not did_fuse:
        reasons = [f for f in report.fallbacks if f["pass"] == "fuse_attention"]
        assert reasons and all(f["site"].startswith("test_user_variants.py:") and f["reason"] for f in reasons), \
            report


class TimeBiasByIndexing(nn.Module):
    """A time bias from per-token timestamps broadcast with ``ts[:, :, None] - ts[:, None, :]``
    (indexing, not unsqueeze), sqrt bucketing, SiLU attention with a float mask, right padding."""

    def __init__(self, N=10, D=8, buckets=16):
        super().__init__()
        self.emb = nn.Embedding(40, D, padding_idx=0)
        self.qkv = nn.Linear(D, 3 * D)
        self.time_table = nn.Parameter(torch.randn(buckets + 1))
        self.buckets = buckets

    def forward(self, ids, ts):
        B, N = ids.shape
        valid = ids != 0
        q, k, v = self.qkv(self.emb(ids)).chunk(3, dim=-1)
        delta = (ts[:, :, None] - ts[:, None, :]).abs().float()
        bucket = torch.sqrt(delta).long().clamp(max=self.buckets)
        scores = q @ k.transpose(-1, -2) + self.time_table[bucket]
        mask = (torch.tril(torch.ones(N, N, device=ids.device))[None] * valid[:, None, :].float())
        attn = F.silu(scores) * mask / N
        return (attn @ v) * valid[..., None]


def test_time_bias_with_indexing_broadcasts():
    torch.manual_seed(0)
    m = TimeBiasByIndexing().double()
    ids, ts = random_batch([10, 1, 4, 0], 10, num_items=40)
    report = assert_same(m, (ids, ts), ids != 0, passes=default_pipeline())
    assert any(r["op"] == "jagged_attention" for r in report.rewrites), report
    assert not report.fallbacks


class GatedQueries(nn.Module):
    """A per-query gate computed from the tokens' own values scales the scores (``[B, 1, N, 1]``)."""

    def __init__(self, D=8, H=2):
        super().__init__()
        self.H = H
        self.emb = nn.Embedding(40, D, padding_idx=0)
        self.qkv = nn.Linear(D, 3 * D)
        self.gate = nn.Linear(D, 1)

    def forward(self, ids, ts):
        B, N = ids.shape
        D = self.emb.embedding_dim
        valid = ids != 0
        x = self.emb(ids)
        q, k, v = (t.view(B, N, self.H, D // self.H).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = (q @ k.transpose(-1, -2)) * torch.sigmoid(self.gate(x))[:, None, :, :]
        allowed = torch.ones(N, N, dtype=torch.bool, device=ids.device).tril() & valid[:, None, None, :]
        attn = scores.masked_fill(~allowed, -1e9).softmax(-1)
        return (attn @ v).transpose(1, 2).reshape(B, N, D) * valid[..., None]


def test_a_side_computed_from_the_tokens_stays_jagged():
    """The gate is a side input of the fused attention and a value of the jagged region: packed
    again from its dense form, it was read outside the region and the whole block stayed dense
    ("expand_as is used by flatten_1 outside the jagged region")."""
    torch.manual_seed(0)
    m = GatedQueries().double()
    ids, ts = random_batch([10, 1, 0, 7], 10, num_items=40)
    report = assert_same(m, (ids, ts), ids != 0, passes=default_pipeline())
    assert any(r["op"] == "jagged_attention" for r in report.rewrites), report
    assert not report.fallbacks, report.fallbacks
