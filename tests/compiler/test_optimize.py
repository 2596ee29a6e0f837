"""grcompile.optimize / report / dumps / pass manager on the tiny naive models.

Optimized vs eager with ``assert_close`` on outputs and parameter gradients; the pipeline's
bookkeeping (rewrites, fallbacks, counters, dumps) with test-only passes.
"""
from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import grcompile
from grcompile import GraphPass, PassContext
from grcompile.modes import COMPILE_MODES, apply_compile_mode, describe_mode
from models import SampledSoftmaxRetrieval, build_encoder

TINY = dict(embedding_dim=16, num_blocks=2, num_heads=2, attention_dim=8, linear_dim=8, dropout=0.0)
B, N, NUM_ITEMS = 4, 16, 50
LENGTHS = [0, 1, 9, N]  # an empty row, a length-1 row, a middle one, a full row


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_encoder(model: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_encoder(model, "ml1m", num_items=NUM_ITEMS, max_len=N, **{**TINY, **overrides})


def make_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    valid = torch.arange(N).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)
    ids = torch.randint(1, NUM_ITEMS + 1, (B, N), generator=g) * valid
    ts = torch.cumsum(torch.randint(1, 5000, (B, N), generator=g), dim=1) * valid
    return ids, ts


def check_outputs_and_grads(model: str, model_overrides: dict | None = None, **options) -> torch.nn.Module:
    """Optimized copy vs eager copy: same outputs, same parameter gradients."""
    eager = make_encoder(model, **(model_overrides or {}))
    opt_model = copy.deepcopy(eager)
    optimized = grcompile.optimize(opt_model, **options)
    ids, ts = make_batch()
    weights = torch.randn(B, N, TINY["embedding_dim"], generator=torch.Generator().manual_seed(1))

    expected = eager(ids, ts)
    (expected * weights).sum().backward()
    actual = optimized(ids, ts)
    (actual * weights).sum().backward()

    torch.testing.assert_close(actual, expected)
    for (name, p_eager), (_, p_opt) in zip(eager.named_parameters(), opt_model.named_parameters()):
        assert p_opt.grad is not None, name
        # float32: the fused norm's analytic backward rounds differently from autograd's chain
        # (float64 tests elsewhere hold the default tolerances)
        torch.testing.assert_close(p_opt.grad, p_eager.grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    return optimized


# --- test-only passes ------------------------------------------------------------------------

_SILU = (F.silu, torch.nn.functional.silu, torch.ops.aten.silu.default)


class ExpandSilu(GraphPass):
    """Matches ``silu(x)``; emits ``x * sigmoid(x)``; keeps values (same function)."""

    name = "expand_silu"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in _SILU and not node.kwargs.get("inplace"):
                x = node.args[0]
                with gm.graph.inserting_before(node):
                    sig = gm.graph.call_function(torch.sigmoid, (x,))
                    mul = gm.graph.call_function(operator.mul, (x, sig))
                sig.meta, mul.meta = dict(node.meta), dict(node.meta)  # keep the user's stack trace
                node.replace_all_uses_with(mul)
                gm.graph.erase_node(node)
                ctx.rewrite("silu->x*sigmoid", mul)
        ctx.count("visited_graphs")


class BreakThenRaise(GraphPass):
    """Replaces every silu with relu (wrong values!) and then raises: must be fully undone."""

    name = "break_then_raise"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in _SILU:
                node.target = F.relu
                ctx.rewrite("silu->relu", node)
        gm.register_buffer("junk", torch.zeros(1))
        raise RuntimeError("boom: unsupported pattern")


# --- (1) outputs and gradients ---------------------------------------------------------------

@pytest.mark.parametrize("model", ["hstu", "sasrec", "fuxi"])
def test_eager_lowering_matches_eager(model: str) -> None:
    optimized = check_outputs_and_grads(model, lowering="eager")
    rep = grcompile.report(optimized)
    assert rep.compiles >= 1 and rep.fallbacks == []
    assert {"score_mod_attention", "jagged_attention", "linear"} <= {r["op"] for r in rep.rewrites}


def test_inductor_lowering_matches_eager_hstu() -> None:
    # One block keeps the inductor compile (forward + backward) short on 2 cores.
    optimized = check_outputs_and_grads("hstu", model_overrides={"num_blocks": 1})  # lowering="inductor"
    rep = grcompile.report(optimized)
    assert rep.compiles == 1 and rep.lowering == "inductor"


# --- (2) training ----------------------------------------------------------------------------

def test_training_steps_match_eager() -> None:
    def train(optimize: bool) -> list[float]:
        task = SampledSoftmaxRetrieval(make_encoder("hstu"), temperature=0.05)
        step = grcompile.optimize(task, lowering="eager") if optimize else task
        adam = torch.optim.Adam(task.parameters(), lr=1e-3)
        losses = []
        for i in range(3):
            ids, ts = make_batch(seed=i)
            negatives = torch.randint(1, NUM_ITEMS + 1, (B, 8), generator=torch.Generator().manual_seed(100 + i))
            adam.zero_grad()
            loss = step(ids, ts, negatives)
            loss.backward()
            adam.step()
            losses.append(loss.item())
        if optimize:
            rep = grcompile.report(step)
            assert rep.compiles == 1 and rep.graph_breaks == 0, str(rep)
        return losses

    eager_losses = train(optimize=False)
    torch._dynamo.reset()
    torch.testing.assert_close(train(optimize=True), eager_losses)
    assert eager_losses[0] != eager_losses[-1]  # the steps did move the parameters


# --- (3) dumps -------------------------------------------------------------------------------

def _run_once(optimized: torch.nn.Module) -> None:
    ids, ts = make_batch()
    optimized(ids, ts).sum().backward()


def _check_captured_dump(dump_dir) -> str:
    path = dump_dir / "graph_0" / "00-captured.py"
    assert path.is_file(), sorted(p.name for p in dump_dir.rglob("*"))
    text = path.read_text()
    assert text.startswith("# grcompile graph 0: captured\n")
    assert "captured by Dynamo" in text and "lowering: eager" in text
    compile(text, str(path), "exec")  # readable *and* valid Python
    return text


def test_dump_dir_option(tmp_path) -> None:
    _run_once(grcompile.optimize(make_encoder("sasrec"), options={"dump_dir": str(tmp_path)}, lowering="eager"))
    text = _check_captured_dump(tmp_path)
    assert "def forward" in text


def test_dump_dir_env(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GRCOMPILE_DUMP_DIR", str(tmp_path))
    _run_once(grcompile.optimize(make_encoder("sasrec"), lowering="eager"))
    _check_captured_dump(tmp_path)


def test_no_dump_without_option(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("GRCOMPILE_DUMP_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    _run_once(grcompile.optimize(make_encoder("sasrec"), lowering="eager"))
    assert list(tmp_path.iterdir()) == []


# --- (4) a custom pass is reported, counted and dumped -----------------------------------------

def test_custom_pass_reported_counted_dumped(tmp_path) -> None:
    optimized = check_outputs_and_grads("hstu", passes=[ExpandSilu()], lowering="eager", dump_dir=tmp_path)
    rep = grcompile.report(optimized)
    # HSTU: two silu per block (uvqk projection, attention scores), two blocks.
    assert len(rep.rewrites) == 4 and rep.fallbacks == []
    assert {r["pass"] for r in rep.rewrites} == {"expand_silu"}
    assert all(r["site"].startswith("hstu.py:") for r in rep.rewrites), rep.rewrites
    assert rep.counters == {"expand_silu.silu->x*sigmoid": 4, "expand_silu.visited_graphs": 1}
    assert rep.passes == ["expand_silu"]
    text = str(rep)
    assert "4 rewrite(s)" in text and "expand_silu: silu->x*sigmoid" in text and "hstu.py:" in text
    assert '"expand_silu.silu->x*sigmoid": 4' in rep.to_json()

    dump = (tmp_path / "graph_0" / "01-expand_silu.py").read_text()
    assert dump.startswith("# grcompile graph 0: expand_silu\n# after pass 1/1 'expand_silu'\n# 4 rewrite(s)")
    compile(dump, "01-expand_silu.py", "exec")
    assert "functional.silu(" not in dump and "torch.sigmoid(" in dump
    assert "functional.silu(" in (tmp_path / "graph_0" / "00-captured.py").read_text()
    assert describe_mode(optimized).startswith("grcompile: 1 pass(es) in pipeline (expand_silu)")


def test_custom_pass_counted_when_nothing_matches() -> None:
    optimized = grcompile.optimize(make_encoder("sasrec"), passes=[ExpandSilu()], lowering="eager")
    _run_once(optimized)
    rep = grcompile.report(optimized)
    assert rep.rewrites == [] and "no pass fired" in str(rep)


# --- (5) a raising pass falls back and changes nothing -----------------------------------------

def test_raising_pass_falls_back(tmp_path) -> None:
    optimized = check_outputs_and_grads("hstu", passes=[BreakThenRaise(), ExpandSilu()], lowering="eager",
                                        dump_dir=tmp_path)
    rep = grcompile.report(optimized)
    assert len(rep.fallbacks) == 1
    fb = rep.fallbacks[0]
    assert fb["pass"] == "break_then_raise" and fb["site"] == "<graph 0>"
    assert "RuntimeError" in fb["reason"] and "boom: unsupported pattern" in fb["reason"]
    # the failed pass's records are dropped; the next pass ran on the restored graph
    assert {r["pass"] for r in rep.rewrites} == {"expand_silu"} and len(rep.rewrites) == 4
    assert not any(k.startswith("break_then_raise") for k in rep.counters)
    assert "1 fallback(s)" in str(rep) and "boom" in str(rep)
    assert "FELL BACK" in (tmp_path / "graph_0" / "01-break_then_raise.py").read_text()


def test_raising_pass_falls_back_under_inductor() -> None:
    """The restored graph keeps Dynamo's node attributes (AOTAutograd needs ``_dynamo_source``)."""
    optimized = check_outputs_and_grads("hstu", passes=[BreakThenRaise()])
    assert len(grcompile.report(optimized).fallbacks) == 1


def test_sasrec_with_attention_dropout_jagged_under_inductor() -> None:
    """SASRec as trained (dropout 0.3, also on the attention weights): fully jagged, lowered by
    inductor, gradients for every parameter."""
    task = SampledSoftmaxRetrieval(make_encoder("sasrec", dropout=0.3), temperature=0.05).train()
    optimized = grcompile.optimize(task)
    ids, ts = make_batch()
    negatives = torch.randint(1, NUM_ITEMS + 1, (B, N, 3), generator=torch.Generator().manual_seed(2))
    optimized(ids, ts, negatives).backward()
    assert all(p.grad is not None for p in task.parameters() if p.requires_grad)
    report = grcompile.report(optimized)
    assert not report.fallbacks and [r.get("dropout_p") for r in report.rewrites
                                     if r["op"] == "score_mod_attention"] == [0.3, 0.3]


# --- (6) misuse --------------------------------------------------------------------------------

def test_report_on_plain_module_raises() -> None:
    enc = make_encoder("sasrec")
    with pytest.raises(TypeError, match="grcompile.optimize"):
        grcompile.report(enc)
    with pytest.raises(TypeError, match="grcompile.optimize"):
        grcompile.report(torch.compile(enc, backend="eager"))
    grcompile.optimize(enc)
    with pytest.raises(TypeError):  # the state lives on the returned module, not the original
        grcompile.report(enc)


def test_option_errors() -> None:
    enc = make_encoder("sasrec")
    with pytest.raises(ValueError, match="dump_dri"):
        grcompile.optimize(enc, dump_dri="/tmp/x")
    with pytest.raises(ValueError, match="colour"):
        grcompile.optimize(enc, options={"colour": 1})
    with pytest.raises(ValueError, match="lowering"):
        grcompile.optimize(enc, lowering="tvm")
    with pytest.raises(TypeError, match="GraphPass"):
        grcompile.optimize(enc, passes=[lambda gm, ctx: None])
    with pytest.raises(ValueError, match="given twice"):
        grcompile.optimize(enc, options={"lowering": "eager"}, lowering="inductor")


# --- (7) the default pipeline ----------------------------------------------------------------

def test_empty_pipeline_report_says_no_passes() -> None:
    optimized = grcompile.optimize(make_encoder("sasrec"), lowering="eager", passes=[])
    rep = grcompile.report(optimized)
    assert rep.compiles == 0  # lazy: nothing compiled before the first call
    _run_once(optimized)
    rep = grcompile.report(optimized)
    text = str(rep)
    assert text.splitlines()[0] == ("grcompile report: 1 graph(s) compiled, 0 pass(es) in pipeline, "
                                    "0 rewrite(s), 0 fallback(s), 0 graph break(s)")
    assert "no passes in the pipeline: the graph is lowered unchanged" in text
    assert rep.to_dict()["passes"] == [] and '"compiles": 1' in rep.to_json()
    assert describe_mode(optimized) == "grcompile: 0 passes in pipeline (empty: graph lowered unchanged eagerly)"


def test_modes() -> None:
    enc = make_encoder("sasrec")
    assert COMPILE_MODES == ("eager", "inductor", "grcompile")
    assert apply_compile_mode(enc, "eager") is enc and describe_mode(enc) == "eager: not compiled"
    assert describe_mode(apply_compile_mode(enc, "inductor")).startswith("inductor:")
    assert describe_mode(apply_compile_mode(enc, "grcompile")) == (
        "grcompile: 5 pass(es) in pipeline (guard_indices, detect_padding, fuse_attention, jagged_rewrite, "
        "fuse_norm_gate), "
        "lowered by inductor")
    assert describe_mode(apply_compile_mode(enc, "grcompile", passes=[])) == (
        "grcompile: 0 passes in pipeline (empty: graph lowered unchanged by inductor)")
    with pytest.raises(ValueError, match="unknown compile mode"):
        apply_compile_mode(enc, "tensorrt")


def test_inductor_lowering_receives_transformed_graph(monkeypatch) -> None:
    """compile_fx must be handed the graph *after* the pipeline (checked without paying for
    an inductor compile: compile_fx is replaced by a recorder that runs the graph as is)."""
    import torch._inductor.compile_fx as inductor

    seen: list[fx.GraphModule] = []

    def fake_compile_fx(gm, example_inputs, **options):
        seen.append(gm)
        return gm.forward

    monkeypatch.setattr(inductor, "compile_fx", fake_compile_fx)
    check_outputs_and_grads("hstu", passes=[ExpandSilu()])
    assert len(seen) == 1
    targets = {n.target for n in seen[0].graph.nodes if n.op == "call_function"}
    assert torch.sigmoid in targets and not targets & set(_SILU)
