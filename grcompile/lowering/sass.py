"""The machine code of a compiled kernel, read without a GPU: ``nvdisasm`` (shipped in Triton's
wheel) on the cubin, and the size of the loops that carry its matrix multiplies.

A flash-attention kernel spends its time in the loop over key (or query) blocks; each trip issues
that loop body once per warp. On an H100 an SM issues one instruction per cycle in each of its four
sub-partitions, while its tensor cores finish a bf16 128 x 32 x 128 tile pair in about 512 cycles,
so a body of N instructions run by W warps costs at least ``N * W / 4`` cycles of issue: the body
size is the static measure of what a score_mod, a mask or a guard adds to the tile's matrix work
(latency and memory stalls come on top; only a GPU measures those).

:func:`mma_loops` finds the loops — a backward branch to a label at or before it — that contain an
``HMMA`` (mma.sync) or ``HGMMA`` (wgmma) instruction, and counts their instructions by opcode. A
per-element branch inside the body (e.g. the slow path of ``logf``) is counted with the body.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)[\w.]*\s*([^;]*);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def cuda_tool(name: str) -> str:
    """The path of one of the CUDA tools Triton's wheel ships (ptxas, cuobjdump, nvdisasm)."""
    import triton.backends.nvidia as nvidia
    return str(Path(nvidia.__file__).parent / "bin" / name)


def run_on_cubin(tool: str, args: list[str], cubin: bytes, timeout: int = 300) -> Optional[subprocess.CompletedProcess]:
    """``tool *args FILE`` on ``cubin`` written to a temporary file; None when the tool is absent."""
    path = cuda_tool(tool)
    if not os.path.exists(path):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([path, *args, f.name], capture_output=True, text=True, timeout=timeout)


def disassemble(cubin: bytes) -> Optional[str]:
    """SASS text of ``cubin``; None when ``nvdisasm`` is absent or fails."""
    done = run_on_cubin("nvdisasm", ["-c"], cubin)
    return done.stdout if done is not None and done.returncode == 0 else None


def instructions(sass: str) -> tuple[list[tuple[int, str, str]], dict[str, int]]:
    """``([(address, opcode, operands)], {label: address})``; the opcode without its modifiers."""
    found, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSTRUCTION.match(line)
        if m:
            address = int(m.group(1), 16)
            labels.update((name, address) for name in pending)
            pending = []
            found.append((address, m.group(2), m.group(3)))
    return found, labels


def mma_loops(sass: str) -> list[dict]:
    """The loops carrying a tensor-core MMA, in code order: ``{"instructions": n, "mix": {opcode:
    count}}`` per loop (its body from the label to the backward branch, both included)."""
    return loops_of(*instructions(sass))


def loops_of(found: list[tuple[int, str, str]], labels: dict[str, int]) -> list[dict]:
    """:func:`mma_loops` of already parsed :func:`instructions`."""
    loops = []
    for address, opcode, operands in found:
        target = _BRANCH_TARGET.search(operands) if opcode == "BRA" else None
        if target and labels.get(target.group(1), address + 1) <= address:
            lo = labels[target.group(1)]
            mix = collections.Counter(op for a, op, _ in found if lo <= a <= address)
            if mix["HMMA"] or mix["HGMMA"]:
                loops.append({"start": lo, "instructions": sum(mix.values()), "mix": dict(mix.most_common())})
    return [{k: v for k, v in loop.items() if k != "start"} for loop in sorted(loops, key=lambda x: x["start"])]


__all__ = ["cuda_tool", "disassemble", "instructions", "loops_of", "mma_loops", "run_on_cubin"]
