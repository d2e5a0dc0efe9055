"""One copy of the weights for every worker (issue 23, item 1): the weight cache.

ONNX Runtime on the CPU provider loads the prepacked external-data form of the model, made once
into the cache folder; its outputs must be byte-identical to the model loaded directly, on every
runtime and model. The cache must survive what happens to files: an entry reused, an entry
damaged (dropped, rebuilt), a writer killed mid-write, a full disk, and engines that start at once.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from slabpool import Engine
from slabpool.workers.onnxfiles import external_files
from slabpool.workers.session import SessionSpec, model_digest
from slabpool.workers.weights import Pinned, cpu_features, pin
from tests.models import onnx_models
from tests.ray_support.plugin import RAY, build
from tests.reference import litert_run, ort_run

DEMO = Path(__file__).resolve().parents[1] / "engine" / "data" / "demo.onnx"


def external(model: Path, out: Path, one_file: bool = True) -> Path:
    m = onnx.load(str(model))
    onnx.save_model(m, str(out), save_as_external_data=True, all_tensors_to_one_file=one_file,
                    location=out.stem + ".data", size_threshold=0)
    return out


def feeds_for(eng: Engine, rows: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds matching the engine's inputs (dynamic dims: `rows`)."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in eng.describe().inputs:
        shape = tuple(rows if d is None else d for d in t.shape)
        dt = np.dtype(t.dtype)
        out[t.name] = (rng.integers(0, 4, shape) if dt.kind in "iu" else rng.standard_normal(shape)).astype(dt)
    return out


MODELS = ["mlp", "convnet", "multi_io", "slow", "int_model", "identity", "static", "demo", "external",
          "external, several files", "tfl_mlp", "tfl_two"]


def _model(models: Any, name: str, tmp_path: Path) -> Path:
    if name == "demo":
        return DEMO
    if name == "external":
        return external(models.slow, tmp_path / "slow_ext.onnx")
    if name == "external, several files":
        return external(models.convnet, tmp_path / "conv_ext.onnx", one_file=False)
    return Path(getattr(models, name))


@pytest.mark.parametrize("name", MODELS)
def test_outputs_are_byte_identical_to_the_model_loaded_directly(models, name, tmp_path, backend):
    """An actor loads its session as a local worker does (workers.session): the same cache."""
    if backend == RAY and name not in ("slow", "external", "tfl_mlp"):
        pytest.skip("the shared form is the session's, the same in an actor: Ray runs one model of each kind "
                    "(prepacked, external data, LiteRT), the table is the local run's (the confined run's time)")
    path = _model(models, name, tmp_path)
    run = litert_run if path.suffix == ".tflite" else ort_run
    with build(backend, path, workers=1, cache_dir=tmp_path / "cache") as eng:
        feeds = feeds_for(eng, rows=1 if name == "static" else 3)
        res = eng.submit(feeds).result(timeout=60)
        weights = eng.describe().weights
        assert eng.stats().slots[0].weights == weights
    want = run(path, feeds)
    assert res.outputs.keys() == want.keys()
    for k, v in want.items():
        assert res.outputs[k].tobytes() == v.tobytes(), k
    if path.suffix == ".tflite":
        assert weights.startswith("loaded as given: XNNPACK packs weights per process")
    elif name in ("identity", "multi_io", "int_model", "static"):  # nothing of 1 KiB or more
        assert weights == "loaded as given: no weight large enough to prepack and share"
    else:
        assert weights == "prepacked weights in a memory-mapped file every worker shares"


def test_what_is_not_shared_says_why(models, tmp_path):
    with Engine(models.mlp, workers=1, share_weights=False, cache_dir=tmp_path / "c") as eng:
        assert eng.describe().weights == "loaded as given: share_weights=False"
    with Engine(models.tfl_mlp, workers=1, delegate="none", cache_dir=tmp_path / "c") as eng:
        assert eng.describe().weights == "built-in kernels read the weights from the mapped file"


def _touch_every_slot(eng: Engine, feeds: dict[str, np.ndarray]) -> None:
    """Run until every slot has run a task (the weights are then resident in each)."""
    for _ in range(200):
        futs = [eng.submit(feeds) for _ in range(8)]
        for f in futs:
            f.result(timeout=60)
        if all(s.tasks_done for s in eng.stats().slots):
            return
    raise AssertionError("a slot never ran a task")


def test_workers_map_one_copy_of_the_weights(models, tmp_path):
    """slow(k=16, dim=512): 16 MiB of weights. Shared, each worker's PSS holds about half of
    them (two sharers) and its shared bytes hold them all; unshared, each has its own copy."""
    weights = 16 * 512 * 512 * 4
    x = {"x": np.ones((4, 512), np.float32)}
    figures = {}
    for share in (True, False):
        with Engine(models.slow, workers=2, share_weights=share, cache_dir=tmp_path / "c") as eng:
            _touch_every_slot(eng, x)
            figures[share] = eng.stats().slots
    for s in figures[True]:
        assert s.shared_bytes >= 0.9 * weights, s
        assert s.rss_bytes >= s.pss_bytes > 0
    saved = sum(s.pss_bytes for s in figures[False]) - sum(s.pss_bytes for s in figures[True])
    assert saved >= 0.8 * weights, (figures, saved)


# -- the cache: reuse, damage, a writer killed, a full disk, engines at once ----------------------


def _spec(path: Path, cache: Path) -> SessionSpec:
    return SessionSpec(str(path), "onnxruntime", digest=model_digest(str(path)), cache_dir=str(cache))


def _pin_prepacked(spec: SessionSpec, convert: Any = None) -> Pinned:
    import onnxruntime as ort

    from slabpool.workers.ort import _prepack

    runtime = f"onnxruntime {ort.__version__} cpu {cpu_features()} opt=all"
    return pin(spec, "prepacked", runtime, convert or _prepack)


def _entry(cache: Path) -> Path:
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".tmp-")]
    return entry


def test_an_entry_is_made_once_and_reused(models, tmp_path):
    spec = _spec(models.slow, tmp_path / "c")
    first = _pin_prepacked(spec)
    manifest = _entry(tmp_path / "c") / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    again = _pin_prepacked(spec, convert=_refuse_convert)  # a hit never converts
    assert again == first and manifest.stat().st_mtime_ns == stamp and first.shared


def _refuse_convert(src: str, dst: str) -> bool:
    raise AssertionError("converted again")


def _truncate(entry: Path) -> None:
    with open(entry / "model.data", "r+b") as f:
        f.truncate(100)


def _flip(entry: Path) -> None:
    with open(entry / "model.data", "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))


def _bad_manifest(entry: Path) -> None:
    (entry / "manifest.json").write_text("{not json")


def _other_digest(entry: Path) -> None:
    m = json.loads((entry / "manifest.json").read_text())
    m["digest"] = "0" * 16
    (entry / "manifest.json").write_text(json.dumps(m))


DAMAGE = {"data truncated": _truncate, "a byte flipped": _flip, "manifest unreadable": _bad_manifest,
          "manifest of another model": _other_digest, "model file gone": lambda e: (e / "model.onnx").unlink(),
          "manifest gone": lambda e: (e / "manifest.json").unlink()}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_entry_is_dropped_and_rebuilt(models, tmp_path, damage):
    x = {"x": np.random.default_rng(3).standard_normal((5, 512)).astype(np.float32)}
    _pin_prepacked(_spec(models.slow, tmp_path / "c"))  # the entry, as an engine's first start writes it
    DAMAGE[damage](_entry(tmp_path / "c"))
    with Engine(models.slow, workers=1, cache_dir=tmp_path / "c") as eng:
        res = eng.submit(x).result(timeout=60)
        assert eng.describe().weights.startswith("prepacked")
    assert res.outputs["y"].tobytes() == ort_run(models.slow, x)["y"].tobytes()
    assert _pin_prepacked(_spec(models.slow, tmp_path / "c"), convert=_refuse_convert).shared  # valid again


def _convert_then_die(src: str, dst: str) -> bool:
    from slabpool.workers.ort import _prepack

    _prepack(src, dst)  # every file written, the manifest and the rename not yet
    os.kill(os.getpid(), signal.SIGKILL)
    return True


def _pin_in_child(path: str, cache: str, how: str, log: str = "") -> None:
    spec = _spec(Path(path), Path(cache))
    if how == "die":
        _pin_prepacked(spec, _convert_then_die)
    elif how == "full":  # every write past 64 KiB fails with EFBIG, as a full disk fails with ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
        got = _pin_prepacked(spec)
        loaded = os.readlink(got.path)  # (the source itself, through the descriptor it was hashed from)
        assert loaded == os.path.realpath(path) and not got.shared and "cache unusable" in got.note, got
    else:
        got = _pin_prepacked(spec, _counting(log))
        with open(log, "a") as f:
            f.write(f"got {got.path}\n")


def _counting(log: str) -> Any:
    def convert(src: str, dst: str) -> bool:
        from slabpool.workers.ort import _prepack

        with open(log, "a") as f:
            f.write("convert\n")
        return _prepack(src, dst)

    return convert


def _child(*args: str) -> multiprocessing.process.BaseProcess:
    p = multiprocessing.get_context("spawn").Process(target=_pin_in_child, args=args)
    p.start()
    return p


@pytest.mark.parametrize("how", ["die", "full"])
def test_a_write_that_does_not_finish_is_never_used(models, tmp_path, how):
    """A writer killed after writing every file but the manifest, or a disk that fills: no entry
    appears; the next engine builds a whole one (a leftover .tmp folder is removed) and its
    outputs are those of the model."""
    cache = tmp_path / "c"
    p = _child(str(models.slow), str(cache), how)
    p.join(120)
    assert p.exitcode == (-signal.SIGKILL if how == "die" else 0)
    assert not [e for e in cache.iterdir() if e.is_dir() and not e.name.startswith(".tmp-")]
    assert bool(list(cache.glob(".tmp-*"))) == (how == "die")
    x = {"x": np.ones((2, 512), np.float32)}
    with Engine(models.slow, workers=1, cache_dir=cache) as eng:
        res = eng.submit(x).result(timeout=60)
    assert res.outputs["y"].tobytes() == ort_run(models.slow, x)["y"].tobytes()
    assert not list(cache.glob(".tmp-*")) and (_entry(cache) / "manifest.json").exists()


def test_engines_that_start_at_once_convert_once(models, tmp_path):
    log = tmp_path / "log"
    kids = [_child(str(models.slow), str(tmp_path / "c"), "count", str(log)) for _ in range(3)]
    for p in kids:
        p.join(120)
        assert p.exitcode == 0
    lines = log.read_text().splitlines()
    assert lines.count("convert") == 1 and len({ln for ln in lines if ln.startswith("got ")}) == 1


def test_an_unwritable_cache_loads_the_model_directly(models, tmp_path):
    (tmp_path / "c").write_text("a file, not a folder")
    with Engine(models.mlp, workers=1, cache_dir=tmp_path / "c") as eng:
        assert "cache unusable" in eng.describe().weights
        res = eng.submit({"x": np.ones((2, 16), np.float32)}).result(timeout=60)
    assert res.outputs["probs"].tobytes() == ort_run(models.mlp, {"x": np.ones((2, 16), np.float32)})["probs"].tobytes()


def test_a_model_loaded_directly_is_the_file_that_was_checked(models, tmp_path):
    """Without a usable cache a slot loads the source itself, checked against the pinned
    version, through the descriptor it hashed: a deploy that replaces the file between the
    check and the load is not what it loads (was, a hostile run: the runtime opened the path
    again, and 15-32 of 17,600 answers came from the new file under the old version)."""
    import onnxruntime as ort

    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    onnx_models.mlp(a, seed=1)
    onnx_models.mlp(b, seed=2)
    live = tmp_path / "live.onnx"
    live.write_bytes(a.read_bytes())
    spec = SessionSpec(str(live), "onnxruntime", digest=model_digest(str(live)))
    got = pin(spec, "copy")
    assert got.path.startswith("/proc/self/fd/") and got.digest == spec.digest
    os.replace(b, live)  # (the deploy, after the check, before the load)
    x = {"x": np.ones((2, 16), np.float32)}
    loaded = ort.InferenceSession(got.path).run(None, x)[0]
    assert loaded.tobytes() == ort_run(a, x)["probs"].tobytes()
    os.close(int(got.path.rsplit("/", 1)[1]))
    with pytest.raises(Exception, match="changed on disk since the engine loaded it"):
        pin(spec, "copy")


def test_a_weight_cache_too_full_for_the_prepacked_model_is_bypassed(models, tmp_path):
    """A cache with room for the model's copy but not for ONNX Runtime's prepacked file: the
    engine loads the model directly and serves (was: SessionInitError, "Failed to write
    external initializers to file", at construction and at reload). In a mount namespace with
    a 160 KiB tmpfs as the cache."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a mount namespace of its own (unshare -m, as root) for a small filesystem")
    model = onnx_models.mlp(tmp_path / "big.onnx", hidden=1024, seed=5)
    cache = tmp_path / "cache"
    cache.mkdir()
    script = tmp_path / "full.py"
    script.write_text(_CACHE_FULL.format(model=str(model), cache=str(cache)))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    got = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=160k tmpfs "{cache}" && exec "{sys.executable}" "{script}"'],
        capture_output=True, text=True, timeout=300, cwd=root, env=env)  # (a deadlock guard)
    assert got.returncode == 0, got.stderr[-4000:]
    weights, same = got.stdout.strip().splitlines()[-2:]
    assert "cache unusable" in weights and "no room for the prepacked model" in weights, weights
    assert same == "True"


