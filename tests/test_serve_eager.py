"""serve's inference route started at once (engine/serve/eager.py, uvproto.py): a request that
comes whole in one read runs in that read's data_received, not in a Task a turn of the loop
later, and only what waits goes on in a Task.

Three levels, all real: `eager.run` on a real event loop (asyncio's and uvloop's); serve's own
uvicorn setup with an app that offers an eager route, driven over real sockets; and the real
HttpApp, Frontend and Engine (two worker processes) in this process, whose answers are checked
against an in-process onnxruntime session. Which way a request went is seen from inside
(whether a Task was current when the route ran), never from timing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from typing import Any

import numpy as np
import pytest
import uvloop

from slabpool.engine.serve import eager
from slabpool.engine.serve.uvproto import DISCONNECT
from tests.reference import ort_run
from tests.serve_support import in_process, read_answers

pytestmark = pytest.mark.timeout(120)


# -- eager.run on a real loop --------------------------------------------------------------------


@pytest.fixture(params=["asyncio", "uvloop"])
def run_loop(request):
    def run(main):
        return asyncio.run(main()) if request.param == "asyncio" else uvloop.run(main())
    return run


def test_a_coroutine_that_never_waits_runs_to_its_end_in_the_caller(run_loop):
    seen = []

    async def work():
        seen.append((asyncio.current_task(), eager.current()))
        await _done(7)  # a done future: awaited without a wait
        seen.append("end")
        return 1

    async def main():
        task = eager.run(asyncio.get_running_loop(), work())
        assert task is None and seen[-1] == "end"  # all of it ran inside run()
        return seen[0]

    outer_task, handle = run_loop(main)
    assert outer_task is not None  # (main's own task: run() was called inside it)
    assert handle is outer_task  # a real task is current: current() is that task


def test_outside_any_task_current_is_the_starts_handle(run_loop):
    """A protocol callback has no current Task: current() is the eager start's handle."""
    seen = []

    async def work():
        seen.append((asyncio.current_task(), eager.current()))

    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        loop.call_soon(lambda: fut.set_result(eager.run(loop, work())))  # a callback, as data_received is
        assert await fut is None

    run_loop(main)
    (task, handle), = seen
    assert task is None and isinstance(handle, eager.Started)
    assert not eager._running  # nothing left marked as running


def test_what_waits_goes_on_in_a_task_with_every_value_and_error_it_awaits(run_loop):
    """The rest runs in a Task: each future's result comes back at its await, an error is
    raised there (and may be caught), sleep(0)'s bare yield and a real sleep both work, and
    the Task's result is the coroutine's."""
    steps = []

    async def work(a, b):
        x = await a  # the first wait: the Task begins here
        steps.append(("a", x, asyncio.current_task() is not None))
        try:
            await b
        except KeyError as exc:
            steps.append(("b raised", exc.args[0]))
        await asyncio.sleep(0)
        await asyncio.sleep(0.001)
        async with asyncio.timeout(5):  # a Task is current: timeouts work
            await asyncio.sleep(0)
        return "done"

    async def main():
        loop = asyncio.get_running_loop()
        a, b = loop.create_future(), loop.create_future()
        task = eager.run(loop, work(a, b))
        assert isinstance(task, asyncio.Task) and not steps
        a.set_result(41)
        await asyncio.sleep(0)
        b.set_exception(KeyError("k"))
        return await task

    assert run_loop(main) == "done"
    assert steps == [("a", 41, True), ("b raised", "k")]


def test_a_cancel_through_the_handle_reaches_the_await_and_can_be_taken_back(run_loop):
    """What serve's disconnect does: the handle taken in the first steps cancels the Task the
    rest runs in; the coroutine sees CancelledError at its await, and uncancel() through the
    same handle lets it end normally (http._watching turns it into a 499)."""
    got = []

    async def work(fut):
        me = eager.current()
        got.append(me)
        try:
            await fut
        except asyncio.CancelledError:
            me.uncancel()
            return "cancelled, answered"
        return "not cancelled"

    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        started = loop.create_future()
        loop.call_soon(lambda: started.set_result(eager.run(loop, work(fut))))
        task = await started
        assert isinstance(task, asyncio.Task) and isinstance(got[0], eager.Started)
        got[0].cancel()
        result = await task
        return result, fut.cancelled(), task.cancelling()

    assert run_loop(main) == ("cancelled, answered", True, 0)


