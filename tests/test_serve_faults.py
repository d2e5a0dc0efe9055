"""`slabpool serve` under faults: a worker SIGKILLed or segfaulting while it holds a request
(the request is replayed and answered correctly; /metrics counts the restart), a poison
request (500 alone), readiness while every slot is down, timeouts (504), a full queue (503),
a client that disconnects (its queued request is cancelled), SIGTERM's drain and reloads.

Every fault is carried by the request itself (tests/serve_hooks.py): a BYTES input "fault"
names it, so it strikes that request at that stage, never at a time. Waits poll for a state
the server reports; their deadlines only catch deadlocks.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from tests.models import onnx_models
from tests.reference import ort_run
from tests.serve_hooks import GATE_ENV, REFUSE_ENV
from tests.serve_support import Server, check_nothing_left, held

pytestmark = pytest.mark.timeout(180)
HOOKS = ["--preprocess", "tests.serve_hooks:marked", "--initializer", "tests.serve_hooks:gate"]
_servers: list[Server] = []
DEADLINE_S = 60  # only a hang reaches it


@pytest.fixture(scope="module")
def gate_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gate") / "gate"


@pytest.fixture(scope="module")
def server(models: SimpleNamespace, gate_file: Path):
    yield from held(_servers, Server(f"mlp={models.mlp}", "--workers", "1", "--max-attempts", "2", "--queue-capacity", "6",
                                     *HOOKS, env={GATE_ENV: str(gate_file)}))


@pytest.fixture(autouse=True)
def nothing_left_behind():  # overrides conftest's: the module's server stays up between tests
    yield
    check_nothing_left(_servers)


def _x(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 16)).astype(np.float32)


def _body(x: np.ndarray, fault: str | None = None, timeout_us: int | None = None) -> dict[str, Any]:
    inputs = [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]
    if fault is not None:
        inputs.append({"name": "fault", "shape": [1], "datatype": "BYTES", "data": [fault]})
    body: dict[str, Any] = {"inputs": inputs, "outputs": [{"name": "probs", "parameters": {"binary_data": True}}]}
    if timeout_us is not None:
        body["parameters"] = {"timeout": timeout_us}
    return body


def post(srv: Server, x: np.ndarray, fault: str | None = None, **kw: Any) -> tuple[int, Any]:
    """(status, probs or the error message) for one raw HTTP request."""
    r = _post(srv, x, fault, **kw)
    if r.status_code != 200:
        return r.status_code, r.json()["error"]
    return 200, _probs(r, x)


def _post(srv: Server, x: np.ndarray, fault: str | None = None, **kw: Any) -> httpx.Response:
    head = json.dumps(_body(x, fault, kw.pop("timeout_us", None))).encode()
    return httpx.post(f"{srv.url}/v2/models/mlp/infer", content=head, timeout=kw.pop("timeout", 120),
                      headers={"Inference-Header-Content-Length": str(len(head))})


def _probs(r: httpx.Response, x: np.ndarray) -> np.ndarray:
    n = int(r.headers["inference-header-content-length"])
    return np.frombuffer(r.content[n:], np.float32).reshape(x.shape[0], 8)


def versioned(srv: Server, x: np.ndarray, fault: str | None = None) -> tuple[str, np.ndarray]:
    """(the model version the answer names, its probs) for one request that must succeed."""
    r = _post(srv, x, fault)
    assert r.status_code == 200, r.text
    return json.loads(r.content[: int(r.headers["inference-header-content-length"])])["model_version"], _probs(r, x)


def grpc_infer(srv: Server, x: np.ndarray, fault: str | None = None, **kw: Any) -> tuple[str, Any]:
    c = tgrpc.InferenceServerClient(srv.grpc_url)
    try:
        inputs = [tgrpc.InferInput("x", list(x.shape), "FP32")]
        inputs[0].set_data_from_numpy(x)
        if fault is not None:
            inputs.append(tgrpc.InferInput("fault", [1], "BYTES"))
            inputs[1].set_data_from_numpy(np.array([fault.encode()], dtype=object))
        try:
            return "OK", c.infer("mlp", inputs, **kw).as_numpy("probs")
        except InferenceServerException as exc:
            return str(exc.status()).removeprefix("StatusCode."), exc.message()
    finally:
        c.close()


def _slots(srv: Server, state: str) -> float:
    """Model mlp's slots in `state` now, from /metrics."""
    text = httpx.get(f"{srv.url}/metrics").text
    got = re.search(rf'^slabpool_slots\{{(?=[^}}]*state="{state}")(?=[^}}]*model="mlp")[^}}]*\}} (\S+)$', text, re.M)
    return float(got.group(1)) if got else 0.0


