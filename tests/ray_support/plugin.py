"""The two-backend suite as a pytest plugin (tests/conftest.py loads it): any test module may
run a case on both backends by taking the `backend` fixture ("local", "ray"), or
`start_or_ray` ("forkserver", "spawn", "ray") where the local case runs under both start
methods, or `ray_only`.

    outer pytest (this process)                   confined pytest (tests.ray_support.inner)
      collection: the [ray] cases go last,          only the [ray] cases the outer run selected,
      and name the confined run's cases             by node id; one ray.init for the session
      test_x[local]  runs here                      test_x[ray] runs for real
      test_x[ray]    reports the confined outcome,  (its leak check: no actor of ours, no second
                     keyed by junit classname+name   node, no slabpool shared memory)

An outer [ray] case never runs its body (`pytest_pyfunc_call`); it waits for the confined run
and takes that case's outcome as its own. Fixtures that build an engine for a module take
`backend` (module-scoped) and return None for an outer [ray] case (`delegated`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from tests.ray_support.inner import INNER, INNER_TIMEOUT_S, is_ray_case, why_no_ray

RAY = "ray"
# what a test may not leave in the confined run: our actors, Ray Data's, a second node
OURS = ("SlotActor", "MapWorker", "ray start", "ray/scripts/scripts.py start")


def delegated(backend: str) -> bool:
    """In the outer run, a [ray] case's fixtures build nothing: the confined run runs it."""
    return backend == RAY and not INNER


def junit_key(nodeid: str) -> tuple[str, str]:
    """(classname, name) as pytest's junit xml writes a node id (junitxml.mangle_test_address):
    equal test names in two files do not collide."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["local", RAY])
def backend(request: pytest.FixtureRequest) -> str:
    """Module-scoped, so that an engine fixture of a module may be built once per backend."""
    name = str(request.param)
    if name == RAY and INNER:
        request.getfixturevalue("ray_cluster")
    return name


@pytest.fixture(params=["forkserver", "spawn", RAY])
def start_or_ray(request: pytest.FixtureRequest) -> str:
    """Both local start methods and the Ray backend (which has no start method: Ray starts actors)."""
    name = str(request.param)
    if name == RAY and INNER:
        request.getfixturevalue("ray_cluster")
    return name


@pytest.fixture
def ray_only(request: pytest.FixtureRequest) -> SimpleNamespace | None:
    if not INNER:
        return None  # the body does not run here
    cluster: SimpleNamespace = request.getfixturevalue("ray_cluster")
    return cluster


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[SimpleNamespace]:
    """One confined Ray cluster for the whole confined run (ray.init is ~10 s); its daemons
    must be gone after ray.shutdown()."""
    import ray

    from tests.conftest import our_children

    # address="local": never join a cluster some other run left recorded in RAY_TMPDIR
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ctx = ray.get_runtime_context()
        yield SimpleNamespace(ray=ray, gcs=ctx.gcs_address, head=ctx.get_node_id())
    finally:
        ray.shutdown()
    deadline = time.monotonic() + 20  # only a leak reaches it
    while our_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    kids = our_children()
    for p in kids:
        p.kill()
    assert not kids, f"Ray processes left after ray.shutdown(): {[(p.pid, p.cmdline()) for p in kids]}"


def build(where: str, model: Path | str | None, workers: int = 2, **kw: Any) -> Any:
    """An engine on `where`: "local", a start method ("forkserver", "spawn": local), or "ray"."""
    from slabpool import Engine, RayEngine

    if where == RAY:
        return RayEngine(model, workers=workers, **kw)
    if where != "local":
        kw["start_method"] = where
    return Engine(model, workers=workers, **kw)


# -- hooks ---------------------------------------------------------------------------------------


@pytest.hookimpl(trylast=True)  # after -k/-m and fixtures' reordering by parameter
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Confined: only the [ray] cases run. Outer: they go last (each waits for the confined
    run, which runs beside every other case), under a deadlock guard as long as that run's."""
    ray_cases = [i for i in items if is_ray_case(i)]
    if INNER:
        others = [i for i in items if not is_ray_case(i)]
        if others:
            config.hook.pytest_deselected(items=others)
        items[:] = ray_cases
        return
    for item in ray_cases:
        item.add_marker(pytest.mark.timeout(INNER_TIMEOUT_S + 60))
    items[:] = [i for i in items if not is_ray_case(i)] + ray_cases


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Outer: a [ray] case's outcome is the confined run's, its body is not run here."""
    if INNER or not is_ray_case(pyfuncitem):
        return None
    report_inner(pyfuncitem)
    return True


def report_inner(item: pytest.Function) -> None:
    reason = why_no_ray()
    if reason:
        pytest.skip(reason)
    run = item.funcargs.get("ray_inner_run")  # conftest's session fixture (autouse)
    assert run is not None, "conftest starts the confined run when a selected case reports it"
    results = run.results()
    outcome, text = results.get(junit_key(item.nodeid), ("missing", results[("", "__output__")][1]))
    if outcome == "failed":
        pytest.fail(f"failed in the confined Ray run:\n{text}", pytrace=False)
    if outcome == "skipped":
        pytest.skip(text.strip().splitlines()[0] if text.strip() else "skipped in the confined run")
    if outcome == "missing":
        pytest.fail(f"not run in the confined Ray run; its output:\n{text}", pytrace=False)


# -- the confined run's leak check ---------------------------------------------------------------


def ours_left() -> list[tuple[int, str]]:
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if any(name in cmd for name in OURS):
            left.append((p.pid, cmd))
    return left


def nothing_of_ours_left() -> None:
    """After each confined case: Ray's daemons stay up (one cluster for the run), but no
    actor of ours, no second node and no slabpool shared memory may be left."""
    from tests.conftest import slabpool_shm

    deadline = time.monotonic() + 15  # only a leak reaches it
    while (ours_left() or slabpool_shm()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = ours_left()
    for pid, _ in left:
        psutil.Process(pid).kill()
    assert not left, f"actors or nodes left behind: {left}"
    assert not slabpool_shm(), f"shared memory left behind: {slabpool_shm()}"
