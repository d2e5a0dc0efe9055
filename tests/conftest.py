"""Shared fixtures: models built once per session, both start methods, the confined Ray run
started in the background (tests.ray_support.inner), and the leak check that runs after every
test (no child process, no slabpool shared memory)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from tests.models import onnx_models, tflite_models
from tests.ray_support import inner

pytest_plugins = ("tests.ray_support.plugin",)  # the `backend` fixture, the confined run's hooks
_MP_INFRA = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
_NETNS = os.readlink("/proc/self/ns/net")
_inner_run: inner.InnerRun | None = None  # the confined Ray run, while it runs beside the tests


def our_children() -> list[psutil.Process]:
    """Child processes of this test process, except multiprocessing's own forkserver and
    resource tracker (one each per parent, shared by every engine, gone when pytest exits),
    and the confined Ray run while it runs: its root process and whatever is in another
    network namespace (only that run makes one; it checks its own leftovers by it)."""
    kids = []
    confined = _inner_run is not None and _inner_run.proc.poll() is None
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if confined and (p.pid == _inner_run.proc.pid or os.readlink(f"/proc/{p.pid}/ns/net") != _NETNS):
                continue
        except (psutil.Error, OSError):
            continue
        if any(name in cmd for name in _MP_INFRA):
            continue
        kids.append(p)
    return kids


def slabpool_shm() -> list[str]:
    """Our shared memory still alive: names in /dev/shm, and memfds held by this process."""
    names = [n for n in os.listdir("/dev/shm") if n.startswith("slabpool-")]
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:slabpool-"):
            names.append(target)
    return names


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    if inner.INNER:  # the confined Ray run: Ray's daemons stay up for the run
        from tests.ray_support.plugin import nothing_of_ours_left

        nothing_of_ours_left()
        return
    deadline = time.monotonic() + 10  # only a leak reaches it
    while (our_children() or slabpool_shm()) and time.monotonic() < deadline:
        time.sleep(0.05)
    kids = our_children()
    for p in kids:
        p.kill()
    assert not kids, f"child processes left behind: {[(p.pid, p.cmdline()) for p in kids]}"
    assert not slabpool_shm(), f"shared memory left behind: {slabpool_shm()}"


_WEIGHT_CACHE: list[Path] = []  # this run's weight cache folder, made at configure
# the user's own weight cache (workers.weights.default_cache_dir without $SLABPOOL_CACHE_DIR),
# and what it held when the run began: the run must add nothing there
_USER_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slabpool"
_USER_CACHE_BEFORE: set[str] = set()


def _user_cache() -> set[str]:
    try:
        return set(os.listdir(_USER_CACHE))
    except FileNotFoundError:
        return set()


def pytest_configure(config: pytest.Config) -> None:
    """Engines (and CLI runs) of the suite keep their weight cache in a folder of this run, not
    in the user's cache dir (workers.weights). Set before any test module is imported: a module
    that copies os.environ for its subprocesses at import (test_cli's ENV) gets it too (a session
    fixture set it after, and the CLI runs wrote prepacked models into ~/.cache/slabpool)."""
    d = Path(tempfile.mkdtemp(prefix="slabpool-test-weight-cache-"))
    _WEIGHT_CACHE.append(d)
    os.environ["SLABPOOL_CACHE_DIR"] = str(d)
    _USER_CACHE_BEFORE.update(_user_cache())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Nothing left behind in the user's home either: a run that wrote into the user's weight
    cache (an engine or a CLI started without this run's $SLABPOOL_CACHE_DIR) fails."""
    added = sorted(_user_cache() - _USER_CACHE_BEFORE)
    if added:
        print(f"\nthe run wrote into the user's weight cache {_USER_CACHE}: {added}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    for d in _WEIGHT_CACHE:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def weight_cache() -> Path:
    """This run's weight cache folder (see pytest_configure)."""
    return _WEIGHT_CACHE[0]


@pytest.fixture(autouse=True, scope="session")
def ray_inner_run(request: pytest.FixtureRequest, weight_cache: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[inner.InnerRun | None]:
    """The Ray cases' confined run, started before the first test when a selected case will
    report it, so that its minutes (mostly ray.init and actors starting) overlap the rest of the
    suite; the first [ray] case (they run last) waits for it."""
    global _inner_run
    cases = inner.wanted(request.session.items)
    if inner.INNER or inner.why_no_ray() or not cases:
        yield None
        return
    _inner_run = inner.InnerRun(tmp_path_factory.mktemp("ray_inner"), cases)
    try:
        yield _inner_run
    finally:
        _inner_run.stop()
        _inner_run = None


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    d: Path = tmp_path_factory.mktemp("models")
    return SimpleNamespace(
        mlp=onnx_models.mlp(d / "mlp.onnx"),
        convnet=onnx_models.convnet(d / "convnet.onnx"),
        multi_io=onnx_models.multi_io(d / "multi_io.onnx"),
        poison=onnx_models.poison(d / "poison.onnx"),
        slow=onnx_models.slow(d / "slow.onnx", k=16, dim=512),
        identity=onnx_models.identity(d / "identity.onnx", dim=4),
        centered=onnx_models.batch_centered(d / "centered.onnx"),
        centered_poison=onnx_models.batch_centered(d / "centered_poison.onnx", poison=True),
        static=onnx_models.static_shape(d / "static.onnx"),
        int_model=onnx_models.int_model(d / "int.onnx"),
        payload=onnx_models.payload(d / "payload.onnx", elements=256 * 1024),
        nonzero=onnx_models.nonzero(d / "nonzero.onnx"),
        tfl_mlp=tflite_models.mlp(d / "mlp.tflite"),
        tfl_static=tflite_models.static_mlp(d / "static_mlp.tflite"),
        tfl_two=tflite_models.two_inputs(d / "two.tflite"),
        dir=d,
    )


@pytest.fixture(params=["forkserver", "spawn"])
def start_method(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.contextmanager
def _files_held(limit: int, upto: int | None = None) -> Iterator[int]:
    """Files held open (/dev/null) under a soft limit on open files of `limit`: up to fd number
    `upto`, or (None) every one the limit allows. Yields the next fd number; all closed after,
    the limit as it was."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        with contextlib.suppress(OSError):
            while upto is None or not held or held[-1] < upto:
                held.append(os.open(os.devnull, os.O_RDONLY))
        yield held[-1] + 1 if held else 0
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def past_fd_setsize() -> Iterator[int]:
    """This process holds files open up to past select()'s FD_SETSIZE (1024), as a server with
    a thousand sockets does: every fd opened meanwhile (an engine's pipes) is numbered past it.
    The lowest such number; all closed after, the limit on open files as it was."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1100
    if hard != resource.RLIM_INFINITY and hard < 2 * want:
        pytest.skip(f"open files are limited to {hard} here: no fd past {want} (the case needs one)")
    limit = soft if soft == resource.RLIM_INFINITY else max(soft, 2 * want)
    with _files_held(limit, upto=want) as next_fd:
        yield next_fd


@pytest.fixture
def out_of_fds() -> object:
    """`with out_of_fds(spare):` this process at its limit on open files while the block runs
    (a server's at too many connections): the soft limit lowered to what is open plus `spare`,
    every one of those taken; all given back after, the limit as it was."""
    return lambda spare: _files_held(len(os.listdir("/proc/self/fd")) + spare)
