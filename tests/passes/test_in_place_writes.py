"""In-place writes in user code (``a.relu_()``, ``a.view(...).mul_(2)``, ``pe.mul_(0.5)``,
``a.masked_fill_(...)``, ``x[i] = v``, a write inside the attention): Dynamo keeps them as written,
and a pass that packs a value where it was defined, fuses ops into one that reads its operands
later, or removes dead code would read around the write. Every variant must equal eager (values at
valid positions and gradients); the passes still fire where no write is in the way."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import grcompile
from grcompile.passes.effects import WriteOrder, written_aliases


def _batch(B=5, N=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([N, 0, 1, *torch.randint(0, N + 1, (B - 3,), generator=g).tolist()])
    ids = torch.randint(1, 40, (B, N), generator=g)
    return ids * (torch.arange(N) < lengths[:, None])


class RowWise(nn.Module):
    """Embedding -> linear -> (a write) -> linear -> norm -> masked softmax attention."""

    def __init__(self, write: str):
        super().__init__()
        self.write = write
        self.token, self.position = nn.Embedding(40, 8, padding_idx=0), nn.Embedding(12, 8)
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        valid = x > 0
        b, n = x.shape
        pe = self.position.weight[:n].unsqueeze(0).expand(b, n, 8).clone()
        if self.write == "positions_mul_":
            pe.mul_(0.5)  # written after its definition, read later through `pe`
        a = self.l1(self.token(x) + pe)
        if self.write == "relu_":
            a.relu_()
        elif self.write == "view_mul_":
            a.view(-1, 8).mul_(2.0)  # through a view
        elif self.write == "masked_fill_":
            a.masked_fill_(~valid.unsqueeze(-1), 0.0)
        elif self.write == "setitem":
            a[:, 0] = 0.0
        elif self.write == "iadd":
            a += 1.0  # rebinds `a`: later reads see the new node, nothing to protect
        n = F.layer_norm(self.l2(a), (8,))
        if self.write == "norm_out_mul_":
            n.mul_(0.5)  # between the norm and its gate
        y = torch.sigmoid(a) * n
        v = y.clone()
        s = y @ y.transpose(1, 2)
        if self.write == "v_in_attention":
            v.mul_(2.0)  # between the scores and weights @ v
        return torch.softmax(s.masked_fill(~valid[:, None, :], -1e9), -1) @ v


WRITES = ["none", "positions_mul_", "relu_", "view_mul_", "masked_fill_", "setitem", "iadd", "v_in_attention", "norm_out_mul_"]


@pytest.mark.parametrize("write", WRITES)
def test_in_place_writes_keep_eager_values_and_gradients(write):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = RowWise(write)
    model = copy.deepcopy(eager)
    optimized = grcompile.optimize(model, lowering="eager")
    for seed, (B, N) in enumerate([(5, 12), (5, 12)]):
        x = _batch(B, N, seed)
        valid = (x > 0).unsqueeze(-1)
        want, got = eager(x), optimized(x)
        torch.testing.assert_close(torch.where(valid, got, 0.0), torch.where(valid, want, 0.0), rtol=1e-4, atol=1e-5,
                                   msg=write)
        torch.where(valid, want, 0.0).square().sum().backward()
        torch.where(valid, got, 0.0).square().sum().backward()
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=f"{write}: gradient of {name}")
    report = grcompile.report(optimized)
    if write in ("none", "iadd"):  # nothing in the way: both rewrites fire
        assert report.counters.get("fuse_attention.score_mod_attention") == 1
        assert report.counters.get("jagged_rewrite.linear", 0) == 2
        assert report.counters.get("fuse_norm_gate.gated_norm") == 1
    if write == "norm_out_mul_":
        assert "fuse_norm_gate.gated_norm" not in report.counters
    if write == "v_in_attention":
        assert any("written in place by Tensor.mul_" in f["reason"] for f in report.fallbacks), report.fallbacks


def test_write_order_follows_views_and_not_the_written_value_operands():
    g = torch.fx.symbolic_trace(_Writes()).graph
    nodes = {n.name: n for n in g.nodes}
    aliases = written_aliases(g)
    assert {"add", "view", "mul_"} <= {n.name for n in aliases}, aliases
    assert not {"m", "view_1", "mul", "mul_1"} & {n.name for n in aliases}  # a.mul_(m) writes a, not m
    order = WriteOrder(g)
    assert order.between(nodes["add"], nodes["mul_1"]) is nodes["mul_"]  # out = a * 2 reads after the write
    assert order.between(nodes["add"], nodes["mul"]) is None  # before = a * 3 reads before it


class _Writes(nn.Module):
    def forward(self, x, m):
        a = x + 1
        before = a * 3
        view = a.view(-1)
        view.mul_(m.view(-1))
        out = a * 2
        return before, out


def test_only_writes_count_as_writes():
    import operator

    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    nodes = {"and_": g.call_function(operator.and_, (a, b)), "or_": g.call_function(operator.or_, (a, b)),
             "iand": g.call_function(operator.iand, (a, b)), "relu_": g.call_function(torch.relu_, (a,)),
             "add_": g.call_method("add_", (a, b)), "add": g.call_method("add", (a, b)),
             "relu_inplace": g.call_function(F.relu, (a,), {"inplace": True}),
             "out": g.call_function(torch.add, (a, b), {"out": b})}
    from grcompile.passes.effects import writes
    assert {k for k, n in nodes.items() if writes(n)} == {"iand", "relu_", "add_", "relu_inplace", "out"}


class InPlaceScores(nn.Module):
    """nanoGPT / minGPT style: the scores filled in place with -inf (Dynamo keeps the writes, and
    the softmax reads the scores' original node)."""

    def __init__(self, fills: str):
        super().__init__()
        self.fills = fills
        self.emb = nn.Embedding(40, 16, padding_idx=0)
        self.wq, self.wk, self.wv = (nn.Linear(16, 16) for _ in range(3))

    def forward(self, ids):
        T = ids.shape[1]
        keep = ids != 0
        x = self.emb(ids)
        att = self.wq(x) @ self.wk(x).transpose(-2, -1) * 0.25
        causal = torch.tril(torch.ones(T, T)) == 0
        if self.fills == "double":
            att.masked_fill_(causal, float("-inf"))
            att.masked_fill_(~keep[:, None, :], float("-inf"))
        elif self.fills == "single":
            att.masked_fill_(causal | ~keep[:, None, :], float("-inf"))
        else:  # "causal_only": the padded keys are not masked: not fused, and the fill stays in place
            att.masked_fill_(causal, float("-inf"))
        return F.softmax(att, dim=-1) @ self.wv(x)


@pytest.mark.parametrize("fills", ["double", "single", "causal_only"])
def test_scores_filled_in_place_fuse_and_equal_eager(fills, tmp_path):
    torch.manual_seed(0)
    eager = InPlaceScores(fills)
    model = copy.deepcopy(eager)
    fast = grcompile.optimize(model, lowering="eager", dump_dir=tmp_path)
    ids = _batch(B=5, N=8)
    ids[:, 0] = torch.arange(1, 6)  # no empty row: every query keeps a key (no all -inf row)
    valid = (ids != 0)[..., None]
    out, ref = fast(ids), eager(ids)
    (out * valid).square().sum().backward()
    (ref * valid).square().sum().backward()
    torch.testing.assert_close(out * valid, ref * valid, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    report = grcompile.report(fast)
    after = (tmp_path / "graph_0" / "03-fuse_attention.py").read_text()
    if fills == "causal_only":
        assert report.counters.get("fuse_attention.score_mod_attention", 0) == 0, str(report)
        assert ".masked_fill_(" in after and ".masked_fill(" not in after  # put back as written
    else:
        assert report.counters["fuse_attention.score_mod_attention"] == 1, str(report)
        assert not [f for f in report.fallbacks if f["pass"] == "fuse_attention"], str(report)


class MaskWrittenInPlace(nn.Module):
    """The additive mask is built (key padding + causal), then overwritten in place before the
    scores read it: ``whole`` — HF LLaMA's ``mask[..., :N] = mask[..., :N].masked_fill(...)`` over
    every element (the causal part replaced by the key padding alone); ``partial`` — only the
    first half of the keys. The capture reads the mask as defined: fused as is, it would apply the
    causal part eager no longer has."""

    def __init__(self, write: str):
        super().__init__()
        self.write = write
        self.emb = nn.Embedding(40, 8, padding_idx=0)
        self.wq, self.wk, self.wv = (nn.Linear(8, 8) for _ in range(3))

    def forward(self, ids):
        B, N = ids.shape
        valid = ids != 0
        x = self.emb(ids)
        keymask = torch.zeros(B, N, N).masked_fill(~valid[:, None, :], -1e9)
        m = keymask + torch.full((N, N), -1e9).triu(1)
        if self.write == "whole":
            m[:, :, :N] = m[:, :, :N].clamp(min=0.0).masked_fill(~valid[:, None, :], -1e9)
        elif self.write == "partial":
            m[:, :, : N // 2] = keymask[:, :, : N // 2]
        s = self.wq(x) @ self.wk(x).transpose(1, 2) + m
        return (torch.softmax(s, -1) @ self.wv(x)) * valid[..., None]


@pytest.mark.parametrize("write", ["none", "whole", "partial"])
def test_mask_written_in_place_before_the_scores_read_it(write):
    """Regression (zoo review, llama_rope_rmsnorm): an in-place write into a value of the score
    region (an indexed assignment into the mask) was not seen by the capture: the fused attention
    applied the mask as defined, wrong by ~2 at valid positions. A write of every element is now
    read as the value it leaves (fused, exact); any other write keeps the attention as written."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = MaskWrittenInPlace(write)
    model = copy.deepcopy(eager)
    optimized = grcompile.optimize(model, lowering="eager")
    ids = _batch(5, 8)
    want, got = eager(ids), optimized(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    want.square().sum().backward()
    got.square().sum().backward()
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")
    report = grcompile.report(optimized)
    fused = report.counters.get("fuse_attention.score_mod_attention", 0)
    if write == "partial":
        assert fused == 0, str(report)
        assert any(f["pass"] == "fuse_attention" and "is written in place by indexed assignment" in f["reason"]
                   and "test_in_place_writes.py:" in f["site"] for f in report.fallbacks), report.fallbacks
    else:
        assert fused == 1, str(report)
        assert report.counters.get("fuse_attention.setitem_functionalised", 0) == (write == "whole"), str(report)


def test_sizes_passed_to_a_view_do_not_alias_the_written_tensor():
    """Regression (llama_rope_rmsnorm, shape change): ``mask[None].expand(B, ...)`` then ``mask *= c``
    linked the symbolic size B to the written storage, so every reader of B (the attention's
    reshapes) counted as reading a written tensor: the fusion refused."""
    g = torch.fx.Graph()
    a, c = g.placeholder("a"), g.placeholder("c")
    b = g.call_method("size", (c, 0))
    b.meta["example_value"] = 5
    e = g.call_method("expand", (a, b, 4))
    w = g.call_method("mul_", (e, 2.0))
    g.output((w, b))
    aliases = written_aliases(g)
    assert e in aliases and a in aliases and b not in aliases and c not in aliases


class CausalMaskMultipliedInPlace(nn.Module):
    """HF's causal mask: ``full(finfo.min).triu(1)`` then ``mask *= arange > position`` in place."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 8, padding_idx=0)
        self.wq, self.wk, self.wv = (nn.Linear(8, 8) for _ in range(3))

    def forward(self, ids):
        N = ids.shape[1]
        valid = ids != 0
        x = self.emb(ids)
        mask = torch.full((N, N), torch.finfo(x.dtype).min).triu(1)
        mask *= torch.arange(N) > torch.arange(N).reshape(-1, 1)
        mask = mask.masked_fill(~valid[:, None, :], torch.finfo(x.dtype).min)
        s = self.wq(x) @ self.wk(x).transpose(1, 2) + mask
        return (torch.softmax(s, -1) @ self.wv(x)) * valid[..., None]


def test_in_place_product_in_the_mask_is_captured_out_of_place(tmp_path):
    """Regression (llama_rope_rmsnorm with the Triton kernels): the captured score_mod kept the
    user's ``*=`` (operator.imul), which the Triton score_mod generator does not know: every call
    went to the reference kernel. Captured as a product (in the written tensor's dtype)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = CausalMaskMultipliedInPlace()
    model = copy.deepcopy(eager)
    optimized = grcompile.optimize(model, lowering="eager", dump_dir=tmp_path)
    ids = _batch(5, 8)
    want, got = eager(ids), optimized(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert grcompile.report(optimized).counters.get("fuse_attention.score_mod_attention") == 1
    code = ["\n".join(line for line in m.read_text().splitlines() if not line.strip().startswith("#"))
            for m in tmp_path.glob("graph_0/score_mods/*.py")]  # the comments quote the user's line
    assert code and all("*=" not in c and "imul" not in c for c in code), code
