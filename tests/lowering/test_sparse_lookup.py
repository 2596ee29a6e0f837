"""``grcompile::sparse_lookup`` is defined by the op layer and implemented by the sparse runtime
(grcompile/lowering/sparse_lookup.py, grcompile/runtime/lookup_op.py)."""
from __future__ import annotations

import subprocess
import sys

import torch

import grcompile.lowering  # noqa: F401 (registers the ops)


def test_the_op_layer_alone_defines_the_op_and_says_what_is_missing() -> None:
    """In a process that never imported the runtime the op exists, means "embedding" to the
    passes, and calling it (eagerly or under fake tensors) names the missing runtime."""
    code = """
import sys, torch
from torch._subclasses.fake_tensor import FakeTensorMode
import grcompile.lowering
from grcompile.lowering import semantics
assert "grcompile.runtime.lookup_op" not in sys.modules
assert semantics.declared(torch.ops.grcompile.sparse_lookup.default) == "embedding"
ids, anchor = torch.zeros(3, dtype=torch.long), torch.zeros(())
for mode in (None, FakeTensorMode()):
    try:
        if mode is None:
            torch.ops.grcompile.sparse_lookup(ids, anchor, 0, "f", False)
        else:
            with mode:
                torch.ops.grcompile.sparse_lookup(mode.from_tensor(ids), mode.from_tensor(anchor), 0, "f", False)
    except RuntimeError as e:
        assert "no sparse runtime bound" in str(e), e
    else:
        raise AssertionError("the unbound op ran")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_runtime_binds_its_implementation() -> None:
    from grcompile.lowering import OPS
    from grcompile.runtime import lookup_op

    assert OPS["sparse_lookup"].reference is lookup_op._lookup
    assert OPS["sparse_lookup_backward"].reference is lookup_op._lookup_backward
