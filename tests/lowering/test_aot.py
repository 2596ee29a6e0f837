"""The ahead-of-time compile report (``python -m grcompile.lowering.aot``): records of small kernels
defined here, the checks that fail a record, the roofline model, and the real providers.

Compiling runs in a subprocess of the command itself: a test process may have ``TRITON_INTERPRET``
set, under which ``@triton.jit`` builds interpreter functions (the command restarts without it)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import triton
import triton.language as tl

from grcompile.lowering import aot

ROOT = Path(__file__).resolve().parents[2]
HERE = "tests.lowering.test_aot"


@triton.jit
def _tile_matmul(a, b, c, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """c[BM, BN] = a[BM, K] @ b[K, BN], bf16 in, fp32 accumulate and out."""
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        x = tl.load(a + rm[:, None] * K + (k + rk)[None, :])
        y = tl.load(b + (k + rk)[:, None] * BN + rn[None, :])
        acc += tl.dot(x, y)
    tl.store(c + rm[:, None] * BN + rn[None, :], acc)


@triton.jit
def _silu(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    v = tl.load(x + offs, mask=keep).to(tl.float32)
    tl.store(y + offs, (v * tl.sigmoid(v)).to(tl.bfloat16), mask=keep)


@triton.jit
def _strided_copy(x, y, n, stride, BLOCK: tl.constexpr):
    """``y[i] = x[i * stride]``: contiguous (vector loads) only where ``stride`` is known to be 1."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(y + offs, tl.load(x + offs * stride, mask=keep), mask=keep)


