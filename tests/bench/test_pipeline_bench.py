"""The pipeline benchmark: its exposed-communication arithmetic, its trace format, and (slow, root
only) one real run on an emulated 2-rank network made and torn down by the benchmark."""
import json
import subprocess

import pytest

from grcompile.bench.netns import unavailable_reason
from grcompile.bench.pipeline import chrome_trace, main, summarize


def _ranks(steps_by_schedule):
    return [{s: {"step_s": v, "sparse_stats": {"embedding_bytes": 10}, "micro_batches": 4,
                 "unique_ids": {"clustered": 1, "unclustered": 2}, "trace": [("optimizer", "MainThread", 0.0, 0.1)]}
             for s, v in steps_by_schedule.items()}]


def test_exposed_ratio_is_what_the_slow_link_adds_over_what_it_adds_to_sync():
    limited = _ranks({"sync": [1.0, 1.0, 1.2], "fwp": [0.7, 0.7, 0.7]})
    unlimited = _ranks({"sync": [0.6, 0.6, 0.6], "fwp": [0.62, 0.62, 0.62]})
    out = summarize(limited, unlimited)
    assert out["communication_ms"] == pytest.approx(400.0)
    assert out["sync"]["exposed_comm_ratio"] == pytest.approx(1.0)
    assert out["fwp"]["exposed_comm_ms"] == pytest.approx(80.0)
    assert out["fwp"]["exposed_comm_ratio"] == pytest.approx(0.2)


def test_chrome_trace_has_one_process_per_schedule(tmp_path):
    chrome_trace(_ranks({"sync": [1.0], "fwp": [1.0]}), tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    assert [e["dur"] for e in events if e["ph"] == "X"] == [pytest.approx(1e5)] * 2


@pytest.mark.slow
@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
def test_a_real_run_on_an_emulated_network_leaves_nothing_behind(tmp_path):
    out = main(["--world", "2", "--rate-mbit", "100", "--items", "2000", "--max-len", "16", "--batch-size", "8",
                "--negatives", "8", "--steps", "2", "--warmup", "1", "--port", "29677",
                "--json", str(tmp_path / "r.json")])
    assert out["sync"]["exposed_comm_ratio"] is None or out["sync"]["exposed_comm_ratio"] == pytest.approx(1.0)
    assert out["fwp"]["micro_batches"] == 4
    assert "grn" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
