"""`slabpool serve`'s arguments: model names, bad models, and a CLI that stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

from slabpool.engine.job.cli import main
from slabpool.engine.serve.cli import model_specs


def test_models_are_named_after_their_file_unless_named(models):
    assert model_specs([str(models.mlp), f"other={models.mlp}"]) == [("mlp", str(models.mlp)), ("other", str(models.mlp))]


@pytest.mark.parametrize("items,words", [
    (["{mlp}", "{mlp}"], ["two models", "'mlp'"]),
    (["=" + "{mlp}"], ["name"]),
    (["a/b={mlp}"], ["'a/b'"]),
    # names go into URLs unescaped: only A-Z a-z 0-9 _ . - (was: a space, '?', '%' accepted)
    (["a b={mlp}"], ["'a b'", "A-Z a-z 0-9 _ . -"]),
    (["q?x={mlp}"], ["'q?x'", "A-Z"]),
    (["p%2f={mlp}"], ["'p%2f'", "A-Z"]),
    (["caf\u00e9={mlp}"], ["'caf\u00e9'", "A-Z"]),
    (["{space}"], ["'my model'", "NAME=PATH"]),
    (["missing.onnx"], ["not found", "missing.onnx"]),
])
def test_bad_model_arguments_say_what_is_wrong(models, items, words, tmp_path):
    space = tmp_path / "my model.onnx"
    space.write_bytes(models.mlp.read_bytes())
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        model_specs([i.format(mlp=models.mlp, space=space) for i in items])
    for w in words:
        assert w in str(err.value)


def test_a_bad_model_is_one_line_and_status_1(capsys):
    assert main(["serve", "missing.onnx"]) == 1
    assert "slabpool serve: error: model not found: missing.onnx" in capsys.readouterr().err


def test_the_command_line_does_not_import_the_servers():
    code = ("import sys, slabpool.engine.job.cli as c; c.build_parser(); "
            "print(sorted(m for m in ('uvicorn', 'grpc', 'orjson', 'prometheus_client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_without_the_serve_extra_it_says_what_to_install(models):
    code = ("import sys; sys.modules['uvicorn'] = None; from slabpool.engine.job.cli import main; "
            f"sys.exit(main(['serve', {str(models.mlp)!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "slabpool serve: error: slabpool serve needs uvicorn: pip install 'slabpool[serve]'" in out.stderr


def _serve_args(*argv: str):
    from slabpool.engine.job.cli import build_parser

    return build_parser().parse_args(["serve", "m.onnx", *argv])


@pytest.mark.parametrize("argv,size,wait", [
    ((), 1, 0.0),  # batching off, as Triton and MLServer ship
    (("--max-batch-size", "8"), 8, 0.0),  # on: what is queued is taken, nothing waits (was 2 ms)
    (("--max-batch-size", "8", "--max-batch-wait-ms", "2.5"), 8, 2.5),
    (("--max-batch-wait-ms", "0"), 1, 0.0),
])
def test_dynamic_batching_is_off_by_default_and_never_waits_unless_told(argv, size, wait):
    """serve's batching defaults are a model server's (docs/serve.md): off, and once on with
    --max-batch-size, Triton's max_queue_delay of 0, so that batching adds no wait at low load."""
    args = _serve_args(*argv)
    assert (args.max_batch_size, args.max_batch_wait_ms) == (size, wait)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_a_bad_batch_wait_is_refused_by_the_command_line(value, capsys):
    with pytest.raises(SystemExit):
        _serve_args("--max-batch-wait-ms", value)
    assert "--max-batch-wait-ms" in capsys.readouterr().err


@pytest.mark.parametrize("argv,spin", [((), 1000.0), (("--spin-us", "0"), 0.0), (("--spin-us", "250"), 250.0)])
def test_spin_us_is_the_engines_setting(argv, spin):
    assert _serve_args(*argv).spin_us == spin


@pytest.mark.parametrize("value", ["-1", "nan", "10001", "soon"])
def test_a_bad_spin_is_refused_by_the_command_line(value, capsys):
    with pytest.raises(SystemExit):
        _serve_args("--spin-us", value)
    assert "--spin-us" in capsys.readouterr().err
