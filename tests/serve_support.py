"""A real `slabpool serve` process for the tests, and the leak check around it.

`Server` starts `python -m slabpool serve ... --http-port 0 --grpc-port 0` and reads the ports
it announces. A module-scoped server outlives each test, so the test modules replace
conftest's `nothing_left_behind` with `check_nothing_left`, which allows exactly the module
server's process tree and its two listening ports, and nothing else: no other child process,
no other listening socket, no slabpool shared memory in this process.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil

from tests.conftest import our_children, slabpool_shm

ROOT = Path(__file__).resolve().parent.parent
ANNOUNCE = re.compile(r"HTTP on http://([\d.]+):(\d+), gRPC on [\d.]+:(\d+)")


class Server:
    def __init__(self, *args: str, env: dict[str, str] | None = None, start_timeout: float = 120) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="slabpool-serve-test-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slabpool", "serve", *args, "--http-port", "0", "--grpc-port", "0"],
            stdout=subprocess.PIPE, stderr=self.log, cwd=ROOT, env={**os.environ, **(env or {})}, text=True)
        line = self._announced(start_timeout)
        m = ANNOUNCE.search(line)
        assert m, f"no announcement from the server: {line!r}\n{self.stderr()}"
        self.host, self.http_port, self.grpc_port = m.group(1), int(m.group(2)), int(m.group(3))
        self.url = f"http://{self.host}:{self.http_port}"
        self.grpc_url = f"{self.host}:{self.grpc_port}"

    def _announced(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)  # only a deadlock reaches it
        return self.proc.stdout.readline() if ready else ""

    def stderr(self) -> str:
        return Path(self.log.name).read_text()

    def tree(self) -> set[int]:
        """The server's pid and its descendants now (workers are rebuilt with new pids)."""
        try:
            root = psutil.Process(self.proc.pid)
            return {root.pid, *(p.pid for p in root.children(recursive=True))}
        except psutil.NoSuchProcess:
            return set()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal it (sig=0: it was signalled already) and wait for its exit status; it must
        leave no process behind."""
        tree = self.tree()
        if sig and self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:  # a deadlock: kill it all, and fail
            for pid in tree:
                _kill(pid)
            raise
        finally:
            assert self.proc.stdout is not None
            self.proc.stdout.close()
            self.log.close()
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(p) and _alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in tree if psutil.pid_exists(p) and _alive(p)]
        assert not left, f"the server left processes behind: {left}"
        os.unlink(self.log.name)
        return rc


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def listening(pids: set[int]) -> list[tuple[int, int]]:
    """(pid, port) of every TCP socket in LISTEN held by one of `pids`."""
    out = []
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            out.append((c.pid, c.laddr.port))
    return out


def check_nothing_left(allowed: list[Server]) -> None:
    """After a test: no child process but the allowed servers' trees, no listening socket but
    theirs, no slabpool shared memory here (only a leak waits for the deadline)."""
    def leaks() -> tuple[list[psutil.Process], list[tuple[int, int]]]:
        keep = set().union(*(s.tree() for s in allowed)) if allowed else set()
        kids = [p for p in our_children() if p.pid not in keep]
        ports = listening({os.getpid(), *(p.pid for p in kids)})
        return kids, ports

    deadline = time.monotonic() + 10
    while (any(leaks()) or slabpool_shm()) and time.monotonic() < deadline:
        time.sleep(0.05)
    kids, ports = leaks()
    for p in kids:
        p.kill()
    assert not kids, f"child processes left behind: {[(p.pid, p.cmdline()) for p in kids]}"
    assert not ports, f"sockets left listening: {ports}"
    assert not slabpool_shm(), f"shared memory left behind: {slabpool_shm()}"


def held(servers: list[Server], srv: Server) -> Iterator[Server]:
    """A module's server: known to its leak check (`servers`) while it serves, stopped cleanly
    (exit 0) at the end. Use as `yield from held(_servers, Server(...))` in a fixture."""
    servers.append(srv)
    yield srv
    servers.remove(srv)
    assert srv.stop() == 0, srv.stderr()


@contextlib.contextmanager
def in_process(app: Any) -> Iterator[SimpleNamespace]:
    """`app` on serve's own uvicorn setup (server.http_server), on a uvloop in a thread of this
    process, on an ephemeral port: where to reach it; stopped (and its socket closed) after."""
    import threading

    import uvloop

    from slabpool.engine.serve import server as serve_server

    http = serve_server.http_server(app)
    sock = socket.create_server(("127.0.0.1", 0))
    t = threading.Thread(target=uvloop.run, args=(http.serve(sockets=[sock]),))
    t.start()
    try:
        while not http.started:
            assert t.is_alive()
            t.join(0.01)
        yield SimpleNamespace(host="127.0.0.1", http_port=sock.getsockname()[1])
    finally:
        http.should_exit = True
        t.join(30)
        sock.close()


def read_answers(sock: socket.socket, n: int, interim: bool = True) -> list[tuple[bytes, bytes]]:
    """Read `n` HTTP/1.1 answers from `sock`: (status line + headers, body) each. A 100
    Continue is an answer of its own (an empty body) if `interim`, else skipped and not counted."""
    out: list[tuple[bytes, bytes]] = []
    buf = b""
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            assert chunk, (out, buf)
            buf += chunk
        head, buf = buf.split(b"\r\n\r\n", 1)
        if head.startswith(b"HTTP/1.1 100"):
            if interim:
                out.append((head, b""))
            continue
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
        while len(buf) < length:
            buf += sock.recv(65536)
        out.append((head, buf[:length]))
        buf = buf[length:]
    return out