@triton.jit
def _row_normalize(x, y, BLOCK: tl.constexpr):
    """A whole row in one warp's registers: at BLOCK=16384 that is 512 floats a thread, spilled."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + r)
    tl.store(y + r, v * tl.rsqrt(tl.sum(v * v, axis=0)))


_MATMUL_SIG = {"a": "*bf16", "b": "*bf16", "c": "*fp32", "K": "constexpr", "BM": "constexpr",
               "BN": "constexpr", "BK": "constexpr"}


def _matmul(kernel: str, tile: int, num_warps: int, uses_dot: bool) -> dict:
    constexprs = dict(K=128, BM=tile, BN=tile, BK=32)
    return dict(kernel=kernel, fn=_tile_matmul, signature=_MATMUL_SIG, constexprs=constexprs,
                num_warps=num_warps, num_stages=2, config=dict(constexprs, num_warps=num_warps), uses_dot=uses_dot)


def aot_test_configs() -> list[dict]:
    """Kernels that must pass: a bf16 tl.dot tile and a pointwise kernel."""
    return [_matmul("tile_matmul", 64, 4, True),
            dict(kernel="silu", fn=_silu, signature={"x": "*bf16", "y": "*bf16", "n": "i32", "BLOCK": "constexpr"},
                 int_args=dict(n=1 << 20), constexprs=dict(BLOCK=1024), num_warps=4, num_stages=1,
                 config=dict(BLOCK=1024), uses_dot=False)]


def aot_specialization_configs() -> list[dict]:
    """One copy kernel launched with stride 1 and n a multiple of 16, and with stride 3 and an odd n."""
    signature = {"x": "*fp32", "y": "*fp32", "n": "i32", "stride": "i32", "BLOCK": "constexpr"}
    return [dict(kernel=f"copy_stride_{stride}", fn=_strided_copy, signature=signature, int_args=dict(n=n, stride=stride),
                 constexprs=dict(BLOCK=1024), num_warps=4, num_stages=1, config=dict(stride=stride), uses_dot=False)
            for stride, n in ((1, 4096), (3, 4095))]


def aot_failing_configs() -> list[dict]:
    """Kernels the report must fail: a spilling one; a one-warp tl.dot (no wgmma on sm_90: a
    warpgroup is 4 warps); the same one declared without a dot."""
    return [dict(kernel="row_normalize", fn=_row_normalize, signature={"x": "*fp32", "y": "*fp32", "BLOCK": "constexpr"},
                 constexprs=dict(BLOCK=16384), num_warps=1, num_stages=1, config=dict(BLOCK=16384), uses_dot=False),
            _matmul("one_warp_matmul", 16, 1, True),
            _matmul("undeclared_dot", 16, 1, False)]


def aot_arch_configs() -> list[dict]:
    """Configs with an ``arch`` key: the one-warp tile (no wgmma) for sm_80 only, a four-warp tile
    for sm_90 only, and a pointwise kernel for every arch."""
    return [dict(_matmul("one_warp_matmul", 16, 1, True), arch="sm_80"),
            dict(_matmul("tile_matmul", 64, 4, True), arch="sm_90"), aot_test_configs()[1]]


def _run_cli(*args: str, timeout: int = 300, **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env_vars
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "grcompile.lowering.aot", "--no-progress", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def test_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "report.json"
    done = _run_cli("--arch", "sm_80,sm_90", "--json", str(out), "--providers",
                    f"{HERE}:aot_test_configs,{HERE}:aot_failing_configs,tests.lowering.no_such_provider:configs")
    assert out.exists(), done.stdout + done.stderr
    return done, json.loads(out.read_text())


def _records(report: dict, kernel: str) -> dict[str, dict]:
    found = {r["arch"]: r for r in report["records"] if r["kernel"] == kernel}
    assert set(found) == {"sm_80", "sm_90"}, found
    return found


def test_record_fields(test_report):
    _, report = test_report
    keys = {"kernel", "arch", "config", "compiled", "error", "registers", "spill_bytes", "stack_bytes",
            "shared_bytes", "num_warps", "num_stages", "tensor_cores", "uses_dot", "compile_seconds"}
    assert len(report["records"]) == 2 * (2 + 3 + 1)
    for r in report["records"]:
        assert keys <= set(r), keys - set(r)
        if r["compiled"]:
            assert r["error"] is None, r
            assert 0 < r["registers"] <= 255 and r["compile_seconds"] >= 0
            assert r["occupancy"]["blocks"] >= 1 and r["occupancy"]["warps"] <= 64
            assert r["notes"] == [], r["notes"]  # ptxas -v re-run agrees with the cubin's registers
    assert report["triton_version"] == triton.__version__
    assert report["roofline"]["rows"]


def test_dot_kernel_uses_each_archs_tensor_cores(test_report):
    r = _records(test_report[1], "tile_matmul")
    for arch, instruction in (("sm_80", "mma.sync"), ("sm_90", "wgmma")):
        rec = r[arch]
        assert rec["compiled"] and rec["tensor_cores"] and rec["ttir_has_dot"], rec
        assert instruction in rec["mma"]
        assert rec["spill_bytes"] == 0 and rec["failures"] == []
        assert rec["shared_bytes"] > 0  # the staged a/b tiles
        assert (rec["num_warps"], rec["num_stages"]) == (4, 2)
        assert rec["config"] == {"K": 128, "BM": 64, "BN": 64, "BK": 32, "num_warps": 4}


def test_pointwise_kernel_compiles_without_dot(test_report):
    for rec in _records(test_report[1], "silu").values():
        assert rec["compiled"] and rec["failures"] == [], rec
        assert rec["mma_loop_instructions"] == [] and rec["sass_instructions"] > 0
        assert rec["uses_dot"] is False and rec["ttir_has_dot"] is False
        assert rec["mma"] == [] and rec["tensor_cores"] is False
        assert rec["spill_bytes"] == 0 and rec["stack_bytes"] == 0


def test_the_matmul_loop_body_is_read_from_the_machine_code(test_report):
    """K = 128 in BK = 32 steps: one loop carrying the MMAs (Triton keeps the K loop rolled)."""
    for rec in _records(test_report[1], "tile_matmul").values():
        (body,) = rec["mma_loop_instructions"]
        assert 10 < body < rec["sass_instructions"], rec


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDS R2, [R3] ;
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
.L_x_1:
        /*0030*/              @!P0 FADD R5, R5, 1 ;
        /*0040*/                   ISETP.GE.AND P0, PT, R5, 4, PT ;
        /*0050*/               @P0 BRA `(.L_x_1) ;
        /*0060*/                   IADD3 R3, R3, 0x10, RZ ;
        /*0070*/                   BRA `(.L_x_0) ;
        /*0080*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0090*/                   EXIT ;
"""


