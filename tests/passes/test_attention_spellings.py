"""Attention as people spell it — ``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``,
``nn.TransformerEncoder(Layer)``, masks built every which way, bias tables of any shape — fuses
into one padding-free op, or stays exactly as written with a reason naming the user's line.

Every case: values at valid positions and every parameter gradient equal eager (float64), in
train and eval mode, on a length mix with an empty row, a length-1 row and a full row; the
expected counters are asserted. Eager lowering (fast); a few cases also with inductor.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import grcompile
from grcompile.passes import attention_pipeline

N, D, H, VOCAB = 8, 8, 2, 30
LENGTHS = [0, 1, N, 5, 3]  # an empty row, a length-1 row, a full row
_SLOW = pytest.mark.slow


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def padded(lengths=LENGTHS, n=N, left=False, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), n), generator=g)
    for b, length in enumerate(lengths):
        if left:
            ids[b, : n - length] = 0
        else:
            ids[b, length:] = 0
    return ids


def fused(report) -> list[dict]:
    return [r for r in report.rewrites if r["pass"] == "fuse_attention"]


def assert_fused(report, per_graph: int = 1, counter: str | None = None, **expected) -> None:
    """Every compiled graph fused ``per_graph`` attentions with the ``expected`` properties, and
    ``fuse_attention.<counter>`` counted each of them; no attention fell back."""
    rewrites = fused(report)
    assert not report.unoptimized, report.unoptimized  # lowered as transformed, not as captured
    assert report.compiles >= 1 and len(rewrites) == per_graph * report.compiles, (rewrites, report.fallbacks)
    for r in rewrites:
        assert {k: r.get(k) for k in expected} == expected, r
    if counter is not None:
        assert report.counters[f"fuse_attention.{counter}"] == per_graph * report.compiles
    assert not reasons(report), reasons(report)


def reasons(report) -> list[str]:
    return [f"{f['site']}: {f['reason']}" for f in report.fallbacks if f["pass"] == "fuse_attention"]


def check(module: nn.Module, ids: torch.Tensor, modes=("train", "eval"), lowering="eager", no_grad=False,
          rtol=None, atol=None, loss="where"):
    """``optimize(module)`` vs ``module`` on ``ids``: outputs at valid positions and the gradients
    of a loss over them (``where(valid, out, 0)``, or ``out * valid`` with ``loss="mul"``: then
    NaN at a padded row would poison eager's loss). Returns the report after the last mode."""
    valid = (ids != 0)[..., None]
    masked = (lambda out: out * valid) if loss == "mul" else (lambda out: torch.where(valid, out, 0))
    optimized = grcompile.optimize(module, passes=attention_pipeline(), lowering=lowering)
    for mode in modes:
        module.train(mode == "train")
        if no_grad:
            with torch.no_grad():
                got, ref = optimized(ids), module(ids)
            torch.testing.assert_close(torch.where(valid, got, 0), torch.where(valid, ref, 0), rtol=rtol, atol=atol)
            continue
        module.zero_grad(set_to_none=True)
        got = optimized(ids)
        masked(got).square().sum().backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        module.zero_grad(set_to_none=True)
        ref = module(ids)
        masked(ref).square().sum().backward()
        torch.testing.assert_close(torch.where(valid, got, 0), torch.where(valid, ref, 0), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{mode}: values differ\n{m}")
        assert grads.keys() == {n for n, p in module.named_parameters() if p.grad is not None}, mode
        for n, p in module.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(grads[n], p.grad, rtol=rtol, atol=atol, msg=lambda m, n=n: f"{mode}: {n}\n{m}")
    return grcompile.report(optimized)


def heads(x: torch.Tensor) -> torch.Tensor:  # [B, N, D] -> [B, H, N, D/H]
    return x.view(x.shape[0], x.shape[1], H, -1).transpose(1, 2)


# --------------------------------------------------------------------------------------------
# F.scaled_dot_product_attention


class SDPA(nn.Module):
    def __init__(self, mask: str, scale=None, dropout_p=0.0):
        super().__init__()
        self.mask, self.scale, self.p = mask, scale, dropout_p
        self.emb = nn.Embedding(VOCAB, D)
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, ids):
        B, n = ids.shape
        valid = ids != 0
        q, k, v = (heads(t) for t in self.qkv(self.emb(ids)).chunk(3, dim=-1))
        kw = {}
        if self.mask == "bool_keys":  # [B, 1, 1, N]
            kw["attn_mask"] = valid[:, None, None, :]
        elif self.mask == "bool_causal":  # [B, 1, N, N]
            kw["attn_mask"] = valid[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()
        elif self.mask == "float_keys":  # additive, -inf
            kw["attn_mask"] = torch.zeros(B, 1, 1, n, dtype=q.dtype).masked_fill(~valid[:, None, None, :], -math.inf)
        elif self.mask == "float_causal_2d":  # [N, N] additive causal + the key padding, -1e4
            causal = torch.full((n, n), -1e4, dtype=q.dtype).triu(1)
            kw["attn_mask"] = causal + (~valid[:, None, None, :]).to(q.dtype) * -1e4
        elif self.mask == "is_causal":  # no key mask at all: padded keys are only excluded by the data
            kw["is_causal"] = True
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, scale=self.scale, **kw)
        return out.transpose(1, 2).reshape(B, n, D)


@pytest.mark.parametrize("mask,causal", [
    pytest.param("bool_keys", False, marks=pytest.mark.slow), ("bool_causal", True),
    pytest.param("float_keys", False, marks=pytest.mark.slow), ("float_causal_2d", True)])
def test_sdpa_masks_fuse_and_stay_exact(mask, causal):
    torch.manual_seed(0)
    report = check(SDPA(mask).double(), padded())
    assert_fused(report, counter="sdpa_expanded", spelling="F.scaled_dot_product_attention", causal=causal)


def test_sdpa_empty_row_with_a_multiplied_loss():
    """SDPA gives 0 (not NaN) on a query row whose keys are all masked, and so does the fused op:
    a loss that multiplies the padded rows by 0 stays finite, gradients equal eager's."""
    torch.manual_seed(0)
    report = check(SDPA("bool_causal").double(), padded(), loss="mul")  # row 0 is all padding
    assert_fused(report, causal=True)


@pytest.mark.slow
def test_sdpa_scale_and_left_padding():
    torch.manual_seed(0)
    report = check(SDPA("bool_causal", scale=0.3).double(), padded(left=True))
    assert_fused(report, causal=True)


def test_sdpa_without_key_mask_is_kept_as_written():
    """is_causal alone: whether padded keys matter depends on where the padding is (data), so the
    call stays F.scaled_dot_product_attention (no spelled-out copy left behind), exact."""
    torch.manual_seed(0)
    report = check(SDPA("is_causal").double(), padded(left=True), modes=("eval",))
    assert not fused(report) and "fuse_attention.sdpa_expanded" not in report.counters
    (why,) = reasons(report)
    assert why.startswith("test_attention_spellings.py:") and "F.scaled_dot_product_attention kept as written" in why
    assert "padded keys" in why


def test_sdpa_dropout_moves_into_the_op():
    torch.manual_seed(0)
    m = SDPA("bool_causal", dropout_p=0.25).double()
    optimized = grcompile.optimize(m, passes=attention_pipeline(), lowering="eager")
    out = optimized(padded())
    (r,) = fused(grcompile.report(optimized))
    assert r["dropout_p"] == 0.25  # SDPA applies dropout_p whatever the module's mode
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------
# nn.MultiheadAttention


class MHA(nn.Module):
    def __init__(self, batch_first=True, attn_mask=None, need_weights=False, return_weights=False,
                 average=True, kpm="bool", dropout=0.0):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.mha = nn.MultiheadAttention(D, H, dropout=dropout, batch_first=batch_first)
        self.batch_first, self.attn_mask, self.kpm = batch_first, attn_mask, kpm
        self.need_weights, self.return_weights, self.average = need_weights, return_weights, average

    def forward(self, ids):
        B, n = ids.shape
        pad = ids == 0
        x = self.emb(ids)
        if not self.batch_first:
            x = x.transpose(0, 1)
        attn_mask = None
        if self.attn_mask == "bool":  # True = blocked
            attn_mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
        elif self.attn_mask == "float":
            attn_mask = torch.triu(torch.full((n, n), -math.inf, dtype=x.dtype), 1)
        elif self.attn_mask == "3d":  # [B * H, N, N], True = blocked, built with repeat_interleave
            allowed = torch.ones(n, n, dtype=torch.bool).tril() & ~pad[:, None, :]
            attn_mask = (~allowed).repeat_interleave(H, dim=0)
        kpm = pad if self.kpm == "bool" else torch.zeros(B, n, dtype=x.dtype).masked_fill(pad, -1e9)
        out, w = self.mha(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=self.need_weights,
                          average_attn_weights=self.average)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return (out, w) if self.return_weights else out


@pytest.mark.parametrize("kw,causal", [
    (dict(batch_first=True, attn_mask="bool"), True),
    pytest.param(dict(batch_first=False, attn_mask="bool"), True, marks=pytest.mark.slow),
    pytest.param(dict(batch_first=True, attn_mask="float", kpm="float"), True, marks=pytest.mark.slow),
    pytest.param(dict(batch_first=True), False, marks=pytest.mark.slow),
    (dict(batch_first=True, attn_mask="3d"), True),
    # weights computed but not used: fused (also covered by the all-padding-row test below)
    pytest.param(dict(batch_first=False, need_weights=True), False, marks=_SLOW),
])
def test_multihead_attention_fuses(kw, causal):
    torch.manual_seed(0)
    ids = padded([2, 1, N, 5, 3]) if kw.get("need_weights") else padded()  # need_weights: no empty row (NaN)
    report = check(MHA(**kw).double(), ids)
    assert_fused(report, counter="mha_expanded", spelling="nn.MultiheadAttention", causal=causal)


@pytest.mark.parametrize("average", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_multihead_attention_weights_returned_stay_dense(average):
    """need_weights=True with the weights used: they are an output [B, (H,) N, N] the fused op does
    not produce, so the layer stays as written (exact, weights included)."""
    torch.manual_seed(0)
    m = MHA(attn_mask="bool", need_weights=True, return_weights=True, average=average).double()
    ids = padded([2, 1, N, 5, 3])
    optimized = grcompile.optimize(m, passes=attention_pipeline(), lowering="eager")
    (out, w), (ref_out, ref_w) = optimized(ids), m(ids)
    valid = (ids != 0)[..., None]
    torch.testing.assert_close(torch.where(valid, out, 0), torch.where(valid, ref_out, 0))
    torch.testing.assert_close(w, ref_w)
    report = grcompile.report(optimized)
    assert not fused(report)
    (why,) = reasons(report)
    assert "nn.MultiheadAttention kept as written" in why and "weights" in why


def test_multihead_attention_all_padding_row_with_need_weights():
    """Decided: MHA's need_weights=True path gives NaN on an all-padding row (softmax over -inf
    only) and NaN gradients everywhere, even with a masked loss. The fused op gives 0 there, so
    values at valid positions equal eager and the gradients are finite — those of the same model
    with need_weights=False (SDPA's path, which returns 0 on such rows)."""
    torch.manual_seed(0)
    m = MHA(batch_first=True, need_weights=True).double()
    ids = padded()  # row 0 is all padding
    valid = (ids != 0)[..., None]
    optimized = grcompile.optimize(m, passes=attention_pipeline(), lowering="eager")
    got = optimized(ids)
    torch.where(valid, got, 0).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    assert_fused(grcompile.report(optimized))
    m.zero_grad()
    ref = m(ids)
    torch.where(valid, ref, 0).square().sum().backward()
    assert torch.isnan(ref[0]).all() and torch.isnan(m.mha.in_proj_weight.grad).any()  # eager's behaviour
    assert torch.isnan((ref * valid).sum()) and torch.isfinite((got * valid).sum())  # a multiplied loss
    torch.testing.assert_close(torch.where(valid, got, 0), torch.where(valid, ref, 0))
    m.zero_grad()
    m.need_weights = False
    sdpa = m(ids)
    torch.where(valid, sdpa, 0).square().sum().backward()
    for n, p in m.named_parameters():
        assert torch.isfinite(grads[n]).all(), n
        torch.testing.assert_close(grads[n], p.grad, msg=n)


# --------------------------------------------------------------------------------------------
# nn.TransformerEncoder / nn.TransformerEncoderLayer


class Encoder(nn.Module):
    def __init__(self, norm_first=False, causal=False, batch_first=True, layers=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, H, 2 * D, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.causal, self.batch_first = causal, batch_first

    def forward(self, ids):
        n = ids.shape[1]
        x = self.emb(ids)
        x = x if self.batch_first else x.transpose(0, 1)
        pad = ids == 0
        if self.causal == "float":  # the usual pair: a float causal mask, a bool key padding mask
            out = self.enc(x, mask=nn.Transformer.generate_square_subsequent_mask(n, dtype=x.dtype),
                           src_key_padding_mask=pad, is_causal=True)
        elif self.causal:  # bool mask and bool key padding: the same mask type (no deprecation warning)
            out = self.enc(x, mask=torch.triu(torch.ones(n, n, dtype=torch.bool), 1), src_key_padding_mask=pad,
                           is_causal=True)
        else:
            out = self.enc(x, src_key_padding_mask=pad)
        return out if self.batch_first else out.transpose(0, 1)


@pytest.mark.parametrize("kw", [pytest.param(dict(), marks=pytest.mark.slow), dict(norm_first=True, causal=True),
                                pytest.param(dict(batch_first=False, causal=True), marks=pytest.mark.slow)])
def test_transformer_encoder_fuses_every_layer(kw):
    torch.manual_seed(0)
    report = check(Encoder(**kw).double(), padded())
    assert_fused(report, per_graph=2, counter="mha_expanded", causal=kw.get("causal", False))


def test_transformer_encoder_mismatched_mask_types_fuse_and_still_warn():
    """torch warns (warnings.warn) when the mask and the key padding mask differ in type; Dynamo
    would break the graph there and run the encoder eagerly. Inside grcompile's calls the warning
    is moved after the graph: the layers fuse, and the user still sees the warning."""
    torch.manual_seed(0)
    m = Encoder(causal="float").double()
    optimized = grcompile.optimize(m, passes=attention_pipeline(), lowering="eager")
    with pytest.warns(UserWarning, match="mismatched"):
        optimized(padded())
    report = grcompile.report(optimized)
    assert report.graph_breaks == 0
    assert_fused(report, per_graph=2, counter="mha_expanded", causal=True)
    torch._dynamo.reset()
    check(m, padded(), modes=("train",))


def test_transformer_encoder_eval_no_grad_takes_the_fusable_path():
    """In eval mode under no_grad, torch would take the native fast path (an opaque
    ``_transformer_encoder_layer_fwd``); grcompile runs its calls with the fast path off, so the
    Python path is traced and fused. Same values (the fast path's own padded rows aside)."""
    torch.manual_seed(0)
    m = Encoder().double()
    report = check(m, padded(), modes=("eval",), no_grad=True)
    assert_fused(report, per_graph=2, counter="mha_expanded")
    assert torch.backends.mha.get_fastpath_enabled()  # only switched off inside the optimized call


# --------------------------------------------------------------------------------------------
# masks as people build them (explicit softmax attention)


class Explicit(nn.Module):
    """``softmax(q kᵀ / √d + mask) @ v`` with the mask spelled by ``how``."""

    def __init__(self, how: str, max_len=N):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(VOCAB, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.causal_np = np.triu(np.ones((max_len, max_len), dtype=bool), 1)  # a numpy attribute
        self.register_buffer("causal_buffer", torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len))

    def forward(self, ids):
        B, n = ids.shape
        valid = ids != 0
        q, k, v = (heads(t) for t in self.qkv(self.emb(ids)).chunk(3, dim=-1))
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        how = self.how
        if how == "tril_and":
            mask = torch.tril(torch.ones(n, n, dtype=torch.bool)) & valid[:, None, None, :]
            p = torch.softmax(s.masked_fill(~mask, -1e9), dim=-1)
        elif how == "inverted_triu":
            mask = ~torch.triu(torch.ones(n, n, dtype=torch.bool), 1) & valid[:, None, None, :]
            p = torch.softmax(s.masked_fill(~mask, -1e9), dim=-1)
        elif how == "eq_zero":  # BERT4Rec: masked_fill(mask == 0, -1e9), mask repeated over queries and heads
            mask = valid.unsqueeze(1).repeat(1, n, 1).unsqueeze(1).repeat(1, H, 1, 1)
            p = torch.softmax(s.masked_fill(mask == 0, -1e9), dim=-1)
        elif how == "expand_tril_where":  # RecBole: [B,1,1,N] -> expand -> tril -> where(m, 0, -1e4) added
            m = torch.tril(valid[:, None, None, :].expand(-1, -1, n, -1))
            p = torch.softmax(s + torch.where(m, 0.0, -10000.0), dim=-1)
        elif how == "repeat_heads":  # [B, 1, N, N] tiled over the heads
            m = (torch.ones(n, n, dtype=torch.bool).tril() & valid[:, None, :])[:, None]
            p = torch.softmax(s.masked_fill(~m.repeat_interleave(H, dim=1), -1e9), dim=-1)
        elif how == "numpy_in_forward":  # the Annotated Transformer's subsequent_mask
            sub = torch.from_numpy(np.triu(np.ones((1, n, n)), k=1).astype("uint8")) == 0
            p = torch.softmax(s.masked_fill(~(sub[:, None] & valid[:, None, None, :]), -1e9), dim=-1)
        elif how == "numpy_attribute":
            blocked = torch.as_tensor(self.causal_np[:n, :n]) | ~valid[:, None, None, :]
            p = torch.softmax(s.masked_fill(blocked, -1e9), dim=-1)
        elif how == "buffer":  # minGPT: a tril buffer sliced to N
            p = torch.softmax(s.masked_fill(self.causal_buffer[:, :, :n, :n] == 0, -1e9)
                              .masked_fill(~valid[:, None, None, :], -1e9), dim=-1)
        elif how == "inf_nan_to_num":
            mask = torch.tril(torch.ones(n, n, dtype=torch.bool)) & valid[:, None, None, :]
            p = torch.nan_to_num(torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1))
        elif how == "inf_isnan_fill":
            mask = torch.tril(torch.ones(n, n, dtype=torch.bool)) & valid[:, None, None, :]
            p = torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1)
            p = p.masked_fill(torch.isnan(p), 0.0)
        elif how == "float64_mask":
            mask = torch.tril(torch.ones(n, n, dtype=torch.float64)) * valid[:, None, None, :]
            p = torch.softmax(s.masked_fill(mask == 0, -math.inf), dim=-1)
            p = torch.where(torch.isnan(p), torch.zeros_like(p), p)
        elif how == "eye_self_loop":  # every query keeps its own key (no row is empty, padded ones too)
            mask = (torch.tril(torch.ones(n, n, dtype=torch.bool)) & valid[:, None, None, :]) | torch.eye(n).bool()
            p = torch.softmax(s.masked_fill(~mask, -1e9), dim=-1)
        elif how == "query_rows_only":  # masks the padded *queries* only: padded keys still count
            p = torch.softmax(s.masked_fill(~valid[:, None, :, None], -1e9), dim=-1)
        elif how == "query_rows_after_softmax":
            p = torch.softmax(s, dim=-1) * valid[:, None, :, None]
        else:
            raise ValueError(how)
        return (p @ v).transpose(1, 2).reshape(B, n, D)


@pytest.mark.parametrize("how,causal", [
    pytest.param("tril_and", True, marks=_SLOW), pytest.param("inverted_triu", True, marks=_SLOW),
    ("eq_zero", False), ("expand_tril_where", True), pytest.param("repeat_heads", True, marks=_SLOW),
    ("numpy_in_forward", True), pytest.param("numpy_attribute", True, marks=_SLOW), ("buffer", True),
    ("inf_nan_to_num", True), pytest.param("inf_isnan_fill", True, marks=_SLOW), ("float64_mask", True),
    ("eye_self_loop", True),
])
def test_masks_as_people_build_them(how, causal):
    torch.manual_seed(0)
    # -inf masks with a NaN guard: an empty row is fine; -1e9 masks: eager averages an empty row's
    # padded values (no key left), which the fused op (0 there) does not copy — padded rows only
    ids = padded() if "inf" in how or how.startswith("float64") else padded([2, 1, N, 5, 3])
    report = check(Explicit(how).double(), ids)
    assert_fused(report, causal=causal)


def test_eye_self_loop_fuses_for_every_sequence_length():
    """``| torch.eye(N)`` is computed in the op as ``q_pos == k_pos``: a valid query and a padded key
    are never the same token, so padded keys stay provably masked — also in the graph compiled
    for any N after a shape change, where eye(N) has no values to enumerate (it fell back)."""
    torch.manual_seed(0)
    module = Explicit("eye_self_loop").double()
    optimized = grcompile.optimize(module, passes=attention_pipeline(), lowering="eager")
    for ids in (padded(), padded([4, 0, 6, 1], n=6, seed=1), padded([7, 2, 3], n=7, seed=2)):
        valid = (ids != 0)[..., None]
        module.zero_grad(set_to_none=True)
        got = optimized(ids)
        torch.where(valid, got, 0).square().sum().backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        module.zero_grad(set_to_none=True)
        ref = module(ids)
        torch.where(valid, ref, 0).square().sum().backward()
        torch.testing.assert_close(torch.where(valid, got, 0), torch.where(valid, ref, 0))
        for n, p in module.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, msg=n)
    report = grcompile.report(optimized)
    assert report.compiles == 2  # the static graph, then one for any N
    assert_fused(report, causal=True)


