"""fuse_attention on the shipped models and variants: equal values and gradients at every valid
position (float64), including empty, length-1 and full rows; unsupported regions fall back with a
reason and stay exact."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import grcompile
from grcompile.passes import attention_pipeline
from models import SampledSoftmaxRetrieval, build_encoder

PIPELINE = attention_pipeline()


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def random_batch(lengths, N, num_items=50, left=False, pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, num_items, (len(lengths), N), generator=g)
    ids[ids == pad] = pad + 1
    for b, length in enumerate(lengths):
        if left:
            ids[b, : N - length] = pad
        else:
            ids[b, length:] = pad
    ts = torch.cumsum(torch.randint(0, 10**5, (len(lengths), N), generator=g), dim=1)
    return ids, ts


def assert_same(module, inputs, valid, lowering="eager", passes=None):
    """Optimized vs eager: outputs at valid positions and every parameter gradient."""
    optimized = grcompile.optimize(module, passes=passes or PIPELINE, lowering=lowering)
    out = optimized(*inputs)
    mask = valid[..., None].to(out.dtype)
    (out * mask).square().sum().backward()
    fused = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    ref = module(*inputs)
    torch.testing.assert_close(out * mask, ref * mask)
    (ref * mask).square().sum().backward()
    for n, p in module.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(fused[n], p.grad, msg=n)
    return grcompile.report(optimized)


@pytest.mark.parametrize("model", ["hstu", "fuxi", "sasrec"])
def test_models_fused_and_exact(model):
    torch.manual_seed(0)
    enc = build_encoder(model, "ml1m", num_items=50, max_len=16, num_blocks=2, dropout=0.0).double()
    ids, ts = random_batch([0, 1, 16, 9], 16)
    report = assert_same(enc, (ids, ts), ids != 0)
    per_block = {"hstu": 1, "fuxi": 3, "sasrec": 1}[model]
    assert report.counters["fuse_attention.score_mod_attention"] == 2 * per_block
    assert report.fallbacks == []
    assert all(r["causal"] for r in report.rewrites)


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4), left=st.booleans(),
       model=st.sampled_from(["hstu", "fuxi", "sasrec"]))
def test_random_length_mixes(lengths, left, model):
    torch._dynamo.reset()
    torch.manual_seed(1)
    enc = build_encoder(model, "ml1m", num_items=50, max_len=12, num_blocks=1, dropout=0.0).double()
    ids, ts = random_batch(lengths, 12, left=left)
    assert_same(enc, (ids, ts), ids != 0)


def test_training_loss_with_inductor_lowering():
    torch.manual_seed(0)
    enc = build_encoder("hstu", "ml1m", num_items=50, max_len=16, num_blocks=1, dropout=0.0)
    task = SampledSoftmaxRetrieval(enc)
    ids, ts = random_batch([3, 16, 1, 8], 16)
    neg = torch.randint(1, 50, (4, 8))
    optimized = grcompile.optimize(task, passes=PIPELINE)
    assert_training_step_same(optimized, task, (ids, ts, neg))
    assert grcompile.report(optimized).counters["fuse_attention.score_mod_attention"] == 1


def assert_training_step_same(optimized, task, inputs):
    """One loss + backward through ``optimized`` equals the eager ``task`` (float32 tolerances)."""
    loss = optimized(*inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in task.named_parameters()}
    task.zero_grad()
    ref = task(*inputs)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    for n, p in task.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n, rtol=1e-4, atol=1e-5)
    task.zero_grad()


class UserAttention(nn.Module):
    """Softmax attention written differently: pad id 7, additive -1e4 mask from `ids == 7`,
    sqrt scaling, a learned per-position key bias gathered with table[index], no causality."""

    def __init__(self, D=8, N=10, attn_dropout=0.0, pad=7):
        super().__init__()
        self.pad, self.D = pad, D
        self.emb = nn.Embedding(40, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.key_bias = nn.Parameter(torch.randn(N))
        self.attn_dropout = attn_dropout

    def forward(self, ids):
        N = ids.shape[1]
        padding = ids == self.pad
        x = self.emb(ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(self.D)
        scores = scores + self.key_bias[torch.arange(N)][None, None, :]
        scores = scores + padding[:, None, :].float() * -10000.0
        attn = F.dropout(torch.softmax(scores, dim=-1), self.attn_dropout, self.training)
        return attn @ v


def test_user_variant_additive_mask_bidirectional():
    torch.manual_seed(0)
    m = UserAttention().double()
    ids, _ = random_batch([10, 1, 4], 10, num_items=40, pad=7)
    report = assert_same(m, (ids,), ids != 7)
    assert len(report.rewrites) == 1 and report.rewrites[0]["causal"] is False


def test_attention_dropout_fused_and_exact_given_the_mask(monkeypatch):
    """Training-mode attention dropout moves into the op; given the op's mask (hashed from the seed
    the graph draws from the default generator) values and gradients equal the eager model's."""
    from grcompile.lowering.attention import dropout_keep
    from grcompile.lowering.jagged import jagged_index

    p = 0.3
    torch.manual_seed(0)
    m = UserAttention(attn_dropout=p).double()
    ids, _ = random_batch([10, 1, 4, 0], 10, num_items=40, pad=7)
    valid = ids != 7
    optimized = grcompile.optimize(m, passes=PIPELINE, lowering="eager")
    torch.manual_seed(123)
    seed = torch.randint(0, 2**31 - 1, (1,))  # the draw the graph makes
    torch.manual_seed(123)
    out = optimized(ids)
    (out * valid[..., None]).square().sum().backward()
    fused = {n: q.grad.clone() for n, q in m.named_parameters()}
    report = grcompile.report(optimized)
    assert [r["dropout_p"] for r in report.rewrites] == [p] and not report.fallbacks
    torch.manual_seed(7)
    assert not torch.equal(optimized(ids), out), "a new step draws a new mask"

    token = torch.zeros(valid.numel(), dtype=torch.int64)
    token[jagged_index(valid)] = torch.arange(int(valid.sum()))
    token = token.view(valid.shape)
    keep = dropout_keep(seed, token, token, 1, p)[:, 0]
    monkeypatch.setattr(F, "dropout", lambda x, q, training: x * keep / (1 - q) if training else x)
    m.zero_grad()
    ref = m(ids)
    torch.testing.assert_close(out * valid[..., None], ref * valid[..., None])
    (ref * valid[..., None]).square().sum().backward()
    for n, q in m.named_parameters():
        torch.testing.assert_close(fused[n], q.grad, msg=n)

    monkeypatch.undo()
    torch._dynamo.reset()
    m.eval()
    m.zero_grad()
    assert_same(m, (ids,), valid)  # eval mode: no dropout, exact