def test_mma_loops_are_the_backward_branches_around_an_mma():
    from grcompile.lowering.sass import instructions, mma_loops
    found, labels = instructions(SASS)
    assert [op for _, op, _ in found] == ["MOV", "LDS", "HMMA", "FADD", "ISETP", "BRA", "IADD3", "BRA", "BRA", "EXIT"]
    assert labels == {".L_x_0": 0x10, ".L_x_1": 0x30, ".L_x_2": 0x90}
    # the inner loop has no MMA; the forward branch is no loop
    (loop,) = mma_loops(SASS)
    assert loop["instructions"] == 7 and loop["mix"]["HMMA"] == 1 and loop["mix"]["BRA"] == 2


def test_failures_are_reported(test_report):
    done, report = test_report
    assert done.returncode == 1, done.stdout + done.stderr
    for rec in _records(report, "row_normalize").values():
        assert rec["compiled"] and rec["spill_bytes"] > 0
        assert any(f.startswith("spills") for f in rec["failures"]), rec["failures"]
    one_warp = _records(report, "one_warp_matmul")
    assert one_warp["sm_80"]["failures"] == [] and one_warp["sm_80"]["tensor_cores"]
    assert one_warp["sm_90"]["mma"] == ["mma.sync"] and not one_warp["sm_90"]["tensor_cores"]
    assert any("no wgmma" in f for f in one_warp["sm_90"]["failures"])
    for rec in _records(report, "undeclared_dot").values():
        assert any("uses_dot=False but the TTIR has tt.dot" in f for f in rec["failures"])
    missing = _records(report, "tests.lowering.no_such_provider:configs")
    assert all("does not exist" in r["error"] and r["failures"] for r in missing.values())
    status = {s["provider"]: s["status"] for s in report["providers"]}
    assert status == {f"{HERE}:aot_test_configs": "ok", f"{HERE}:aot_failing_configs": "ok",
                      "tests.lowering.no_such_provider:configs": "missing"}
    assert report["failed"] == 2 + 1 + 2 + 2  # spills, one-warp dot on sm_90, undeclared dot, missing


def test_stdout_table(test_report):
    done, _ = test_report
    assert "provider tests.lowering.no_such_provider:configs: missing" in done.stdout
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("kernel "))
    names = header.split()
    assert names[:8] == ["kernel", "config", "arch", "ok", "regs", "spill", "stack", "smem"]
    starts = [header.index(f"{n} ") if n != names[-1] else header.rindex(n) for n in names]

    def cells(line: str) -> dict[str, str]:
        return {n: line[a:b].strip() for n, a, b in zip(names, starts, starts[1:] + [None])}

    rows = {(c["kernel"], c["arch"]): c for c in map(cells, lines[lines.index(header) + 2:])
            if c["kernel"] in ("tile_matmul", "silu")}
    assert set(rows) == {(k, a) for k in ("tile_matmul", "silu") for a in ("sm_80", "sm_90")}
    assert rows[("tile_matmul", "sm_90")]["ok"] == "ok" and rows[("tile_matmul", "sm_90")]["mma"] == "wgmma"
    assert rows[("tile_matmul", "sm_80")]["config"] == "K=128 BM=64 BN=64 BK=32 num_warps=4"
    assert rows[("silu", "sm_80")]["mma"] == "-" and rows[("silu", "sm_80")]["dot"] == "no"
    assert rows[("silu", "sm_90")]["loads"] == "ld16", rows[("silu", "sm_90")]  # 8 bf16 a thread, one vector
    assert "Roofline, HSTU causal attention, 8192 tokens per row" in done.stdout


