"""Ahead-of-time compile report for grcompile's Triton kernels: no GPU needed.

    python -m grcompile.lowering.aot --arch sm_80,sm_90 --json aot.json

Every kernel configuration that a *provider* lists is compiled by Triton for each target
architecture (``triton.compile`` with an explicit ``GPUTarget``: TTIR → TTGIR → LLVM IR → PTX →
cubin, all on the CPU), and its resources are read back:

- registers, stack frame and spill bytes (stores + loads): ``ptxas -v`` re-run on the kernel's PTX with the flags
  Triton itself used for the cubin (Triton's own ``-v`` log is discarded, and the compiled
  kernel's ``n_regs`` / ``n_spills`` are only filled in when a driver loads the cubin on a GPU);
  the register count is cross-checked with ``cuobjdump --dump-resource-usage`` on Triton's cubin;
- shared memory: ``metadata.shared``, the dynamic shared memory the launch requests, checked
  against the architecture's per-block limit (Triton only checks that when it loads the kernel);
- tensor cores: the architecture's own MMA instruction in the PTX (``mma.sync`` on sm_80,
  ``wgmma`` on sm_90: a Hopper kernel that falls back to ``mma.sync`` runs at about half the
  tensor-core peak and is reported as not using them);
- machine code: ``nvdisasm`` on the cubin — the kernel's instruction count and the body size of
  each loop carrying an MMA (``mma_loop_instructions``, :mod:`.sass`): the instructions every warp
  issues per tile beside its matrix multiplies, reported, not judged.

A provider is ``"module:function"``; the function returns a list of dicts with the keys
``kernel`` (name), ``fn`` (a ``@triton.jit`` function), ``signature`` (argument → Triton type,
``"*bf16"``, ``"i32"``, ``"fp32"``, ``"constexpr"``…), ``constexprs`` (argument → value),
``num_warps``, ``num_stages``, ``config`` (JSON-able description), ``uses_dot`` (the kernel has a
``tl.dot``) and optionally ``int_args`` (integer argument → a value a launch passes: Triton's
launcher specialises integers, 1 becomes a constant and a multiple of 16 is declared divisible,
which decides vector widths and whether loads are pipelined, so the report compiles the variant
a launch runs only with these; an integer argument without a value is compiled unspecialised and
noted), ``divisible_by_16`` (pointer/int arguments Triton may assume 16-aligned, default: every
pointer, as a launch on PyTorch-allocated tensors specialises them),
``options`` (further ``triton.compile`` options such as ``maxnreg``), ``ieee`` (True: the
``tl.dot`` multiplies float32 in IEEE precision, on FMA instructions by design — the tensor-core
check is skipped and the record says so) and ``arch`` (``"sm_80"`` /
``"sm_90"``: the config is compiled for that arch only — tiles chosen per architecture — and
skipped when ``--arch`` leaves that arch out; without it, for every ``--arch``). With
``--max-per-kernel N`` the first N configs of each kernel are taken per ``arch`` key.

A record fails when the kernel does not compile, spills, needs more shared memory than the
architecture has, or declares a ``tl.dot`` (or has one in its TTIR) without using the
architecture's tensor-core instruction; the command exits 1 on any failure unless ``--no-fail``.
A provider module that does not exist (yet) or raises on import gives a failing record that says
so. ``--roofline`` (default on) adds the analytic attention cost at 8K tokens per row: see
:func:`roofline` and :func:`attention_cost`; the CLI (:func:`main`) reads the HSTU presets' sizes
from ``models/presets.py`` and passes them in as :class:`AttentionShape` (the library functions
import no model).

``TRITON_INTERPRET=1`` makes ``@triton.jit`` build interpreter functions that cannot be compiled;
the command restarts itself without it (Triton reads it at import, which ``import torch`` does).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

from .sass import disassemble, instructions, loops_of, run_on_cubin

PROVIDERS = [
    "grcompile.lowering.norm.triton:aot_configs",
    "grcompile.lowering.attention.triton:aot_configs",
    "grcompile.lowering.fp8.triton:aot_configs",
]

# arch name -> compute capability. sm_90 compiles as sm_90a (Triton's choice: wgmma needs it).
ARCHS = {"sm_80": 80, "sm_90": 90}
# The architecture's own tensor-core MMA instruction, as it appears in Triton's PTX.
TENSOR_CORE_PTX = {80: "mma.sync", 90: "wgmma"}
_MMA_PATTERNS = {"mma.sync": re.compile(r"\bmma\.sync\b"), "wgmma": re.compile(r"\bwgmma\.mma_async\b")}
# Largest dynamic shared memory one block may opt into (CUDA programming guide, compute
# capabilities table): A100 163 KiB, H100 227 KiB.
MAX_SHARED_BYTES = {80: 166912, 90: 232448}
# Per SM (CUDA occupancy calculator, compute capabilities 8.0 / 9.0): shared memory, 32-bit
# registers, resident warps and blocks; each block also reserves 1 KiB of shared memory, and
# registers are allocated per warp in units of 256.
SM_SHARED_BYTES = {80: 167936, 90: 233472}
SM_REGISTERS, SM_WARPS, SM_BLOCKS, BLOCK_RESERVED_SHARED, REGISTER_UNIT = 65536, 64, 32, 1024, 256
# The register file is split between 4 scheduler sub-partitions and a warp lives in one of them.
SM_SUB_PARTITIONS = 4


def tensor_core_instruction(cc: int) -> Optional[str]:
    """The tensor-core MMA instruction Triton emits for compute capability ``cc`` (``mma.sync``
    on 8.x and consumer Blackwell 12.x, ``wgmma`` on 9.0); ``None`` where this report has no rule
    (data-centre Blackwell's tcgen05)."""
    if 80 <= cc < 90 or 120 <= cc < 130:
        return "mma.sync"
    return TENSOR_CORE_PTX.get(cc)

REQUIRED_KEYS = ("kernel", "fn", "signature", "constexprs", "num_warps", "num_stages", "config", "uses_dot")

# H100 SXM: dense bf16 tensor-core peak and HBM3 bandwidth.
H100_BF16_FLOPS = 989e12
H100_BANDWIDTH = 3.35e12


# ----------------------------------------------------------------------------- providers


def load_providers(specs: Iterable[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(configs, provider_status)``: every provider's config dicts (each tagged with
    ``provider``) and one status per provider: ``ok``, ``missing`` (its module does not exist) or
    ``error`` (it raised, or its function is absent or returned something other than a list)."""
    configs: list[dict[str, Any]] = []
    status: list[dict[str, Any]] = []
    for spec in specs:
        module_name, _, attr = spec.partition(":")
        entry: dict[str, Any] = {"provider": spec, "status": "ok", "error": None, "configs": 0}
        try:
            if not attr:
                raise ValueError(f"provider {spec!r} is not of the form 'module:function'")
            module = importlib.import_module(module_name)
            found = getattr(module, attr)()
            if not isinstance(found, list):
                raise TypeError(f"{spec} returned {type(found).__name__}, expected a list of dicts")
        except ModuleNotFoundError as e:
            if e.name != module_name:
                entry.update(status="error", error=f"importing {module_name} failed: {e!r}")
            else:
                entry.update(status="missing", error=f"provider module {module_name} does not exist (yet)")
        except Exception as e:  # report, never crash: a broken provider is one failing line
            entry.update(status="error", error=f"{spec}: {_one_line(e)}")
        else:
            entry["configs"] = len(found)
            configs.extend(dict(c, provider=spec) if isinstance(c, dict) else {"provider": spec, "bad": c}
                           for c in found)
        status.append(entry)
    return configs, status


def provider_record(entry: dict[str, Any], arch: str) -> dict[str, Any]:
    """The failing record that stands for a provider whose configs could not be listed."""
    return _judge(_empty_record(kernel=entry["provider"], arch=arch, provider=entry["provider"],
                                error=entry["error"]))


# ----------------------------------------------------------------------------- compiling


def _empty_record(**fields: Any) -> dict[str, Any]:
    record = {"kernel": None, "provider": None, "arch": None, "config": None, "constexprs": None,
              "compiled": False, "error": None, "registers": None, "spill_bytes": None,
              "spill_store_bytes": None, "spill_load_bytes": None, "stack_bytes": None,
              "shared_bytes": None, "num_warps": None, "num_stages": None, "tensor_cores": False,
              "mma": [], "uses_dot": None, "ttir_has_dot": None, "compile_seconds": None,
              "ptxas_seconds": None, "cache_hit": None, "specialized": {}, "global_loads": {}, "occupancy": None,
              "sass_instructions": None, "mma_loop_instructions": None, "notes": [], "failures": []}
    record.update(fields)
    return record


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0] if len(lines) <= 1 else f"{lines[0]} … {lines[-1]}"


def _cc(arch: str) -> int:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    return ARCHS[arch]


def compile_config(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Compile one provider config for ``arch`` (``"sm_80"`` / ``"sm_90"``) and return its record.
    Never raises for a kernel problem: the record says ``compiled: False`` and the error."""
    record = _empty_record(kernel=cfg.get("kernel"), provider=cfg.get("provider"), arch=arch,
                           config=cfg.get("config"), num_warps=cfg.get("num_warps"),
                           num_stages=cfg.get("num_stages"), uses_dot=cfg.get("uses_dot"))
    record["ieee"] = bool(cfg.get("ieee", False))
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing:
        record["error"] = f"provider config lacks {missing} (has {sorted(k for k in cfg if k != 'provider')})"
        return _judge(record)
    try:
        record["constexprs"] = {k: _jsonable(v) for k, v in cfg["constexprs"].items()}
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction

        cc = _cc(arch)
        fn = cfg["fn"]
        if not isinstance(fn, JITFunction):
            raise TypeError(f"fn is a {type(fn).__name__}, not a @triton.jit function"
                            + (" (TRITON_INTERPRET=1 was set when it was defined)"
                               if type(fn).__name__ == "InterpretedFunction" else ""))
        divisible = cfg.get("divisible_by_16")
        if divisible is None:
            divisible = [a for a, t in cfg["signature"].items() if t.startswith("*")]
        int_args = dict(cfg.get("int_args") or {})
        unknown = [a for a in [*divisible, *cfg["constexprs"], *int_args] if a not in fn.arg_names]
        if unknown:
            raise ValueError(f"arguments {unknown} are not parameters of {fn.__name__}{tuple(fn.arg_names)}")
        signature, constexprs, divisible = launch_specialization(cfg["signature"], cfg["constexprs"], divisible,
                                                                 int_args)
        record["specialized"] = {a: ("constant 1" if a in constexprs and a not in cfg["constexprs"] else
                                     "divisible by 16" if a in divisible else "none") for a in int_args}
        unvalued = [a for a, t in signature.items() if t in ("i32", "i64") and a not in int_args and a not in divisible]
        if unvalued:
            record["notes"].append(f"integer arguments without a launch value, compiled unspecialised: {unvalued}")
        # Triton 3.9 keys attributes by argument path: (index,) -> [[name, value]].
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], **cfg.get("options", {})}
        hits: list[bool] = []
        listener_before = triton.knobs.compilation.listener
        triton.knobs.compilation.listener = lambda **kw: hits.append(kw.get("cache_hit", False))
        start = time.perf_counter()
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
        finally:
            triton.knobs.compilation.listener = listener_before
        record["compile_seconds"] = round(time.perf_counter() - start, 3)
        record["cache_hit"] = hits[-1] if hits else None
    except Exception as e:
        record["error"] = _one_line(e)
        record["notes"].append(traceback.format_exc(limit=-3))
        return _judge(record)

    ptx = kernel.asm["ptx"]
    record["compiled"] = True
    record["shared_bytes"] = int(kernel.metadata.shared)
    record["num_warps"] = int(kernel.metadata.num_warps)
    record["num_stages"] = int(kernel.metadata.num_stages)
    record["mma"] = sorted(name for name, pattern in _MMA_PATTERNS.items() if pattern.search(ptx))
    record["tensor_cores"] = tensor_core_instruction(cc) in record["mma"]
    record["global_loads"] = global_loads(ptx)
    record["ttir_has_dot"] = bool(re.search(r"\btt\.dot\b|\btt\.dot_scaled\b", kernel.asm["ttir"]))
    try:
        start = time.perf_counter()
        record.update(ptxas_resources(ptx, cc, kernel.metadata))
        record["ptxas_seconds"] = round(time.perf_counter() - start, 3)
        record["occupancy"] = blocks_per_sm(cc, record["registers"], record["shared_bytes"], record["num_warps"])
        _add_sass(record, kernel.asm["cubin"])
        cubin_regs = cubin_registers(kernel.asm["cubin"])
        if cubin_regs is not None and cubin_regs != record["registers"]:
            record["notes"].append(f"ptxas -v re-run reports {record['registers']} registers, "
                                   f"Triton's cubin has {cubin_regs}")
    except Exception as e:
        record["error"] = f"ptxas -v: {_one_line(e)}"
    return _judge(record)


