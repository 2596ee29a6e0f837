"""The layers of grcompile (docs/DESIGN.md, "Layers"), enforced on the source with ``ast``: every
``import`` (module level or inside a function), every lazy ``"grcompile.x:attr"`` kernel path and
every ``importlib.import_module("grcompile.x")`` under grcompile/ is checked against the layer it
may use. Also: importing ``grcompile.lowering`` registers every op defined under it."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "grcompile"

# top-level entry of grcompile/ -> its layer; "api" is grcompile/__init__.py and its small modules
LAYER = {"lowering": "lowering", "passes": "passes", "capture": "capture", "runtime": "runtime", "data": "data",
         "modes": "api", "user_model": "api", "train": "cli", "bench": "cli", "demo": "cli", "explain": "cli"}
LIBRARY = {"lowering", "passes", "capture", "runtime", "data", "api"}
# layer -> the layers it may import (its own included); the CLIs may import anything
ALLOWED = {
    "lowering": {"lowering"},
    "passes": {"passes", "lowering"},
    "capture": {"capture", "passes", "lowering"},
    "runtime": {"runtime", "lowering"},
    "data": {"data"},
    "api": LIBRARY,
    "cli": LIBRARY | {"cli"},
}
# (layer, imported module) -> why it is allowed for now
EXCEPTIONS: dict[tuple[str, str], str] = {}
_LAZY_PATH = re.compile(r"grcompile(\.\w+)+:\w+")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "grcompile":
        return None
    return LAYER.get(parts[1], "api") if len(parts) > 1 else "api"


def _is_module(dotted: str) -> bool:
    path = ROOT.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path, top_level_only: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` of every grcompile module ``path`` imports (``from m import n``: ``m.n``
    where that is a module, else ``m``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for a in node.names:
                found.append((node.lineno, f"{module}.{a.name}" if _is_module(f"{module}.{a.name}") else module))
        elif not top_level_only and isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _LAZY_PATH.fullmatch(node.value):  # register_op(..., triton="grcompile.x:attr")
                found.append((node.lineno, node.value.partition(":")[0]))
        elif not top_level_only and isinstance(node, ast.Call) and node.args:
            fn, arg = node.func, node.args[0]
            if (getattr(fn, "attr", getattr(fn, "id", None)) == "import_module" and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)):
                found.append((node.lineno, arg.value))
    return [(line, m) for line, m in found if m == "grcompile" or m.startswith("grcompile.")]


SOURCES = sorted(ROOT.rglob("*.py"))


def test_every_top_level_entry_has_a_layer() -> None:
    entries = {p.stem if p.suffix == ".py" else p.name for p in ROOT.iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()}
    assert entries <= set(LAYER), f"give {sorted(entries - set(LAYER))} a layer in LAYER (and docs/DESIGN.md)"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_imports_follow_the_layers(path: Path) -> None:
    layer = _layer(_module_name(path))
    bad = []
    for line, module in _imports(path):
        target = _layer(module)
        if target in ALLOWED[layer] or (layer, module) in EXCEPTIONS:
            continue
        bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module} ({layer} -> {target})")
    assert not bad, "layer violations (docs/DESIGN.md, Layers):\n" + "\n".join(bad)


def test_the_exceptions_are_still_needed() -> None:
    used = {(_layer(_module_name(p)), m) for p in SOURCES for _, m in _imports(p)}
    assert set(EXCEPTIONS) <= used, f"no longer imported, drop from EXCEPTIONS: {set(EXCEPTIONS) - used}"


def _model_imports_outside_main(path: Path) -> list[int]:
    """Lines where ``path`` imports the model zoo (``models``, ``models.*``) outside a function named
    ``main``: a module's ``main`` is its CLI (``python -m``), which may read ``models/presets.py``
    and pass sizes down; the library functions must take them as arguments."""
    def is_models(name: str) -> bool:
        return name == "models" or name.startswith("models.")

    lines = []

    def visit(node: ast.AST, in_main: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_main or (isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.name == "main")
            if not inside:
                if isinstance(child, ast.Import) and any(is_models(a.name) for a in child.names):
                    lines.append(child.lineno)
                elif isinstance(child, ast.ImportFrom) and not child.level and is_models(child.module or ""):
                    lines.append(child.lineno)
                elif (isinstance(child, ast.Call) and child.args and isinstance(child.args[0], ast.Constant)
                      and getattr(child.func, "attr", getattr(child.func, "id", None)) == "import_module"
                      and isinstance(child.args[0].value, str) and is_models(child.args[0].value)):
                    lines.append(child.lineno)
            visit(child, inside)

    visit(ast.parse(path.read_text(), str(path)), False)
    return lines


@pytest.mark.parametrize("path", [p for p in SOURCES if _layer(_module_name(p)) == "lowering"],
                         ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_lowering_imports_no_model(path: Path) -> None:
    """The op layer knows no model: sizes (the roofline's HSTU presets) come in as arguments, read
    from ``models/`` only by a CLI's ``main``."""
    lines = _model_imports_outside_main(path)
    assert not lines, f"{path.relative_to(ROOT.parent)}:{lines} imports models/ outside main()"


def test_the_model_import_rule_sees_imports() -> None:
    """The rule above finds what it must: a library import, not the CLI's."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.py"
        probe.write_text("import os\ndef f():\n    from models.presets import PRESETS\n"
                         "def main():\n    import models.presets\nimport models\n")
        assert _model_imports_outside_main(probe) == [3, 6]


def _defines_op(path: Path) -> bool:
    return 'custom_op("grcompile::' in path.read_text()


def test_importing_lowering_registers_every_op() -> None:
    """Every module under grcompile/lowering that defines a grcompile op is imported, at module
    level and transitively, by grcompile/lowering/__init__.py: no one imports an op for its side
    effect. Ops are defined nowhere else (the sparse runtime binds its implementation to the
    ``sparse_lookup`` that lowering defines)."""
    seen, todo = set(), ["grcompile.lowering"]
    while todo:
        module = todo.pop()
        if module in seen or not module.startswith("grcompile.lowering"):
            continue
        seen.add(module)
        path = ROOT.parent.joinpath(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        todo += [m for _, m in _imports(path, top_level_only=True)]
    defining = {_module_name(p) for p in SOURCES if _defines_op(p)}
    lowering = {m for m in defining if m.startswith("grcompile.lowering")}
    assert lowering, "no op found: the test reads the wrong files"
    assert lowering <= seen, f"define ops but are not imported by grcompile/lowering/__init__.py: {lowering - seen}"
    assert defining == lowering, f"ops belong in grcompile/lowering: {sorted(defining - lowering)}"
