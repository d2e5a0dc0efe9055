"""`slabpool serve` speaks the Open Inference Protocol: the real tritonclient.http and
tritonclient.grpc clients, unmodified, and raw HTTP requests (httpx) read health and metadata
and run inference with JSON and binary tensors; outputs are byte-identical to an in-process
onnxruntime session; errors are the protocol's, with the status each case calls for.

One server process for the module (three models, two workers each); the leak check allows its
process tree and its two listening ports, and nothing else.
"""

from __future__ import annotations

import functools
import json
import re
import socket
import struct
import time
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from tests.reference import ort_run
from tests.serve_support import Server, check_nothing_left, held, read_answers
from tests.serve_support import in_process as _in_process

pytestmark = pytest.mark.timeout(120)
_servers: list[Server] = []
LIMIT = 2**20  # the module server's --max-request-bytes


@pytest.fixture(scope="module")
def server(models: SimpleNamespace):
    yield from held(_servers, Server(f"mlp={models.mlp}", f"multi_io={models.multi_io}", f"ints={models.int_model}",
                                     "--workers", "2", "--max-request-bytes", str(LIMIT)))


@pytest.fixture(autouse=True)
def nothing_left_behind():  # overrides conftest's: the module's server stays up between tests
    yield
    check_nothing_left(_servers)


def _feeds(model: str, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if model == "mlp":
        return {"x": rng.standard_normal((rows, 16)).astype(np.float32)}
    if model == "multi_io":
        return {"feats": rng.standard_normal((rows, 4)).astype(np.float32), "ids": rng.integers(-5, 5, rows)}
    return {"x": rng.integers(-1000, 1000, (rows, 4)).astype(np.int32)}


def _path(models: SimpleNamespace, name: str):
    return {"mlp": models.mlp, "multi_io": models.multi_io, "ints": models.int_model}[name]


def _same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


# -- health and metadata ------------------------------------------------------------------------


@pytest.mark.parametrize("client", ["http", "grpc"])
def test_health_and_metadata_through_tritonclient(server, client):
    c = thttp.InferenceServerClient(server.url[7:]) if client == "http" else tgrpc.InferenceServerClient(server.grpc_url)
    try:
        assert c.is_server_live() and c.is_server_ready()
        assert c.is_model_ready("mlp") and c.is_model_ready("multi_io")
        meta = c.get_server_metadata(as_json=True) if client == "grpc" else c.get_server_metadata()
        assert meta["name"] == "slabpool" and "binary_tensor_data" in meta["extensions"]
        mm = c.get_model_metadata("multi_io", as_json=True) if client == "grpc" else c.get_model_metadata("multi_io")
        inputs = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in mm["inputs"]}
        outputs = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in mm["outputs"]}
        assert inputs == {"feats": ("FP32", [-1, 4]), "ids": ("INT64", [-1])}
        assert outputs == {"sum": ("FP32", [-1]), "total": ("FP32", [1])}
        assert len(mm["versions"]) == 1
        with pytest.raises(InferenceServerException) as err:
            c.get_model_metadata("nope")
        assert "nope" in err.value.message()
    finally:
        c.close()


def test_health_over_raw_http(server):
    with httpx.Client(base_url=server.url) as h:
        assert h.get("/v2/health/live").json() == {"live": True}
        r = h.get("/v2/health/ready")
        assert r.status_code == 200 and r.json() == {"ready": True}
        assert h.get("/v2/models/mlp/ready").json() == {"name": "mlp", "ready": True}
        assert h.get("/v2/models/nope/ready").status_code == 404
        version = h.get("/v2/models/mlp").json()["versions"][0]
        assert h.get(f"/v2/models/mlp/versions/{version}/ready").status_code == 200
        r = h.get("/v2/models/mlp/versions/other")
        assert r.status_code == 404 and "version" in r.json()["error"]
        index = h.post("/v2/repository/index").json()
        assert {m["name"] for m in index} == {"mlp", "multi_io", "ints"}


# -- inference: byte-identical to onnxruntime ---------------------------------------------------------


@pytest.mark.parametrize("model", ["mlp", "multi_io", "ints"])
@pytest.mark.parametrize("how", ["http-binary", "http-json", "grpc"])
def test_tritonclient_outputs_are_byte_identical_to_onnxruntime(server, models, model, how):
    feeds = _feeds(model, rows=5, seed=hash(how) % 100)
    want = ort_run(_path(models, model), feeds)
    dtypes = {"float32": "FP32", "int64": "INT64", "int32": "INT32"}
    if how == "grpc":
        mod, c = tgrpc, tgrpc.InferenceServerClient(server.grpc_url)
    else:
        mod, c = thttp, thttp.InferenceServerClient(server.url[7:])
    try:
        inputs = []
        for name, arr in feeds.items():
            i = mod.InferInput(name, list(arr.shape), dtypes[arr.dtype.name])
            if how == "http-json":
                i.set_data_from_numpy(arr, binary_data=False)
            else:
                i.set_data_from_numpy(arr)
            inputs.append(i)
        outputs = None
        if how == "http-json":
            outputs = [thttp.InferRequestedOutput(n, binary_data=False) for n in want]
        res = c.infer(model, inputs, outputs=outputs, request_id=f"req-{how}")
        for name, w in want.items():
            got = res.as_numpy(name)
            if how == "http-json" and w.dtype.kind == "f":  # JSON carries the shortest repr of each float32
                assert got.astype(w.dtype).tobytes() == w.tobytes()
            else:
                _same(got, w)
        rid = res.get_response().id if how == "grpc" else res.get_response()["id"]
        assert rid == f"req-{how}"
    finally:
        c.close()