class LeakyMask(nn.Module):
    """Masks only the queries, not the keys: padded keys leak into valid outputs, so fusing
    would change the result. Must fall back."""

    def __init__(self, D=8):
        super().__init__()
        self.emb = nn.Embedding(40, D)

    def forward(self, ids):
        valid = ids != 0
        x = self.emb(ids)
        scores = F.silu(x @ x.transpose(1, 2)) * valid[:, :, None]
        return scores @ x


def test_unprovable_mask_falls_back_and_stays_exact():
    torch.manual_seed(0)
    m = LeakyMask().double()
    ids, _ = random_batch([5, 2], 8, num_items=40)
    report = assert_same(m, (ids,), ids != 0)
    assert report.rewrites == []
    assert any("padded keys" in f["reason"] for f in report.fallbacks)


def test_explain_cli_prints_report_and_op_counts(capsys, tmp_path):
    from grcompile.explain import main

    report = main(["--model", "sasrec", "--max-len", "12", "--pipeline", "attention", "--dump", str(tmp_path)])
    out = capsys.readouterr().out
    assert "score_mod_attention" in out and "sasrec.py:" in out
    assert "torch.ops.grcompile.score_mod_attention.default +2" in out
    stage = report.passes.index("fuse_attention") + 1  # dumps are numbered by pipeline position
    assert len(report.rewrites) == 2 and (tmp_path / "graph_0" / f"{stage:02d}-fuse_attention.py").exists()


class RotaryUnderAutocast(nn.Module):
    """LLaMA-style: q and k rotated by float32 cos / sin tables after bf16 projections (under
    autocast, bf16 * float32 is float32), v straight from its bf16 projection; the scores' and
    ``weights @ v``'s matmuls run in bf16 (autocast casts their operands)."""

    def __init__(self, d=16, n=8):
        super().__init__()
        self.emb = nn.Embedding(50, d, padding_idx=0)
        self.wq, self.wk, self.wv = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.register_buffer("cos", torch.cos(torch.arange(n)[:, None] * torch.linspace(0.1, 1.0, d)[None]))

    def forward(self, ids):
        n = ids.shape[1]
        valid = ids != 0
        x = self.emb(ids)
        q, k, v = self.wq(x) * self.cos[:n], self.wk(x) * self.cos[:n], self.wv(x)
        s = (q @ k.transpose(1, 2) / 4.0).masked_fill(~valid[:, None, :], float("-inf"))
        return (torch.softmax(s, -1) @ v) * valid[..., None]


def test_operands_of_mixed_dtypes_under_autocast_are_cast_as_eager_casts_them():
    """Regression (zoo: llama_rope_rmsnorm under bf16 autocast): q and k were float32, v bf16, and
    the fused op raised 'q, k, v must share one dtype' on code eager runs."""
    torch.manual_seed(0)
    model = RotaryUnderAutocast()
    fast = grcompile.optimize(model, lowering="eager")
    ids, _ = random_batch([0, 1, 8, 5], 8)
    ids[0, 0] = 3  # no empty row: its all -inf softmax is NaN in eager
    valid = (ids != 0)[..., None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = model(ids), fast(ids)
    assert got.dtype == want.dtype
    torch.testing.assert_close(torch.where(valid, got, 0).float(), torch.where(valid, want, 0).float(),
                               rtol=2e-2, atol=2e-2)
    report = grcompile.report(fast)
    assert report.counters.get("fuse_attention.score_mod_attention") == 1, str(report)