@pytest.mark.parametrize("how", ["query_rows_only", "query_rows_after_softmax"])
def test_mask_on_query_rows_only_stays_dense(how):
    """Padded keys are not masked, so valid outputs depend on them: prove it (changing a padded
    token's embedding changes a valid output), and the attention must stay dense, exactly."""
    torch.manual_seed(0)
    m = Explicit(how).double()
    ids = padded([2, 1, N, 5, 3])
    report = check(m, ids)
    expected = "padded keys" if how == "query_rows_only" else "changed after their softmax"
    assert not fused(report) and reasons(report) and all(expected in r for r in reasons(report)), reasons(report)
    with torch.no_grad():
        before = m(ids)
        m.emb.weight[0] += 1.0  # the padding id's embedding: read only at padded positions
        after = m(ids)
    valid = (ids != 0)[..., None]
    assert not torch.allclose(torch.where(valid, before, 0), torch.where(valid, after, 0))


@pytest.mark.parametrize("lowering", ["eager", pytest.param("inductor", marks=_SLOW)])
def test_buffer_mask_changed_after_compile_raises(lowering):
    """A mask read from a buffer is proved at compile time; Dynamo does not guard on tensor values,
    so the graph checks the value on every call and refuses to run with another one."""
    torch.manual_seed(0)
    m = Explicit("buffer").double()
    optimized = grcompile.optimize(m, passes=attention_pipeline(), lowering=lowering)
    ids = padded([2, 1, N, 5, 3])
    optimized(ids)
    assert_fused(grcompile.report(optimized))
    with torch.no_grad():
        m.causal_buffer.fill_(1.0)  # no longer causal
    with pytest.raises(RuntimeError, match="changed after grcompile compiled"):
        optimized(ids)