def test_an_error_in_the_first_steps_is_raised_by_run_and_a_cancelled_task_ends_cancelled(run_loop):
    async def bad():
        raise ValueError("first step")

    async def waits(fut):
        await fut

    async def main():
        loop = asyncio.get_running_loop()
        with pytest.raises(ValueError, match="first step"):
            eager.run(loop, bad())
        assert not eager._running  # nothing left marked as running
        task = eager.run(loop, waits(loop.create_future()))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled()

    assert run_loop(main) is True


def _done(value: Any) -> asyncio.Future[Any]:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


# -- serve's protocol with an app that offers an eager route ------------------------------------


class _App:
    """POST /now has an eager route (it answers what it got, and how it ran); everything else,
    and /now when the protocol does not start it at once, is plain ASGI. POST /wait waits for
    `release` (or its client's going away); POST /raise and /mute are a route's bugs."""

    def __init__(self) -> None:
        self.ways: list[str] = []
        self.asgi_started = threading.Event()
        self.waiting = threading.Event()
        self.release: asyncio.Future[None] | None = None
        self.cancelled = threading.Event()
        self.refused = ""

    def eager(self, scope):
        if scope["method"] != "POST" or scope["path"] not in ("/now", "/wait", "/raise", "/mute", "/twice"):
            return None
        return lambda body, respond: self.route(scope, body, respond)

    async def route(self, scope, body, respond):
        self.ways.append("task" if asyncio.current_task() is not None else "at once")
        if scope["path"] == "/raise":
            raise RuntimeError("a bug in the route")
        if scope["path"] == "/mute":
            return
        if scope["path"] == "/twice":
            await respond(200, b"one", [(b"content-length", b"3")])
            try:
                await respond(200, b"two", [(b"content-length", b"3")])
            except RuntimeError as exc:
                self.refused = str(exc)
            return
        if scope["path"] == "/wait":
            me, on_lost = eager.current(), scope["extensions"][DISCONNECT]
            on_lost.append(me.cancel)
            self.release = asyncio.get_running_loop().create_future()
            self.waiting.set()
            try:
                await self.release
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            finally:
                on_lost.remove(me.cancel)
        out = json.dumps({"got": body.decode(), "way": self.ways[-1]}).encode()
        await respond(200, out, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out))])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        self.asgi_started.set()
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        self.ways.append("asgi")
        out = json.dumps({"got": body.decode(), "way": "asgi"}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out))]})
        await send({"type": "http.response.body", "body": out})