_CACHE_FULL = """
import numpy as np
from slabpool import Engine
from tests.reference import ort_run

if __name__ == "__main__":
    x = {{"x": np.ones((2, 16), np.float32)}}
    with Engine("{model}", workers=2, cache_dir="{cache}") as eng:
        print(eng.describe().weights)
        print(eng.submit(x).result(timeout=60).outputs["probs"].tobytes() == ort_run("{model}", x)["probs"].tobytes())
"""


# -- the model's version covers its external data -------------------------------------------------


def test_the_digest_covers_external_data_files(models, tmp_path):
    path = external(models.convnet, tmp_path / "m.onnx", one_file=False)
    names = external_files(str(path))
    want = sorted({e.value for t in onnx.load(str(path), load_external_data=False).graph.initializer
                   for e in t.external_data if e.key == "location"})
    assert names == want and len(names) > 1
    before = model_digest(str(path))
    data = tmp_path / names[-1]
    data.write_bytes(bytes(b ^ 1 for b in data.read_bytes()))
    assert model_digest(str(path)) != before


def test_a_single_file_model_keeps_its_version(models):
    import hashlib

    assert model_digest(str(models.mlp)) == hashlib.sha256(models.mlp.read_bytes()).hexdigest()[:16]


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("share_weights", "yes", "share_weights must be True or False"),
    ("cache_dir", 3, "cache_dir must be None"),
])
def test_bad_settings_are_named(models, setting, value, message):
    with pytest.raises(ValueError, match=message):
        Engine(models.mlp, workers=1, **{setting: value})