# --------------------------------------------------------------------------------------------
# bias tables of any shape


def t5_bucket(relative_position: torch.Tensor, num_buckets=8, max_distance=16) -> torch.Tensor:
    """T5's bidirectional log-bucketing of ``j - i``."""
    num_buckets //= 2
    buckets = (relative_position > 0).long() * num_buckets
    n = relative_position.abs()
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (torch.log(n.float() / max_exact + 1e-9) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.minimum(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, n, large)


class Biased(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(VOCAB, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.t5 = nn.Embedding(8, H)  # num_buckets x heads
        self.per_head = nn.Parameter(torch.randn(2 * N - 1, H))
        self.shared = nn.Parameter(torch.randn(2 * N - 1))
        self.pair = nn.Parameter(torch.randn(H, N, N) * 0.1)

    def forward(self, ids):
        B, n = ids.shape
        valid = ids != 0
        q, k, v = (heads(t) for t in self.qkv(self.emb(ids)).chunk(3, dim=-1))
        pos = torch.arange(n)
        rel = pos[None, :] - pos[:, None]  # j - i
        if self.how == "t5_embedding":  # [N, N, H] -> [1, H, N, N]
            bias = self.t5(t5_bucket(rel)).permute(2, 0, 1).unsqueeze(0)
        elif self.how == "per_head_param":
            bias = self.per_head[rel + n - 1].permute(2, 0, 1)[None]
        elif self.how == "one_hot_shared":
            bias = F.one_hot(rel + n - 1, 2 * N - 1).to(self.shared.dtype) @ self.shared
        elif self.how == "one_hot_per_head":
            bias = (F.one_hot(rel + n - 1, 2 * N - 1).to(self.per_head.dtype) @ self.per_head).permute(2, 0, 1)
        elif self.how == "pair_param":  # a learned [H, N, N] bias sliced to N
            bias = self.pair[:, :n, :n]
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
        s = s.masked_fill(~valid[:, None, None, :], -1e9)
        return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, n, D)


@pytest.mark.parametrize("how,head_index", [("t5_embedding", True), pytest.param("per_head_param", True, marks=_SLOW),
                                            ("one_hot_shared", False), pytest.param("one_hot_per_head", True, marks=_SLOW),
                                            ("pair_param", True)])
def test_bias_tables_of_any_shape(how, head_index):
    torch.manual_seed(0)
    report = check(Biased(how).double(), padded([2, 1, N, 5, 3]))
    assert_fused(report, head_index=head_index)
    # the learned table, plus (T5) the position-only part of the bucketing folded into an [N, N] constant
    assert all(r["bias_tables"] == (2 if how == "t5_embedding" else 1) for r in fused(report))


# --------------------------------------------------------------------------------------------
# inductor lowering, float32


@pytest.mark.parametrize("module", [lambda: MHA(attn_mask="bool"),
                                    pytest.param(lambda: Biased("t5_embedding"), marks=_SLOW)], ids=["mha", "t5"])
def test_inductor_lowering(module):
    torch.manual_seed(0)
    report = check(module(), padded([2, 1, N, 5, 3]), lowering="inductor", rtol=1e-4, atol=1e-5)
    assert_fused(report)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_random_length_mixes(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, N + 1, (5,), generator=g).tolist() + [0, N]
    torch.manual_seed(seed)
    check(MHA(attn_mask="bool").double(), padded(lengths, left=bool(seed % 2), seed=seed))
    torch._dynamo.reset()
    check(Biased("t5_embedding").double(), padded([max(x, 1) for x in lengths], seed=seed))
