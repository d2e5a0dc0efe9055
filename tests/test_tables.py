"""The enums and tables that replaced names compared as strings: error kinds (a worker's
RemoteError onto the caller's error tree), counters, admission policies. No process starts."""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest

from slabpool import Engine
from slabpool.engine.core.admission import Counter, Counters, TaskQueue
from slabpool.engine.core.config import AdmissionPolicy
from slabpool.engine.core.stats import EngineStats
from slabpool.workers import errors as E
from slabpool.workers.errors import ErrorKind
from slabpool.workers.pipeline import DeadlinePassed, error_kind, remote_error
from slabpool.workers.protocol import RemoteError
from slabpool.workers.session import RunTimeout
from tests.backends import BOTH_BACKENDS, LOCAL_ONLY

# kind -> (class, its message for task 7 of RemoteError(kind, "Boom", "bad {x}", ...)): the
# messages read as they did when the kinds were strings in an if/elif chain
FROM_REMOTE = {
    ErrorKind.CAPACITY: (E.ShmCapacityError, "task 7: bad {x}"),
    ErrorKind.DATA: (E.TaskDataError, "task 7: bad {x}"),
    ErrorKind.CONTRACT: (E.InputContractError, "task 7: bad {x}"),
    ErrorKind.DEADLINE: (E.TaskTimeout, "task 7 was still queued at its deadline; it was not started"),
    ErrorKind.TIMEOUT: (E.TaskTimeout, "task 7 ran past task_timeout and was terminated: bad {x}"),
    ErrorKind.RUN: (E.SessionRunError, "task 7 failed: Boom: bad {x}"),
    ErrorKind.SPLIT: (E.SessionRunError, "task 7 failed: Boom: bad {x}"),  # handled before; reads as RUN
}


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_every_error_kind_maps_onto_its_class_and_message(kind: ErrorKind) -> None:
    err = RemoteError(kind, "Boom", "bad {x}", "Traceback: ...", needed=10, available=4)
    cls, message = FROM_REMOTE[kind]
    exc = E.from_remote(pickle.loads(pickle.dumps(err)), 7)  # as it arrives from a worker
    assert type(exc) is cls and str(exc) == message
    assert isinstance(exc.__cause__, E.RemoteTraceback)
    if cls is E.ShmCapacityError:
        assert (exc.needed, exc.available) == (10, 4)
    else:
        assert exc.task_id == 7


@pytest.mark.parametrize("exc,kind", [
    (E.InputContractError("x"), ErrorKind.CONTRACT), (E.TaskDataError("x"), ErrorKind.DATA),
    (RunTimeout("x"), ErrorKind.TIMEOUT), (DeadlinePassed("x"), ErrorKind.DEADLINE),
    (ValueError("x"), ErrorKind.RUN), (KeyboardInterrupt(), ErrorKind.RUN),
])
def test_a_workers_exception_gets_the_kind_of_whose_fault_it_is(exc: BaseException, kind: ErrorKind) -> None:
    assert error_kind(exc) is kind
    assert remote_error(exc, error_kind(exc)).kind is kind


def test_the_counters_are_one_enum_for_the_queue_the_stats_and_the_metrics() -> None:
    names = {c.value for c in Counter}
    assert names == {f.name for f in dataclasses.fields(Counters)}
    assert names <= {f.name for f in dataclasses.fields(EngineStats)}
    c = Counters()
    c.add(Counter.REPLAYED, 2)
    c.add("stacked_batches")  # type: ignore[arg-type]  # the owner's count("...") call sites: the same
    assert (c.replayed, c.stacked_batches) == (2, 1) and c.snapshot()["replayed"] == 2
    with pytest.raises(KeyError, match="replayd"):
        c.add("replayd")  # type: ignore[arg-type]  # a misspelt counter fails, never a new attribute


@pytest.mark.parametrize("given", ["block", "reject", "drop_oldest", AdmissionPolicy.REJECT])
def test_an_admission_policy_is_accepted_by_its_name(given: str) -> None:
    queue = TaskQueue(capacity=4, policy=given, wake=lambda: None)
    assert queue.policy is AdmissionPolicy(given) and queue.policy == given


@pytest.mark.parametrize("bad", ["rejct", "BLOCK", "", None, 1])
def test_a_bad_admission_policy_names_the_choices(models, bad: object) -> None:
    with pytest.raises(ValueError, match=r"admission must be one of 'block', 'reject', 'drop_oldest', got") as info:
        Engine(models.mlp, workers=1, admission=bad)  # type: ignore[arg-type]
    assert repr(bad) in str(info.value)


def test_every_test_module_names_the_backends_it_runs_on() -> None:
    """A test module runs on both backends or says why it is local-only (tests/backends.py):
    a new module listed nowhere fails here, as does a name that is no module."""
    modules = {p.stem for p in Path(__file__).parent.glob("test_*.py")}
    assert not set(BOTH_BACKENDS) & set(LOCAL_ONLY), sorted(set(BOTH_BACKENDS) & set(LOCAL_ONLY))
    listed = set(BOTH_BACKENDS) | set(LOCAL_ONLY)
    assert modules - listed == set(), f"list these in tests/backends.py with a reason: {sorted(modules - listed)}"
    assert listed - modules == set(), f"no such test module: {sorted(listed - modules)}"
    assert all(why.strip() for why in LOCAL_ONLY.values())


RAY_FIXTURES = {"backend", "start_or_ray", "ray_only"}  # tests/ray_support/plugin.py: a case with a [ray] run


def _ray_cases(module: str) -> list[str]:
    """The module's tests that take a Ray fixture (not a parameter of the same name, as the
    shared-memory `backend` of test_shm)."""
    tree = ast.parse((Path(__file__).parent / f"{module}.py").read_text())
    return [f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
            and RAY_FIXTURES & ({a.arg for a in f.args.args} - _parametrized(f))]


def _parametrized(f: ast.FunctionDef) -> set[str]:
    names: set[str] = set()
    for d in f.decorator_list:
        if isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "parametrize" and d.args:
            first = d.args[0]
            given = [first] if isinstance(first, ast.Constant) else getattr(first, "elts", [])
            for node in given:
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names |= {n.strip() for n in node.value.split(",")}
    return names


def test_a_module_on_both_backends_runs_cases_on_ray_and_one_that_does_not_says_why() -> None:
    """Issue 20: every behaviour test runs on both backends, or says by name why one does not
    apply. A module in BOTH_BACKENDS has [ray] cases; a LOCAL_ONLY one has none; no reason is
    a promise ("not yet")."""
    assert not [m for m in BOTH_BACKENDS if not _ray_cases(m)], "listed on both backends, with no case on Ray"
    on_ray = {m: _ray_cases(m) for m in LOCAL_ONLY if _ray_cases(m)}
    assert not on_ray, f"cases on Ray in a module listed LOCAL_ONLY: {on_ray}"
    promised = [m for m, why in {**BOTH_BACKENDS, **LOCAL_ONLY}.items() if "not yet" in why.lower()]
    assert not promised, f"a reason that is no reason (say why it does not apply, or run it on Ray): {promised}"
    assert all(len(why.split()) >= 4 for why in {**BOTH_BACKENDS, **LOCAL_ONLY}.values())