def test_a_model_naming_data_outside_its_folder_is_refused(models, tmp_path):
    from slabpool.workers.onnxfiles import DataOutsideFolder

    m = onnx.load(str(external(models.mlp, tmp_path / "m.onnx")), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../elsewhere.data"
    onnx.save_model(m, str(tmp_path / "bad.onnx"))
    with pytest.raises(DataOutsideFolder, match="outside its folder"):
        external_files(str(tmp_path / "bad.onnx"))
    with pytest.raises(DataOutsideFolder):
        Engine(tmp_path / "bad.onnx", workers=1)


def test_doctor_shows_each_workers_memory(models, tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "SLABPOOL_CACHE_DIR": str(tmp_path / "c")}
    p = subprocess.run([sys.executable, "-m", "slabpool", "doctor", str(models.slow), "--workers", "2"],
                       capture_output=True, text=True, env=env, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    assert f"weight cache    {tmp_path / 'c'}" in p.stdout
    assert "weights: prepacked weights in a memory-mapped file every worker shares" in p.stdout
    for slot in (0, 1):
        assert f"worker #{slot}" in p.stdout and "PSS" in p.stdout and "shared" in p.stdout, p.stdout


def test_the_shared_form_under_intra_op_threads(models, tmp_path):
    """The cache key holds no thread count: the prepacked form must give the same bytes at 2 threads."""
    x = {"x": np.random.default_rng(4).standard_normal((6, 512)).astype(np.float32)}
    with Engine(models.slow, workers=1, threads_per_worker=2, cache_dir=tmp_path / "c") as eng:
        res = eng.submit(x).result(timeout=60)
        assert eng.describe().weights.startswith("prepacked")
    assert res.outputs["y"].tobytes() == ort_run(models.slow, x)["y"].tobytes()
