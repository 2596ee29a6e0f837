"""Graph dumps: every graph grcompile produces is written as readable Python with a provenance
header (lightning-thunder style), into ``dump_dir/graph_<k>/NN-<label>.py``, and emitted as a
``trace_structured`` artifact so ``tlparse`` shows it next to Dynamo's own graphs."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.fx as fx

__all__ = ["describe_inputs", "emit_artifact", "provenance_header", "readable_code", "safe_name",
           "resolve_dump_dir", "write_dump"]

DUMP_ENV = "GRCOMPILE_DUMP_DIR"


def resolve_dump_dir(option: str | os.PathLike[str] | None) -> Path | None:
    """The explicit option wins; else ``$GRCOMPILE_DUMP_DIR``; else no dumps."""
    value = option if option is not None else os.environ.get(DUMP_ENV) or None
    return Path(value) if value is not None else None


def safe_name(label: str) -> str:
    """A file-name-safe slug: ``"fuse attention/rab"`` -> ``"fuse_attention_rab"``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("._") or "pass"


def readable_code(gm: fx.GraphModule) -> str:
    """``print_readable`` (shapes/dtypes as annotations) with ``gm.code`` as fallback: printing
    must never be the reason a compile fails."""
    try:
        return gm.print_readable(print_output=False)
    except Exception:  # noqa: BLE001
        return gm.code


def provenance_header(graph_index: int, label: str, lines: Sequence[str] = ()) -> str:
    body = [f"grcompile graph {graph_index}: {label}", *lines]
    return "".join(f"# {line}\n" for line in body)


def describe_inputs(example_inputs: Sequence[Any]) -> str:
    parts = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            parts.append(f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}")
        else:
            parts.append(type(x).__name__)
    return ", ".join(parts)


def write_dump(dump_dir: Path, graph_index: int, step: int, label: str, gm: fx.GraphModule,
               header_lines: Sequence[str] = ()) -> Path:
    """Write ``dump_dir/graph_<k>/<step:02d>-<label>.py``: header comment, ``import torch``,
    then the readable module code (valid Python: it compiles, though it is not meant to run)."""
    folder = Path(dump_dir) / f"graph_{graph_index}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{step:02d}-{safe_name(label)}.py"
    text = provenance_header(graph_index, label, header_lines) + "import torch\n\n" + readable_code(gm)
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path


def write_score_mods(dump_dir: Path, graph_index: int, gm: fx.GraphModule) -> list[Path]:
    """Write the score_mods the graph's fused attentions reference (``score_mod=<key>``) as
    ``dump_dir/graph_<k>/score_mods/<key>.py``: the user's bias / activation / mask math as the
    attention op evaluates it per (query, key) pair."""
    from ..lowering.score_mod import get_score_mod

    keys = sorted({n.kwargs["score_mod"] for n in gm.graph.nodes
                   if n.op == "call_function" and isinstance(n.kwargs.get("score_mod"), str) and n.kwargs["score_mod"]})
    paths = []
    for key in keys:
        try:
            mod = get_score_mod(key)
        except KeyError:
            continue
        folder = Path(dump_dir) / f"graph_{graph_index}" / "score_mods"
        folder.mkdir(parents=True, exist_ok=True)
        if isinstance(mod.fn, fx.GraphModule):
            body = readable_code(mod.fn)
        else:
            import inspect

            try:
                body = inspect.getsource(mod.fn)
            except (OSError, TypeError):
                body = repr(mod.fn)
        path = folder / f"{safe_name(key)}.py"
        path.write_text(f"# grcompile score_mod {key} (kind={mod.kind!r}), graph {graph_index}\nimport torch\n\n{body}\n")
        paths.append(path)
    return paths


def emit_artifact(graph_index: int, step: int, label: str, gm: fx.GraphModule) -> None:
    """A structured-trace artifact (TORCH_TRACE / tlparse); free when tracing is off."""
    name = f"grcompile_graph{graph_index}_{step:02d}_{safe_name(label)}"
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=lambda: readable_code(gm),
    )