def test_raw_json_request_selects_outputs_and_echoes_the_id(server, models):
    x = _feeds("mlp", 3)["x"]
    want = ort_run(models.mlp, {"x": x})
    body = {"id": "abc-1", "inputs": [{"name": "x", "shape": [3, 16], "datatype": "FP32", "data": x.ravel().tolist()}],
            "outputs": [{"name": "logits"}], "parameters": {"custom": 1}}
    r = httpx.post(f"{server.url}/v2/models/mlp/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "abc-1" and out["model_name"] == "mlp" and out["model_version"]
    assert [o["name"] for o in out["outputs"]] == ["logits"]
    o = out["outputs"][0]
    assert o["datatype"] == "FP32" and o["shape"] == [3, 8]
    _same(np.asarray(o["data"], np.float32).reshape(3, 8), want["logits"])


@pytest.mark.parametrize("binary_out", ["binary_data_output", "per-output", "json", "listed-under-binary_data_output"])
def test_raw_binary_extension_request(server, models, binary_out):
    """The JSON header, then the raw little-endian tensors; the answer split the same way. An
    output listed without binary_data of its own takes the request's binary_data_output (the
    extension: "unless overridden by binary_data on a specific output"; was: sent as JSON)."""
    feeds = _feeds("multi_io", 4)
    want = ort_run(models.multi_io, feeds)
    inputs = [{"name": n, "shape": list(a.shape), "datatype": {"float32": "FP32", "int64": "INT64"}[a.dtype.name],
               "parameters": {"binary_data_size": a.nbytes}} for n, a in feeds.items()]
    head: dict = {"inputs": inputs}
    if binary_out == "binary_data_output":
        head["parameters"] = {"binary_data_output": True}
    elif binary_out == "per-output":
        head["outputs"] = [{"name": "total", "parameters": {"binary_data": True}}, {"name": "sum"}]
    elif binary_out == "listed-under-binary_data_output":
        head["parameters"] = {"binary_data_output": True}
        head["outputs"] = [{"name": "total"}, {"name": "sum", "parameters": {"binary_data": False}}]
    header = json.dumps(head).encode()
    body = header + b"".join(a.tobytes() for a in feeds.values())
    r = httpx.post(f"{server.url}/v2/models/multi_io/infer", content=body,
                   headers={"Inference-Header-Content-Length": str(len(header))})
    assert r.status_code == 200, r.text
    n = r.headers.get("inference-header-content-length")
    if binary_out == "json":
        assert n is None
        for o in r.json()["outputs"]:
            assert np.asarray(o["data"], np.float32).tobytes() == want[o["name"]].tobytes()
        return
    meta = json.loads(r.content[: int(n)])
    pos = int(n)
    binary = {o["name"] for o in meta["outputs"] if "parameters" in o}
    assert binary == {"binary_data_output": {"sum", "total"}}.get(binary_out, {"total"})
    for o in meta["outputs"]:
        if "parameters" in o:
            size = o["parameters"]["binary_data_size"]
            got = np.frombuffer(r.content[pos : pos + size], np.float32).reshape(o["shape"])
            pos += size
        else:
            got = np.asarray(o["data"], np.float32).reshape(o["shape"])
        _same(got, want[o["name"]])
    assert pos == len(r.content)


# -- errors ---------------------------------------------------------------------------------------------

X = {"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}
XI = {"name": "x", "shape": [1, 4], "datatype": "INT32", "data": [1, 2, 3, 4]}
ERRORS = {  # case -> (model, JSON body or raw bytes, status, words the message must hold)
    "dtype": ("mlp", {"inputs": [{**X, "datatype": "FP64"}]}, 400, ["'x'", "float32", "float64"]),
    "static dim": ("mlp", {"inputs": [{**X, "shape": [1, 15], "data": [0.5] * 15}]}, 400, ["'x'", "16", "15"]),
    "missing input": ("multi_io", {"inputs": [{**X, "name": "feats", "shape": [4, 4]}]}, 400, ["ids"]),
    "data count": ("mlp", {"inputs": [{**X, "data": [0.5] * 15}]}, 400, ["'x'", "16", "15"]),
    "datatype name": ("mlp", {"inputs": [{**X, "datatype": "FLOAT"}]}, 400, ["'x'", "FLOAT", "FP32"]),
    "shape": ("mlp", {"inputs": [{**X, "shape": "1x16"}]}, 400, ["'x'", "shape"]),
    "no inputs": ("mlp", {"inputs": []}, 400, ["inputs"]),
    "not json": ("mlp", b"{nope", 400, ["JSON"]),
    "unknown output": ("mlp", {"inputs": [X], "outputs": [{"name": "zz"}]}, 400, ["'zz'", "probs"]),
    "output twice": ("mlp", {"inputs": [X], "outputs": [{"name": "probs"}, {"name": "probs"}]}, 400,
                     ["'probs'", "more than once"]),  # (was: answered twice)
    "bad timeout": ("mlp", {"inputs": [X], "parameters": {"timeout": "soon"}}, 400, ["timeout"]),
    "unknown model": ("nope", {"inputs": [X]}, 404, ["'nope'", "mlp"]),
    # JSON data is read as the datatype names it, never cast (was: 1.5 -> 1, "1" -> 1.0, null -> nan,
    # true -> 1.0, 1e40 -> inf, all answered 200; an integer past INT32 answered a plain-text 500)
    "float as INT32": ("ints", {"inputs": [{**XI, "data": [1.5, 2, 3, 4]}]}, 400, ["'x'", "INT32", "1.5"]),
    "INT32 range": ("ints", {"inputs": [{**XI, "data": [1, 2, 3, 2**40]}]}, 400, ["'x'", "range", "INT32"]),
    "string as FP32": ("mlp", {"inputs": [{**X, "data": ["0.5"] * 16}]}, 400, ["'x'", "FP32", "'0.5'"]),
    "null as FP32": ("mlp", {"inputs": [{**X, "data": [None] + [0.5] * 15}]}, 400, ["'x'", "None"]),
    "bool as FP32": ("mlp", {"inputs": [{**X, "data": [True] + [0.5] * 15}]}, 400, ["'x'", "True"]),
    "FP32 range": ("mlp", {"inputs": [{**X, "data": [1e40] + [0.5] * 15}]}, 400, ["'x'", "range", "FP32"]),
    "input twice": ("ints", {"inputs": [XI, {**XI, "data": [5, 6, 7, 8]}]}, 400, ["'x'", "twice"]),
    # fields of the wrong JSON type (was: "false" read as true, a null id echoed as "None")
    "flag as string": ("ints", {"inputs": [XI], "parameters": {"binary_data_output": "false"}}, 400,
                       ["binary_data_output", "'false'"]),
    "output flag": ("ints", {"inputs": [XI], "outputs": [{"name": "y", "parameters": {"binary_data": 1}}]}, 400,
                    ["output 'y'", "binary_data"]),
    "id not a string": ("ints", {"id": None, "inputs": [XI]}, 400, ["id", "None"]),
    "nested shape": ("ints", {"inputs": [{**XI, "data": [[1, 2], [3, 4]]}]}, 400, ["'x'", "[2, 2]", "[1, 4]"]),
    # a string tensor for a float input, in the protocol's words (was: "expected a numpy.ndarray of <f4, got list")
    "BYTES nested unevenly": ("mlp", {"inputs": [{"name": "x", "shape": [2], "datatype": "BYTES",
                                                  "data": ["a", ["b"]]}]}, 400, ["'x'", "nested unevenly"]),
    "numbers as BYTES": ("mlp", {"inputs": [{"name": "x", "shape": [2], "datatype": "BYTES", "data": [1, 2]}]},
                         400, ["'x'", "BYTES data must be strings", "element 0 is 1"]),
    "BYTES as FP32": ("mlp", {"inputs": [{**X, "datatype": "BYTES", "data": ["a"] * 16}]}, 400,
                      ["'x'", "takes FP32, got BYTES"]),
    # one input's elements in two places (was: the binary ones read, "data" dropped)
    "data and binary": ("ints", {"inputs": [{**XI, "parameters": {"binary_data_size": 16}}]}, 400,
                        ["'x'", "both", "binary_data_size"]),
    # a client's mistakes that were 500s (a hostile run): data nested past any tensor's rank
    # (a RecursionError, 167 KB of traceback logged), dims past int64 or past any array's size
    "nested 500 deep": ("mlp", {"inputs": [{**X, "data": functools.reduce(lambda a, _: [a], range(500), 0.5)}]},
                        400, ["'x'", "nested deeper than"]),
    "dim past int64": ("mlp", {"inputs": [{**X, "shape": [0, 2**63], "data": []}]}, 400, ["'x'", "2**63-1"]),
    "no array that big": ("mlp", {"inputs": [{**X, "shape": [0, 2**62], "data": []}]}, 400,
                          ["'x'", "larger than any array"]),
    "binary size not a count": ("ints", {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "INT32",
                                                     "parameters": {"binary_data_size": "16"}}]}, 400,
                                ["'x'", "binary_data_size", "integer", "'16'"]),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_are_the_protocols_error_object(server, case):
    model, body, status, words = ERRORS[case]
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", **kw)
    assert r.status_code == status, r.text
    msg = r.json()["error"]
    for w in words:
        assert w in msg, (w, msg)


def test_json_data_may_hold_nan_and_infinities_as_tritonclient_sends_them(server, models):
    """tritonclient.http with binary_data=False writes NaN / Infinity / -Infinity tokens, as this
    server writes them in its own JSON outputs (was: 400 "not valid JSON": orjson refuses them)."""
    x = np.full((1, 16), 0.5, np.float32)
    x[0, :3] = [np.nan, np.inf, -np.inf]
    with thttp.InferenceServerClient(server.url.removeprefix("http://")) as c:
        inp = thttp.InferInput("x", [1, 16], "FP32")
        inp.set_data_from_numpy(x, binary_data=False)
        got = c.infer("mlp", [inp], outputs=[thttp.InferRequestedOutput("probs", binary_data=False)])
    np.testing.assert_array_equal(got.as_numpy("probs"), ort_run(models.mlp, {"x": x})["probs"])
    r = httpx.post(f"{server.url}/v2/models/mlp/infer", content=b'{"inputs": [{"name": "x", "shape": [1, 16], '
                   b'"datatype": "FP32", "data": [NaN, Infinity, -Infinity' + b", 0.5" * 13 + b"]}]}")
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/v2/models/ints/infer", content=b'{"inputs": [{"name": "x", "shape": [1, 4], '
                   b'"datatype": "INT32", "data": [NaN, 1, 2, 3]}]}')
    assert r.status_code == 400 and "INT32 data must be integers" in r.json()["error"], r.text