def metric(srv: Server, name: str) -> float:
    """The sum of a family's samples for model mlp, from /metrics."""
    text = httpx.get(f"{srv.url}/metrics").text
    total = 0.0
    for m in re.finditer(rf'^{name}\{{([^}}]*)\}} (\S+)$', text, re.M):
        if 'model="mlp"' in m.group(1):
            total += float(m.group(2))
    return total


def wait_for(cond: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout  # only a deadlock reaches it
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _until(stop: threading.Event, call: Any) -> list[Any]:
    """call() again and again until `stop` is set (at least once); what each returned."""
    out = [call()]
    while not stop.is_set():
        out.append(call())
    return out


def _ref(models: SimpleNamespace, x: np.ndarray) -> np.ndarray:
    return ort_run(models.mlp, {"x": x})["probs"]


# -- crashes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize("fault", ["kill-once", "segv-once"])
def test_a_worker_that_dies_holding_a_request_replays_it(server, models, tmp_path, transport, fault):
    restarts = metric(server, "slabpool_worker_restarts_total")
    send = post if transport == "http" else grpc_infer
    ok = 200 if transport == "http" else "OK"
    xs = [_x(i) for i in range(5)]
    with ThreadPoolExecutor(5) as pool:
        futs = [pool.submit(send, server, xs[0], f"{fault}:{tmp_path / 'once'}")]
        futs += [pool.submit(send, server, x) for x in xs[1:]]
        results = [f.result() for f in futs]
    assert (tmp_path / "once").exists()  # the worker did die on it
    for x, (status, probs) in zip(xs, results, strict=True):
        assert status == ok, probs
        assert probs.tobytes() == _ref(models, x).tobytes()
    assert metric(server, "slabpool_worker_restarts_total") == restarts + 1
    assert metric(server, "slabpool_tasks_replayed_total") >= 1


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_poison_request_fails_alone_with_its_exit_signals(server, models, transport):
    send = post if transport == "http" else grpc_infer
    xs = [_x(10 + i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        poison = pool.submit(send, server, xs[0], "kill")
        others = [pool.submit(send, server, x) for x in xs[1:]]
        status, msg = poison.result()
        assert status == (500 if transport == "http" else "INTERNAL")
        assert "poison" in msg and msg.count("SIGKILL") >= 2
        for x, f in zip(xs[1:], others, strict=True):
            st, probs = f.result()
            assert st in (200, "OK"), probs
            assert probs.tobytes() == _ref(models, x).tobytes()


def test_ready_is_false_while_every_slot_is_down_and_true_after_the_rebuild(server, models, tmp_path, gate_file):
    """The only worker dies; its replacement waits at start (the gate): the model and the
    server report not ready (HTTP 503 and gRPC false) while live stays true; once it starts,
    the held request is answered and ready is true again."""
    x = _x(20)
    h = httpx.Client(base_url=server.url)
    g = tgrpc.InferenceServerClient(server.grpc_url)
    gate_file.touch()
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post, server, x, f"kill-once:{tmp_path / 'once'}")
            wait_for(lambda: h.get("/v2/models/mlp/ready").status_code == 503, "model ready to turn false")
            assert h.get("/v2/health/ready").status_code == 503
            assert h.get("/v2/health/live").status_code == 200
            assert not g.is_model_ready("mlp") and not g.is_server_ready() and g.is_server_live()
            gate_file.unlink()
            status, probs = fut.result()
        assert status == 200 and probs.tobytes() == _ref(models, x).tobytes()
        wait_for(lambda: h.get("/v2/health/ready").status_code == 200, "ready again")
        assert g.is_model_ready("mlp")
    finally:
        gate_file.unlink(missing_ok=True)
        h.close()
        g.close()


# -- admission and time --------------------------------------------------------------------------------


def test_a_request_past_its_timeout_is_504(server, tmp_path):
    release = tmp_path / "release"
    c = thttp.InferenceServerClient(server.url[7:])
    try:
        i = thttp.InferInput("x", [2, 16], "FP32")
        i.set_data_from_numpy(_x(30))
        f = thttp.InferInput("fault", [1], "BYTES")
        f.set_data_from_numpy(np.array([f"hold:{release}".encode()], dtype=object))
        with pytest.raises(InferenceServerException) as err:
            c.infer("mlp", [i, f], timeout=200_000)  # tritonclient's timeout parameter: microseconds
        status, message = err.value.status(), err.value.message()
        del err  # its traceback holds the client, whose gevent hub must be let go on this thread
        assert status == "504" and "timeout" in message
        status, _ = grpc_infer(server, _x(31), f"hold:{release}", client_timeout=0.3)
        assert status == "DEADLINE_EXCEEDED"
    finally:
        release.touch()
        c.close()
        del c
        gc.collect()
    wait_for(lambda: metric(server, "slabpool_busy_slots") == 0, "the held worker to be free")


def test_a_full_queue_answers_503_at_once(server, models, tmp_path):
    release = tmp_path / "release"
    xs = [_x(40 + i) for i in range(16)]
    try:
        with ThreadPoolExecutor(16) as pool:
            futs = [pool.submit(post, server, x, f"hold:{release}") for x in xs]
            wait_for(lambda: any(f.done() for f in futs), "a rejection")  # the held ones cannot finish
            early = [f.result() for f in futs if f.done()]
            release.touch()
            results = [f.result() for f in futs]
    finally:
        release.touch()
    assert early and all(st == 503 and "queue is full" in msg for st, msg in early)
    assert {st for st, _ in results} == {200, 503}
    for x, (st, probs) in zip(xs, results, strict=True):
        if st == 200:
            assert probs.tobytes() == _ref(models, x).tobytes()


@pytest.mark.parametrize("transport", ["http", "http-large", "grpc"])
def test_a_client_that_goes_away_cancels_its_queued_request(server, tmp_path, transport):
    """The worker holds two requests; a third waits in the queue; its client goes away (HTTP:
    a raw socket closed once the server has queued the request; gRPC: the call cancelled): the
    engine counts it cancelled, and it never runs. http-large: a body past uvicorn's 64 KiB
    high-water mark, after which uvicorn stopped reading the socket; was: the client's going
    away went unseen, and the request ran."""
    release = tmp_path / "release"
    cancelled = metric(server, "slabpool_tasks_cancelled_total")
    accepted = metric(server, "slabpool_tasks_accepted_total")
    try:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(post, server, _x(50 + i), f"hold:{release}") for i in range(2)]
            wait_for(lambda: metric(server, "slabpool_tasks_accepted_total") == accepted + 2 and
                     metric(server, "slabpool_queue_depth") == 0, "the worker to hold two requests")
            with _third_request(server, transport):
                wait_for(lambda: metric(server, "slabpool_queue_depth") == 1, "the third request to be queued")
            wait_for(lambda: metric(server, "slabpool_tasks_cancelled_total") == cancelled + 1,
                     "the abandoned request to be cancelled")
            assert metric(server, "slabpool_queue_depth") == 0
            release.touch()
            assert all(f.result()[0] == 200 for f in held)
    finally:
        release.touch()


def _answered(srv: Server, code: str) -> float:
    """slabpool_serve_requests_total for model mlp over HTTP with this status code."""
    want = {f'code="{code}"', 'model="mlp"', 'transport="http"'}
    for m in re.finditer(r'^slabpool_serve_requests_total\{([^}]*)\} (\S+)$', httpx.get(f"{srv.url}/metrics").text, re.M):
        if set(m.group(1).split(",")) == want:
            return float(m.group(2))
    return 0.0


@pytest.mark.parametrize("pipelined", [0, 1, 3])
@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_pipelining_client_that_goes_away_is_no_error_of_the_server(server, tmp_path, pipelined, how):
    """A connection's first request is held by the worker, `pipelined` more wait behind it on the
    same connection, and the client closes or resets it: the held request ends cancelled (499,
    counted), the pipelined ones never start, and the server logs nothing. Was, with any
    pipelined request: uvicorn marked only the newest request disconnected, so the cancelled
    first one, left unanswered, was logged as an app that returned without answering (ERROR)
    and given a 500 on the closed transport (a RuntimeError in the task)."""
    release = tmp_path / "release"
    log_from = len(server.stderr())
    cancelled, accepted = _answered(server, "499"), metric(server, "slabpool_tasks_accepted_total")
    req = json.dumps(_body(_x(70), f"hold:{release}")).encode()
    first = b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(req), req)
    try:
        with socket.create_connection((server.host, server.http_port)) as sock:
            sock.sendall(first + b"".join(_raw_infer(_x(71 + i)) for i in range(pipelined)))
            wait_for(lambda: metric(server, "slabpool_tasks_accepted_total") == accepted + 1, "the held request")
            if how == "reset":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        wait_for(lambda: _answered(server, "499") == cancelled + 1, "the held request to be cancelled")
        log = server.stderr()[log_from:]  # the cancelled request's task logged (or not) before it was counted
        assert "ERROR" not in log and "Traceback" not in log, log
    finally:
        release.touch()
    wait_for(lambda: metric(server, "slabpool_busy_slots") == 0, "the held worker to be free")
    assert metric(server, "slabpool_tasks_accepted_total") == accepted + 1  # the pipelined ones never ran
    assert post(server, _x(75))[0] == 200