def _post(path: str, body: bytes, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return b"POST %s HTTP/%s\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s" % (
        path.encode(), version, extra, len(body), body)


def _answers(sock: socket.socket, n: int) -> list[tuple[bytes, Any]]:
    """`n` answers (a 100 Continue skipped); a JSON body decoded."""
    return [(head, json.loads(body) if b"application/json" in head else body)
            for head, body in read_answers(sock, n, interim=False)]


def test_a_request_whole_in_one_read_runs_at_once_and_keeps_its_connection():
    app = _App()
    with in_process(app) as where, socket.create_connection(("127.0.0.1", where.http_port), timeout=30) as s:
        for i in range(3):
            s.sendall(_post("/now", b"body%d" % i))
            (head, body), = _answers(s, 1)
            assert head.startswith(b"HTTP/1.1 200") and body == {"got": f"body{i}", "way": "at once"}
            assert b"date: " in head and b"server: uvicorn" in head  # uvicorn's default headers, as its send adds
            assert b"connection: close" not in head.lower()
    assert app.ways == ["at once"] * 3


def test_a_body_still_to_come_goes_the_asgi_way():
    """Headers first, the body once the ASGI task has started (seen from the app): the request
    could not start at once, and uvicorn's path reads the rest."""
    app = _App()
    with in_process(app) as where, socket.create_connection(("127.0.0.1", where.http_port), timeout=30) as s:
        s.sendall(b"POST /now HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nhalf")
        assert app.asgi_started.wait(30)
        s.sendall(b"-body")
        (_, body), = _answers(s, 1)
    assert body == {"got": "half-body", "way": "asgi"}


@pytest.mark.parametrize("case", ["expect-100", "pipelined", "connection-close", "http/1.0", "other route"])
def test_what_cannot_start_at_once_is_answered_as_before(case):
    """Expect: 100-continue (the client waits for the interim answer), requests pipelined in one
    read, and a route the app does not take at once go uvicorn's way; a request that asks to
    close the connection runs at once, and its answer says close and closes it."""
    app = _App()
    with in_process(app) as where, socket.create_connection(("127.0.0.1", where.http_port), timeout=30) as s:
        if case == "expect-100":
            s.sendall(b"POST /now HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 100 Continue")
            s.sendall(b"ok")
            (_, body), = _answers(s, 1)
            assert body == {"got": "ok", "way": "asgi"}
        elif case == "pipelined":
            s.sendall(_post("/now", b"one") + _post("/now", b"two") + _post("/other", b"three"))
            got = [body for _, body in _answers(s, 3)]
            assert [g["got"] for g in got] == ["one", "two", "three"]  # in order
        elif case in ("connection-close", "http/1.0"):
            req = _post("/now", b"bye", b"Connection: close\r\n") if case == "connection-close" else \
                _post("/now", b"bye", version=b"1.0")
            s.sendall(req)
            (head, body), = _answers(s, 1)
            assert body == {"got": "bye", "way": "at once"} and b"connection: close" in head.lower()
            assert s.recv(100) == b""  # and the server closed the connection
        else:
            s.sendall(_post("/other", b"x"))
            (_, body), = _answers(s, 1)
            assert body == {"got": "x", "way": "asgi"}


@pytest.mark.parametrize("path", ["/raise", "/mute"])
def test_a_route_that_raises_or_forgets_to_answer_gets_uvicorns_500(path, capfd):
    app = _App()
    with in_process(app) as where, socket.create_connection(("127.0.0.1", where.http_port), timeout=30) as s:
        s.sendall(_post(path, b"x"))
        buf = b""
        while chunk := s.recv(65536):  # uvicorn's 500 closes the connection
            buf += chunk
    assert buf.startswith(b"HTTP/1.1 500") and buf.endswith(b"Internal Server Error")
    logged = capfd.readouterr().err  # (uvicorn's logger, as uvicorn logs an ASGI app's bug)
    assert ("Exception in ASGI application" if path == "/raise" else "without starting response") in logged


def test_a_second_answer_is_refused_and_the_connection_goes_on():
    app = _App()
    with in_process(app) as where, socket.create_connection(("127.0.0.1", where.http_port), timeout=30) as s:
        s.sendall(_post("/twice", b"x"))
        (head, body), = _answers(s, 1)
        s.sendall(_post("/now", b"next"))
        (_, after), = _answers(s, 1)
    assert head.startswith(b"HTTP/1.1 200") and body == b"one" and after == {"got": "next", "way": "at once"}
    assert app.refused == "a second answer (200) to a request already answered"


@pytest.mark.parametrize("how", ["answered", "close", "reset"])
def test_a_request_that_waits_goes_on_in_a_task_and_its_client_going_away_cancels_it(how):
    """/wait starts at once and waits: the rest runs in a Task, which answers when released; or
    the client closes or resets the connection, and the protocol's DISCONNECT callback cancels
    that Task through the handle taken in the first steps."""
    app = _App()
    with in_process(app) as where:
        s = socket.create_connection(("127.0.0.1", where.http_port), timeout=30)
        try:
            s.sendall(_post("/wait", b"w"))
            assert app.waiting.wait(30)
            assert app.ways == ["at once"]
            if how == "answered":
                release = app.release
                release.get_loop().call_soon_threadsafe(release.set_result, None)
                (_, body), = _answers(s, 1)
                assert body == {"got": "w", "way": "at once"}
            else:
                if how == "reset":
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
                assert app.cancelled.wait(30)
        finally:
            s.close()


# -- the real inference route, engine and all ----------------------------------------------------


@pytest.fixture
def real(models):  # (per test: the leak check after each wants no engine left)
    from slabpool import Engine
    from slabpool.engine.serve import http
    from slabpool.engine.serve.core import Frontend
    from slabpool.engine.serve.metrics import RequestMetrics
    from slabpool.engine.serve.models import Repository, Served

    eng = Engine(models.mlp, workers=2, spin_us=1000)
    fe = Frontend(Repository([Served("mlp", models.mlp, eng)]), RequestMetrics())
    try:
        yield http.HttpApp(fe, 2**20), models.mlp
    finally:
        fe.repo.close(timeout=30)


def _infer_request(x: np.ndarray, binary: bool, params: dict[str, Any] | None = None) -> bytes:
    if binary:
        head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                       "parameters": {"binary_data_size": x.nbytes}}],
                           "parameters": {"binary_data_output": True, **(params or {})}}).encode()
        return _post("/v2/models/mlp/infer", head + x.tobytes(), b"Inference-Header-Content-Length: %d\r\n" % len(head))
    body = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}], "parameters": params or {}}).encode()
    return _post("/v2/models/mlp/infer", body)