@pytest.mark.parametrize("client", ["http", "grpc"])
def test_no_output_named_answers_every_output(server, client):
    """`"outputs": []` over HTTP answers every output, as gRPC reads an empty list and as no
    "outputs" at all reads (was: an answer with no outputs)."""
    if client == "http":
        r = httpx.post(f"{server.url}/v2/models/mlp/infer", json={"inputs": [X], "outputs": []})
        assert r.status_code == 200, r.text
        names = [o["name"] for o in r.json()["outputs"]]
    else:
        with tgrpc.InferenceServerClient(server.grpc_url) as c:
            inp = tgrpc.InferInput("x", [1, 16], "FP32")
            inp.set_data_from_numpy(np.full((1, 16), 0.5, np.float32))
            names = [o.name for o in c.infer("mlp", [inp], outputs=[]).get_response().outputs]
            twice = [tgrpc.InferRequestedOutput("probs")] * 2
            with pytest.raises(InferenceServerException, match="more than once"):
                c.infer("mlp", [inp], outputs=twice)  # (was: answered twice)
    assert sorted(names) == ["logits", "probs"]


@pytest.mark.parametrize("path", ["/v2/models/mlp/foo/infer", "/v2/models/mlp/versions/infer",
                                  "/v2/models/mlp/ready/infer", "/v2/models/mlp/a/b/c/infer", "/v2/models/mlp/x",
                                  "/v2/health", "/v2/nope", "/metrics/x"])
def test_a_path_that_is_no_route_is_404(server, path):
    """Was: anything between a model's name and /infer was ignored (200)."""
    X1 = {"inputs": [X]}
    r = httpx.post(f"{server.url}{path}", json=X1) if path.endswith("infer") else httpx.get(f"{server.url}{path}")
    assert r.status_code == 404, r.text
    assert "no route" in r.json()["error"]


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("DELETE", "/v2/models/mlp", "GET, HEAD"), ("PUT", "/v2/models/mlp/ready", "GET, HEAD"),
    ("PATCH", "/v2", "GET, HEAD"), ("POST", "/v2/health/live", "GET, HEAD"), ("POST", "/metrics", "GET, HEAD"),
    ("GET", "/v2/models/mlp/infer", "POST"), ("PUT", "/v2/repository/index", "POST"),
    ("GET", "/v2/repository/models/mlp/load", "POST"),
])
def test_a_route_asked_with_a_method_it_does_not_take_is_405(server, method, path, allow):
    """Was: the method was read only for /metrics and inference (DELETE /v2/models/mlp: 200)."""
    r = httpx.request(method, f"{server.url}{path}")
    assert r.status_code == 405, r.text
    assert r.headers["allow"] == allow and method in r.json()["error"]
    assert httpx.request(method, f"{server.url}/v2/models/nope/ready").status_code in (404, 405)
    assert httpx.head(f"{server.url}/v2/health/live").status_code == 200


def test_a_reload_that_changes_the_signature_is_400_in_the_protocols_words(server, models):
    """The message says what differs and what to do as a client of the server (was: "pass
    allow_signature_change=True", an argument of the Python API no protocol client can send)."""
    before = httpx.get(f"{server.url}/v2/models/ints").json()["versions"]
    r = httpx.post(f"{server.url}/v2/repository/models/ints/load", json={"parameters": {"path": str(models.mlp)}},
                   timeout=60)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]
    assert "signature differs" in msg and "old model keeps serving" in msg and "allow_signature_change" not in msg
    assert httpx.get(f"{server.url}/v2/models/ints").json()["versions"] == before
    x = _feeds("ints", 2)["x"]
    body = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "INT32", "data": x.ravel().tolist()}]}
    assert httpx.post(f"{server.url}/v2/models/ints/infer", json=body).status_code == 200


@pytest.mark.parametrize("body", [{"parameters": 5}, {"parameters": ["path"]}, {"parameters": {"path": 5}}, [1],
                                  {"parameters": {"path": ""}}])  # ("": was a reload of the old file, 200)
def test_a_malformed_load_request_is_400_and_reloads_nothing(server, body):
    """Was: `"parameters": 5` answered a plain-text 500 (an AttributeError in the app)."""
    before = httpx.get(f"{server.url}/v2/models/ints").json()["versions"]
    r = httpx.post(f"{server.url}/v2/repository/models/ints/load", json=body)
    assert r.status_code == 400, r.text
    assert "parameters" in r.json()["error"] or "JSON object" in r.json()["error"]
    assert httpx.get(f"{server.url}/v2/models/ints").json()["versions"] == before


@pytest.mark.parametrize("case", ["short", "long"])
def test_binary_sizes_that_do_not_add_up_are_400(server, case):
    x = np.zeros((1, 16), np.float32)
    size = x.nbytes + (8 if case == "short" else 0)
    header = json.dumps({"inputs": [{**X, "parameters": {"binary_data_size": size}, "data": None}]}).encode()
    body = header + x.tobytes() + (b"\0" * 4 if case == "long" else b"")
    r = httpx.post(f"{server.url}/v2/models/mlp/infer", content=body,
                   headers={"Inference-Header-Content-Length": str(len(header))})
    assert r.status_code == 400
    assert "binary" in r.json()["error"]


@pytest.mark.parametrize("header", ["underscore", "plus", "negative"])
def test_header_length_is_plain_digits(server, header):
    """Was: `1_0` (and `+10`, as int() reads them) accepted as 10."""
    head = json.dumps({"inputs": [{**X, "data": None, "parameters": {"binary_data_size": 64}}]}).encode()
    n = str(len(head))
    value = {"underscore": f"{n[0]}_{n[1:]}", "plus": f"+{n}", "negative": f"-{n}"}[header]
    r = httpx.post(f"{server.url}/v2/models/mlp/infer", content=head + bytes(64),
                   headers={"Inference-Header-Content-Length": value})
    assert r.status_code == 400, r.text
    assert "Inference-Header-Content-Length" in r.json()["error"] and "digits" in r.json()["error"]


def _raw_http(server, head: bytes) -> bytes:
    """One request's head on a bare socket (no body follows), and the whole answer."""
    with socket.create_connection((server.host, server.http_port), timeout=30) as s:  # only a hang reaches it
        s.sendall(head)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer and b'"}' in answer:
                break
    return answer