def _raw_infer(x: np.ndarray) -> bytes:
    body = json.dumps(_body(x)).encode()
    return b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


@contextlib.contextmanager
def _third_request(srv: Server, transport: str) -> Iterator[None]:
    """A request in flight while the block runs, abandoned by its client when the block ends."""
    if transport.startswith("http"):
        x = _x(52) if transport == "http" else np.tile(_x(52), (2_000, 1))
        body = json.dumps(_body(x)).encode()
        assert (len(body) > 64 * 1024) == (transport == "http-large")
        with socket.create_connection((srv.host, srv.http_port)) as sock:
            sock.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            yield
        return
    import grpc

    from slabpool.engine.serve.proto import grpc_predict_v2_pb2 as pb

    x = _x(52)
    req = pb.ModelInferRequest(model_name="mlp", raw_input_contents=[x.tobytes()])
    req.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    with grpc.insecure_channel(srv.grpc_url) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                              request_serializer=pb.ModelInferRequest.SerializeToString,
                              response_deserializer=pb.ModelInferResponse.FromString).future(req)
        yield
        call.cancel()


# -- operations: drain, reload, access log ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_drains_what_was_accepted_then_exits_0(models, tmp_path, sig):
    srv = Server(f"mlp={models.mlp}", "--workers", "1", "--drain-timeout", "60", "--access-log", *HOOKS)
    _servers.append(srv)
    release = tmp_path / "release"
    try:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(post, srv, _x(60 + i), f"hold:{release}") for i in range(2)]
            wait_for(lambda: metric(srv, "slabpool_tasks_accepted_total") >= 2, "two accepted requests")
            srv.proc.send_signal(sig)
            wait_for(lambda: httpx.get(f"{srv.url}/v2/health/ready").status_code == 503, "ready to turn false")
            with httpx.Client() as keep:  # (keep-alive: the answer closes it, the client does not reuse it)
                r = keep.post(f"{srv.url}/v2/models/mlp/infer", json=_body(_x(62)))
                assert r.status_code == 503 and f"draining ({sig.name})" in r.json()["error"]
                assert r.headers["connection"] == "close", r.headers  # (was: kept, then closed under the client)
            assert grpc_infer(srv, _x(63))[0] == "UNAVAILABLE"
            release.touch()
            for i, f in enumerate(held):
                st, probs = f.result()
                assert st == 200 and probs.tobytes() == _ref(models, _x(60 + i)).tobytes()
        log = srv.stderr()
        assert srv.stop(sig=0) == 0, log
    finally:
        release.touch()
        _servers.remove(srv)
    lines = [json.loads(ln) for ln in log.splitlines() if ln.startswith("{")]
    codes = sorted(ln["code"] for ln in lines if ln["model"] == "mlp")
    assert codes.count("200") == 2 and "503" in codes and "UNAVAILABLE" in codes
    assert all({"ts", "transport", "model", "code", "ms", "id"} <= set(ln) for ln in lines)


