"""grcompile.bench: analytic FLOPs, the CLI end to end, failure recording."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from grcompile.bench.__main__ import format_table, ratios, run_mode
from grcompile.bench.flops import forward_flops, training_flops, valid_lengths
from models import build_encoder, make_config

REPO = Path(__file__).resolve().parents[2]
SHAPE = dict(embedding_dim=4, num_heads=2, attention_dim=3, linear_dim=5, ffn_dim=8, num_blocks=1)


def test_flops_hand_computed() -> None:
    """D=4, H=2, dqk=3, dv=5, F=8, lengths [2, 3] -> T=5, causal pairs P=3+6=9, R=2."""
    lengths, R = [2, 3], 2
    hstu = make_config("hstu", "ml1m", 10, **SHAPE)
    # uvqk 2*5*4*2*(6+10)=1280, out 2*5*2*5*4=400, attn 2*9*2*3+2*9*2*5=288, loss 2*5*3*4=120
    assert forward_flops(hstu, lengths, R) == dict(projections=1680, attention=288, ffn=0, loss=120, total=2088)
    assert training_flops(hstu, lengths, R) == 3 * 2088
    two = make_config("hstu", "ml1m", 10, **dict(SHAPE, num_blocks=2))
    assert forward_flops(two, lengths, R)["total"] == 2 * (1680 + 288) + 120
    # FuXi: uvqk 2*5*4*2*(20+6)=2080, out 2*5*30*4=1200, attn 108+3*180=648, SwiGLU 3*2*5*4*8=960
    assert forward_flops(make_config("fuxi", "ml1m", 10, **SHAPE), lengths, R)["total"] == 2080 + 1200 + 648 + 960 + 120
    # SASRec: qkv 2*5*4*2*(6+5)=880, out 400, attn 288, FFN 2*2*5*4*8=640
    assert forward_flops(make_config("sasrec", "ml1m", 10, **SHAPE), lengths, R)["total"] == 880 + 400 + 288 + 640 + 120
    assert valid_lengths(torch.tensor([[3, 4, 0], [0, 0, 0]])) == [2, 0]


@pytest.mark.parametrize("model", ["hstu", "fuxi", "sasrec"])
def test_flops_match_layer_shapes(model: str) -> None:
    """On one fully valid row the dense model computes every (i, j) pair: torch's matmul count
    equals the formula with the causal pair count P replaced by N^2."""
    N = 6
    config = dict(SHAPE, num_blocks=2, dropout=0.0)
    enc = build_encoder(model, "ml1m", num_items=20, max_len=N, **config).eval()
    ids = torch.arange(1, N + 1).unsqueeze(0)
    ts = torch.arange(N).unsqueeze(0) * 100
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        enc(ids, ts)
    ours = forward_flops(enc.config, [N], num_negatives=0)
    dense = ours["projections"] + ours["ffn"] + Fraction(ours["attention"]) * N * N / (N * (N + 1) // 2)
    assert counter.get_total_flops() == dense


def test_cli_smoke(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    cmd = [sys.executable, "-m", "grcompile.bench", "--preset", "ml1m", "--max-len", "16", "--batch-size", "4",
           "--steps", "2", "--warmup", "1", "--modes", "eager,grcompile", "--num-users", "64", "--num-items", "50",
           "--dropout", "0", "--json", str(out_json), "--plot", str(out_png)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert set(report) == {"config", "results", "ratios"}
    assert report["config"]["max_len"] == 16 and report["config"]["batch_size"] == 4
    for mode in ("eager", "grcompile"):
        r = report["results"][mode]
        for key in ("step_ms", "peak_mem_mb", "tokens_per_s", "tflops", "flops_per_step", "padding_fraction"):
            assert isinstance(r[key], float) and r[key] > 0, (mode, key, r[key])
        assert set(report["ratios"][mode]) == {"speedup_vs_eager", "mem_vs_eager"}
    assert report["ratios"]["eager"] == {"speedup_vs_eager": 1.0, "mem_vs_eager": 1.0}
    eager, grc = report["results"]["eager"], report["results"]["grcompile"]
    assert eager["flops_per_step"] == grc["flops_per_step"]  # same batches
    assert grc["first_loss"] == pytest.approx(eager["first_loss"], rel=1e-5)  # same batches and weights
    assert "pass" in grc["description"] and "grcompile" in proc.stdout
    assert grc["description"] in proc.stdout
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the Triton kernels of the attention the grcompile mode ran, compiled for both archs
    assert eager["aot"] is None
    compiled = {(r["kernel"], r["arch"]) for r in grc["aot"] if r["compiled"]}
    assert {("jagged_attention_fwd", "sm_80"), ("jagged_attention_fwd", "sm_90"),
            ("jagged_attention_bwd_kv", "sm_90")} <= compiled, grc["aot"]
    assert all(isinstance(r["registers"], int) and r["registers"] > 0 for r in grc["aot"] if r["compiled"])
    assert "Triton kernels, compiled ahead of time: sm_80" in proc.stdout


def test_bf16_precision_runs_every_mode_under_autocast() -> None:
    """--precision bf16: eager and grcompile train under autocast; their first losses (same weights,
    same batch) agree with each other and with float32 to bf16 rounding, and differ from float32."""
    config = dict(model="hstu", preset="ml1m", max_len=16, batch_size=4, steps=1, warmup=0, seed=0,
                  num_users=32, num_items=50, dropout=0.0, aot=False)
    fp32 = run_mode(config, "eager", echo=False)
    bf16 = {mode: run_mode(dict(config, precision="bf16"), mode, echo=False) for mode in ("eager", "grcompile")}
    assert fp32["precision"] == "fp32" and all(r["precision"] == "bf16" for r in bf16.values()), bf16
    assert bf16["grcompile"]["first_loss"] == pytest.approx(bf16["eager"]["first_loss"], rel=1e-2)
    assert bf16["eager"]["first_loss"] == pytest.approx(fp32["first_loss"], rel=2e-2)
    assert bf16["eager"]["first_loss"] != fp32["first_loss"]  # autocast did run


def test_remat_shrinks_the_measured_activations() -> None:
    """--remat: the grcompile mode saves fewer activation bytes (measured with saved-tensor hooks)
    than without, per block too, and its first loss is unchanged."""
    config = dict(model="hstu", preset="ml1m", max_len=32, batch_size=4, steps=1, warmup=0, seed=0,
                  num_users=32, num_items=50, dropout=0.0, aot=False)
    plain, remat = (run_mode(dict(config, remat=r), "grcompile", echo=False) for r in (False, True))
    assert remat["remat"] and not plain["remat"] and "+ remat" in remat["description"]
    assert 0 < remat["activation_mb"] < 0.8 * plain["activation_mb"], (remat["activation_mb"], plain["activation_mb"])
    blocks = plain["model_config"]["num_blocks"]
    assert plain["activation_mb_per_block"] == pytest.approx(plain["activation_mb"] / blocks)
    assert remat["first_loss"] == pytest.approx(plain["first_loss"], rel=1e-5)


def test_checkpoint_blocks_are_fused_and_recomputed() -> None:
    """--checkpoint-blocks: each HSTU block runs under torch.utils.checkpoint; grcompile opens the
    regions (the attention is fused inside them) and keeps their recomputation: fewer activation
    bytes than without the checkpoints (the encoder alone: 0.28x; the sampled-softmax loss outside
    the blocks keeps its own), same losses (dropout on: the draws are replayed)."""
    config = dict(model="hstu", preset="ml1m", max_len=32, batch_size=4, steps=1, warmup=0, seed=0,
                  num_users=32, num_items=50, dropout=0.2, aot=False)
    plain, checkpointed = (run_mode(dict(config, checkpoint_blocks=c), "grcompile", echo=False) for c in (False, True))
    assert checkpointed["model_config"]["checkpoint_blocks"] and not plain["model_config"]["checkpoint_blocks"]
    assert 0 < checkpointed["activation_mb"] < 0.8 * plain["activation_mb"], (checkpointed["activation_mb"],
                                                                              plain["activation_mb"])
    assert checkpointed["first_loss"] == pytest.approx(plain["first_loss"], rel=1e-5)
    assert checkpointed["last_loss"] == pytest.approx(plain["last_loss"], rel=1e-4)


def test_failing_mode_is_recorded() -> None:
    config = dict(model="hstu", preset="ml1m", max_len=8, batch_size=2, steps=1, warmup=0, seed=0,
                  num_users=16, num_items=20)
    r = run_mode(config, "no-such-mode", echo=False)
    assert "error" in r and "no-such-mode" in r["error"] and r["returncode"] != 0
    results = {"eager": {"step_ms": 2.0, "peak_mem_mb": 100.0}, "no-such-mode": r}
    assert ratios(results)["no-such-mode"] == {"speedup_vs_eager": None, "mem_vs_eager": None}
    table = format_table({"config": dict(config, steps=1), "results": {"no-such-mode": r}, "ratios": {}})
    assert "FAILED" in table


def test_cli_user_model(tmp_path: Path) -> None:
    """``--model examples/sasrec_mha.py:factory``: same schema (+ config.model_spec), the user's
    batches (valid tokens from its ``valid``), the same weights in every mode, FLOPs not counted."""
    from grcompile.user_model import load_user_model

    spec = "examples/sasrec_mha.py:factory"
    out_json, out_png = tmp_path / "u.json", tmp_path / "u.png"
    cmd = [sys.executable, "-m", "grcompile.bench", "--model", spec, "--max-len", "8", "--batch-size", "4",
           "--steps", "1", "--warmup", "0", "--modes", "eager,grcompile", "--seed", "3", "--no-aot",
           "--json", str(out_json), "--plot", str(out_png)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert set(report) == {"config", "results", "ratios"}
    c = report["config"]
    assert c["model"] == c["model_spec"] == spec and c["preset"] is None and (c["max_len"], c["batch_size"]) == (8, 4)
    user = load_user_model(str(REPO / spec), max_len=8)
    (ids,) = user.batch(4, 8, seed=3)  # the only (timed) step: seed + 0
    eager, grc = report["results"]["eager"], report["results"]["grcompile"]
    for r in (eager, grc):
        assert r["valid_tokens_per_step"] == int((ids != 0).sum())
        assert r["padding_fraction"] == pytest.approx(1 - int((ids != 0).sum()) / 32)
        assert r["tokens_per_s"] == pytest.approx(r["valid_tokens_per_step"] / (r["step_ms"] / 1e3))
        assert r["peak_mem_mb"] == r["peak_rss_mb"] > 0 and r["step_ms"] > 0  # CPU: process high-water RSS
        assert r["tflops"] is None and r["flops_per_step"] is None
        assert r["model_config"]["module"] == "SASRecMHA" and r["model_config"]["factory_kwargs"] == {"max_len": 8}
    assert grc["first_loss"] == pytest.approx(eager["first_loss"], rel=1e-5)  # same batch and weights
    assert grc["aot"] is None and report["config"]["aot"] is False  # --no-aot
    assert set(report["ratios"]["grcompile"]) == {"speedup_vs_eager", "mem_vs_eager"}
    assert f"grcompile.bench: {spec}, max_len 8" in proc.stdout and "not counted (user model)" in proc.stdout
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_attention_kernel_timer_runs_in_the_interpreter(tmp_path: Path) -> None:
    """The GPU measurement's command, as a smoke test: on CPU it is the interpreter, so no MFU."""
    import os

    from grcompile.bench import attention_kernel

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py)")
    out = tmp_path / "a.json"
    assert attention_kernel.main(["--tokens", "40", "--heads", "2", "--head-dim", "16", "--iters", "1",
                                  "--warmup", "0", "--device", "cpu", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["interpreter"] is True and r["peak_tflops"] is None
    for name in ("fwd", "bwd"):
        assert r[name]["ms"] > 0 and r[name]["mfu"] is None and r[name]["useful_tflop"] > 0
    assert r["bwd"]["useful_tflop"] == pytest.approx(2.5 * r["fwd"]["useful_tflop"])


def test_fp8_kernel_bench_runs_in_the_interpreter(tmp_path: Path) -> None:
    """The FP8 GPU measurement's command, as a smoke test: its on-device checks hold in the
    interpreter too (bit-equal quantisations), every path is timed, the JSON carries both GEMMs."""
    import os

    from grcompile.bench import fp8_kernel

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py)")
    out = tmp_path / "f.json"
    assert fp8_kernel.main(["--tokens", "24", "--dim", "32", "--heads", "2", "--head-dim", "16", "--iters", "1",
                            "--warmup", "0", "--back-to-back", "2", "--device", "cpu", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for side, (K, N) in (("input_projection", (32, 128)), ("output_projection", (32, 32))):
        assert (r[side]["M"], r[side]["K"], r[side]["N"]) == (24, K, N)
        checks = r[side]["checks"]
        assert checks["norm_quant_bit_equal"] and checks["weight_quant_bit_equal"]
        assert checks["triton_vs_bf16_linear_rel"] < 0.1  # e4m3's rounding, not a wrong GEMM
        assert all(t["ms"] > 0 for t in r[side]["timings"].values()) and len(r[side]["timings"]) == 10


def test_parity_compares_two_runs_losses(tmp_path: Path) -> None:
    """bench.parity: tail means, their standard errors and the gap in standard errors, and a plot."""
    from grcompile.bench import parity

    def write(name: str, losses: list[float], precision: str) -> str:
        path = tmp_path / name
        path.write_text(json.dumps({"results": {"grcompile": {"losses": losses, "precision": precision}}}))
        return str(path)
    a = write("a.json", [5.0, 4.0, 3.0, 2.0, 2.1, 1.9, 2.0, 2.2, 1.8], "fp32")
    b = write("b.json", [5.0, 4.0, 3.0, 2.0, 3.1, 2.9, 3.0, 3.2, 2.8], "bf16")
    runs = [parity.run_losses(a, "grcompile"), parity.run_losses(b, "grcompile")]
    assert [label for label, _ in runs] == ["grcompile fp32", "grcompile bf16"]
    result = parity.compare(runs, window=5)
    assert result["runs"]["grcompile fp32"]["mean"] == pytest.approx(2.0)
    assert result["runs"]["grcompile bf16"]["mean"] == pytest.approx(3.0)
    se = parity.tail_stats(runs[0][1], 5)[1]
    assert se == pytest.approx(statistics.stdev([2.1, 1.9, 2.0, 2.2, 1.8]) / 5 ** 0.5)
    assert result["gap_in_stderr"] == pytest.approx(1.0 / (2 ** 0.5 * se))
    assert parity.moving_average([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
    out = tmp_path / "p.png"
    assert parity.main([a, b, "--window", "5", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpu_attention_timer_runs(tmp_path: Path) -> None:
    """The CPU reference's timer: both directions timed, the pairs counted from the length mix."""
    from grcompile.bench import attention_cpu

    out = tmp_path / "c.json"
    assert attention_cpu.main(["--rows", "5", "--max-len", "12", "--heads", "2", "--head-dim", "4", "--iters", "1",
                               "--warmup", "0", "--dropout", "0.1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["forward_ms"] > 0 and r["backward_ms"] > 0 and r["causal"] and r["dropout"] == 0.1
    assert r["pairs"] >= 2 * (1 + 12 * 13 // 2)  # rows of length 0, 1 and 12 among the 5, two heads
    with pytest.raises(SystemExit):
        attention_cpu.main(["--rows", "0"])