@pytest.mark.parametrize("route", ["models/mlp/infer", "repository/models/ints/load"])
@pytest.mark.parametrize("how", ["content-length", "chunked", "at the limit"])
def test_a_body_past_max_request_bytes_is_413_and_never_buffered(server, route, how):
    """Was: any body read whole into memory. A declared length past the limit is refused before a
    byte of the body is read (the body here is never sent: before, the server waited for it);
    a chunked one as it passes the limit; one at the limit is read (and is not JSON: 400)."""
    if how == "content-length":
        answer = _raw_http(server, f"POST /v2/{route} HTTP/1.1\r\nHost: x\r\nContent-Length: {100 * 2**30}\r\n"
                                   "Connection: close\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        msg = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    else:
        body = [b"x" * (LIMIT // 2)] * 2 + ([b"y"] if how == "chunked" else [])
        r = httpx.post(f"{server.url}/v2/{route}", content=iter(body))  # an iterator goes out chunked
        assert r.status_code == (413 if how == "chunked" else 400), r.text
        msg = r.json()["error"]
    if how != "at the limit":
        assert "too large" in msg and f"{LIMIT} bytes" in msg and "--max-request-bytes" in msg, msg
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200


def _http_codes(server, model: str) -> dict[str, float]:
    """slabpool_serve_requests_total over HTTP for `model`, by status code (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "slabpool_serve_requests")
    return {s.labels["code"]: s.value for s in family.samples
            if s.name.endswith("_total") and s.labels["model"] == model and s.labels["transport"] == "http"}


@pytest.mark.parametrize("how", ["close", "reset"])
@pytest.mark.parametrize("length", ["content-length", "chunked"])
def test_a_client_gone_before_its_body_is_counted_cancelled_not_bad(server, length, how):
    """A request's head, then the client goes away before a byte of its body: counted 499 (the
    client went away), not 400. Was: the disconnect read as an empty body, "not valid JSON"."""
    before = _http_codes(server, "mlp")
    framing = f"Content-Length: {LIMIT}" if length == "content-length" else "Transfer-Encoding: chunked"
    with socket.create_connection((server.host, server.http_port), timeout=30) as s:
        s.sendall(f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n{framing}\r\n\r\n".encode())
        if how == "reset":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    deadline = time.monotonic() + 30  # only a hang reaches it
    while sum((after := _http_codes(server, "mlp")).values()) == sum(before.values()):
        assert time.monotonic() < deadline, "the abandoned request was never counted"
    assert {c: n - before.get(c, 0) for c, n in after.items() if n != before.get(c, 0)} == {"499": 1}


def test_a_load_whose_client_went_away_before_its_body_reloads_nothing():
    """The repository's load reads a body ({"parameters": {"path": ...}}) and then reloads: a
    client gone before its body came is not a load without parameters. Was: the disconnect read
    as an empty body, and the model reloaded from its own file. Served by HttpApp itself, its
    receive() saying what uvicorn's says when the client has gone."""
    import asyncio

    from slabpool.engine.serve.core import Frontend
    from slabpool.engine.serve.http import HttpApp
    from slabpool.engine.serve.metrics import RequestMetrics
    from slabpool.engine.serve.models import Repository

    loads: list[str] = []
    sent: list[dict[str, Any]] = []

    class Recording(Frontend):
        async def load(self, name: str, params: dict[str, Any]) -> str:
            loads.append(name)
            return "1"

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    app = HttpApp(Recording(Repository([]), RequestMetrics()), LIMIT)
    for framing in [(b"content-length", b"60"), (b"transfer-encoding", b"chunked")]:
        scope = {"type": "http", "method": "POST", "path": "/v2/repository/models/mlp/load", "headers": [framing]}
        asyncio.run(app(scope, receive, send))
    assert loads == [] and sent == []


def _grpc_raw(server, method: str, raw: bytes):
    import grpc

    unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(server.grpc_url, options=unlimited) as ch:
        call = ch.unary_unary(f"/inference.GRPCInferenceService/{method}")  # bytes as they are
        with pytest.raises(grpc.RpcError) as err:
            call(raw, timeout=30)
    return err.value


@pytest.mark.parametrize("size", [LIMIT + 1, 4 * LIMIT])
def test_a_grpc_message_past_max_request_bytes_is_resource_exhausted(server, size):
    """Was: a limit of 2 GiB, each message buffered whole. A valid message past the limit."""
    from slabpool.engine.serve.proto import grpc_predict_v2_pb2 as pb

    req = pb.ModelInferRequest(model_name="mlp", raw_input_contents=[bytes(size)])
    req.inputs.add(name="x", datatype="FP32", shape=[size // 64, 16])
    err = _grpc_raw(server, "ModelInfer", req.SerializeToString())
    assert err.code().name == "RESOURCE_EXHAUSTED" and "SERVER" in err.details(), err  # not the client's limit


@pytest.mark.parametrize("method", ["ModelInfer", "ModelMetadata", "ModelReady"])
@pytest.mark.parametrize("raw", [b"\xff\xff\xff", b"garbage bytes", b"\x0a\xff"])
def test_grpc_garbage_is_invalid_argument(server, method, raw):
    """Was: UNKNOWN (grpcio's deserializer failed), with no word of why."""
    err = _grpc_raw(server, method, raw)
    assert err.code().name == "INVALID_ARGUMENT", err
    assert f"not a inference.{method}Request message" in err.details()


def test_grpc_errors_carry_the_status_code(server):
    c = tgrpc.InferenceServerClient(server.grpc_url)
    try:
        i = tgrpc.InferInput("x", [1, 16], "FP64")
        i.set_data_from_numpy(np.zeros((1, 16), np.float64))
        with pytest.raises(InferenceServerException) as err:
            c.infer("mlp", [i])
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "float32" in err.value.message() and "'x'" in err.value.message()
        with pytest.raises(InferenceServerException) as err:
            c.infer("nope", [i])
        assert err.value.status() == "StatusCode.NOT_FOUND"
        with pytest.raises(InferenceServerException) as err:
            c.is_model_ready("nope")
        assert err.value.status() == "StatusCode.NOT_FOUND"
    finally:
        c.close()


def test_grpc_typed_contents_are_read_too(server, models):
    """A request with `contents` (not raw_input_contents), built from the protocol's messages."""
    import grpc

    from slabpool.engine.serve.proto import grpc_predict_v2_pb2 as pb

    x = _feeds("ints", 2)["x"]
    req = pb.ModelInferRequest(model_name="ints", id="typed")
    t = req.inputs.add(name="x", datatype="INT32", shape=list(x.shape))
    t.contents.int_contents.extend(x.ravel().tolist())
    with grpc.insecure_channel(server.grpc_url) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                              request_serializer=pb.ModelInferRequest.SerializeToString,
                              response_deserializer=pb.ModelInferResponse.FromString)
        resp = call(req, timeout=30)
    assert resp.id == "typed" and [o.name for o in resp.outputs] == ["y"]
    _same(np.frombuffer(resp.raw_output_contents[0], np.int32).reshape(2, 4), ort_run(models.int_model, {"x": x})["y"])


def test_metrics_count_requests_by_model_transport_and_code(server):
    with httpx.Client(base_url=server.url) as h:
        h.post("/v2/models/mlp/infer", json={"inputs": [X]})
        h.post("/v2/models/mlp/infer", json={"inputs": [{**X, "datatype": "FP64"}]})
        text = h.get("/metrics").text
    assert 'slabpool_serve_requests_total{code="200",model="mlp",transport="http"}' in text
    assert 'slabpool_serve_requests_total{code="400",model="mlp",transport="http"}' in text
    assert 'slabpool_serve_request_seconds_bucket{le="0.001",model="mlp",transport="http"}' in text
    assert 'slabpool_worker_restarts_total{model="mlp",slot="0"}' in text
    assert 'slabpool_tasks_completed_total{model="multi_io"}' in text


@pytest.mark.parametrize("created", [True, False])
def test_request_metrics_text_is_prometheus_clients_own(created, monkeypatch):
    """The request families are counted in plain lists and built at /metrics (metrics.py); their
    text is what prometheus_client's own Counter and Histogram write for the same requests (the
    `_created` timestamps aside, and without them when they are turned off): values on a
    bucket's bound, under the first, past the last, series by model, transport and code."""
    import re

    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client import metrics as client_metrics

    from slabpool.engine.serve.metrics import BUCKETS, RequestMetrics

    monkeypatch.setattr(client_metrics, "_use_created", created)  # as disable_created_metrics() sets it
    reg = CollectorRegistry(auto_describe=True)
    count = Counter("slabpool_serve_requests", "Requests answered, by model, transport and status code.",
                    ["model", "transport", "code"], registry=reg)
    latency = Histogram("slabpool_serve_request_seconds",
                        "Seconds from a request's arrival to its answer, by model and transport.",
                        ["model", "transport"], buckets=BUCKETS, registry=reg)
    ours = RequestMetrics()
    seen = [("mlp", "http", "200", v) for v in (BUCKETS[0], BUCKETS[0] / 2, BUCKETS[3], BUCKETS[3] * 1.01,
                                                BUCKETS[-1] * 2)]
    seen += [("", "grpc", "INTERNAL", 0.25), ("mlp", "http", "400", 0.001), ("mlp", "grpc", "OK", 0.0)]
    for model, transport, code, v in seen:
        ours.observe(model, transport, code, v)
        count.labels(model, transport, code).inc()
        latency.labels(model, transport).observe(v)

    def text(raw: bytes) -> str:
        return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", raw.decode())

    assert text(ours.render()) == text(generate_latest(reg))
    assert ("_created{" in text(ours.render())) is created


def _binary_body(x: np.ndarray, extra: dict[str, Any] | None = None, inputs: list[Any] | None = None) -> tuple[bytes, bytes]:
    head = json.dumps({"inputs": inputs or [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                             "parameters": {"binary_data_size": x.nbytes}}], **(extra or {})}).encode()
    return head + x.tobytes(), b"%d" % len(head)


def test_a_binary_header_read_once_gives_each_request_its_own_tensors_and_checks():
    """A binary request's JSON header is read and checked once (http._Plan): the same header
    again reads only the tensors, the new bytes each time (never the first request's), checked
    against their sizes as the full path checks them; its outputs list is the request's own."""
    from slabpool.engine.serve import http

    http._PLANS.clear()
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    extra = {"id": "r", "outputs": [{"name": "probs", "parameters": {"binary_data": True}}],
             "parameters": {"binary_data_output": True, "timeout": 5000}}
    body, n = _binary_body(a, extra)
    first = http.decode_request("mlp", "", body, n)
    assert len(http._PLANS) == 1
    for k in range(3):
        b = a + k + 1
        again = http.decode_request("mlp", "", body[: int(n)] + b.tobytes(), n)
        assert again.inputs["x"].tobytes() == b.tobytes() and first.inputs["x"].tobytes() == a.tobytes()
        assert (again.id, again.outputs, again.binary_outputs, again.timeout) == \
            (first.id, first.outputs, first.binary_outputs, first.timeout)
        assert again.outputs is not first.outputs
    assert len(http._PLANS) == 1
    head = body[: int(n)]
    for blob, why in [(a.tobytes()[:-4], "runs past the 60 bytes"), (a.tobytes() + b"xx", "2 bytes of binary data after")]:
        with pytest.raises(http.BadRequest, match=why):
            http.decode_request("mlp", "", head + blob, n)
    http._PLANS.clear()
    with pytest.raises(http.BadRequest, match=r"runs past the 60 bytes"):  # the full path says the same
        http.decode_request("mlp", "", head + a.tobytes()[:-4], n)
    assert not http._PLANS  # a refused request leaves no plan


def test_headers_with_json_data_or_bytes_are_read_every_time_and_the_plans_stay_bounded():
    from slabpool.engine.serve import http

    http._PLANS.clear()
    a = np.ones((1, 16), np.float32)
    mixed = [{"name": "x", "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": 64}},
             {"name": "y", "shape": [1], "datatype": "INT64", "data": [3]}]
    body, n = _binary_body(a, inputs=mixed)
    assert http.decode_request("mlp", "", body, n).inputs["y"].tolist() == [3]
    strings = [{"name": "s", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 6}}]
    body, n = _binary_body(np.frombuffer(struct.pack("<I", 2) + b"hi", np.uint8), inputs=strings)
    assert http.decode_request("mlp", "", body, n).inputs["s"] == [b"hi"]
    assert not http._PLANS
    for rows in range(1, http._MAX_PLANS + 2):
        x = np.zeros((rows, 16), np.float32)
        assert http.decode_request("mlp", "", *_binary_body(x)).inputs["x"].shape == (rows, 16)
        assert len(http._PLANS) <= http._MAX_PLANS
    assert len(http._PLANS) == 1  # (cleared when full, then refilled)