def _add_sass(record: dict[str, Any], cubin: bytes) -> None:
    """The kernel's instruction count and the size of its MMA loops' bodies (see :mod:`.sass`)."""
    sass = disassemble(cubin)
    if sass is not None:
        found, labels = instructions(sass)
        record["sass_instructions"] = len(found)
        record["mma_loop_instructions"] = [loop["instructions"] for loop in loops_of(found, labels)]


# ld.global and its qualified forms (ld.volatile.global, ld.relaxed.gpu.global, ld.global.nc.L1::...)
_LD_GLOBAL = re.compile(r"\bld(?:\.(?!global\b)[\w:]+)*\.global\S*?(?:\.v([248]))?\.[bsuf](\d+)\s")
_CP_ASYNC = re.compile(r"\bcp\.async\.c[ag]\.shared\.global[^;]*?,\s*(0x[0-9a-fA-F]+|\d+)\s*[,;]")


def global_loads(ptx: str) -> dict[str, int]:
    """Global-memory load instructions in ``ptx`` by kind and bytes per thread: ``ld.global``
    (synchronous, through registers) and ``cp.async`` (asynchronous copies into shared memory: a
    pipelined loop's loads), e.g. ``{"ld 2 B": 320, "cp.async 16 B": 96}``. Scalar 2-byte loads
    of a bf16 tile are the sign of a layout the compiler could not prove contiguous."""
    counts: dict[str, int] = {}
    for m in _LD_GLOBAL.finditer(ptx):
        key = f"ld {int(m.group(1) or 1) * int(m.group(2)) // 8} B"
        counts[key] = counts.get(key, 0) + 1
    for m in _CP_ASYNC.finditer(ptx):
        key = f"cp.async {int(m.group(1), 0)} B"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def blocks_per_sm(cc: int, registers: int, shared_bytes: int, num_warps: int) -> dict[str, int]:
    """How many blocks of this kernel one SM holds at once, and what limits it: ``{"blocks",
    "warps", "limit"}`` (limit: ``registers``, ``shared`` or ``warps``). One block of 4 warps
    per SM is a single warpgroup with nothing to overlap its loads, MMAs and softmax against."""
    per_warp = -(-max(registers, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    warps_by_registers = (SM_REGISTERS // SM_SUB_PARTITIONS // per_warp) * SM_SUB_PARTITIONS
    limits = {"registers": warps_by_registers // num_warps,
              "shared": SM_SHARED_BYTES[cc] // (shared_bytes + BLOCK_RESERVED_SHARED),
              "warps": min(SM_WARPS // num_warps, SM_BLOCKS)}
    limit = min(limits, key=limits.get)
    return {"blocks": limits[limit], "warps": limits[limit] * num_warps, "limit": limit}


def launch_specialization(signature: Mapping[str, str], constexprs: Mapping[str, Any], divisible: Iterable[str],
                          int_args: Mapping[str, int]) -> tuple[dict[str, str], dict[str, Any], list[str]]:
    """``(signature, constexprs, divisible)`` as Triton's launcher specialises a call whose integer
    arguments have the values ``int_args``: its own rule (``native_specialize_impl``) makes a 1 a
    constant, marks a multiple of 16 divisible and picks ``i32`` / ``i64`` by range."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature, constexprs, divisible = dict(signature), dict(constexprs), list(divisible)
    for name, value in int_args.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"int_args[{name!r}] = {value!r} is not an int")
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)[:2]
        if kind == "constexpr":
            signature[name], constexprs[name] = "constexpr", value
        else:
            signature[name] = kind
            if spec == "D" and name not in divisible:
                divisible.append(name)
    return signature, constexprs, divisible


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def ptxas_command(cc: int, metadata: Any) -> list[str]:
    """The ``ptxas`` command Triton 3.9 runs for the cubin (``make_cubin``), output file excluded."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    debug = ["-lineinfo", "-suppress-debug-info"] if knobs.compilation.disable_line_info else ["-lineinfo"]
    fmad = [] if metadata.enable_fp_fusion else ["--fmad=false"]
    extra = metadata.ptx_options.split(" ") if metadata.ptx_options else []
    return [get_ptxas(cc).path, *debug, *fmad, "-v", "--regAllocOptLevel=2", *extra,
            f"--gpu-name={sm_arch_from_capability(cc)}"]


def parse_ptxas_log(log: str) -> dict[str, int]:
    """Registers, stack frame and spill bytes from a ``ptxas -v`` log (one kernel)."""
    regs = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or frame is None:
        raise ValueError(f"no register / stack-frame line in the ptxas log: {log.strip()[:500]!r}")
    stack, stores, loads = (int(g) for g in frame.groups())
    return {"registers": int(regs.group(1)), "stack_bytes": stack, "spill_store_bytes": stores,
            "spill_load_bytes": loads, "spill_bytes": stores + loads}


def ptxas_resources(ptx: str, cc: int, metadata: Any) -> dict[str, int]:
    """Run ``ptxas -v`` on ``ptx`` as Triton does and parse its resource lines."""
    with tempfile.TemporaryDirectory(prefix="grcompile-aot-") as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        cmd = [*ptxas_command(cc, metadata), str(source), "-o", str(Path(tmp) / "kernel.cubin")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[:500]}")
    return parse_ptxas_log(done.stdout + done.stderr)


def cubin_registers(cubin: bytes) -> Optional[int]:
    """Registers of the (single) kernel in ``cubin``, by ``cuobjdump --dump-resource-usage``;
    ``None`` when cuobjdump is absent or prints no ``REG:`` field."""
    done = run_on_cubin("cuobjdump", ["--dump-resource-usage"], cubin, timeout=120)
    if done is None:
        return None
    found = re.findall(r"\bREG:(\d+)", done.stdout)
    return int(found[0]) if len(found) == 1 else None


def _judge(record: dict[str, Any]) -> dict[str, Any]:
    """Fill ``failures``: the reasons this record fails the report (empty: it passes)."""
    reasons = []
    if not record["compiled"]:
        reasons.append(f"not compiled: {record['error']}")
    else:
        if record["error"]:
            reasons.append(record["error"])
        spills = f"spills {record['spill_store_bytes']} B stored / {record['spill_load_bytes']} B loaded"
        tiles = (record.get("config") or {}).get("tiles")
        if record["spill_bytes"] and tiles in ("measured", "candidate"):
            # a tile chosen, or to be chosen, by timing it on the GPU: the spill is reported, the timing decides
            record["notes"].append(f"{spills} (tile " + ("measured fastest on a GPU)" if tiles == "measured"
                                                         else "the autotuner times)"))
        elif record["spill_bytes"]:
            reasons.append(spills)
        limit = MAX_SHARED_BYTES.get(ARCHS.get(record["arch"], 0))
        if limit is not None and record["shared_bytes"] > limit:
            reasons.append(f"needs {record['shared_bytes']} B shared memory, {record['arch']} allows {limit} B per block")
        instruction = _arch_tensor_core_instruction(record["arch"])
        if (record["uses_dot"] or record["ttir_has_dot"]) and not record["tensor_cores"]:
            found = ", ".join(record["mma"]) or "no MMA instruction"
            if record.get("ieee"):
                record["notes"].append(f"IEEE float32 products: no tensor cores by design (found: {found})")
            elif instruction is None:
                record["notes"].append(f"tensor cores not checked: no rule for {record['arch']}'s MMA "
                                       f"instruction (found: {found})")
            else:
                reasons.append(f"has tl.dot but no {instruction} in the PTX ({found})")
        if record["ttir_has_dot"] and not record["uses_dot"]:
            reasons.append("provider says uses_dot=False but the TTIR has tt.dot")
    record["failures"] = reasons
    return record


def _arch_tensor_core_instruction(arch: str) -> Optional[str]:
    cc = ARCHS.get(arch)
    if cc is None and re.fullmatch(r"sm_\d+a?", arch):
        cc = int(arch[3:].rstrip("a"))
    return None if cc is None else tensor_core_instruction(cc)


_TTIR_DIVISIBLE = re.compile(r"%(\w+): [^,{]*\{tt\.divisibility = 16")


def cache_records(cache_dir: str, kernels: Optional[str] = None) -> list[dict[str, Any]]:
    """Records of the CUDA kernels Triton compiled into ``cache_dir`` (its ``TRITON_CACHE_DIR``,
    default ``~/.triton/cache``), read back without compiling: after a run on a GPU, what that run
    launched — its specialisation (``config.divisible``: the arguments the TTIR declares divisible
    by 16), registers and spills (``ptxas -v`` on the cached PTX), shared memory, MMA instructions
    and global loads, judged as the report judges a compile. ``kernels``: a name regex."""
    from types import SimpleNamespace

    records = []
    for meta_path in sorted(Path(cache_dir).glob("*/*.json")):
        if meta_path.name.startswith("__grp__"):
            continue
        ptx_path = meta_path.with_suffix(".ptx")
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        if not ptx_path.exists() or meta.get("target", {}).get("backend") != "cuda":
            continue
        if kernels and not re.search(kernels, meta.get("name", "")):
            continue
        cc = int(meta["target"]["arch"])
        arch = next((a for a, c in ARCHS.items() if c == cc), f"sm_{cc}")
        ttir_path = meta_path.with_suffix(".ttir")
        ttir = ttir_path.read_text() if ttir_path.exists() else ""
        header = ttir[ttir.find("tt.func"):].split("\n", 1)[0]
        record = _empty_record(kernel=meta.get("name"), provider=f"triton cache {cache_dir}", arch=arch,
                               config={"cache": meta_path.parent.name[:12],
                                       "divisible": _TTIR_DIVISIBLE.findall(header)},
                               compiled=True, num_warps=meta.get("num_warps"), num_stages=meta.get("num_stages"),
                               shared_bytes=int(meta.get("shared", 0)))
        ptx = ptx_path.read_text()
        record["mma"] = sorted(name for name, pattern in _MMA_PATTERNS.items() if pattern.search(ptx))
        record["tensor_cores"] = tensor_core_instruction(cc) in record["mma"]
        record["ttir_has_dot"] = bool(re.search(r"\btt\.dot\b|\btt\.dot_scaled\b", ttir)) if ttir else None
        record["uses_dot"] = record["ttir_has_dot"]
        record["global_loads"] = global_loads(ptx)
        cubin_path = meta_path.with_suffix(".cubin")
        if cubin_path.exists():
            _add_sass(record, cubin_path.read_bytes())
        try:
            record.update(ptxas_resources(ptx, cc, SimpleNamespace(enable_fp_fusion=meta.get("enable_fp_fusion", True),
                                                                   ptx_options=meta.get("ptx_options"))))
            if cc in SM_SHARED_BYTES:
                record["occupancy"] = blocks_per_sm(cc, record["registers"], record["shared_bytes"],
                                                    record["num_warps"])
        except Exception as e:
            record["error"] = f"ptxas -v: {_one_line(e)}"
        records.append(_judge(record))
    return records


def config_archs(cfg: dict[str, Any], archs: list[str]) -> list[str]:
    """The archs of ``archs`` that ``cfg`` is compiled for: all of them, or only its ``arch`` key
    (none when that arch was not asked for; an unknown arch is kept, to fail as a record)."""
    arch = cfg.get("arch")
    if arch is None:
        return list(archs)
    return [arch] if arch in archs or arch not in ARCHS else []


def compile_all(configs: list[dict[str, Any]], archs: list[str], progress: bool = True) -> list[dict[str, Any]]:
    """One record per (config, arch), in provider order, then arch order (a config with an
    ``arch`` key: that arch only, see :func:`config_archs`)."""
    jobs = [(cfg, arch) for cfg in configs for arch in config_archs(cfg, archs)]
    bar = None
    if progress and jobs:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(jobs), desc="aot compile", unit="kernel", file=sys.stderr, leave=False)
        except ImportError:
            bar = None
    records = []
    for cfg, arch in jobs:
        if bar is not None:
            bar.set_postfix_str(f"{cfg.get('kernel')} {arch}", refresh=False)
        records.append(compile_config(cfg, arch))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return records


# ----------------------------------------------------------------------------- roofline


def roofline(flops: float, bytes: float, peak_flops: float = H100_BF16_FLOPS,
             bandwidth: float = H100_BANDWIDTH) -> dict[str, Any]:
    """Roofline lower bound on a kernel's time: ``max(flops / peak_flops, bytes / bandwidth)``.

    Defaults: H100 SXM, 989e12 FLOP/s dense bf16 tensor-core peak, 3.35e12 B/s HBM3. Returns the
    two terms, the bound (``seconds``), which one binds (``"compute"`` / ``"memory"``), the
    arithmetic intensity ``flops / bytes`` and the ridge point ``peak_flops / bandwidth``."""
    compute = flops / peak_flops
    memory = bytes / bandwidth
    return {"flops": flops, "bytes": bytes, "compute_seconds": compute, "memory_seconds": memory,
            "seconds": max(compute, memory), "bound": "compute" if compute >= memory else "memory",
            "intensity": flops / bytes if bytes else math.inf, "ridge": peak_flops / bandwidth}


def attention_cost(tokens: int, heads: int, dqk: int, dv: int, causal: bool = True,
                   dtype_bytes: int = 2, extra_bytes: float = 0.0) -> dict[str, dict[str, float]]:
    """Analytic FLOPs and HBM bytes of one attention layer over one row of ``tokens`` tokens.

    FLOPs count the two matmuls only (the SiLU / softmax, bias and mask pointwise work runs off
    the tensor cores and is left out). With ``P = N²/2`` (causal: the lower triangle, diagonal
    ignored) or ``P = N²`` query-key pairs:

        fwd = 2·P·H·dqk  (q kᵀ)  +  2·P·H·dv  (a v)       — for dqk = dv = d, causal: 2·N²·d·H
        bwd = 2.5 · fwd   (recompute q kᵀ, then dv, da→ds, dq, dk: 5 matmuls against the forward's 2)

    Bytes are the compulsory traffic of a fused (flash-style) kernel, each tensor read or written
    once in ``dtype_bytes`` per element, nothing of size N² stored:

        fwd = N·H·(2·dqk + 2·dv)·b     read q, k, v; write o
        bwd = N·H·(4·dqk + 3·dv)·b     read q, k, v, do; write dq, dk, dv

    plus ``extra_bytes`` per pass (timestamps, bias tables, offsets: the kernel author knows them).
    """
    pairs = tokens * tokens / 2 if causal else tokens * tokens
    fwd_flops = 2 * pairs * heads * dqk + 2 * pairs * heads * dv
    fwd_bytes = tokens * heads * (2 * dqk + 2 * dv) * dtype_bytes + extra_bytes
    bwd_bytes = tokens * heads * (4 * dqk + 3 * dv) * dtype_bytes + extra_bytes
    return {"fwd": {"flops": fwd_flops, "bytes": fwd_bytes},
            "bwd": {"flops": 2.5 * fwd_flops, "bytes": bwd_bytes}}


def _padded(d: int) -> int:
    """Head width a Triton kernel computes with: a power of two, at least 16 (``tl.dot``'s K)."""
    return max(16, 1 << (d - 1).bit_length())


@dataclass(frozen=True)
class AttentionShape:
    """The sizes of one model's attention that the roofline reads: heads, the q/k and v head widths
    and the number of layers. ``name`` labels the rows, ``reading`` says what the sizes are (the
    report prints it). The op layer knows no model: a caller (the CLI below) passes these in."""
    name: str
    heads: int
    dqk: int
    dv: int
    blocks: int
    reading: str = "preset"

    @classmethod
    def from_config(cls, name: str, config: Mapping[str, Any], reading: str = "preset") -> "AttentionShape":
        """From a model config with the keys of ``models/presets.py`` (``num_heads``,
        ``attention_dim``, ``linear_dim``, ``num_blocks``)."""
        return cls(name, config["num_heads"], config["attention_dim"], config["linear_dim"], config["num_blocks"],
                   reading)


# The presets "HSTU-large" can mean in this project (models/presets.py, hstu) -> how the report reads
# them; the CLI looks their sizes up and passes them to attention_roofline
HSTU_LARGE_READINGS = {"ml1m-large": "the HSTU paper's HSTU-large", "large": "TurboGR's large"}


def attention_roofline(shapes: Sequence[AttentionShape], tokens: int = 8192,
                       peak_flops: float = H100_BF16_FLOPS, bandwidth: float = H100_BANDWIDTH) -> dict[str, Any]:
    """Roofline of causal attention per row of ``tokens`` tokens, for each of ``shapes``. The CLI
    passes the HSTU presets "HSTU-large" can mean in this project (:data:`HSTU_LARGE_READINGS`,
    sizes read from ``models.presets.PRESETS["hstu"]``, not restated): ``ml1m-large`` (the HSTU
    paper's HSTU-large: 8 blocks, 2 heads, dqk = dv = 25) and ``large`` (TurboGR's large: 16 blocks,
    8 heads, dqk = dv = 128); only the head count and widths enter the formulas, at ``tokens``
    tokens whatever the preset's max_len. Rows: per layer (``useful`` FLOPs at the model's head
    widths, and ``executed`` at the widths padded to a power of two ≥ 16 when they differ, bytes
    unpadded) and
    the whole model's attention (``blocks`` layers, forward + backward, useful FLOPs)."""
    described = []
    rows = []
    for shape in shapes:
        preset = shape.name
        described.append(f"{preset} = {shape.reading}: {shape.blocks} blocks, "
                         f"{shape.heads} heads, dqk={shape.dqk}, dv={shape.dv}")
        heads, dqk, dv, blocks = shape.heads, shape.dqk, shape.dv, shape.blocks
        widths = [("useful", dqk, dv)]
        if (_padded(dqk), _padded(dv)) != (dqk, dv):
            widths.append(("executed", _padded(dqk), _padded(dv)))
        cost = attention_cost(tokens, heads, dqk, dv)
        for label, wq, wv in widths:
            flops = attention_cost(tokens, heads, wq, wv)  # bytes stay unpadded: memory holds dqk, dv
            for direction in ("fwd", "bwd"):
                rows.append({"preset": preset, "heads": heads, "dqk": wq, "dv": wv, "blocks": blocks,
                             "tokens": tokens, "scope": f"layer {direction} ({label})",
                             **roofline(flops[direction]["flops"], cost[direction]["bytes"], peak_flops, bandwidth)})
        flops = blocks * (cost["fwd"]["flops"] + cost["bwd"]["flops"])
        nbytes = blocks * (cost["fwd"]["bytes"] + cost["bwd"]["bytes"])
        rows.append({"preset": preset, "heads": heads, "dqk": dqk, "dv": dv, "blocks": blocks, "tokens": tokens,
                     "scope": f"model fwd+bwd ({blocks} layers)", **roofline(flops, nbytes, peak_flops, bandwidth)})
    return {"assumptions": {
        "tokens_per_row": tokens, "presets": described, "dtype": "bf16 (2 bytes)", "causal": True,
        "peak_flops": peak_flops, "bandwidth": bandwidth, "device": "H100 SXM (dense bf16, HBM3)",
        "fwd_flops": "2·P·H·dqk + 2·P·H·dv, P = N²/2 (= 2·N²·d·H for dqk = dv = d)",
        "bwd_flops": "2.5 × fwd",
        "fwd_bytes": "N·H·(2·dqk + 2·dv)·2 (read q, k, v; write o)",
        "bwd_bytes": "N·H·(4·dqk + 3·dv)·2 (read q, k, v, do; write dq, dk, dv)",
        "not_counted": "pointwise SiLU/bias/mask FLOPs; timestamps, bias tables, offsets bytes"},
        "rows": rows}


# ----------------------------------------------------------------------------- output


def _short_config(record: dict[str, Any], width: int = 60) -> str:
    config = record["config"]
    if config is None:
        return "-"
    if isinstance(config, dict):
        text = " ".join(f"{k}={v}" for k, v in config.items()).replace(", ", ",")
    else:
        text = str(config)
    text = text or "-"
    return text if len(text) <= width else text[: width - 1] + "…"


def _short_loads(loads: dict[str, int]) -> str:
    """``{"cp.async 16 B": 96, "ld 2 B": 320}`` -> ``"cp16 ld2"`` (kinds and widths, no counts)."""
    return " ".join(k.replace("cp.async ", "cp").replace("ld ", "ld").removesuffix(" B") for k in loads) or "-"


def format_table(records: list[dict[str, Any]]) -> str:
    """A fixed-width table: one line per record, failures spelled out underneath."""
    header = ("kernel", "config", "arch", "ok", "regs", "spill", "stack", "smem", "warps", "stages",
              "mma", "dot", "loads", "warps/SM", "loop", "secs")
    rows = []
    for r in records:
        def num(v: Any) -> str:
            return "-" if v is None else str(v)
        rows.append((str(r["kernel"]), _short_config(r), str(r["arch"]),
                     "FAIL" if r["failures"] else "ok", num(r["registers"]), num(r["spill_bytes"]),
                     num(r["stack_bytes"]), num(r["shared_bytes"]), num(r["num_warps"]), num(r["num_stages"]),
                     ("+".join(r["mma"]) or "-") if r["compiled"] else "-",
                     "-" if r["uses_dot"] is None else ("yes" if r["uses_dot"] else "no"),
                     _short_loads(r.get("global_loads") or {}),
                     (lambda o: f"{o['warps']} ({o['limit'][:4]})" if o else "-")(r.get("occupancy")),
                     "+".join(map(str, r.get("mma_loop_instructions") or [])) or "-",
                     "-" if r["compile_seconds"] is None
                     else f"{r['compile_seconds']:.2f}" + ("*" if r["cache_hit"] else "")))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r, row in zip(records, rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        lines.extend(f"    ! {reason}" for reason in r["failures"])
    if any(r["cache_hit"] for r in records):
        lines.append("(* from Triton's cache: the time is a lookup, not a compile)")
    return "\n".join(lines)


def format_roofline(report: dict[str, Any]) -> str:
    a = report["assumptions"]
    lines = [f"Roofline, HSTU causal attention, {a['tokens_per_row']} tokens per row, {a['dtype']}, "
             f"{a['device']}: {a['peak_flops'] / 1e12:g} TFLOP/s, {a['bandwidth'] / 1e12:g} TB/s",
             f"  FLOPs fwd = {a['fwd_flops']}; bwd = {a['bwd_flops']}",
             f"  bytes fwd = {a['fwd_bytes']}; bwd = {a['bwd_bytes']}",
             f"  not counted: {a['not_counted']}",
             "  'HSTU-large' read both ways (models/presets.py, hstu; only heads and widths matter):",
             *(f"    {p}" for p in a["presets"])]
    header = ("preset", "H", "dqk", "dv", "scope", "GFLOP", "MB", "FLOP/B", "roofline us", "bound")
    rows = [(r["preset"], str(r["heads"]), str(r["dqk"]), str(r["dv"]), r["scope"], f"{r['flops'] / 1e9:.1f}",
             f"{r['bytes'] / 1e6:.2f}", f"{r['intensity']:.0f}", f"{r['seconds'] * 1e6:.1f}", r["bound"])
            for r in report["rows"]]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    lines.extend("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
    return "\n".join(lines)


def build_report(providers: list[str], archs: list[str], with_roofline: bool = True,
                 kernels: Optional[str] = None, max_per_kernel: Optional[int] = None,
                 progress: bool = True, roofline_shapes: Sequence[AttentionShape] = ()) -> dict[str, Any]:
    """Load ``providers``, compile their configs for ``archs`` (only kernels whose name matches the
    regular expression ``kernels``, and only the first ``max_per_kernel`` configs of each kernel
    name, per ``arch`` key, when given), and assemble the JSON report; with ``with_roofline`` and
    ``roofline_shapes`` (the caller's model sizes) it carries their :func:`attention_roofline`."""
    import triton

    for arch in archs:
        _cc(arch)
    configs, status = load_providers(providers)
    if kernels:
        configs = [c for c in configs if re.search(kernels, str(c.get("kernel")))]
    if max_per_kernel is not None:
        seen: dict[str, int] = {}
        kept = []
        for c in configs:
            key = f"{c.get('provider')}:{c.get('kernel')}:{c.get('arch')}"
            seen[key] = seen.get(key, 0) + 1
            if seen[key] <= max_per_kernel:
                kept.append(c)
        configs = kept
    start = time.perf_counter()
    records = [provider_record(s, arch) for s in status if s["status"] != "ok" for arch in archs]
    records += compile_all(configs, archs, progress=progress)
    report = {"triton_version": triton.__version__, "archs": archs, "providers": status, "records": records,
              "failed": sum(bool(r["failures"]) for r in records),
              "seconds": round(time.perf_counter() - start, 2)}
    if with_roofline and roofline_shapes:
        report["roofline"] = attention_roofline(roofline_shapes)
    return report


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grcompile.lowering.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_80,sm_90", help="comma-separated targets (sm_80, sm_90)")
    parser.add_argument("--json", metavar="PATH", help="write the full report here")
    parser.add_argument("--providers", help="comma-separated 'module:function' providers "
                                            f"(default: {','.join(PROVIDERS)})")
    parser.add_argument("--kernels", metavar="REGEX", help="only kernels whose name matches")
    parser.add_argument("--max-per-kernel", type=int, metavar="N",
                        help="only the first N configs of each kernel (a quick subset)")
    parser.add_argument("--roofline", action=argparse.BooleanOptionalAction, default=True,
                        help="add the analytic attention roofline (default on)")
    parser.add_argument("--from-cache", metavar="DIR", help="compile nothing: read back the kernels Triton "
                        "compiled into DIR (a TRITON_CACHE_DIR; after a GPU run, what it launched)")
    parser.add_argument("--no-fail", action="store_true", help="exit 0 even when records fail")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    if _interpreting():
        print("error: TRITON_INTERPRET is set: @triton.jit builds interpreter functions, which cannot be "
              "compiled; unset it (python -m grcompile.lowering.aot does so itself)", file=sys.stderr)
        return 2
    if args.from_cache:
        records = cache_records(args.from_cache, args.kernels)
        print(format_table(records))
        failed = sum(bool(r["failures"]) for r in records)
        print(f"{len(records)} kernels in {args.from_cache}, {failed} failing")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"triton_version": __import__("triton").__version__, "cache": args.from_cache,
                                                   "records": records, "failed": failed}, indent=1, default=str))
            print(f"report: {args.json}")
        return 1 if failed and not args.no_fail else 0
    providers = [p for p in (args.providers.split(",") if args.providers else PROVIDERS) if p]
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    shapes: list[AttentionShape] = []
    if args.roofline:  # the CLI reads the model zoo's sizes; the library functions take them as arguments
        from models.presets import PRESETS

        shapes = [AttentionShape.from_config(name, PRESETS["hstu"][name], reading)
                  for name, reading in HSTU_LARGE_READINGS.items()]
    report = build_report(providers, archs, with_roofline=args.roofline, kernels=args.kernels,
                          max_per_kernel=args.max_per_kernel, progress=not args.no_progress, roofline_shapes=shapes)
    for s in report["providers"]:
        line = f"provider {s['provider']}: {s['status']}"
        print(line + (f", {s['configs']} configs" if s["status"] == "ok" else f" — {s['error']}"))
    print(format_table(report["records"]))
    compiled = [r for r in report["records"] if r["compile_seconds"] is not None]
    print(f"{len(report['records'])} records, {report['failed']} failing; "
          f"{sum(r['compile_seconds'] for r in compiled):.1f} s compiling "
          f"({sum(bool(r['cache_hit']) for r in compiled)} from Triton's cache), "
          f"{sum(r['ptxas_seconds'] or 0 for r in compiled):.1f} s in ptxas -v, {report['seconds']:.1f} s in all")
    if args.roofline:
        print()
        print(format_roofline(report["roofline"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"report: {args.json}")
    return 1 if report["failed"] and not args.no_fail else 0


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


if __name__ == "__main__":
    if _interpreting():
        # Triton read the variable when torch imported it (before this module ran): start afresh.
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        print("note: running without TRITON_INTERPRET (interpreted kernels cannot be compiled)", file=sys.stderr)
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "grcompile.lowering.aot", *sys.argv[1:]], env)
    sys.exit(main())
