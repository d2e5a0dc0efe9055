"""The package as users install and import it: one `slabpool` namespace, layers that point one
way, a wheel whose only top-level name is `slabpool`, and imports that a user's own `engine.py`,
`workers/` or `shm.py` next to their script cannot shadow."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import slabpool

REPO = Path(__file__).resolve().parent.parent

# What each layer may import from the package (besides itself).
ALLOWED = {"shm": set(), "workers": {"shm"}, "engine": {"workers", "shm", "slabpool"}}


def _imports_of(path: Path) -> set[str]:
    """Every `slabpool.X...` module a file imports (run time and TYPE_CHECKING alike)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "slabpool" or name.startswith("slabpool.")}


# Inside engine/: the owner core knows no backend; the caller's side only the core; each
# backend the core and the caller's side; the batch job and the server run on the local backend.
INNER = {"core": set(), "caller": {"core"}, "local": {"core", "caller"}, "ray": {"core", "caller"},
         "job": {"core", "caller", "local"}, "serve": {"core", "caller", "local"}}
COMMAND = ("engine/job/cli.py", "slabpool.engine.serve.cli")  # the `slabpool` command hands `serve` on


@pytest.mark.parametrize("part", sorted(INNER))
def test_engine_subpackages_point_one_way(part: str) -> None:
    wrong = []
    for path in sorted((REPO / "engine" / part).rglob("*.py")):
        for module in _imports_of(path):
            parts = module.split(".")
            if parts[:2] != ["slabpool", "engine"] or len(parts) < 3:
                continue
            if parts[2] != part and parts[2] not in INNER[part] and (str(path.relative_to(REPO)), module) != COMMAND:
                wrong.append(f"{path.relative_to(REPO)} imports {module}")
    assert not wrong, "\n".join(wrong)
    assert sorted(p.name for p in (REPO / "engine").glob("*.py")) == ["__init__.py"], "engine/ holds subpackages only"


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layers_point_one_way(layer: str) -> None:
    wrong = []
    for path in sorted((REPO / layer).rglob("*.py")):
        for module in _imports_of(path):
            parts = module.split(".")
            target = parts[1] if len(parts) > 1 else "slabpool"
            if target != layer and target not in ALLOWED[layer]:
                wrong.append(f"{path.relative_to(REPO)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_imports_are_absolute() -> None:
    """The layering tests read absolute imports: a relative one (`from ..engine import x`)
    would slip past them."""
    relative = [f"{path.relative_to(REPO)}:{node.lineno}" for layer in ALLOWED
                for path in sorted((REPO / layer).rglob("*.py"))
                for node in ast.walk(ast.parse(path.read_text(), str(path)))
                if isinstance(node, ast.ImportFrom) and node.level > 0]
    assert not relative, relative


def test_no_engine_module_is_longer_than_500_lines() -> None:
    """A module a newcomer reads whole: past 500 lines it holds more than one thing."""
    long = {str(p.relative_to(REPO)): n for p in sorted((REPO / "engine").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_no_engine_class_is_split_across_bases() -> None:
    """A class made of several bases (`A(B, C)`, B calling what only A defines) is one object
    split across files: the owner holds its parts instead (engine.core.coordinator). Only an
    exception may have a second base (TaskCancelled is also a CancelledError)."""
    found = set()
    for path in sorted((REPO / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and len(node.bases) > 1:
                names = [ast.unparse(b) for b in node.bases]
                if not any(n.endswith(("Error", "Exception")) for n in names):
                    found.add(f"{path.relative_to(REPO)}:{node.name}")
    assert not found, sorted(found)


def test_the_subpackages_are_the_root_folders() -> None:
    for layer in ALLOWED:
        module = __import__(f"slabpool.{layer}", fromlist=["_"])
        assert Path(module.__file__).resolve().parent == REPO / layer


def test_public_names_resolve_lazily() -> None:
    code = (
        "import sys, slabpool\n"
        "assert 'onnxruntime' not in sys.modules and 'slabpool.engine.local.pool' not in sys.modules\n"
        "for name in slabpool.__all__: getattr(slabpool, name)\n"
        "assert issubclass(slabpool.PoisonTask, slabpool.TaskError)\n"
        "assert 'onnxruntime' not in sys.modules\n"
        "print(slabpool.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == slabpool.__version__ != "0+unknown"


@pytest.mark.parametrize("argv", [["-m", "slabpool", "--version"], ["-m", "slabpool.engine.job.cli", "--version"]])
def test_version_on_the_command_line(argv: list[str]) -> None:
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"slabpool {slabpool.__version__}"


def _shadowing_folder(tmp_path: Path) -> Path:
    """A user's folder with modules named like the layers (and a broken one of each)."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "engine.py").write_text("raise ImportError('the user engine.py was imported')\n")
    (tmp_path / "shm.py").write_text("raise ImportError('the user shm.py was imported')\n")
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "__init__.py").write_text("raise ImportError('the user workers/')\n")
    return tmp_path


def _score_script(folder: Path, models) -> Path:
    script = folder / "score.py"
    script.write_text(
        "import numpy as np\n"
        "from slabpool import Engine\n"
        "if __name__ == '__main__':\n"
        f"    with Engine({str(models.mlp)!r}, workers=1) as eng:\n"
        "        y = eng.infer({'x': np.ones((2, 16), np.float32)})\n"
        "    import slabpool; print(sorted(y), slabpool.__file__)\n"
    )
    return script


def test_a_users_engine_workers_and_shm_do_not_shadow_ours(tmp_path: Path, models) -> None:
    folder = _shadowing_folder(tmp_path)
    script = _score_script(folder, models)
    out = subprocess.run([sys.executable, str(script)], cwd=folder, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("['logits', 'probs']")


@pytest.mark.slow
def test_the_wheel_has_one_top_level_name_and_runs(tmp_path: Path, models) -> None:
    # built from a copy of the tracked files: a build/ folder left in the checkout would put
    # stale modules in the wheel
    src = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in tracked.splitlines():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        target = REPO / name
        if target.is_symlink():
            (src / name).symlink_to(os.readlink(target))
        elif target.is_file():
            (src / name).write_bytes(target.read_bytes())
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(src)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("slabpool-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        top_level = [n for n in names if n.endswith("top_level.txt")]
        assert tops == {"slabpool"}
        if top_level:
            assert zf.read(top_level[0]).decode().split() == ["slabpool"]
        assert "slabpool/py.typed" in names
        assert "slabpool/engine/data/demo.onnx" in names
        assert {"slabpool/engine/local/pool.py", "slabpool/engine/core/owner.py", "slabpool/engine/job/store/journal.py",
                "slabpool/workers/main.py", "slabpool/shm/arena.py"} <= set(names)
        assert not [n for n in names if n.startswith("slabpool/") and ("/tests/" in n or "/bench/" in n)]

    # Installed from the wheel (not the editable tree), run from a folder that shadows the layers.
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    folder = _shadowing_folder(tmp_path / "user")
    script = _score_script(folder, models)
    out = subprocess.run([sys.executable, str(script)], cwd=folder, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(site)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == str(site / "slabpool" / "__init__.py")


def test_settings_are_typed_keyword_only_parameters(models) -> None:
    import inspect

    from slabpool import Engine, RayEngine

    params = inspect.signature(Engine).parameters
    assert params["model"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    public = [p for name, p in params.items() if name != "model" and not name.startswith("_")]
    assert len(public) > 20 and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in public)
    assert params["workers"].default is None and params["max_attempts"].default == 3
    with pytest.raises(TypeError, match="'worker'"):
        Engine(models.mlp, worker=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'worker'"):
        RayEngine(models.mlp, worker=2)
    assert not issubclass(Engine, RayEngine) and not issubclass(RayEngine, Engine)


@pytest.mark.parametrize("cls_name", ["Engine", "RayEngine"])
def test_no_public_method_shows_a_private_parameter(cls_name: str) -> None:
    """Every public method of both engines (and the constructor) takes only public parameters:
    the caller's internals (a block's rows per call, a task's test fault, ...) travel in one
    internal Request (engine.caller.request), never as `_keyword`s in a public signature."""
    import inspect

    import slabpool

    cls = getattr(slabpool, cls_name)
    methods = {name: fn for name, fn in inspect.getmembers(cls, callable) if not name.startswith("_")}
    methods["__init__"] = cls.__init__
    assert {"submit", "map", "infer", "infer_async", "submit_async", "map_async", "reload", "close"} <= set(methods)
    private = {name: [p for p in inspect.signature(fn).parameters if p.startswith("_")]
               for name, fn in methods.items()}
    assert {name: ps for name, ps in private.items() if ps} == {}
    assert not [p for p in inspect.signature(cls).parameters if p.startswith("_")]


@pytest.mark.slow
def test_mypy_types_what_a_caller_writes(tmp_path: Path) -> None:
    from mypy import api

    snippet = tmp_path / "caller.py"
    snippet.write_text(
        "import numpy as np\n"
        "from slabpool import Engine, RayEngine\n"
        "with Engine('m.onnx', workers=2) as eng:\n"
        "    reveal_type(eng)\n"
        "    reveal_type(eng.submit({'x': np.zeros(3)}))\n"
        "    reveal_type(eng.stats().completed)\n"
        "    reveal_type(eng.infer({'x': np.zeros(3)}))\n"
        "    reveal_type(eng.map([{'x': np.zeros(3)}]))\n"
        "    reveal_type(eng.map([{'x': np.zeros(3)}], return_exceptions=True))\n"
        "with RayEngine('m.onnx', workers=2) as ray_eng:\n"
        "    reveal_type(ray_eng)\n"
        "Engine('m.onnx', worker=2)\n"
    )
    out, _, _ = api.run([str(snippet), "--no-incremental", "--follow-imports=silent"])
    assert 'Revealed type is "slabpool.engine.local.pool.Engine"' in out
    assert "concurrent.futures._base.Future[slabpool.engine.core.task.Result]" in out
    assert 'Revealed type is "int"' in out or 'Revealed type is "builtins.int"' in out
    assert 'Revealed type is "slabpool.engine.ray.backend.RayEngine"' in out
    plain = out.replace("builtins.", "")
    assert 'Revealed type is "dict[str, numpy.ndarray[' in plain  # infer()
    assert "typing.Generator[slabpool.engine.core.task.Result, None, None]" in plain  # map()
    assert "typing.Generator[slabpool.engine.core.task.Result | BaseException, None, None]" in plain
    assert 'Unexpected keyword argument "worker"' in out


def test_the_readme_example_runs_as_pasted(tmp_path: Path) -> None:
    import shutil

    readme = (REPO / "README.md").read_text()
    (example,) = [block for block in readme.split("```python\n")[1:2]]
    (tmp_path / "example.py").write_text(example.split("```")[0])
    shutil.copy(REPO / "engine" / "data" / "demo.onnx", tmp_path / "model.onnx")
    out = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "(8, 10) (8, 10) 10"
