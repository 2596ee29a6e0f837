"""The sparse-runtime measurement CLIs: python -m grcompile.bench.step_split / .dedup_stats."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grcompile.bench.step_split import parse_run

REPO = Path(__file__).resolve().parents[2]


def test_step_split_run_names() -> None:
    assert parse_run("torchrec-row-two_stage") == {"sparse_backend": "torchrec", "sharding": "row",
                                                   "dedup": "two_stage"}
    assert parse_run("native-row-none-hsp2") == {"sparse_backend": "native", "sharding": "row", "dedup": "none",
                                                 "hsp_group_size": 2}
    for bad in ("torchrec-row", "cuda-row-none", "native-row-none-x2"):
        with pytest.raises(SystemExit):
            parse_run(bad)


def test_dedup_stats_two_ranks(tmp_path: Path) -> None:
    """End to end on 2 gloo ranks: every mode looks up the same ids, and deduplicating never sends more."""
    out = tmp_path / "dedup.json"
    subprocess.run([sys.executable, "-m", "grcompile.bench.dedup_stats", "--nproc", "2", "--batch-size", "8",
                    "--max-len", "10", "--steps", "2", "--num-negatives", "4", "--dim", "8", "--json", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=300)
    per_step = json.loads(out.read_text())["per_step"]
    assert set(per_step) == {"none", "comm", "lookup", "two_stage"}
    looked_up = {mode: s["ids_looked_up"] for mode, s in per_step.items()}
    assert len(set(looked_up.values())) == 1 and looked_up["none"] > 0
    for mode in ("comm", "two_stage"):
        assert per_step[mode]["ids_sent"] <= per_step["none"]["ids_sent"]
        assert per_step[mode]["embedding_bytes"] <= per_step["none"]["embedding_bytes"]
