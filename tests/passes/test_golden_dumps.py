"""Golden per-pass dumps of a one-block HSTU: the graph after each pass of the default pipeline
and the captured score_mod, as readable Python, must match tests/golden/hstu-1block/ (paths
reduced to file names), and each pass must fire exactly the expected number of times.

A change to a pass, a model or the pinned torch shows up here as a readable diff. After checking
the new graphs by eye, refresh them with ``GRCOMPILE_UPDATE_GOLDEN=1 pytest tests/passes/test_golden_dumps.py``.
"""
import os
import re
from pathlib import Path

import pytest
import torch

import grcompile
from models import build_encoder

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "hstu-1block"
STAGES = ["00-captured", "01-guard_indices", "02-detect_padding", "03-fuse_attention", "04-jagged_rewrite",
          "05-fuse_norm_gate"]
MATCH_COUNTS = {  # what each pass fired on, for one block
    "guard_indices.check_index": 1,  # ids into item_embedding
    "guard_indices.proved": 3,   # arange(N) positions, the relative-position and time-bucket gathers
    "detect_padding.validity_sources": 1,
    "fuse_attention.score_mod_attention": 1,
    "jagged_rewrite.embedding": 1,
    "jagged_rewrite.linear": 2,
    "jagged_rewrite.layer_norm": 2,
    "jagged_rewrite.jagged_attention": 1,
    "fuse_norm_gate.norm": 1,
    "fuse_norm_gate.gated_norm": 1,
}


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def normalise(text: str) -> str:
    """Absolute paths -> file names (the checkout and the venv live anywhere)."""
    return re.sub(r"(?:[A-Za-z]:)?[/\\][^\s:\"']*[/\\]([\w.-]+\.py)", r"\1", text)


def test_golden_per_pass_dumps_and_match_counts(tmp_path):
    torch.manual_seed(0)
    enc = build_encoder("hstu", "ml1m", num_items=20, max_len=8, embedding_dim=8, num_blocks=1, num_heads=2,
                        attention_dim=4, linear_dim=4, dropout=0.0)
    optimized = grcompile.optimize(enc, lowering="eager", dump_dir=tmp_path)
    ids = torch.tensor([[3, 4, 5, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8], [0] * 8, [9] + [0] * 7])
    ts = torch.cumsum(torch.full((4, 8), 1000), dim=1) * (ids != 0)
    optimized(ids, ts)

    report = grcompile.report(optimized)
    fired = {k: v for k, v in report.counters.items() if k in MATCH_COUNTS}
    assert fired == MATCH_COUNTS and report.fallbacks == []

    update = os.environ.get("GRCOMPILE_UPDATE_GOLDEN") == "1"
    score_mods = sorted((tmp_path / "graph_0" / "score_mods").glob("*.py"))
    assert len(score_mods) == 1  # the captured HSTU region: rab gathers, silu, / N
    for dump in [*(tmp_path / "graph_0" / f"{stage}.py" for stage in STAGES), score_mods[0]]:
        got = normalise(dump.read_text())
        name = "score_mod.py" if dump.parent.name == "score_mods" else dump.name
        golden = GOLDEN / name
        stage = name[:-3]
        if update:
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(got)
            continue
        assert golden.exists(), f"{golden} missing: run with GRCOMPILE_UPDATE_GOLDEN=1"
        assert got == golden.read_text(), f"{stage}: graph differs from {golden} (diff them; update if intended)"