def _outputs(head: bytes, body: Any, binary: bool) -> dict[str, bytes]:
    """Each output's raw bytes, from a JSON answer or a binary one."""
    assert head.startswith(b"HTTP/1.1 200"), (head, body)
    if not binary:
        return {o["name"]: np.array(o["data"], dtype=np.float32).reshape(o["shape"]).tobytes()
                for o in body["outputs"]}
    n = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"inference-header-content-length"))
            .split(b":")[1])
    got, pos = {}, n
    for o in json.loads(body[:n])["outputs"]:
        size = o["parameters"]["binary_data_size"]
        got[o["name"]], pos = body[pos : pos + size], pos + size
    assert pos == len(body)
    return got


def _want(model: Any, x: np.ndarray) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in ort_run(model, {"x": x}).items()}


def _in_a_task_at_decode(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """For each request the real route decodes from now on: whether a Task was current."""
    from slabpool.engine.serve import http

    seen: list[bool] = []
    decode = http.decode_request

    def spied(*a: Any) -> Any:
        seen.append(asyncio.current_task() is not None)
        return decode(*a)

    monkeypatch.setattr(http, "decode_request", spied)
    return seen


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_the_inference_route_runs_at_once_and_answers_what_onnxruntime_does(real, binary, monkeypatch):
    """On an idle engine the whole request (decode, the engine's round trip through the express
    lane, encode, the write) runs in the read's data_received: no Task is current when the
    request is decoded. A request with a timeout moves to a Task before its timeout is set
    (asyncio.timeout needs one), and the body in two reads goes uvicorn's ASGI way: the same
    answers, byte for byte, as an in-process onnxruntime session."""
    from slabpool.engine.serve import http

    app, model = real
    tasks = _in_a_task_at_decode(monkeypatch)
    asgi = threading.Event()
    call = http.HttpApp.__call__

    async def seen(self: Any, scope: Any, receive: Any, send: Any) -> None:
        asgi.set()
        await call(self, scope, receive, send)

    monkeypatch.setattr(http.HttpApp, "__call__", seen)
    rng = np.random.default_rng(3)
    with in_process(app) as where, socket.create_connection(("127.0.0.1", where.http_port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for rows in (1, 1, 5, 1):
            x = rng.standard_normal((rows, 16)).astype(np.float32)
            s.sendall(_infer_request(x, binary))
            (head, body), = _answers(s, 1)
            assert _outputs(head, body, binary) == _want(model, x)
        x = rng.standard_normal((2, 16)).astype(np.float32)
        s.sendall(_infer_request(x, binary, {"timeout": 30_000_000}))
        (head, body), = _answers(s, 1)
        assert _outputs(head, body, binary) == _want(model, x)
        assert not asgi.is_set()  # none of them took the ASGI way
        req = _infer_request(x, binary)
        split = req.index(b"\r\n\r\n") + 4
        s.sendall(req[:split])
        assert asgi.wait(30)  # the headers alone: uvicorn's task started, waiting for the body
        s.sendall(req[split:])
        (head, body), = _answers(s, 1)
        assert _outputs(head, body, binary) == _want(model, x)
    assert tasks == [False] * 5 + [True]  # decoded in data_received, but the ASGI task's


def test_while_a_request_is_in_flight_the_next_waits_for_a_turn_of_the_loop(models, tmp_path, monkeypatch):
    """Under load requests go uvicorn's way (a Task each, started together in the loop's next
    turn, where the engine's admission gathers them): a request held by its worker
    (tests/serve_hooks.py) is in flight, so a second, on another connection, is not started at
    once; both are answered, and after them a request starts at once again."""
    from slabpool import Engine
    from slabpool.engine.serve import http
    from slabpool.engine.serve.core import Frontend
    from slabpool.engine.serve.metrics import RequestMetrics
    from slabpool.engine.serve.models import Repository, Served

    ways = _in_a_task_at_decode(monkeypatch)
    release = tmp_path / "release"
    eng = Engine(models.mlp, workers=2, preprocess="tests.serve_hooks:marked")
    fe = Frontend(Repository([Served("mlp", models.mlp, eng)]), RequestMetrics())

    def request(fault: str | None) -> bytes:
        inputs = [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]
        if fault is not None:
            inputs.append({"name": "fault", "shape": [1], "datatype": "BYTES", "data": [fault]})
        return _post("/v2/models/mlp/infer", json.dumps({"inputs": inputs}).encode())

    try:
        with in_process(http.HttpApp(fe, 2**20)) as where:
            held = socket.create_connection(("127.0.0.1", where.http_port), timeout=30)
            other = socket.create_connection(("127.0.0.1", where.http_port), timeout=30)
            try:
                held.sendall(request(f"hold:{release}"))
                while fe.inflight == 0:  # a state polled for (only a deadlock outlasts the test's timeout)
                    time.sleep(0.001)
                other.sendall(request(None))
                (head, _), = _answers(other, 1)
                assert head.startswith(b"HTTP/1.1 200")
                release.touch()
                (head, _), = _answers(held, 1)
                assert head.startswith(b"HTTP/1.1 200")
                other.sendall(request(None))
                (head, _), = _answers(other, 1)
                assert head.startswith(b"HTTP/1.1 200")
            finally:
                held.close()
                other.close()
    finally:
        release.touch()
        fe.repo.close(timeout=30)
    assert ways == [False, True, False]


def test_a_request_waiting_when_the_server_stops_is_cancelled_and_answered_500(capfd):
    """uvicorn's shutdown waits for the requests it holds (timeout_graceful_shutdown, 5 s), then
    cancels them: a request that went on in a Task is among them (the protocol adds it to
    uvicorn's tasks), ends cancelled, and its client gets uvicorn's 500, as an ASGI task's
    would; the server stops."""
    app = _App()
    s = None
    try:
        with in_process(app) as where:
            s = socket.create_connection(("127.0.0.1", where.http_port), timeout=30)
            s.sendall(_post("/wait", b"w"))
            assert app.waiting.wait(30)
        assert app.cancelled.is_set()
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
        assert buf.startswith(b"HTTP/1.1 500"), buf
    finally:
        if s is not None:
            s.close()
    assert "Exception in ASGI application" in capfd.readouterr().err