def test_no_fail_and_kernel_filter(tmp_path):
    out = tmp_path / "r.json"
    done = _run_cli("--arch", "sm_80", "--providers", f"{HERE}:aot_failing_configs", "--kernels", "^one_warp",
                    "--no-roofline", "--no-fail", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert [(r["kernel"], r["arch"]) for r in report["records"]] == [("one_warp_matmul", "sm_80")]
    assert "roofline" not in report and "Roofline" not in done.stdout


def test_arch_key_compiles_for_that_arch_only(tmp_path):
    out = tmp_path / "r.json"
    done = _run_cli("--arch", "sm_80,sm_90", "--providers", f"{HERE}:aot_arch_configs", "--no-roofline",
                    "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr  # the one-warp dot never meets sm_90
    report = json.loads(out.read_text())
    assert [(r["kernel"], r["arch"]) for r in report["records"]] == [
        ("one_warp_matmul", "sm_80"), ("tile_matmul", "sm_90"), ("silu", "sm_80"), ("silu", "sm_90")]
    assert report["records"][1]["mma"] == ["wgmma"] and report["failed"] == 0


# ------------------------------------------------------------------ in-process, no compiling


def test_config_archs():
    assert aot.config_archs({}, ["sm_80", "sm_90"]) == ["sm_80", "sm_90"]
    assert aot.config_archs({"arch": "sm_90"}, ["sm_80", "sm_90"]) == ["sm_90"]
    assert aot.config_archs({"arch": "sm_90"}, ["sm_80"]) == []  # not asked for: skipped
    assert aot.config_archs({"arch": "sm_75"}, ["sm_80"]) == ["sm_75"]  # unknown: kept, fails as a record
    rec = aot.compile_config(dict(aot_test_configs()[1], arch="sm_75"), "sm_75")
    assert not rec["compiled"] and "unknown arch" in rec["error"]


def test_launch_specialization_is_tritons():
    """Integer arguments specialised as Triton's launcher does: 1 a constant, a multiple of 16
    divisible, a value over 2**31 i64; pointers keep the given divisibility."""
    sig, constexprs, divisible = aot.launch_specialization(
        {"x": "*bf16", "one": "i32", "d": "i32", "odd": "i32", "big": "i32", "B": "constexpr"}, {"B": 64}, ["x"],
        dict(one=1, d=128, odd=7, big=1 << 40))
    assert sig == {"x": "*bf16", "one": "constexpr", "d": "i32", "odd": "i32", "big": "i64", "B": "constexpr"}
    assert constexprs == {"B": 64, "one": 1} and divisible == ["x", "d", "big"]
    with pytest.raises(TypeError, match="odd"):
        aot.launch_specialization({"odd": "i32"}, {}, [], dict(odd=7.0))


def test_blocks_per_sm_by_the_occupancy_rules():
    # 2 blocks of 113 KiB + 1 KiB reserved fill an H100 SM's 228 KiB exactly; one byte more does not
    assert aot.blocks_per_sm(90, 236, 115712, 4) == {"blocks": 2, "warps": 8, "limit": "registers"}
    assert aot.blocks_per_sm(90, 200, 115713, 4) == {"blocks": 1, "warps": 4, "limit": "shared"}
    # 255 registers: 8,192 a warp (256-register units), 8 warps an SM
    assert aot.blocks_per_sm(80, 255, 1000, 8) == {"blocks": 1, "warps": 8, "limit": "registers"}
    assert aot.blocks_per_sm(80, 64, 0, 1)["blocks"] == 32  # the resident-block cap
    assert aot.blocks_per_sm(90, 32, 0, 4)["warps"] == 64
    # 40 registers: 1,280 a warp; a sub-partition's 16,384 hold 12 warps, so 48 an SM, not 65,536 / 1,280 = 51
    assert aot.blocks_per_sm(90, 40, 0, 2) == {"blocks": 24, "warps": 48, "limit": "registers"}


def test_tensor_core_instruction_by_compute_capability():
    assert [aot.tensor_core_instruction(cc) for cc in (80, 86, 89, 90, 100, 120)] == \
        ["mma.sync", "mma.sync", "mma.sync", "wgmma", None, "mma.sync"]


def test_global_loads_reads_widths_from_ptx():
    ptx = """
        @%p1 ld.global.b16 { %rs1 }, [ %rd1 + 0 ];
        ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd2 + 0 ];
        @%p2 ld.global.L1::evict_last.v2.b32 { %r5, %r6 }, [ %rd3 + 0 ];
        @%p3 cp.async.cg.shared.global [ %r7 + 0 ], [ %rd4 + 0 ], 0x10, %r8;
        cp.async.ca.shared.global [ %r9 + 0 ], [ %rd5 + 0 ], 8;
        st.global.b32 [ %rd6 + 0 ], { %r10 };
        ld.volatile.global.b32 %r11, [ %rd7 + 0 ];
        @%p4 ld.relaxed.gpu.global.v2.b32 { %r12, %r13 }, [ %rd8 + 0 ];
        ld.shared.v4.b32 { %r14, %r15, %r16, %r17 }, [ %r18 + 0 ];
        ld.param.u64 %rd9, [ k_param_0 ];
    """
    assert aot.global_loads(ptx) == {"cp.async 16 B": 1, "cp.async 8 B": 1, "ld 16 B": 1, "ld 2 B": 1, "ld 4 B": 1,
                                     "ld 8 B": 2}


def test_the_report_compiles_the_launchs_specialisation(tmp_path):
    """A launch with stride 1 gets vector loads, one with stride 3 scalar ones: the report sees
    the difference only through the launch values (``int_args``)."""
    out = tmp_path / "spec.json"
    done = _run_cli("--arch", "sm_90", "--no-roofline", "--json", str(out), "--providers",
                    f"{HERE}:aot_specialization_configs")
    assert out.exists(), done.stdout + done.stderr
    records = {r["kernel"]: r for r in json.loads(out.read_text())["records"]}
    unit, strided = records["copy_stride_1"], records["copy_stride_3"]
    assert unit["specialized"] == {"n": "divisible by 16", "stride": "constant 1"}
    assert strided["specialized"] == {"n": "none", "stride": "none"}
    assert set(unit["global_loads"]) == {"ld 16 B"}, unit["global_loads"]
    assert set(strided["global_loads"]) == {"ld 4 B"}, strided["global_loads"]


def test_the_kernels_in_a_triton_cache_read_back_as_compiled(tmp_path):
    """``--from-cache``: what Triton compiled into a cache directory (after a GPU run: what ran),
    read back without compiling, has the compile's registers, shared memory, loads and
    specialisation."""
    cache, compiled, read = tmp_path / "cache", tmp_path / "compiled.json", tmp_path / "read.json"
    done = _run_cli("--arch", "sm_80,sm_90", "--no-roofline", "--json", str(compiled), "--providers",
                    f"{HERE}:aot_specialization_configs,{HERE}:aot_test_configs", TRITON_CACHE_DIR=str(cache))
    assert compiled.exists(), done.stdout + done.stderr
    done = _run_cli("--from-cache", str(cache), "--json", str(read))
    assert done.returncode == 0 and read.exists(), done.stdout + done.stderr
    assert "8 kernels in" in done.stdout

    def facts(r: dict) -> tuple:
        return (r["arch"], r["registers"], r["spill_bytes"], r["shared_bytes"], r["num_warps"], r["num_stages"],
                tuple(r["mma"]), tuple(sorted(r["global_loads"].items())))
    before = json.loads(compiled.read_text())["records"]
    after = json.loads(read.read_text())["records"]
    assert sorted(map(facts, before)) == sorted(map(facts, after))
    by_kernel = {}
    for r in after:
        by_kernel.setdefault(r["kernel"], []).append(r["config"]["divisible"])
    # stride 1 is a constant (not an argument at all); n = 4096 divisible, n = 4095 not
    assert sorted(map(tuple, by_kernel["_strided_copy"])) == [("x", "y")] * 2 + [("x", "y", "n")] * 2
    assert all(r["failures"] == [] for r in after)
    assert _run_cli("--from-cache", str(cache), "--kernels", "silu").stdout.count("_silu ") == 2

    # a cache from another GPU: sm_89 has sm_80's mma.sync; sm_100's MMA has no rule here (noted, not failed)
    for cc in (89, 100):
        other = tmp_path / f"cache_{cc}"
        shutil.copytree(cache, other)
        for meta_path in sorted(other.glob("*/*.json")):
            if meta_path.name.startswith("__grp__"):
                continue
            meta = json.loads(meta_path.read_text())
            if meta.get("target", {}).get("arch") != 80:
                shutil.rmtree(meta_path.parent)
                continue
            meta["target"]["arch"] = cc
            meta_path.write_text(json.dumps(meta))
        records = aot.cache_records(str(other))
        assert len(records) == 4 and {r["arch"] for r in records} == {f"sm_{cc}"}
        dots = [r for r in records if r["ttir_has_dot"]]
        assert dots and all(r["failures"] == [] for r in records), records
        if cc == 89:
            assert all(r["tensor_cores"] for r in dots)
        else:
            assert all("no rule for sm_100" in " ".join(r["notes"]) for r in dots)


def test_parse_ptxas_log():
    log = textwrap.dedent("""\
        ptxas-blackwell info    : 0 bytes gmem
        ptxas-blackwell info    : Compiling entry function 'k' for 'sm_90a'
        ptxas-blackwell info    : Function properties for k
            344 bytes stack frame, 344 bytes spill stores, 328 bytes spill loads
        ptxas-blackwell info    : Used 254 registers, used 1 barriers
        """)
    assert aot.parse_ptxas_log(log) == {"registers": 254, "stack_bytes": 344, "spill_store_bytes": 344,
                                        "spill_load_bytes": 328, "spill_bytes": 672}
    with pytest.raises(ValueError, match="no register"):
        aot.parse_ptxas_log("ptxas fatal   : Unsupported .version 8.7")


def test_bad_configs_give_records_not_exceptions():
    rec = aot.compile_config({"kernel": "k", "fn": None}, "sm_80")
    assert not rec["compiled"] and "lacks" in rec["error"] and rec["failures"]
    cfg = dict(aot_test_configs()[1], fn=lambda x: x)
    rec = aot.compile_config(cfg, "sm_90")
    assert not rec["compiled"] and "not a @triton.jit function" in rec["error"]
    rec = aot.compile_config(aot_test_configs()[1], "sm_75")
    assert not rec["compiled"] and "unknown arch" in rec["error"]


def test_load_providers_tells_missing_from_broken(tmp_path, monkeypatch):
    (tmp_path / "aot_broken_provider.py").write_text("import aot_dependency_that_is_absent\n")
    (tmp_path / "aot_tuple_provider.py").write_text("def configs():\n    return ()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    configs, status = aot.load_providers(["aot_missing_provider:configs", "aot_broken_provider:configs",
                                          "aot_tuple_provider:configs", "aot_tuple_provider:nothing",
                                          "no_colon"])
    assert configs == []
    assert [s["status"] for s in status] == ["missing", "error", "error", "error", "error"]
    assert "aot_dependency_that_is_absent" in status[1]["error"]
    assert "expected a list" in status[2]["error"] and "nothing" in status[3]["error"]


def test_attention_cost_formulas():
    n, h, d = 8192, 2, 25
    cost = aot.attention_cost(n, h, d, d)
    assert cost["fwd"]["flops"] == 2 * (2 * n * n * d * h) / 2
    assert cost["bwd"]["flops"] == 2.5 * cost["fwd"]["flops"]
    assert cost["fwd"]["bytes"] == 4 * n * h * d * 2 and cost["bwd"]["bytes"] == 7 * n * h * d * 2
    full = aot.attention_cost(n, h, 16, 32, causal=False)
    assert full["fwd"]["flops"] == 2 * n * n * h * (16 + 32)


def test_roofline():
    r = aot.roofline(989e12, 3.35e12)  # one second of each: a tie counts as compute-bound
    assert r["seconds"] == 1.0 and r["bound"] == "compute"
    r = aot.roofline(1e9, 1e9)
    assert r["bound"] == "memory" and r["seconds"] == pytest.approx(1e9 / 3.35e12)
    assert r["intensity"] == 1.0 and r["ridge"] == pytest.approx(989e12 / 3.35e12)
    assert aot.roofline(2e12, 1e9, peak_flops=1e12)["seconds"] == 2.0


def _hstu_large_shapes() -> list[aot.AttentionShape]:
    from models.presets import PRESETS

    return [aot.AttentionShape.from_config(name, PRESETS["hstu"][name], reading)
            for name, reading in aot.HSTU_LARGE_READINGS.items()]


def test_attention_roofline_of_the_presets():
    """The roofline takes its sizes as arguments (the op layer imports no model); given the HSTU
    presets, as the CLI passes them, its rows carry their heads and layers."""
    from models.presets import PRESETS

    report = aot.attention_roofline(_hstu_large_shapes())
    assert report["assumptions"]["tokens_per_row"] == 8192
    for row in report["rows"]:
        preset = PRESETS["hstu"][row["preset"]]
        assert row["heads"] == preset["num_heads"] and row["blocks"] == preset["num_blocks"]
        assert row["bound"] in ("compute", "memory") and math.isfinite(row["seconds"])
    scopes = {(r["preset"], r["scope"]) for r in report["rows"]}
    assert ("ml1m-large", "layer fwd (executed)") in scopes  # dqk = 25 runs at width 32
    assert ("large", "layer fwd (executed)") not in scopes  # 128 needs no padding
    layer = next(r for r in report["rows"] if r["preset"] == "ml1m-large" and r["scope"] == "layer fwd (useful)")
    assert layer["flops"] == 2 * 8192 ** 2 * 25 * 2
    assert report["assumptions"]["presets"][0] == "ml1m-large = the HSTU paper's HSTU-large: 8 blocks, 2 heads, dqk=25, dv=25"


def test_attention_roofline_of_given_sizes():
    shape = aot.AttentionShape("tiny", heads=1, dqk=16, dv=16, blocks=3, reading="a test model")
    report = aot.attention_roofline([shape], tokens=128)
    assert report["assumptions"]["presets"] == ["tiny = a test model: 3 blocks, 1 heads, dqk=16, dv=16"]
    assert [r["scope"] for r in report["rows"]] == ["layer fwd (useful)", "layer bwd (useful)", "model fwd+bwd (3 layers)"]
    assert report["rows"][0]["flops"] == 2 * 128 ** 2 * 16 * 1


# ------------------------------------------------------------------ the real kernels


def _real_provider_report(spec: str, tmp_path: Path, *extra: str) -> dict:
    module = spec.partition(":")[0]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} does not exist yet (its kernels are being written)")
    out = tmp_path / "real.json"
    done = _run_cli("--arch", "sm_80,sm_90", "--providers", spec, "--no-roofline", "--json", str(out), *extra,
                    timeout=600)
    assert out.exists(), done.stdout + done.stderr
    report = json.loads(out.read_text())
    status = report["providers"][0]
    assert status["status"] == "ok" and status["configs"] > 0, status
    by_config: dict[str, set] = {}
    by_kernel: dict[str, set] = {}
    for r in report["records"]:
        assert not any(n.startswith("integer arguments without a launch value") for n in r["notes"]), r["notes"]
        by_config.setdefault(json.dumps([r["kernel"], r["config"]], sort_keys=True, default=str), set()).add(r["arch"])
        by_kernel.setdefault(r["kernel"], set()).add(r["arch"])
        assert r["compiled"], (r["kernel"], r["arch"], r["error"])
        if (r["config"] or {}).get("tiles") != "measured":  # a GPU-timed tile may spill (noted, not failed)
            assert r["spill_bytes"] == 0, (r["kernel"], r["config"], r["arch"], r["failures"])
        if r["uses_dot"] and not r.get("ieee"):  # float32 multiplies in IEEE precision: FMA by design
            assert r["tensor_cores"], (r["kernel"], r["config"], r["arch"], r["mma"])
        assert r["failures"] == [], (r["kernel"], r["config"], r["arch"], r["failures"])
    for key, archs in by_config.items():  # a config naming its arch is compiled for that one only
        named = json.loads(key)[1].get("arch") if isinstance(json.loads(key)[1], dict) else None
        assert archs == ({named} if named else {"sm_80", "sm_90"}), (key, archs)
    assert all(archs == {"sm_80", "sm_90"} for archs in by_kernel.values()), by_kernel
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return report


