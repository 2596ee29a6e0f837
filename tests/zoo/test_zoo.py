"""The zoo: padded sequential recommenders written in outside styles (one file each, see
harness.py), run through ``grcompile.optimize``.

- exactness (never wrong, never a crash): values at the positions that count and every parameter
  gradient equal eager, on one optimized module through train -> eval (no_grad) -> train and a new
  batch size and padded length. Default run: every model with eager lowering, two with inductor.
  ``-m slow``: every model with both lowerings, eval with gradients too, five more shapes, and
  training with dropout on.
- expectations: each model's ``EXPECT`` is what is *legal* on it; where today's pipeline does not
  deliver it the test is a strict xfail naming what is missing, so this file says what works.
"""
from __future__ import annotations

import re

import pytest
import torch

from .harness import (BATCH, MAX_LEN, MODELS, MORE_SHAPES, SHAPES, Pair, eval_fused_count, first_report, fused_count,
                      jagged, load, run_bf16, run_fp8, run_sequence, run_with_dropout)

# inductor lowering in the default run (about a minute each): a hand-written additive-mask SASRec
# and the softmax over the sequence axis (inductor's own attention rewrite is wrong there)
INDUCTOR_DEFAULT = ["recbole_sasrec", "linrec"]

# model -> what today's pipeline does not deliver of its EXPECT (strict xfail: a pass that starts
# to deliver it turns the test into a failure, and the entry is then removed)
NOT_YET: dict[str, str] = {
    "llama_rope_rmsnorm": "the rotary cos/sin tables are computed from cumsum position ids (a scan along the "
                          "positions has no row-wise layout), so the rotations and what reads them stay dense",
}

# model -> why its no_grad eval graph (inference) does not fuse what its training graph fuses
NOT_YET_EVAL: dict[str, str] = {}

# models whose fallback reasons are not yet sentences naming the user's op (raw reprs)
NOT_YET_SENTENCES: dict[str, str] = {}

# at most 2 compiles while B, N and the length mix vary (issue 10, symbolic shapes)
NOT_YET_SHAPES: dict[str, str] = {}
SHAPE_MODELS = ["mha_batch_first"]  # default run; all three under -m slow
SHAPE_MODELS_SLOW = ["hstu_onehot_einsum", "recbole_sasrec"]


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _xfail(names, why: dict[str, str]):
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=f"not yet: {why[n]}")) if n in why else n
            for n in names]


def test_zoo_is_complete():
    assert len(MODELS) >= 18, MODELS
    for name in MODELS:
        user, expect = load(name)
        assert set(expect) == {"fused_attention", "jagged", "dense_reason"}, name
        dense = expect["fused_attention"] == 0 or not expect["jagged"]
        assert bool(expect["dense_reason"]) == (not expect["jagged"]), f"{name}: say why it stays dense"
        assert dense or not expect["dense_reason"], name
        args = user.batch(BATCH, MAX_LEN, 0)
        ids = args[0]
        assert ids.shape == (BATCH, MAX_LEN) and ids.dtype == torch.long, name
        tokens = ids != 0
        assert (~tokens).all(1).any(), f"{name}: the batch needs an all-padding row"
        assert (tokens[:, 0] & tokens[:, -1]).any(), f"{name}: the batch needs a full-span row"
        assert (tokens.sum(1) == 1).any(), f"{name}: the batch needs a length-1 row"


@pytest.mark.parametrize("name", MODELS)
def test_exact_eager_lowering(name):
    """train -> eval (no_grad) -> train, then a new B and N: the lean default."""
    run_sequence(name, "eager", shapes=SHAPES[:1], eval_grad=False)


