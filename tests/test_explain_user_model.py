"""``--model path/to/file.py:factory``: explain on a user's model, and bad specs as clear errors
(grcompile.user_model, grcompile.explain, grcompile.bench's argument check)."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch

from grcompile.user_model import StepLoss, UserModel, UserModelSpecError, load_user_model

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = f"{REPO / 'examples' / 'sasrec_mha.py'}:factory"


def write(tmp_path: Path, body: str, name: str = "user.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_example_loads_with_factory_kwargs_and_runs_eagerly() -> None:
    user = load_user_model(EXAMPLE, max_len=6, embedding_dim=8, not_a_parameter=1)
    assert user.module.pos_emb.num_embeddings == 6 and user.module.item_emb.embedding_dim == 8
    (ids,) = user.batch(5, 6, seed=3)
    assert ids.shape == (5, 6) and (ids[0] == 0).all() and (ids[1, 1:] == 0).all() and (ids[2] != 0).all()
    assert torch.equal(ids, user.batch(5, 6, seed=3)[0]) and not torch.equal(ids, user.batch(5, 6, seed=4)[0])
    out = user.module(ids)
    assert out.shape == (5, 6, 8) and torch.isfinite(out).all()
    loss = StepLoss(user)(ids)  # forward + the default loss over the valid positions
    assert loss.dim() == 0 and float(loss.detach()) > 0
    loss.backward()
    assert user.module.item_emb.weight.grad is not None


def test_explain_on_user_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from grcompile.explain import main

    report = main(["--model", EXAMPLE, "--max-len", "8", "--batch-size", "4", "--dump", str(tmp_path)])
    out = capsys.readouterr().out
    assert f"grcompile.explain: {EXAMPLE} (sasrec_mha), N=8, B=4, pipeline 'jagged'" in out
    assert "grcompile report: 1 graph(s) compiled" in out and report.compiles == 1
    stages = ["00-captured"] + [f"{i:02d}-{name}" for i, name in enumerate(report.passes, 1)]
    assert "jagged_rewrite" in report.passes and "fuse_attention" in report.passes
    for stage in stages:  # one op-count line per pass, as for the built-in models
        assert re.search(rf"^  {stage}\s+\d+ calls   vs captured: ", out, re.M), stage
        assert (tmp_path / "graph_0" / f"{stage}.py").exists()
    captured = (tmp_path / "graph_0" / "00-captured.py").read_text()
    # one training step: the module (attention, layer norms) and the loss over the valid positions
    assert "multi_head_attention_forward" in captured or "scaled_dot_product_attention" in captured
    assert "layer_norm" in captured and "pow" in captured
    # every fallback names the user's file
    assert all("sasrec_mha.py:" in f["site"] for f in report.fallbacks), report.fallbacks


@pytest.mark.parametrize("body, spec_tail, error, message", [
    (None, "missing.py:factory", FileNotFoundError, "no file"),
    ("def factory():\n    pass\n", "user.py:nothing", AttributeError, "has no attribute 'nothing'"),
    ("factory = 3\n", "user.py:factory", TypeError, "'factory' in .* is a int object, not a callable"),
    ("def factory(max_len=4):\n    return 3\n", "user.py:factory", TypeError, "must return .*UserModel.*got int"),
    ("import torch\ndef factory():\n    return (torch.nn.Linear(2, 2),)\n", "user.py:factory", TypeError,
     r"got a tuple of 1 \(Linear\)"),
    ("from grcompile.user_model import UserModel\ndef factory():\n    return UserModel(lambda x: x, None)\n",
     "user.py:factory", TypeError, "module must be a torch.nn.Module, got function"),
    ("import torch\nfrom grcompile.user_model import UserModel\n"
     "def factory():\n    return UserModel(torch.nn.Linear(2, 2), 'batch')\n",
     "user.py:factory", TypeError, "make_batch must be callable, got str"),
    (None, "no_colon.py", ValueError, "expected 'path/to/file.py:factory'"),
    (None, "no_such_package.mod:factory", FileNotFoundError, "no module 'no_such_package.mod'"),
])
def test_bad_specs_are_clear_errors(tmp_path: Path, body: str | None, spec_tail: str, error: type,
                                    message: str) -> None:
    if body is not None:
        write(tmp_path, body)
    spec = spec_tail if spec_tail.startswith("no_such_package") else f"{tmp_path}/{spec_tail}"
    with pytest.raises(error, match=message) as caught:
        load_user_model(spec)
    assert isinstance(caught.value, UserModelSpecError) and spec in str(caught.value)


def test_errors_inside_the_users_code_keep_their_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, "import torch\ndef factory():\n    raise RuntimeError('my bug')\n")
    with pytest.raises(RuntimeError, match="my bug") as caught:
        load_user_model(f"{path}:factory")
    assert not isinstance(caught.value, UserModelSpecError)
    path = write(tmp_path, "import no_such_module_here\n", name="imports.py")
    with pytest.raises(ModuleNotFoundError, match="no_such_module_here"):
        load_user_model(f"{path}:factory")


def test_user_file_imports_its_neighbours(tmp_path: Path) -> None:
    write(tmp_path, "import torch\nclass Layer(torch.nn.Linear):\n    pass\n", name="layers_beside.py")
    path = write(tmp_path, """\
        import torch
        from layers_beside import Layer
        def factory():
            return Layer(3, 2), lambda batch_size, max_len, seed: torch.ones(batch_size, max_len, 3)
        """)
    user = load_user_model(f"{path}:factory")
    assert isinstance(user, UserModel) and type(user.module).__name__ == "Layer"
    assert StepLoss(user)(*user.batch(2, 4)).dim() == 0


@pytest.mark.parametrize("cli", ["explain", "bench"])
def test_cli_bad_spec_is_a_usage_error(cli: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    if cli == "explain":
        from grcompile.explain import main as run
    else:
        from grcompile.bench.__main__ import parse_args as run
    for argv, message in [(["--model", f"{tmp_path}/missing.py:factory"], "no file"),
                          (["--model", f"{EXAMPLE[:-len('factory')]}nope"], "has no attribute 'nope'"),
                          (["--model", "transformer"], "choose from fuxi, hstu, sasrec or give FILE.py:FACTORY")]:
        with pytest.raises(SystemExit) as caught:
            run(argv)
        assert caught.value.code == 2
        assert message in capsys.readouterr().err


def test_bench_args_for_a_user_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from grcompile.bench.__main__ import parse_args

    args = parse_args(["--model", EXAMPLE])
    assert args.max_len == 50 and args.preset is None and args.model_spec == EXAMPLE  # the factory's default
    assert parse_args(["--model", EXAMPLE, "--max-len", "12"]).max_len == 12
    assert parse_args(["--model", "sasrec"]).preset == "small"  # built-ins unchanged
    path = write(tmp_path, "def factory(num_items=10):\n    return 3\n")
    for argv, message in [(["--model", f"{path}:factory"], "--max-len is required"),
                          (["--model", f"{path}:factory", "--max-len", "4"], "must return"),
                          (["--model", EXAMPLE, "--preset", "small"], "--preset applies to the built-in models")]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
