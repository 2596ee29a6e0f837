"""Padding detection on the shipped models and on hand-written variants of the same math."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import grcompile
from grcompile.passes.detect_padding import LAYOUT, PADDING, DetectPadding
from grcompile.passes.layout import Pair, Token
from models import SampledSoftmaxRetrieval, build_encoder


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def analysed(module, *inputs):
    """Run module through optimize with only DetectPadding; return (graph module, report)."""
    seen = {}

    class Grab(DetectPadding):
        def __call__(self, gm, ctx):
            super().__call__(gm, ctx)
            seen["gm"] = gm

    optimized = grcompile.optimize(module, lowering="eager", passes=[Grab()])
    out = optimized(*inputs)
    torch.testing.assert_close(out, module(*inputs))  # the analysis changes nothing
    return seen["gm"], grcompile.report(optimized)


def layout_of(gm, name):
    return {n.name: n.meta.get(LAYOUT) for n in gm.graph.nodes}[name]


def batch(B=4, N=16, pad=0, num_items=50, left=False):
    ids = torch.randint(1, num_items, (B, N))
    ids[ids == pad] = pad + 1
    lengths = torch.tensor([0, 1, N, N // 2][:B])
    for b, length in enumerate(lengths):
        if left:
            ids[b, : N - length] = pad
        else:
            ids[b, length:] = pad
    return ids, torch.arange(N).expand(B, N) * 100, lengths


@pytest.mark.parametrize("model", ["hstu", "fuxi", "sasrec"])
def test_shipped_models(model):
    enc = build_encoder(model, "ml1m", num_items=50, max_len=16, num_blocks=1, dropout=0.0)
    ids, ts, _ = batch()
    gm, report = analysed(SampledSoftmaxRetrieval(enc), ids, ts, torch.randint(1, 50, (4, 8)))
    info = gm.meta[PADDING]
    assert (info.batch, info.seq_len) == (4, 16) and "!= 0" in info.description
    assert report.counters["detect_padding.validity_sources"] == 1
    layouts = {n.name: n.meta.get(LAYOUT) for n in gm.graph.nodes}
    assert layouts["matmul"] == Pair(0, 2, 3, 4)  # q @ kᵀ
    assert layouts["matmul_1"] == Token(0, 2, 4)  # scores @ v
    assert layouts["user"] is None  # the loss shifts the sequence: no layout claimed past it
    assert report.fallbacks == []


class Variant(nn.Module):
    """Single-head attention written with einsum, a pad id of 5 detected as ~(ids == 5), an
    additive float mask and a mean over the sequence at the end."""

    def __init__(self, pad=5, D=8):
        super().__init__()
        self.pad = pad
        self.emb = nn.Embedding(60, D)
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, ids):
        valid = ~(ids == self.pad)
        x = self.emb(ids) * valid[..., None].float()
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = torch.einsum("bnd,bmd->bnm", q, k)
        additive = (1.0 - valid[:, None, :].float()) * -10000.0
        attn = torch.softmax(scores + additive, dim=-1)
        out = torch.einsum("bnm,bmd->bnd", attn, v)
        pooled = out.mean(dim=1)
        return out, pooled


def test_einsum_pad_id_and_sequence_reduction():
    ids, _, _ = batch(pad=5, num_items=60)
    gm, _ = analysed(Variant(), ids)
    assert "== 5" in gm.meta[PADDING].description
    einsums = [n for n in gm.graph.nodes if n.target is torch.einsum]
    assert einsums[0].meta[LAYOUT] == Pair(0, 1, 2, 3)
    assert einsums[1].meta[LAYOUT] == Token(0, 1, 3)
    means = [n for n in gm.graph.nodes if n.target == "mean"]
    assert means and means[0].meta[LAYOUT] is None
    softmax = [n for n in gm.graph.nodes if n.target is torch.softmax][0]
    assert softmax.meta[LAYOUT] == Pair(0, 1, 2, 3)


class FromLengths(nn.Module):
    def __init__(self, D=8):
        super().__init__()
        self.emb = nn.Embedding(60, D)

    def forward(self, ids, lengths):
        N = ids.shape[1]
        valid = torch.arange(N, device=ids.device)[None, :] < lengths[:, None]
        return F.layer_norm(self.emb(ids), (8,)) * valid.unsqueeze(-1)


def test_validity_from_lengths_with_batch_equal_to_seq_len():
    ids, _, _ = batch(B=4, N=4)  # B == N must not confuse the axes
    gm, _ = analysed(FromLengths(), ids, torch.tensor([0, 1, 4, 2]))
    info = gm.meta[PADDING]
    assert "arange(N) <" in info.description
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0][0]
    assert out.meta[LAYOUT] == Token(0, 1, 3)


def test_left_padding_detected_the_same_way():
    enc = build_encoder("hstu", "ml1m", num_items=50, max_len=16, num_blocks=1, dropout=0.0)
    ids, ts, _ = batch(left=True)
    gm, _ = analysed(enc, ids, ts)
    assert gm.meta[PADDING].validity


def test_no_padding_mask_is_reported():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x).relu()

    _, report = analysed(Plain(), torch.randn(2, 5, 8))
    assert len(report.fallbacks) == 1 and "no padding mask" in report.fallbacks[0]["reason"]