def test_bytes_length_prefix_codec_round_trips():
    from slabpool.engine.serve import tensors

    items = [b"", b"a", "h\u00e9".encode(), b"\x00" * 300]
    raw = tensors.to_bytes(np.array(items, dtype=object))
    assert raw[:4] == struct.pack("<I", 0)
    assert tensors.from_buffer("s", "BYTES", (2, 2), raw) == items


_ARRAYS = {
    "BOOL": np.array([[True, False, True]]), "UINT8": np.arange(6, dtype=np.uint8).reshape(2, 3),
    "UINT16": np.arange(4, dtype=np.uint16), "UINT32": np.arange(4, dtype=np.uint32),
    "UINT64": np.array([2**63 + 5], dtype=np.uint64), "INT8": np.array([-128, 127], dtype=np.int8),
    "INT16": np.array([-3, 3], dtype=np.int16), "INT32": np.array([[-7], [7]], dtype=np.int32),
    "INT64": np.array([-(2**62)], dtype=np.int64), "FP16": np.array([0.5, -2.0], dtype=np.float16),
    "FP32": np.array([[1.5, np.inf]], dtype=np.float32), "FP64": np.array([np.pi], dtype=np.float64),
}


@pytest.mark.parametrize("datatype", list(_ARRAYS))
def test_every_datatype_round_trips_raw_and_as_json(datatype):
    from slabpool.engine.serve import tensors

    arr = _ARRAYS[datatype]
    assert tensors.datatype_of(arr.dtype) == datatype
    raw = tensors.to_bytes(tensors.as_output("t", arr))
    got = tensors.from_buffer("t", datatype, arr.shape, raw)
    assert got.dtype == arr.dtype and got.tobytes() == arr.tobytes() and not got.flags.writeable  # a view
    listed = tensors.to_list("t", arr).tolist()
    assert tensors.from_list("t", datatype, arr.shape, listed).tobytes() == arr.tobytes()


REFUSED = [  # (datatype, data): a value that is not one of the datatype, or past its range
    ("BOOL", [1, 0]), ("BOOL", ["true", False]), ("INT8", [300, 0]), ("UINT8", [-1, 0]), ("INT16", [1.0, 2]),
    ("UINT32", [True, 1]), ("INT64", [2**63, 0]), ("UINT64", [2**64, 0]), ("INT32", [None, 1]),
    ("FP16", [70000.0, 0]), ("FP32", [-1e39, 0]), ("FP32", [10**400, 0]), ("FP64", ["1", 0]), ("FP32", [[1], 2]),
    # the fast checks (a set of element types; the range by min/max): a NaN first makes min/max NaN,
    # a bool among floats is one more type in the set
    ("FP32", [float("nan"), 1e39]), ("FP16", [float("nan"), -70000.0]), ("FP32", [1.5, True]),
]


@pytest.mark.parametrize(("datatype", "data"), REFUSED, ids=[f"{d}-{v[0]!r}"[:24] for d, v in REFUSED])
def test_data_that_is_not_of_its_datatype_is_refused_not_cast(datatype, data):
    from slabpool.engine.serve import tensors
    from slabpool.engine.serve.errors import BadRequest

    with pytest.raises(BadRequest, match=f"input 'x': .*{datatype}|input 'x': .*data"):
        tensors.from_list("x", datatype, (2,), data)


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**30])
def test_an_integer_past_64_bits_in_json_is_out_of_range_not_a_float(value):
    """orjson reads an integer past 64 bits as a float: the message says which it was (was:
    "must be integers; element 0 is 1.8e+19 (float)")."""
    from slabpool.engine.serve import http as serve_http
    from slabpool.engine.serve.errors import BadRequest

    body = b'{"inputs":[{"name":"x","shape":[2],"datatype":"UINT64","data":[%d,1]}]}' % value
    with pytest.raises(BadRequest, match=r"input 'x': element 0 .* is out of range for UINT64 .*past 64 bits"):
        serve_http.decode_request("m", "", body, None)


def test_nan_and_infinity_given_are_kept_not_refused():
    from slabpool.engine.serve import tensors

    got = tensors.from_list("x", "FP32", (4,), [float("nan"), float("inf"), -float("inf"), 3.4e38])
    assert np.isnan(got[0]) and list(got[1:3]) == [np.inf, -np.inf] and got[3] == np.float32(3.4e38)


def test_grpc_typed_contents_out_of_range_are_refused():
    """int_contents carries INT8/INT16 as int32: a value past the datatype's range is refused."""
    from slabpool.engine.serve import grpc as serve_grpc
    from slabpool.engine.serve.errors import BadRequest
    from slabpool.engine.serve.proto import grpc_predict_v2_pb2 as pb

    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="x", datatype="INT8", shape=[2]).contents.int_contents.extend([300, 1])
    with pytest.raises(BadRequest, match="out of range for INT8"):
        serve_grpc.decode_request(req, None)


