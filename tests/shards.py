"""`make test`: the whole suite as two pytest runs at once, the second in private namespaces.

The suite waits more than it computes (a measured run: 834 s of CPU in 1,283 s of wall time on
2 cores: workers starting, CLI processes, Ray's start-up), so two runs side by side take the
suite's wall time down without changing a test. Each run keeps its leak checks exact
(tests/conftest.py: no child process, no slabpool shared memory, no listening socket):

    shard a  this process's namespaces           tests/ minus shard b (the engine, crashes, Ray, ...)
    shard b  unshare -n -m: its own tmpfs on      the job and CLI, the formats, the server, the
             /dev/shm and a loopback of its own   weight cache (B_PATTERNS)

Neither sees the other's `slabpool-*` names or sockets, and neither is the other's child. The
confined Ray run (tests/ray_support/inner.py) of each shard's [ray] cases starts with that
shard: shard a's holds most of them (test_ray.py and the behaviour modules), shard b's only
test_weights.py's (nested: its own namespaces inside shard b's).
Without `unshare` and root, the suite runs as one pytest. Extra arguments go to both shards
(`python -m tests.shards -m "not slow"`); `pytest` alone still runs everything in one process.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
B_PATTERNS = ("test_job_*.py", "test_cli*.py", "test_formats.py", "test_serve*.py", "test_weights.py")
# a private /dev/shm as large as the machine's, loopback up, then that shard's pytest
NOTHING_RAN = 5  # pytest: no test collected
SCRIPT = 'mount -t tmpfs -o "size=$SHM_SIZE" tmpfs /dev/shm && ip link set lo up && exec "$0" -m pytest "$@"'


def shards() -> tuple[list[str], list[str]]:
    files = sorted(p.name for p in (REPO / "tests").glob("test_*.py"))
    b = [f for f in files if any(fnmatch.fnmatch(f, pat) for pat in B_PATTERNS)]
    return [os.path.join("tests", f) for f in files if f not in b], [os.path.join("tests", f) for f in b]


def why_not_confined() -> str | None:
    for tool in ("unshare", "ip", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing"
    if os.geteuid() != 0:
        return "not root (unshare -n -m needs it)"
    return None


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    why = why_not_confined()
    if why is not None:
        print(f"tests.shards: one run ({why}: shard b cannot be confined)", flush=True)
        return subprocess.call([*pytest, "-q", *args], cwd=REPO)
    a, b = shards()
    folder = Path(tempfile.mkdtemp(prefix="slabpool-shards-"))
    log = folder / "shard-b.txt"
    env = {**os.environ, "SHM_SIZE": str(shutil.disk_usage("/dev/shm").total)}
    with open(log, "wb") as out:
        confined = subprocess.Popen(
            ["unshare", "-n", "-m", "sh", "-c", SCRIPT, sys.executable, "-p", "no:cacheprovider", "-q",
             f"--basetemp={folder / 'b'}", *args, *b],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        print(f"shard a: {len(a)} files here; shard b: {len(b)} files confined beside it ({log})", flush=True)
        rc_a = subprocess.call([*pytest, "-q", f"--basetemp={folder / 'a'}", *args, *a], cwd=REPO)
        rc_b = confined.wait()
    except BaseException:
        confined.kill()
        confined.wait()
        raise
    print(f"\n==== shard b ({' '.join(b)})", flush=True)
    sys.stdout.write(log.read_text(errors="replace"))
    print(f"\ntests.shards: shard a exit {rc_a}, shard b exit {rc_b}", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    if NOTHING_RAN in (rc_a, rc_b) and (rc_a, rc_b) != (NOTHING_RAN, NOTHING_RAN):
        rc_a, rc_b = (0 if rc == NOTHING_RAN else rc for rc in (rc_a, rc_b))  # a -k that selects in one shard only
    return rc_a or rc_b


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
