"""A worker that dies before its handshake says why, in the caller (engine/local/mainguard.py,
workers/main.py SealedBoot, engine/local/transport.py).

What the caller can tell before starting any worker, it refuses at once with what to do: a
script read from stdin (`python - <<EOF`), whose main module no worker can import again; a
hook defined in a main module the workers never import (`python -c`, `python -m package`).
What fails in a worker is carried back: a hook's module that does not import there, an
initializer that raises. What fails inside multiprocessing's own start of the process
(importing the main script again) is named, with where its traceback is. Real interpreters
run each case; none of them may leave a worker behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slabpool import Engine
from slabpool.workers.errors import RemoteTraceback, SessionInitError

X = "{'x': __import__('numpy').zeros((1, 16), 'float32')}"


def _python(args: list[str], stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


def _refused_before_any_worker(out: subprocess.CompletedProcess[str], says: str) -> None:
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: ") and says in last, out.stderr
    assert "died during start-up" not in out.stderr and "spawn_main" not in out.stderr, out.stderr


def test_a_script_fed_on_stdin_is_refused_saying_why(models, start_method) -> None:  # type: ignore[no-untyped-def]
    script = f"from slabpool import Engine\nEngine({str(models.mlp)!r}, workers=1, start_method={start_method!r})\n"
    out = _python(["-"], stdin=script)
    _refused_before_any_worker(out, "the main module was read from '<stdin>'")
    assert "Save the script to a file" in out.stderr


@pytest.mark.parametrize("hook", ["preprocess", "initializer"])
def test_a_hook_defined_in_python_c_is_refused_naming_it(models, start_method, hook) -> None:  # type: ignore[no-untyped-def]
    code = textwrap.dedent(f"""
        from slabpool import Engine
        def pre(item): return item
        def init(): pass
        Engine({str(models.mlp)!r}, workers=1, start_method={start_method!r},
               {hook}={'pre' if hook == 'preprocess' else 'init'})
    """)
    _refused_before_any_worker(_python(["-c", code]), f"{hook}=<function ")


def test_python_c_with_hooks_from_a_module_still_works(models) -> None:  # type: ignore[no-untyped-def]
    code = (f"from slabpool import Engine\nwith Engine({str(models.mlp)!r}, workers=1, preprocess='tests.hooks:to_feeds') "
            f"as e: print(sorted(e.infer({X})))")
    out = _python(["-c", code])
    assert out.returncode == 0 and out.stdout.strip() == "['logits', 'probs']", out.stderr


def test_a_hook_in_python_m_packages_main_is_refused(models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pkg = tmp_path / "tool"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(
        f"from slabpool import Engine\ndef pre(item): return item\nEngine({str(models.mlp)!r}, workers=1, preprocess=pre)\n")
    out = _python(["-m", "tool"], cwd=tmp_path)
    _refused_before_any_worker(out, "preprocess=<function pre")


_RAISES_IN_WORKERS = """
    import sys
    if __name__ == "__mp_main__":  # the worker's import of this script again
        raise RuntimeError("this script refuses to be imported in a worker")
    from slabpool import Engine
    if __name__ == "__main__":
        Engine(sys.argv[1], workers=1, start_method=sys.argv[2])
"""


def test_a_main_script_that_raises_in_the_worker_is_named(models, tmp_path, start_method) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "raises.py"
    script.write_text(textwrap.dedent(_RAISES_IN_WORKERS))
    out = _python([str(script), str(models.mlp), start_method])
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("slabpool.workers.errors.SessionInitError: slot 0 ") and "exit(1)" in last, out.stderr
    assert f"importing the main module {str(script)!r} again" in last and "worker's stderr" in last
    assert "RuntimeError: this script refuses to be imported in a worker" in out.stderr  # the cause, above


@pytest.mark.parametrize(("settings", "cause"), [
    ({"preprocess": "tests.startup_hooks:pre"}, "ImportError: tests.startup_hooks refuses to be imported in a worker"),
    ({"initializer": "tests.startup_hooks:refuse_init"}, "ImportError: tests.startup_hooks refuses"),
], ids=["hook module", "initializer module"])
def test_a_hook_module_that_fails_to_import_in_the_worker_says_why(models, start_method, settings, cause) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SessionInitError) as info:
        Engine(models.mlp, workers=2, start_method=start_method, **settings)
    assert cause in str(info.value) and "could not build its session" in str(info.value)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "startup_hooks.py" in str(info.value.__cause__)  # the worker's traceback


def test_an_initializer_that_raises_says_why(models, start_method) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SessionInitError, match="ValueError: no licence") as info:
        Engine(models.mlp, workers=1, start_method=start_method, initializer=_refuse)
    assert isinstance(info.value.__cause__, RemoteTraceback)


def _refuse() -> None:
    raise ValueError("no licence server")