@pytest.mark.parametrize("spec", aot.PROVIDERS)
def test_real_kernels_compile_first_config_each(spec, tmp_path):
    """The first config of every kernel, both archs: the default CI subset."""
    _real_provider_report(spec, tmp_path, "--max-per-kernel", "1")


@pytest.mark.slow
@pytest.mark.parametrize("spec", aot.PROVIDERS)
def test_real_kernels_compile_every_config(spec, tmp_path):
    _real_provider_report(spec, tmp_path)


def test_a_spill_fails_a_rule_tile_and_is_noted_on_a_measured_one():
    base = dict(compiled=True, error=None, spill_bytes=96, spill_store_bytes=48, spill_load_bytes=48, arch="sm_90",
                shared_bytes=1024, uses_dot=True, ttir_has_dot=True, tensor_cores=True, mma=["wgmma"])
    rule = aot._judge(dict(base, notes=[], config={"tiles": "rule"}))
    assert any(f.startswith("spills") for f in rule["failures"])
    measured = aot._judge(dict(base, notes=[], config={"tiles": "measured"}))
    assert measured["failures"] == [] and "measured fastest on a GPU" in measured["notes"][0]
    candidate = aot._judge(dict(base, notes=[], config={"tiles": "candidate"}))
    assert candidate["failures"] == [] and "the autotuner times" in candidate["notes"][0]


def per_head_table_configs() -> list[dict]:
    """AOT provider: the backward kernels of a ``table[head]`` score_mod (one index per program)."""
    import torch
    from grcompile.lowering import score_mod as S
    from grcompile.lowering.attention import triton as at

    def per_head_temperature(score, q_pos, k_pos, head, table_0):
        return score * table_0[head]
    case = (S.register_score_mod(per_head_temperature), "silu", True, False, [], [], [torch.zeros(4)])
    return [at.case_aot_config(case, kernel, "sm_90", 64) for kernel in ("bwd_kv", "bwd_q")]


def test_a_per_head_table_lookup_compiles_for_sm90(tmp_path):
    """``table[head]``'s gradient is one atomic, not a tile reduction: compiled Triton cannot reduce
    a 0-d tensor (the interpreter can, so only a compile shows it)."""
    out = tmp_path / "head.json"
    done = _run_cli("--arch", "sm_90", "--no-roofline", "--json", str(out), "--providers",
                    f"{HERE}:per_head_table_configs")
    assert out.exists(), done.stdout + done.stderr
    records = json.loads(out.read_text())["records"]
    assert len(records) == 2 and all(r["compiled"] for r in records), [r["error"] for r in records]