@pytest.mark.slow
def test_reload_through_the_repository_extension_and_sighup(models, tmp_path):
    v2 = onnx_models.mlp(tmp_path / "mlp_v2.onnx", seed=1)
    srv = Server(f"mlp={models.mlp}", "--workers", "2")
    _servers.append(srv)
    try:
        h = httpx.Client(base_url=srv.url, timeout=120)
        x = _x(70)
        body = {"inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32", "data": x.ravel().tolist()}]}
        old = h.get("/v2/models/mlp").json()["versions"][0]
        with ThreadPoolExecutor(1) as pool:  # requests all through the swap: none fails
            stop = threading.Event()
            during = pool.submit(_until, stop, lambda: post(srv, x)[0])
            r = h.post("/v2/repository/models/mlp/load", json={"parameters": {"path": str(v2)}})
            stop.set()
            statuses = during.result()
        assert r.status_code == 200, r.text
        assert statuses and set(statuses) == {200}
        new = r.json()["version"]
        assert new != old and h.get("/v2/models/mlp").json()["versions"] == [new]
        out = h.post("/v2/models/mlp/infer", json=body).json()
        assert out["model_version"] == new
        probs = next(o for o in out["outputs"] if o["name"] == "probs")
        assert np.asarray(probs["data"], np.float32).reshape(2, 8).tobytes() == ort_run(v2, {"x": x})["probs"].tobytes()
        r = h.post("/v2/repository/models/mlp/load", json={"parameters": {"path": str(models.multi_io)}})
        assert r.status_code == 400 and "old model keeps serving" in r.json()["error"]
        assert h.post("/v2/repository/models/nope/load").status_code == 404
        tc = thttp.InferenceServerClient(srv.url[7:])
        tc.load_model("mlp")  # tritonclient's repository call: reloads from the current file (v2)
        assert tc.get_model_metadata("mlp")["versions"] == [new] and tc.is_model_ready("mlp")
        tc.close()
        srv.proc.send_signal(signal.SIGHUP)  # reloads from its file, now v2: same version
        wait_for(lambda: "reloaded" in srv.stderr(), "the SIGHUP reload")
        assert h.get("/v2/models/mlp").json()["versions"] == [new]
        assert h.get("/v2/health/ready").status_code == 200
        # gRPC (was: UNIMPLEMENTED): tritonclient.grpc's load_model reloads from the file, now v3,
        # while gRPC requests flow: none fails, and the answers after it are v3's
        onnx_models.mlp(v2, seed=2)
        g = tgrpc.InferenceServerClient(srv.grpc_url)
        with ThreadPoolExecutor(1) as pool:
            stop = threading.Event()
            during = pool.submit(_until, stop, lambda: grpc_infer(srv, x)[0])
            g.load_model("mlp")
            stop.set()
            statuses = during.result()
        assert statuses and set(statuses) == {"OK"}
        v3 = g.get_model_metadata("mlp", as_json=True)["versions"]
        assert v3 != [new] and v3 == h.get("/v2/models/mlp").json()["versions"]
        assert grpc_infer(srv, x)[1].tobytes() == ort_run(v2, {"x": x})["probs"].tobytes()
        g.close()
        h.close()
        assert srv.stop() == 0, srv.stderr()
    finally:
        if srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
        _servers.remove(srv)