@pytest.mark.parametrize("how", ["grpc-raw", "http-binary"])
def test_bool_bytes_other_than_0_and_1_are_refused(how):
    """The protocol's BOOL is one byte, 0 or 1 (was: 2 and 255 went to the model as they were,
    and a Not of them answered true)."""
    from slabpool.engine.serve import grpc as serve_grpc
    from slabpool.engine.serve import http as serve_http
    from slabpool.engine.serve.errors import BadRequest
    from slabpool.engine.serve.proto import grpc_predict_v2_pb2 as pb

    def decode(raw: bytes) -> Any:
        if how == "grpc-raw":
            req = pb.ModelInferRequest(model_name="m", raw_input_contents=[raw])
            req.inputs.add(name="b", datatype="BOOL", shape=[4])
            return serve_grpc.decode_request(req, None).inputs["b"]
        head = json.dumps({"inputs": [{"name": "b", "shape": [4], "datatype": "BOOL",
                                       "parameters": {"binary_data_size": 4}}]}).encode()
        return serve_http.decode_request("m", "", head + raw, b"%d" % len(head)).inputs["b"]

    with pytest.raises(BadRequest, match=r"input 'b': .*0 \(false\) or 1 \(true\); element 2 is 255"):
        decode(bytes([1, 0, 255, 1]))
    assert decode(bytes([1, 0, 0, 1])).tolist() == [True, False, False, True]


def test_grpc_contents_in_two_places_or_the_wrong_field_are_refused():
    """Was: typed contents beside raw_input_contents, or in a field of another datatype, were
    dropped without a word (the second: "holds 16 elements, got 0")."""
    from slabpool.engine.serve import grpc as serve_grpc
    from slabpool.engine.serve.errors import BadRequest
    from slabpool.engine.serve.proto import grpc_predict_v2_pb2 as pb

    x = np.arange(4, dtype=np.float32)
    both = pb.ModelInferRequest(model_name="m", raw_input_contents=[x.tobytes()])
    both.inputs.add(name="x", datatype="FP32", shape=[4]).contents.fp32_contents.extend(x.tolist())
    with pytest.raises(BadRequest, match=re.escape("input 'x' has both raw_input_contents and contents.fp32_contents")):
        serve_grpc.decode_request(both, None)
    for extra in (True, False):
        wrong = pb.ModelInferRequest(model_name="m")
        t = wrong.inputs.add(name="x", datatype="FP32", shape=[4])
        if extra:
            t.contents.fp32_contents.extend(x.tolist())
        t.contents.int_contents.extend([1, 2, 3, 4])
        with pytest.raises(BadRequest, match=re.escape("FP32 takes its elements in contents.fp32_contents, "
                                                       "got contents.int_contents")):
            serve_grpc.decode_request(wrong, None)


@pytest.mark.parametrize(("kind", "value"), [("string_param", "soon"), ("int64_param", -5), ("bool_param", True),
                                             ("double_param", -0.5), ("double_param", float("nan"))])
def test_grpc_timeout_parameter_is_checked_as_http_checks_it(kind, value):
    """Was: a string answered UNKNOWN (a TypeError), a negative or `true` timeout a 504."""
    from slabpool.engine.serve import grpc as serve_grpc
    from slabpool.engine.serve.errors import BadRequest
    from slabpool.engine.serve.proto import grpc_predict_v2_pb2 as pb

    req = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\0" * 4])
    req.inputs.add(name="x", datatype="INT32", shape=[1])
    ok = pb.ModelInferRequest()
    ok.CopyFrom(req)
    setattr(req.parameters["timeout"], kind, value)
    with pytest.raises(BadRequest, match=r"parameters\.timeout must be microseconds"):
        serve_grpc.decode_request(req, None)
    ok.parameters["timeout"].int64_param = 250_000
    assert serve_grpc.decode_request(ok, None).timeout == 0.25
    assert serve_grpc.decode_request(ok, 0.1).timeout == 0.1  # the tighter of it and the deadline


def test_grpc_input_given_twice_is_refused():
    """Two tensors of one name: 400, not the last one silently run (raw and typed contents)."""
    from slabpool.engine.serve import grpc as serve_grpc
    from slabpool.engine.serve.errors import BadRequest
    from slabpool.engine.serve.proto import grpc_predict_v2_pb2 as pb

    raw = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\0" * 4, b"\1" * 4])
    typed = pb.ModelInferRequest(model_name="m")
    for req in (raw, typed):
        for _ in range(2):
            t = req.inputs.add(name="x", datatype="INT32", shape=[1])
            if req is typed:
                t.contents.int_contents.append(1)
        with pytest.raises(BadRequest, match="input 'x' is given twice"):
            serve_grpc.decode_request(req, None)


def test_a_postprocess_list_of_strings_keeps_every_byte():
    """A postprocess returns strings as a list (an object array cannot cross shared memory):
    each goes out whole (was: numpy's fixed-width S/U strings dropped trailing NULs, b"\\x00"
    came back as b"")."""
    from slabpool.engine.serve import tensors

    words = [b"a\x00b", b"\x00", b"pb\x08\x00", b""]
    arr = tensors.as_output("s", words)
    assert arr.dtype == object and list(arr) == words
    assert tritonclient_bytes(tensors.to_bytes(arr)) == words
    nested = tensors.as_output("t", [["x\x00", "y"], ["", "\x00"]])
    assert nested.shape == (2, 2) and nested.tolist() == [["x\x00", "y"], ["", "\x00"]]


def test_string_outputs_go_out_as_bytes_json_and_binary():
    from slabpool.engine.serve.core import InferResponse, OutputTensor
    from slabpool.engine.serve.http import encode_response

    words = np.array([["a", "bé"], ["", "c"]], dtype=object)
    resp = InferResponse("m", "v", "i", [OutputTensor("s", "BYTES", [2, 2], words, False),
                                          OutputTensor("b", "BYTES", [2, 2], words, True)])
    body, n = encode_response(resp)
    assert n is not None
    head = json.loads(body[:n])
    assert head["outputs"][0]["data"] == ["a", "bé", "", "c"]
    assert head["outputs"][1]["parameters"]["binary_data_size"] == len(body) - n
    assert tritonclient_bytes(body[n:]) == [b"a", "bé".encode(), b"", b"c"]


