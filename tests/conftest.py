"""Test-process isolation, set before torch is imported.

Under ``pytest -n 2`` both workers compile inductor kernels (the attention chunks, the lowering
tests); each worker gets its own inductor cache directory, and compilation stays in-process
(no compile-worker pool per worker), so the workers share no files and no helper processes."""
import os
import tempfile

_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"grcompile-inductor-{_worker}")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# The attention chunk runs eagerly in tests unless a test turns the inductor-compiled chunk on
# (test_compiled_chunks_match_* in tests/lowering/test_jagged_ops.py do, on varied shapes):
# the two compute the same values, and compiling each option set (forward, backward) in every test
# process would add many minutes to the suite. Benchmarks, the demo and users get the compiled one.
os.environ.setdefault("GRCOMPILE_COMPILE_CHUNKS", "0")

# Triton kernels run on CPU tensors only in Triton's interpreter, which Triton reads when it is
# imported (``import torch._dynamo`` imports it): set here, before anything imports torch. It only
# matters where a test asks for the Triton backend (``use_backend("triton")``, tests/lowering).
# ``GRCOMPILE_TEST_DEVICE=cuda`` (on a GPU machine) runs the kernel-vs-reference tests natively.
if os.environ.get("GRCOMPILE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