def _slot_versions(srv: Server) -> dict[str, str]:
    """Each slot's model version, from /metrics (slabpool_slot_info)."""
    text = httpx.get(f"{srv.url}/metrics").text
    out = {}
    for m in re.finditer(r'^slabpool_slot_info\{([^}]*)\} ', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[labels["slot"]] = labels["model_version"]
    return out


@pytest.mark.slow
def test_each_answer_during_a_reload_names_the_version_that_computed_it(models, tmp_path):
    """A reload swaps one slot at a time, and the model's version is the new one only once the
    last has swapped: meanwhile one slot runs the new model and another the old. Each answer
    names the version whose outputs it carries (was: the engine's version when it answered, so
    the new model's outputs came labelled with the old version). Requests held in the workers
    pin which slot runs what: A on slot 0 and B on slot 1, both on the old model; the reload
    drains slot 0 (A answers: old), swaps it, then waits on slot 1 (B); C, sent then, runs on
    slot 0 (new: the case that was wrong); B answers old; D, after, new."""
    v2 = onnx_models.mlp(tmp_path / "v2.onnx", seed=1)
    srv = Server(f"mlp={models.mlp}", "--workers", "2", *HOOKS)
    _servers.append(srv)
    rel_a, rel_b = tmp_path / "release-a", tmp_path / "release-b"
    try:
        old = httpx.get(f"{srv.url}/v2/models/mlp").json()["versions"][0]
        xs = [_x(90 + i) for i in range(4)]
        with ThreadPoolExecutor(3) as pool:
            a = pool.submit(versioned, srv, xs[0], f"hold:{rel_a}")
            wait_for(lambda: metric(srv, "slabpool_busy_slots") == 1, "slot 0 to hold A")
            b = pool.submit(versioned, srv, xs[1], f"hold:{rel_b}")
            wait_for(lambda: metric(srv, "slabpool_busy_slots") == 2, "slot 1 to hold B")
            load = pool.submit(httpx.post, f"{srv.url}/v2/repository/models/mlp/load",
                               json={"parameters": {"path": str(v2)}}, timeout=120)
            rel_a.touch()
            wait_for(lambda: _slot_versions(srv)["0"] not in ("", old), "slot 0 on the new model")
            new = _slot_versions(srv)["0"]
            assert _slot_versions(srv)["1"] == old and not load.done()  # (slot 1 drains B)
            c = versioned(srv, xs[2])
            rel_b.touch()
            assert load.result().status_code == 200 and load.result().json()["version"] == new
            d = versioned(srv, xs[3])
            got = [a.result(), b.result(), c, d]
        assert [v for v, _ in got] == [old, old, new, new]
        for (_, probs), x, model in zip(got, xs, [models.mlp, models.mlp, v2, v2], strict=True):
            assert probs.tobytes() == ort_run(model, {"x": x})["probs"].tobytes()
        assert srv.stop() == 0, srv.stderr()
    finally:
        rel_a.touch()
        rel_b.touch()
        if srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
        _servers.remove(srv)


@pytest.mark.slow
@pytest.mark.parametrize("loads", [1, (os.cpu_count() or 1) + 5], ids=["one-load", "more-loads-than-threads"])
def test_sigterm_during_a_reload_whose_worker_never_starts_exits_at_once(models, tmp_path, gate_file, loads):
    """Was (a hostile run): the engines were closed after the event loop, whose shutdown waited
    for the reload's thread, which waited for a worker held at start: the process never exited
    (90 s and more), and the load's client got uvicorn's plain 500. Now the engines close in
    the loop: the reload ends, its client gets 503, the server exits 0 and leaves nothing.
    And with more loads waiting than the loop's executor has threads (min(32, CPUs + 4)): each
    waiting load held a thread, the close got none, and SIGTERM never exited; now a waiting
    load holds none, and the close has a thread of its own."""
    srv = Server(f"mlp={models.mlp}", "--workers", "2", *HOOKS, env={GATE_ENV: str(gate_file)})
    _servers.append(srv)
    try:
        with ThreadPoolExecutor(loads) as pool:
            gate_file.touch()  # (the reload's new worker waits at start)
            sent = [pool.submit(httpx.post, f"{srv.url}/v2/repository/models/mlp/load", json={}, timeout=120)
                    for _ in range(loads)]
            wait_for(lambda: _slots(srv, "STARTING") == 1, "the reload's worker to wait at start")
            assert post(srv, _x(90))[0] == 200  # (the other slot serves on)
            assert srv.stop(timeout=30) == 0
            answers = [f.result() for f in sent]
            for r in answers:
                assert r.status_code == 503, r.text
            assert sum("reload of 'mlp' ended" in r.json()["error"] for r in answers) >= 1, answers[0].text
    finally:
        gate_file.unlink(missing_ok=True)
        _servers.remove(srv)


@pytest.mark.slow
@pytest.mark.parametrize("leaves", ["http-close", "grpc-deadline"])
def test_a_load_whose_client_leaves_mid_swap_holds_the_next_load_until_its_swap_ends(models, gate_file, leaves):
    """A load's client leaves while the swap runs (its new worker held at start): an HTTP client
    closes its connection, a gRPC one's deadline passes (gRPC cancels the handler). The swap goes
    on, and a second load waits for it, then swaps in turn: 200 (was, over gRPC: the cancelled
    handler let go of the lock on the model's loads, and the second load met the swap still
    running: "a reload is already in progress")."""
    srv = Server(f"mlp={models.mlp}", "--workers", "2", *HOOKS, env={GATE_ENV: str(gate_file)})
    _servers.append(srv)
    try:
        gate_file.touch()  # (the reload's new worker waits at start)
        if leaves == "http-close":
            host, port = srv.url.removeprefix("http://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as s:
                s.sendall(b"POST /v2/repository/models/mlp/load HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
                wait_for(lambda: _slots(srv, "STARTING") == 1, "the first load's worker to wait at start")
        else:
            with tgrpc.InferenceServerClient(srv.grpc_url) as g, pytest.raises(InferenceServerException):
                g.load_model("mlp", client_timeout=1.0)  # (its worker waits at start: the deadline passes)
            assert _slots(srv, "STARTING") == 1
        with ThreadPoolExecutor(1) as pool:
            second = pool.submit(httpx.post, f"{srv.url}/v2/repository/models/mlp/load", json={}, timeout=120)
            assert post(srv, _x(93))[0] == 200  # (the other slot serves on)
            gate_file.unlink()
            r = second.result()
        assert r.status_code == 200, r.text
        assert httpx.get(f"{srv.url}/v2/health/ready").status_code == 200 and post(srv, _x(94))[0] == 200
        assert srv.stop() == 0
    finally:
        gate_file.unlink(missing_ok=True)
        _servers.remove(srv)


def test_an_engine_that_stopped_for_good_is_not_live(models, tmp_path):
    """The only worker dies and every start of its slot fails: the engine stops (docs/faults.md)
    and nothing brings it back, not a reload. Was: live 200 for ever (a supervisor never
    restarts it) while every request answered 500 naming the failure. Now live is 503 (HTTP
    and gRPC), and SIGTERM still exits cleanly."""
    refuse = tmp_path / "refuse"
    srv = Server(f"mlp={models.mlp}", "--workers", "1", "--preprocess", "tests.serve_hooks:marked",
                 "--initializer", "tests.serve_hooks:refuse", env={REFUSE_ENV: str(refuse)})
    _servers.append(srv)
    try:
        assert httpx.get(f"{srv.url}/v2/health/live").status_code == 200
        refuse.touch()
        status, msg = post(srv, _x(92), "kill")  # (its worker dies; no start of the slot succeeds again)
        assert status >= 500, msg
        wait_for(lambda: httpx.get(f"{srv.url}/v2/health/live").status_code == 503, "live to turn false")
        assert httpx.get(f"{srv.url}/v2/health/live").json() == {"live": False}
        with tgrpc.InferenceServerClient(srv.grpc_url) as c:
            assert c.is_server_live() is False
        status, msg = post(srv, _x(91))
        assert status == 500 and "the engine stopped" in msg, msg
        assert srv.stop() == 0
    finally:
        _servers.remove(srv)


def test_a_client_too_slow_to_send_its_request_is_disconnected(models, tmp_path):
    """--read-timeout: a connection that sends nothing, headers never ended, a body paused past
    it: each closed by the server. Was (a hostile run): 300 such connections held for 40 s and
    more, each an fd, with no end. A body sent in pauses shorter than it, slower altogether,
    is answered; so is a request pipelined behind one that runs longer than the timeout."""
    srv = Server(f"mlp={models.mlp}", "--workers", "1", "--read-timeout", "2", *HOOKS)
    _servers.append(srv)
    release = tmp_path / "release"
    try:
        held = json.dumps(_body(_x(93), f"hold:{release}")).encode()
        after = json.dumps(_body(_x(94))).encode()
        with socket.create_connection((srv.host, srv.http_port)) as piped:
            both = b"".join(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                            b"Inference-Header-Content-Length: %d\r\n\r\n%s" % (len(b), len(b), b)
                            for b in (held, after))
            piped.sendall(both)
            wait_for(lambda: metric(srv, "slabpool_busy_slots") == 1, "the worker to hold the first request")
            time.sleep(3)  # (past the read timeout while the first runs, the second queued behind it)
            release.touch()
            piped.settimeout(DEADLINE_S)
            answers = b""
            while answers.count(b"HTTP/1.1 200 OK") < 2:
                got = piped.recv(65536)
                assert got, f"closed after {answers!r}"
                answers += got
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}).encode()
        head = (f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        slow = [socket.create_connection((srv.host, srv.http_port)) for _ in range(3)]
        slow[1].sendall(head[:20])  # its headers begun, never ended
        slow[2].sendall(head + body[:10])  # its body begun, then paused
        with socket.create_connection((srv.host, srv.http_port)) as s:
            s.sendall(head)
            for i in range(0, len(body), 15):  # ~3 s in all, 0.2 s pauses
                time.sleep(0.2)
                s.sendall(body[i : i + 15])
            s.settimeout(DEADLINE_S)
            assert s.recv(65536).startswith(b"HTTP/1.1 200 OK")
        for s in slow:
            s.settimeout(DEADLINE_S)  # (only a server that never closes it reaches this)
            assert s.recv(1024) == b""
            s.close()
        assert srv.stop() == 0
    finally:
        _servers.remove(srv)


@pytest.mark.parametrize("cut", ["timeout", "SIGINT again", "SIGTERM again"])
def test_a_drain_cut_short_cancels_the_rest_and_exits_1(models, tmp_path, cut):
    """A drain whose request never ends, cut short by --drain-timeout, or by a second Ctrl-C or
    SIGTERM (was: a second signal was ignored, and the drain ran its whole --drain-timeout, 30 s
    by default): the request is answered 503, and the server exits 1 saying why."""
    timeout = "0.5" if cut == "timeout" else "600"
    srv = Server(f"mlp={models.mlp}", "--workers", "1", "--drain-timeout", timeout, *HOOKS)
    _servers.append(srv)
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(post, srv, _x(80), f"hold:{tmp_path / 'never'}")
            wait_for(lambda: metric(srv, "slabpool_busy_slots") == 1, "the worker to hold the request")
            srv.proc.send_signal(signal.SIGTERM)
            if cut != "timeout":
                wait_for(lambda: httpx.get(f"{srv.url}/v2/health/ready").status_code == 503, "the drain to begin")
                srv.proc.send_signal(signal.Signals[cut.split()[0]])
            srv.proc.wait(60)  # (only a hang reaches it)
            said = srv.stderr()
            assert srv.stop(sig=0) == 1, said
            status, msg = held.result()
            assert status == 503, msg
        why = "the drain timeout (0.5 s) passed" if cut == "timeout" else f"a second {cut.split()[0]} ended the drain"
        assert why in said, said
    finally:
        _servers.remove(srv)
