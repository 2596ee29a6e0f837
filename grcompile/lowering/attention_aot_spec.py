"""Ahead-of-time figures for the attention variants a process actually ran.

The attention op records every variant it runs (``attention.SEEN_VARIANTS``: score_mod, activation,
dtypes, head widths, table shapes), whatever kernel ran it. :func:`spec_for_seen` generates their
Triton kernel modules (the files :mod:`.attention.triton` imports) and writes a JSON *spec*: per
(kernel, arch), the module file, the argument types, the constexprs and the launch configuration
the device would use. A fresh process without ``TRITON_INTERPRET`` compiles the spec
(:func:`aot_configs_from_spec` is an AOT provider), since the registry of score_mods, and with it
the source of a captured score_mod, exists only in the process that ran the model.

    python -m grcompile.bench ...           # the grcompile mode's JSON gains an "aot" list
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Optional

import torch

SPEC_ENV = "GRCOMPILE_AOT_SPEC"
ARCHS = ("sm_80", "sm_90")


def _examples(dtypes, shapes=None) -> list[torch.Tensor]:
    if shapes is None:
        return [torch.zeros(4, dtype=d) for d in dtypes]
    return [torch.zeros(shape, dtype=d) for shape, d in shapes]


def spec_for_seen(seen: dict, archs=ARCHS) -> list[dict[str, Any]]:
    """One spec entry per distinct compile (module, kernel, arch, signature, constexprs, launch
    configuration) of ``seen`` (``attention.SEEN_VARIANTS``), with the calls of every seen key
    that compiles to it; a
    variant the kernels cannot run (its score_mod has an op the generator does not know) gets an
    entry with ``error`` instead."""
    from .attention.triton import (Variant, _bucket, _kernel_signature, kernels_for, launch_config, split_interior,
                                    tile_source, _ACT)
    from .score_mod_codegen import Unsupported

    entries, compiled = [], {}  # compiled: what a compile depends on -> its entry
    cuda = torch.device("cuda")
    for key, calls in sorted(seen.items(), key=lambda kv: -kv[1]):
        score_mod, activation, causal, use_qk, dropout, dtype, dqk, dv, q_dtypes, k_dtypes, table_meta, \
            (max_len, heads), side_ranges = key
        q_sides, k_sides = _examples(q_dtypes), _examples(k_dtypes)
        tables = _examples(None, table_meta)
        config = dict(score_mod=score_mod.split("-")[0] or "none", activation=activation, causal=causal,
                      dropout=dropout, dtype=str(dtype).removeprefix("torch."), dqk=dqk, dv=dv, calls=calls)
        variant = Variant(score_mod, activation, causal, use_qk, dropout, tuple(q_dtypes), tuple(k_dtypes),
                          tuple((tuple(shape), d) for shape, d in table_meta), tuple(side_ranges))
        try:
            module, code = kernels_for(variant, q_sides, k_sides, tables)
        except Unsupported as why:
            entries.append(dict(kernel="jagged_attention", config=config, error=str(why)))
            continue
        all_tables = tables + list(code.constants if code else [])
        for kernel in ("fwd", "bwd_kv", "bwd_q") if use_qk else ("fwd", "bwd_kv"):
            fn = getattr(module, kernel)
            kernel_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
            guards = code.guard_bits(max_len, heads) if code else 0
            for arch in archs:
                plain = not score_mod and not dropout
                blocks, warps, stages = launch_config(kernel, dqk, dv, cuda, arch=arch, plain=plain,
                                                      dtype=kernel_dtype)
                entry = dict(
                    kernel=f"jagged_attention_{kernel}", module=module.__file__, fn=kernel, arch=arch,
                    signature=_kernel_signature(fn, kernel_dtype, q_sides, k_sides, all_tables),
                    constexprs=dict(blocks, ACT=_ACT[activation], CAUSAL=causal, USE_QK=use_qk, DROPOUT=dropout,
                                    IEEE=int(kernel_dtype == torch.float32), OOB_ROWS=arch == "sm_80",
                                    SPLIT=split_interior(bool(score_mod)),
                                    GUARDS=guards),
                    num_warps=warps, num_stages=stages, uses_dot=True, ieee=kernel_dtype == torch.float32,
                    config=dict(config, tiles=tile_source(kernel, arch, _bucket(max(dqk, dv)), plain,
                                                          kernel_dtype)))
                identity = repr([entry[k] for k in ("module", "fn", "arch", "signature", "constexprs", "num_warps",
                                                    "num_stages")])
                if identity in compiled:  # another max_len or head count, the same kernel: count its calls
                    compiled[identity]["config"]["calls"] += calls
                    continue
                compiled[identity] = entry
                entries.append(entry)
    return entries


def aot_configs_from_spec(path: Optional[str] = None) -> list[dict]:
    """AOT provider: the spec at ``path`` (default ``$GRCOMPILE_AOT_SPEC``) with its kernels
    imported from their module files."""
    path = path or os.environ.get(SPEC_ENV)
    if not path:
        raise RuntimeError(f"aot_configs_from_spec: set {SPEC_ENV} to a spec written by spec_for_seen")
    with open(path) as f:
        entries = json.load(f)
    configs = []
    for entry in entries:
        if "error" in entry:
            continue
        name = os.path.splitext(os.path.basename(entry["module"]))[0]
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, entry["module"])
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        configs.append({**{k: v for k, v in entry.items() if k not in ("module", "fn")},
                        "fn": getattr(module, entry["fn"])})
    return configs


def compile_seen(seen: dict, archs=ARCHS, timeout: int = 900) -> list[dict[str, Any]]:
    """Compile the kernels of ``seen`` for ``archs`` in a fresh process (no ``TRITON_INTERPRET``);
    compact records: kernel, arch, config, compiled, registers, spill_bytes, shared_bytes,
    tensor_cores, error."""
    entries = spec_for_seen(seen, archs)
    skipped = [dict(kernel=e["kernel"], config=e["config"], compiled=False, error=e["error"])
               for e in entries if "error" in e]
    if not any("error" not in e for e in entries):
        return skipped
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "aot.json")
        with open(spec_path, "w") as f:
            json.dump(entries, f)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env[SPEC_ENV] = spec_path
        cmd = [sys.executable, "-m", "grcompile.lowering.aot", "--providers",
               "grcompile.lowering.attention_aot_spec:aot_configs_from_spec", "--arch", ",".join(archs),
               "--json", out_path, "--no-roofline", "--no-fail", "--no-progress"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not os.path.exists(out_path):
            return skipped + [dict(kernel="jagged_attention", compiled=False,
                                   error=f"the AOT compile failed: {(done.stderr or done.stdout)[-500:]}")]
        with open(out_path) as f:
            report = json.load(f)
    records = report["records"] if isinstance(report, dict) else report
    keep = ("kernel", "arch", "config", "compiled", "registers", "spill_bytes", "shared_bytes", "tensor_cores",
            "error")
    return skipped + [{k: r.get(k) for k in keep} for r in records]


__all__ = ["spec_for_seen", "aot_configs_from_spec", "compile_seen", "SPEC_ENV"]
