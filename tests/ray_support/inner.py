"""The confined Ray run, started in the background when the session starts.

The Ray cases (`wanted`: test_x[ray] of any module, and the Ray-only ones; by node id) run in
one subprocess pytest (SLABPOOL_RAY_NETNS=1, tests.ray_support.plugin) inside private
namespaces: a network namespace with only `lo` up (Ray confined to loopback) and a mount
namespace with its own tmpfs on /dev/shm. It is minutes of mostly waiting (ray.init, actors
starting), so it runs while the rest of the suite runs, not in front of it:

    session start: InnerRun.start()  ->  unshare -n -m: mount /dev/shm; ip link set lo up; pytest
    tests ...                            (the Ray cases, for real)
    the outer [ray] cases (last):    <-  wait for it, then: no process left in its namespace;
      results()                          each takes its case's outcome (junit classname + name)

The private /dev/shm keeps each run's leak check exact while both run: neither sees the other's
`slabpool-*` names (or sweeps them). The outer leak check leaves this one process tree out
(`pids()`); everything it leaves behind is checked here, by its network namespace. That
namespace is held open (an fd of it) from the run's start to its check: nsfs inode numbers are
reused once a namespace is gone, and a later `unshare -n` (another run's, a test's) got the
same one, whose processes were then taken for this run's leftovers (and killed).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil

from tests.shards import why_not_confined

REPO = Path(__file__).resolve().parents[2]
INNER = os.environ.get("SLABPOOL_RAY_NETNS") == "1"  # this process is the confined run
INNER_TIMEOUT_S = 720  # the whole confined run (~5 min on a quiet 2-core machine, 8.5 under load); only a hang reaches it
# private namespaces, then the file's pytest: /dev/shm as large as the machine's (Ray's object store)
SCRIPT = ('mount -t tmpfs -o "size=$SHM_SIZE" tmpfs /dev/shm && ip link set lo up && '
          'exec "$0" -m pytest "$@"')


def why_no_ray() -> str | None:
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed: pip install 'slabpool[ray]' to run the Ray backend's tests"
    why = why_not_confined()
    if why is not None:
        return f"{why}: the Ray tests run in private namespaces (unshare -n -m: loopback only, a private /dev/shm)"
    return None


class InnerRun:
    """One confined run of the Ray cases `wanted` named: started once, its outcome read once."""

    def __init__(self, folder: Path, cases: list[str]) -> None:
        self.xml, self.log = folder / "junit.xml", folder / "output.txt"
        self.ray_tmp = tempfile.mkdtemp(prefix="slabray-", dir="/tmp")  # short: Ray's socket paths live here
        env = {**os.environ, "SLABPOOL_RAY_NETNS": "1",
               "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": self.ray_tmp,
               "SHM_SIZE": str(shutil.disk_usage("/dev/shm").total),
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        cmd = ["unshare", "-n", "-m", "sh", "-c", SCRIPT, sys.executable, "-q", "-p", "no:cacheprovider",
               f"--basetemp={folder / 'tmp'}", f"--junitxml={self.xml}", "-o", "junit_family=xunit2", *cases]
        self.deadline = time.monotonic() + INNER_TIMEOUT_S
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.netns = _pin_namespace(self.proc)
        self._results: dict[tuple[str, str], tuple[str, str]] | None = None

    def pids(self) -> set[int]:
        """This run's process tree, as the outer leak check must leave it out (while it runs)."""
        if self.proc.poll() is not None:
            return set()
        try:
            root = psutil.Process(self.proc.pid)
            return {root.pid, *(p.pid for p in root.children(recursive=True))}
        except psutil.Error:
            return {self.proc.pid}

    def results(self) -> dict[tuple[str, str], tuple[str, str]]:
        """(junit classname, test name) -> (outcome, text), once the run has ended and left nothing behind."""
        if self._results is None:
            self._results = self._finish()
        return self._results

    def _finish(self) -> dict[tuple[str, str], tuple[str, str]]:
        try:
            self.proc.wait(max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        left = _left_in_namespace(self.netns)
        self.netns = None
        shutil.rmtree(self.ray_tmp, ignore_errors=True)  # Ray's session logs and its current-cluster file
        tail = self.log.read_text(errors="replace")[-6000:]
        assert not left, f"processes left in the Ray tests' network namespace: {left}\n{tail}"
        if not self.xml.exists():
            raise AssertionError(f"the confined Ray run produced no report (exit {self.proc.returncode}):\n{tail}")
        return _parse_junit(self.xml, tail)

    def stop(self) -> None:
        """At the session's end: a run whose results no case asked for (deselected, -x) is
        stopped, and what it left is killed."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        _left_in_namespace(self.netns)
        self.netns = None
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def is_ray_case(item: object) -> bool:
    """A case the confined run runs: test_x[ray] (of the `backend` or `start_or_ray` fixture of
    tests.ray_support.plugin), or one that takes `ray_only`."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec else {}
    return "ray" in (params.get("backend"), params.get("start_or_ray")) or "ray_only" in getattr(item, "fixturenames", ())


def wanted(items: list[object]) -> list[str]:
    """The node ids of the selected cases that report the confined run's outcome: what it runs."""
    return [str(getattr(item, "nodeid")) for item in items if is_ray_case(item)]


def _pin_namespace(proc: subprocess.Popen[bytes]) -> int | None:
    """An fd of the run's network namespace, once `unshare` has made it (a few ms after the
    exec): it keeps the namespace, and so its inode number, from being reused until the check.
    None if the run ended first (it then has no namespace of its own to check)."""
    ours = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + 30  # only a hang reaches it
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            fd = os.open(f"/proc/{proc.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        if os.readlink(f"/proc/self/fd/{fd}") != ours:
            return fd
        os.close(fd)
        time.sleep(0.001)
    return None


def _left_in_namespace(netns: int | None) -> list[tuple[int, str]]:
    """Every process still in the inner run's network namespace (`netns`, its pinned fd,
    closed here) once those that see the inner pytest gone have had time to exit
    (multiprocessing's resource tracker reads EOF, then cleans up): SIGKILLed and listed."""
    if netns is None:
        return []
    try:
        ns = os.readlink(f"/proc/self/fd/{netns}")
        deadline = time.monotonic() + 15  # only a leak reaches it
        while (left := _in_namespace(ns)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid, _ in left:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        return left
    finally:
        os.close(netns)


def _in_namespace(ns: str) -> list[tuple[int, str]]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.readlink(f"/proc/{p.pid}/ns/net") == ns:
                found.append((p.pid, " ".join(p.info["cmdline"] or [])))
        except (OSError, psutil.Error):
            continue
    return found


def _parse_junit(xml: Path, tail: str) -> dict[tuple[str, str], tuple[str, str]]:
    results = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, text = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                text = (child.get("message") or "") + "\n" + (child.text or "")
                if outcome == "failed":
                    break
        results[(case.get("classname", ""), case.get("name", ""))] = (outcome, text)
    results[("", "__output__")] = ("", tail)
    return results
