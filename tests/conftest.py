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