@pytest.mark.parametrize("size", [4, 5000])  # a list up to 4096 elements, numpy's check past it
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nan_and_infinities_go_out_as_json_tokens_python_reads(dtype, size):
    """Was: null (orjson), which reads back as no number. NaN, Infinity, -Infinity: json.loads
    (and tritonclient.http) reads them back as the same values of the datatype."""
    from slabpool.engine.serve import tensors
    from slabpool.engine.serve.core import InferResponse, OutputTensor
    from slabpool.engine.serve.http import encode_response

    arr = np.full((2, size // 2), 0.1, dtype=dtype)
    arr[0, :2], arr[1, 0] = [np.nan, np.inf], -np.inf
    big = np.full(size, np.finfo(dtype).max, dtype=dtype)  # finite; their sum is not
    datatype = tensors.datatype_of(arr.dtype)
    body, n = encode_response(InferResponse("m", "v", "", [OutputTensor("f", datatype, list(arr.shape), arr, False),
                                                          OutputTensor("g", datatype, [1], arr[1, 1:2], False),
                                                          OutputTensor("h", datatype, [size], big, False)]))
    assert n is None and b"null" not in body
    outs = json.loads(body)["outputs"]
    assert np.asarray(outs[0]["data"], dtype).reshape(arr.shape).tobytes() == arr.tobytes()
    assert np.asarray(outs[1]["data"], dtype).tobytes() == arr[1, 1:2].tobytes()
    assert np.asarray(outs[2]["data"], dtype).tobytes() == big.tobytes()


def test_nan_outputs_read_back_through_tritonclient_json(server, models):
    """An input of infinities (sent binary) makes the MLP's outputs NaN; asked as JSON they read back
    through tritonclient (an end-to-end check: tritonclient read null as NaN too; infinities it
    could not, which the test above covers)."""
    x = np.full((2, 16), np.inf, np.float32)
    x[1] = -np.inf
    want = ort_run(models.mlp, {"x": x})
    c = thttp.InferenceServerClient(server.url[7:])
    try:
        i = thttp.InferInput("x", [2, 16], "FP32")
        i.set_data_from_numpy(x)
        res = c.infer("mlp", [i], outputs=[thttp.InferRequestedOutput(n, binary_data=False) for n in want])
    finally:
        c.close()
    for name, w in want.items():
        assert not np.isfinite(w).all()  # the case is the one it claims
        got = res.as_numpy(name).astype(np.float32)
        assert np.array_equal(got, w, equal_nan=True), (name, got, w)


def test_bytes_that_are_not_utf8_are_refused_as_json_and_go_out_binary():
    """Was: decoded with errors="replace", the bytes silently changed."""
    from slabpool.engine.serve.core import InferResponse, OutputTensor
    from slabpool.engine.serve.errors import BadRequest
    from slabpool.engine.serve.http import encode_response

    for bad in ([b"ok", b"\xff\xfe"], [b"\xc3"], [b"a", b"b", "é".encode("latin-1")]):
        words = np.array(bad, dtype=object)
        with pytest.raises(BadRequest, match=r"output 's': BYTES element \d+ .* not UTF-8.*binary_data"):
            encode_response(InferResponse("m", "v", "", [OutputTensor("s", "BYTES", [len(bad)], words, False)]))
        body, n = encode_response(InferResponse("m", "v", "", [OutputTensor("s", "BYTES", [len(bad)], words, True)]))
        assert n is not None and tritonclient_bytes(body[n:]) == bad


def tritonclient_bytes(raw: bytes) -> list[bytes]:
    """tritonclient's own reader of the BYTES binary format."""
    from tritonclient.utils import deserialize_bytes_tensor

    return list(deserialize_bytes_tensor(raw))


# -- the repository extension over gRPC (Triton's RepositoryIndex / ModelLoad / ModelUnload) ---------------


def _grpc_load(server, name: str, **params) -> None:
    """RepositoryModelLoad with parameters tritonclient's load_model cannot send (path, an int),
    through tritonclient's own stub and messages."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    req = service_pb2.RepositoryModelLoadRequest(model_name=name)
    for k, v in params.items():
        if isinstance(v, str):
            req.parameters[k].string_param = v
        else:
            req.parameters[k].int64_param = v
    import grpc

    with grpc.insecure_channel(server.grpc_url) as ch:
        service_pb2_grpc.GRPCInferenceServiceStub(ch).RepositoryModelLoad(req, timeout=60)


def test_grpc_repository_index_and_refusals_through_tritonclient(server, models):
    """Was: UNIMPLEMENTED for all three calls. The index lists every model (ready only, if
    asked), as HTTP's does; unload is refused as on HTTP; a load that cannot be done is refused
    by the status HTTP gives it, and the model keeps its version."""
    import grpc

    c = tgrpc.InferenceServerClient(server.grpc_url)
    try:
        index = c.get_model_repository_index(as_json=True)["models"]
        http_index = httpx.post(f"{server.url}/v2/repository/index").json()
        assert sorted((m["name"], m["version"], m["state"]) for m in index) == sorted(
            (m["name"], m["version"], m["state"]) for m in http_index)
        assert {m["state"] for m in c.get_model_repository_index(as_json=True)["models"]} == {"READY"}
        before = c.get_model_metadata("ints", as_json=True)["versions"]
        cases = [
            (lambda: c.unload_model("ints"), "INVALID_ARGUMENT", "unload is not supported"),
            (lambda: c.load_model("nope"), "NOT_FOUND", "unknown model 'nope'"),
            (lambda: c.load_model("ints", config='{"backend": "onnx"}'), "INVALID_ARGUMENT", "['config']"),
            (lambda: _grpc_load(server, "ints", path=5), "INVALID_ARGUMENT", "parameters.path must be a model file's path"),
            (lambda: _grpc_load(server, "ints", path=str(models.mlp)), "INVALID_ARGUMENT", "old model keeps serving"),
        ]
        for call, code, words in cases:
            with pytest.raises((InferenceServerException, grpc.RpcError)) as err:
                call()
            e = err.value
            got = (str(e.status()), e.message()) if isinstance(e, InferenceServerException) else (str(e.code()), e.details())
            assert got[0].endswith(code) and words in got[1], got
        assert c.get_model_metadata("ints", as_json=True)["versions"] == before and c.is_model_ready("ints")
    finally:
        c.close()


# -- HTTP/1.1 itself (uvicorn's, as serve configures it) -------------------------------------------------


def _exchange(server, data: bytes, answers: int) -> list[tuple[bytes, bytes]]:
    """Send raw bytes on one connection; read `answers` answers (status line + headers, body)."""
    with socket.create_connection((server.host, server.http_port), timeout=30) as s:  # only a hang reaches it
        s.sendall(data)
        return read_answers(s, answers)


def _infer_bytes(rows: int, extra: str = "") -> bytes:
    x = np.arange(rows * 16, dtype=np.float32).reshape(rows, 16) / 100
    body = json.dumps({"inputs": [{"name": "x", "shape": [rows, 16], "datatype": "FP32",
                                   "data": x.ravel().tolist()}], "id": f"r{rows}"}).encode()
    return (f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n{extra}Content-Length: {len(body)}\r\n\r\n"
            .encode() + body)


@pytest.mark.parametrize("case", ["pipelined", "expect-100", "http/1.0", "HEAD", "query string", "large head",
                                  "garbage"])
def test_http11_connection_behaviours(server, case):
    """HTTP/1.1 as uvicorn (httptools) serves the app: pipelined requests answered in order on one
    connection; Expect: 100-continue answered before the body; HTTP/1.0 closes after its answer;
    HEAD answers headers without the body (the next answer on the connection is whole); a query
    string is not part of the path; bytes that are not HTTP 400 (uvicorn's plain-text answer,
    the connection closed). A 70 KB head is served: RFC 9112 sets no limit on a head (a server
    MAY refuse one it will not process, 431); uvicorn's httptools path sets none either."""
    if case == "pipelined":
        got = _exchange(server, b"".join(_infer_bytes(r) for r in (1, 2, 3)) + b"GET /v2/health/live HTTP/1.1\r\n\r\n", 4)
        assert [json.loads(b)["id"] for _, b in got[:3]] == ["r1", "r2", "r3"]
        assert [len(json.loads(b)["outputs"][0]["data"]) for _, b in got[:3]] == [8, 16, 24]
        assert json.loads(got[3][1]) == {"live": True}
    elif case == "expect-100":
        got = _exchange(server, _infer_bytes(2, "Expect: 100-continue\r\n"), 2)
        assert got[0][0].startswith(b"HTTP/1.1 100") and got[1][0].startswith(b"HTTP/1.1 200")
    elif case == "http/1.0":
        answer = _raw_http(server, b"GET /v2/health/ready HTTP/1.0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer.lower()
    elif case == "HEAD":
        with socket.create_connection((server.host, server.http_port), timeout=30) as s:
            s.sendall(b"HEAD /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\nGET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            buf = b""
            while buf.count(b"HTTP/1.1 200") < 2 or not buf.endswith(b"}"):
                buf += s.recv(65536)
        first, second = buf.split(b"HTTP/1.1 200")[1:]
        assert first.endswith(b"\r\n\r\n") and b"content-length: 13" in first.lower()
        assert second.endswith(b'{"live":true}')
    elif case == "query string":
        (head, body), = _exchange(server, b"GET /v2/models/mlp/ready?x=1 HTTP/1.1\r\nHost: x\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"name": "mlp", "ready": True}
    elif case == "large head":
        (head, body), = _exchange(server, b"GET /v2 HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["name"] == "slabpool"
    else:
        (head, body), = _exchange(server, b"\x16\x03\x01 not http\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 400") and b"connection: close" in head.lower() and b"Invalid HTTP" in body
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200


@pytest.mark.parametrize("bad", [b"\x16\x03\x01 not http\r\n\r\n", b"GET /v2 HTTP/1.1\r\nBad Header\r\n\r\n",
                                 b"POST /v2/models/mlp/infer HTTP/1.1\r\nContent-Length: x\r\n\r\n"],
                         ids=["not-http", "bad-header", "bad-length"])
@pytest.mark.parametrize("before", [1, 3])
def test_a_bad_request_pipelined_after_good_ones_is_answered_after_them(server, before, bad):
    """Good requests then bytes the parser refuses, in one send: each good request gets its own
    answer, in order, then uvicorn's 400 and the connection's end. Was: the 400 at once, read by
    the client as its first request's answer, and the good answers lost."""
    good = [_infer_bytes(r) for r in range(1, before + 1)]
    with socket.create_connection((server.host, server.http_port), timeout=30) as s:  # only a hang reaches it
        s.sendall(b"".join(good) + bad)
        buf = b""
        while chunk := s.recv(65536):  # the server closes the connection after its 400
            buf += chunk
    answers = buf.split(b"HTTP/1.1 ")[1:]
    assert len(answers) == before + 1, buf[:300]
    for rows, answer in enumerate(answers[:-1], start=1):
        head, body = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"200") and json.loads(body)["id"] == f"r{rows}"
    assert answers[-1].startswith(b"400") and answers[-1].endswith(b"Invalid HTTP request received.")


@pytest.mark.parametrize("chunks", [b"ZZ\r\n", b"5\r\n{\"inp\r\nZZ\r\n", b"5\r\n{\"inpXX"])
def test_bad_chunk_framing_is_its_requests_400_at_once(server, chunks):
    """Bytes the parser refuses inside a request's own chunked body are that request's: its 400
    at once and the connection's end, never a wait for the rest of a body that cannot come."""
    with socket.create_connection((server.host, server.http_port), timeout=30) as s:  # only a hang reaches it
        s.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    assert buf.startswith(b"HTTP/1.1 400") and buf.endswith(b"Invalid HTTP request received."), buf


def _writes(pid: int) -> int:
    """Write syscalls (write, writev, ...) the process's main thread has made: the kernel's count."""
    io = open(f"/proc/{pid}/task/{pid}/io").read()  # the event loop's thread is the main thread
    return int(next(line for line in io.splitlines() if line.startswith("syscw:")).split()[1])


@pytest.mark.parametrize("request_line", [
    b"GET /v2/health/live", b"GET /v2/health/ready", b"GET /v2", b"GET /v2/models/mlp", b"GET /v2/models/mlp/ready",
    b"GET /v2/models/nope/ready", b"GET /metrics",
])
def test_each_answer_leaves_in_one_write(server, request_line):
    """An answer's head and body go out in one write (uvproto.py), not one each (uvicorn's own
    protocol: 2 per answer): counted by the kernel for the server's event loop thread, over
    answers of every kind that touch no engine (an inference also wakes the owner thread,
    another write): constant bytes, JSON built per request, a 404 error, the metrics text."""
    n = 20
    with socket.create_connection((server.host, server.http_port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(n + 1):
            if i == 1:  # the connection is up and one answer is out: count from here
                before = _writes(server.proc.pid)
            s.sendall(request_line + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += s.recv(65536)
            head, body = buf.split(b"\r\n\r\n", 1)
            length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
            while len(body) < length:
                body += s.recv(65536)
        assert _writes(server.proc.pid) - before == n


@pytest.mark.parametrize("sizes", [(13,), (120, 900), (120, 3 * 2**20), (5, 6, 7, 70_000)])
def test_joined_writes_hold_until_flushed_and_lose_nothing(sizes):
    """uvproto.JoinedWrites on a real uvloop transport: what is written is held (nothing on the
    socket yet), then leaves whole and in order at the loop's next turn (a lone interim line,
    a streamed chunk: nothing waits past it), large ones by writelines; what is written just
    before close() is flushed before the connection ends."""
    import asyncio

    import uvloop

    from slabpool.engine.serve.uvproto import JoinedWrites

    parts = [bytes([65 + i]) * n for i, n in enumerate(sizes)]

    async def read(sock: socket.socket, n: int) -> bytes:
        got = b""
        while len(got) < n:
            chunk = await asyncio.get_running_loop().sock_recv(sock, 2**20)
            assert chunk, got[-50:]
            got += chunk
        return got

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ours, peer = socket.socketpair()
        peer.setblocking(False)
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
        joined = JoinedWrites(transport, loop)  # type: ignore[arg-type]
        for part in parts:
            joined.write(part)
        with pytest.raises(BlockingIOError):
            peer.recv(1)  # held
        assert await read(peer, sum(sizes)) == b"".join(parts)
        joined.write(b"last")
        joined.close()
        assert await read(peer, 4) == b"last"
        assert await loop.sock_recv(peer, 10) == b""  # then the end of the connection
        peer.close()

    uvloop.run(main())


@pytest.mark.parametrize("how", ["close", "shutdown-write", "reset"])
def test_the_protocol_tells_a_waiting_app_its_client_went_away(how):
    """uvproto's DISCONNECT extension, on serve's own uvicorn setup: an app waiting on a request
    (nothing read from receive() after the body, no watcher task) has its callback called when
    the client closes, half-closes or resets the connection; a request answered first leaves
    no callback behind."""
    import asyncio
    import threading

    from slabpool.engine.serve.uvproto import DISCONNECT

    told = threading.Event()
    waiting = threading.Event()
    registered: list[list[Any]] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        on_lost = scope["extensions"][DISCONNECT]
        registered.append(on_lost)
        if scope["path"] == "/quick":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        gone = asyncio.Event()
        on_lost.append(gone.set)
        waiting.set()
        await gone.wait()
        on_lost.remove(gone.set)
        told.set()

    with _in_process(app) as where:
        assert _exchange(where, b"GET /quick HTTP/1.1\r\nHost: x\r\n\r\n", 1)[0][1] == b"ok"
        c = socket.create_connection(("127.0.0.1", where.http_port), timeout=30)
        c.sendall(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        assert waiting.wait(30)  # only a deadlock reaches these timeouts
        if how == "reset":
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if how == "shutdown-write":
            c.shutdown(socket.SHUT_WR)
        else:
            c.close()
        assert told.wait(30)
        c.close()
        assert registered[0] == []  # the quick request's connection: nothing left to call


class _Broken:
    """A front end with a bug in two routes (a fault at a chosen stage: the sync metadata route,
    and the repository index, which reads a body first); every other route is the real one."""

    def server_metadata(self):
        raise RuntimeError("a bug in server_metadata")

    def repository_index(self, ready_only=False):
        raise KeyError("a bug in repository_index")


def test_a_route_that_raises_answers_500_and_the_connection_lives_on():
    """Was (uvicorn's own answer to an app that raises): 500 text/plain and the connection
    closed. The app answers the protocol's error object, and the next request on the same
    connection is answered; served by serve's own uvicorn setup (server.http_server)."""


    from slabpool.engine.serve.core import Frontend
    from slabpool.engine.serve.http import HttpApp
    from slabpool.engine.serve.metrics import RequestMetrics
    from slabpool.engine.serve.models import Repository

    fe = type("BrokenFrontend", (_Broken, Frontend), {})(Repository([]), RequestMetrics())
    with _in_process(HttpApp(fe, LIMIT)) as where:
        live = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
        got = _exchange(where, b"GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n" + live
                        + b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}" + live, 4)
        for (head, body), bug in zip(got[::2], ["RuntimeError('a bug in server_metadata')",
                                                "KeyError('a bug in repository_index')"], strict=True):
            assert head.startswith(b"HTTP/1.1 500") and b"connection: close" not in head.lower()
            assert json.loads(body) == {"error": f"internal error: {bug}"}
        assert [json.loads(b) for _, b in got[1::2]] == [{"live": True}] * 2