@pytest.mark.parametrize("name", INDUCTOR_DEFAULT)
def test_exact_inductor_lowering(name):
    run_sequence(name, "inductor", shapes=(), eval_grad=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_exact_inductor_lowering_with_shape_changes(name):
    run_sequence(name, "inductor", shapes=SHAPES + MORE_SHAPES)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_exact_eager_lowering_eval_grad_and_more_shapes(name):
    run_sequence(name, "eager", shapes=SHAPES + MORE_SHAPES)


@pytest.mark.slow  # the fused attention compiles its dropout kernels: a minute or more per model
@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("name", MODELS)
def test_dropout_trains_and_eval_is_exact_all(name, lowering):
    run_with_dropout(name, lowering)


@pytest.mark.parametrize("name", _xfail(MODELS, NOT_YET))
def test_expected_rewrites(name):
    report = first_report(name)
    _, expect = load(name)
    assert fused_count(report) == expect["fused_attention"], f"fused attentions vs EXPECT\n{report}"
    assert jagged(report) == expect["jagged"], f"row-wise block jagged vs EXPECT\n{report}"
    if expect["dense_reason"]:  # what stays dense says why
        assert report.fallbacks, f"{name} stays dense without a reason in the report\n{report}"


@pytest.mark.parametrize("name", _xfail(MODELS, NOT_YET_EVAL))
def test_expected_rewrites_in_eval_no_grad(name):
    """Inference fuses what is legal too (the legality does not depend on gradients)."""
    _, expect = load(name)
    assert eval_fused_count(name) == expect["fused_attention"]


_RAW = re.compile(r"<built-in|<function|<method| at 0x[0-9a-f]+")


@pytest.mark.parametrize("name", _xfail(MODELS, NOT_YET_SENTENCES))
def test_fallback_reasons_are_sentences(name):
    report = first_report(name)
    for f in report.fallbacks:
        assert not _RAW.search(f["reason"]), f"raw repr in a fallback reason: {f}"
        assert re.match(r"[\w.]+\.py:\d+", f["site"]) or f["site"].startswith("<graph"), \
            f"fallback site does not name a source line: {f}"


@pytest.mark.parametrize("name", _xfail(SHAPE_MODELS, NOT_YET_SHAPES)
                         + [pytest.param(p, marks=pytest.mark.slow) for p in _xfail(SHAPE_MODELS_SLOW, NOT_YET_SHAPES)])
def test_few_compiles_while_shapes_vary(name):
    """B, N and the length mix change every step: exact every time, at most 2 compiles (the passes
    still fire: the expectations of the first graph hold for the last)."""
    user, _ = load(name)
    pair = Pair(user, "eager")
    for i, (b, n) in enumerate([(5, 12), (3, 12), (5, 9), (6, 7), (2, 11), (4, 10)]):
        pair.step(b, n, seed=20 + i, train=True)
        report = pair.report()
        assert report.compiles <= 2, f"{report.compiles} compiles after {i + 1} shapes\n{report}"
    _, expect = load(name)
    last = max(r["graph"] for r in report.rewrites)
    fused_last = sum(r["op"] == "score_mod_attention" and r["graph"] == last for r in report.rewrites)
    assert fused_last == expect["fused_attention"], f"graph {last} fused {fused_last}\n{report}"


def test_user_jagged_ops_do_not_recompile_per_length_mix():
    """fbgemm dense_to_jagged in forward: T is data dependent; a new length mix at the same B and N
    must reuse the compiled graphs."""
    user, _ = load("fbgemm_user_jagged")
    pair = Pair(user, "eager")
    pair.step(BATCH, MAX_LEN, seed=0, train=True)
    compiles = pair.report().compiles
    for seed in (1, 2, 3):
        pair.step(BATCH, MAX_LEN, seed=seed, train=True)
    assert pair.report().compiles == compiles, pair.report()


def test_dense_models_really_read_their_padding():
    """The models that must stay dense do depend on padding at valid positions (so packing them would
    be wrong, and the exactness tests above would see it): TiSASRec's valid queries read padded keys
    (change the time intervals towards padded keys only: valid outputs move); LinRec's sequence-axis
    softmax counts padded positions (pad two more positions: valid outputs move)."""
    user, _ = load("tisasrec")
    model = user.module.eval()
    seq, interval = user.batch(BATCH, MAX_LEN, 0)
    valid = seq != 0
    towards_padding = valid[:, :, None] & ~valid[:, None, :]  # (valid query, padded key)
    assert towards_padding.any()
    with torch.no_grad():
        moved = model(seq, torch.where(towards_padding, (interval + 3) % 17, interval)) - model(seq, interval)
    assert moved[valid].abs().max() > 1e-3

    user, _ = load("linrec", max_len=MAX_LEN + 2)
    model = user.module.eval()
    ids = user.batch(BATCH, MAX_LEN, 0)[0]
    with torch.no_grad():
        short, longer = model(ids), model(torch.nn.functional.pad(ids, (0, 2)))
    valid = ids != 0
    assert (longer[:, :MAX_LEN] - short)[valid].abs().max() > 1e-3


# The Triton kernels (run by Triton's interpreter on CPU): each zoo model's captured score_mod is
# generated into the attention kernel. Default run: the per-head tables, 0-d tables, bool masks
# and time buckets (log-bucketed and torch.bucketize-d); -m slow: every model.
TRITON_DEFAULT = ["t5_bucket_bias", "hstu_onehot_einsum", "hstu_gather_holes", "negatives_rn", "time_bucketize_bias"]


def _exact_with_triton(name: str) -> None:
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 before triton is imported")
    from grcompile.lowering import OPS, use_backend
    before = {op: OPS[op].calls["triton"] for op in ("jagged_attention", "jagged_attention_backward")}
    fallbacks = {op: dict(OPS[op].fallbacks) for op in before}
    with use_backend("triton"):
        first, _ = run_sequence(name, "eager", shapes=SHAPES[:1], eval_grad=False)
    if fused_count(first):
        for op in before:
            assert OPS[op].calls["triton"] > before[op], f"{op} never ran its Triton kernel"
            new = {k: v for k, v in OPS[op].fallbacks.items() if k not in fallbacks[op]}
            assert not new, f"{op} handed score_mods to the reference: {new}"


@pytest.mark.parametrize("name", TRITON_DEFAULT)
def test_exact_with_triton_kernels(name):
    _exact_with_triton(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_exact_with_triton_kernels_all(name):
    _exact_with_triton(name)


@pytest.mark.parametrize("name", MODELS)
def test_fp8_is_the_model_with_fp8_linears(name):
    """``precision="fp8"`` on code nobody here wrote: equal to the eager model with its linears in
    emulated FP8, and every layer it leaves alone is either counted (float64, convolutions) or
    reported (unaligned dims, a whole attention module) — never silently dropped."""
    report = run_fp8(name)
    converted = report.counters.get("fp8_linear.fp8_linear", 0)
    left = sum(v for k, v in report.counters.items() if k.startswith("fp8_linear.skipped_"))
    assert converted + left > 0, f"{name}: the fp8_linear pass saw no linear"


@pytest.mark.parametrize("name", MODELS)
def test_bf16_autocast_keeps_every_rewrite_and_the_eager_accuracy(name):
    """Code nobody here wrote, under torch.autocast(bfloat16): the same rewrites as in float32, and
    outputs and gradients as close to float32 eager as eager bf16 is."""
    rewrites32, rewrites16 = run_bf16(name)
    assert rewrites16 == rewrites32



# model -> why AOTAutograd cannot split its symbolic-shape graph (the graph then runs as is, saving
# every activation, reported; values stay exact — checked before the strict xfail's assertion)
REMAT_NOT_YET: dict[str, str] = {}


@pytest.mark.parametrize("name", [pytest.param(m, marks=pytest.mark.xfail(reason=REMAT_NOT_YET[m], strict=True))
                                  if m in REMAT_NOT_YET else m for m in MODELS])
def test_remat_is_exact(name):
    """``remat=True`` on code nobody here wrote: train steps (two shapes) and an eval step equal
    eager, values and gradients; where the model has a fused norm, the policy tagged something."""
    user, _ = load(name)
    pair = Pair(user, "eager", options={"remat": True})
    pair.step(BATCH, MAX_LEN, seed=0, train=True)
    pair.step(*SHAPES[0], seed=1, train=True)
    pair.step(BATCH, MAX_LEN, seed=2, train=False, grad=False)
    report = pair.report()
    assert not [u for u in report.unoptimized if u["kind"] == "remat_error"], report.unoptimized
    if report.counters.get("fuse_norm_gate.gated_norm", 0) + report.counters.get("fuse_norm_gate.norm", 0):
        assert report.counters.get("remat_policy.recompute", 0) > 0, report.counters
