"""The docs cannot drift: every path and module they name exists, and every example runs.

README.md and docs/*.md are read block by block. A ```python block runs as a script in a
temporary folder that holds the files the docs name (`model.onnx`: the bundled demo, input
`image` [?, 3, 112, 112]; `mlp.onnx`: input `x` [?, 16]; `in.npy`, `photos/`, `table.parquet`,
`in.csv`, `items.jsonl.gz`); a python block whose first line is a file name (`# mypkg/io.py`)
is written to that file instead (appended to it when an earlier block wrote it), for the
commands after it. A shell block that holds a `slabpool run|inspect|doctor|bench` command (or
`python -m slabpool`) runs line by line in bash. Blocks that cannot run here carry, on the
line before their fence, `<!-- docs-test: skip (why) -->`; `<!-- docs-test: model.onnx=mlp -->`
puts the MLP at `model.onnx` for that block (`=houses`: the 5-feature MLP of houses.csv).
"""

from __future__ import annotations

import gzip
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.models import onnx_models

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<what>.*?)\s*-->\s*$")
COMMAND = re.compile(r"(^|[|;&]\s*)(slabpool (run|inspect|doctor|bench)(?=\s|$)|python -m slabpool\b)", re.M)
FILE_HEADER = re.compile(r"^# (?P<path>[\w./-]+\.py)\b")
SHELL = ("", "sh", "bash", "shell", "console")
BLOCK_TIMEOUT_S = 180  # only a hang reaches it


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    directive: str  # '' or what the docs-test comment before the fence says

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    @property
    def skip(self) -> str | None:
        return self.directive[len("skip"):].strip(" ()") or "no reason given" if self.directive.startswith("skip") else None

    @property
    def file(self) -> str | None:
        """The file a python block is (its first line names it), or None: a script."""
        m = FILE_HEADER.match(self.text)
        return m.group("path") if self.lang == "python" and m else None

    @property
    def runs(self) -> bool:
        return (self.lang == "python" and self.file is None) or (self.lang in SHELL and bool(COMMAND.search(self.text)))


def blocks(doc: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with the docs-test directive before each."""
    lines = doc.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = len(m.group("indent")), i
        body = []
        i += 1
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append(lines[i][indent:])
            i += 1
        before = DIRECTIVE.match(lines[start - 1]) if start else None
        found.append(Block(doc, start + 1, m.group("lang"), "\n".join(body) + "\n",
                           before.group("what") if before else ""))
        i += 1
    return found


def _all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in blocks(doc)]


# -- references ---------------------------------------------------------------------------------

PATH = re.compile(r"(?<![\w./-])((?:\.\./)*(?:engine|workers|shm|tests|bench|docs|examples|notes|slabpool)/[\w./{},-]*\w\}?)")
NAME = re.compile(r"(?<![\w.])(slabpool(?:\.\w+)+)")
SOURCES = [*DOCS, *(p for d in ("engine", "workers", "shm", "examples", "bench", "tests") for p in sorted((REPO / d).rglob("*.py")))]
NOT_NAMES = {"slabpool.schema", "slabpool.X", "slabpool.engine.serve.access"}  # a Parquet metadata key; a placeholder; a logger
NOT_PATHS = {"workers/actors"}  # prose: "its workers/actors"


def _expand(ref: str) -> list[str]:
    """`bench/results/latest.{md,json}` -> both names."""
    m = re.search(r"\{([^}]*)\}", ref)
    if not m:
        return [ref]
    return [x for alt in m.group(1).split(",") for x in _expand(ref[: m.start()] + alt + ref[m.end():])]


def _path_exists(ref: str, base: Path) -> bool:
    for cand in (REPO / ref, base / ref):
        if cand.exists():
            return True
        stem, dot, _ = cand.name.rpartition(".")  # workers/protocol.Chunk: a module and its attribute
        if dot and cand.with_name(stem + ".py").exists():
            return True
    return False


def _name_exists(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_path_and_module_the_docs_name_exists() -> None:
    """README.md, docs/*.md and the package's sources: `engine/caller/aio.py`, `docs/ray.md`,
    `slabpool.engine.ray.data.SlabpoolPredictor`... each names something that is there."""
    missing = []
    for src in SOURCES:
        text = src.read_text()
        for m in PATH.finditer(text):
            for ref in _expand(m.group(1).rstrip(".,")):
                if ref not in NOT_PATHS and not _path_exists(ref, src.parent):
                    missing.append(f"{src.relative_to(REPO)}: {ref}")
        for m in NAME.finditer(text):
            if m.group(1) not in NOT_NAMES and not _name_exists(m.group(1)):
                missing.append(f"{src.relative_to(REPO)}: {m.group(1)}")
    for doc in DOCS:  # Markdown links
        for m in re.finditer(r"\]\(([^)#\s]+)(#[^)]*)?\)", doc.read_text()):
            if "://" not in m.group(1) and not (doc.parent / m.group(1)).exists():
                missing.append(f"{doc.relative_to(REPO)}: link {m.group(1)}")
    assert not missing, "references to nothing:\n" + "\n".join(missing)


def test_a_block_that_does_not_run_says_why() -> None:
    """Every skip names its reason; every directive is one the runner knows."""
    for b in _all_blocks():
        if b.directive:
            assert b.skip not in (None, "no reason given") or b.directive.startswith("model.onnx="), b.where


# -- examples -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the examples name, built once: copied into each doc's folder."""
    d = tmp_path_factory.mktemp("doc_fixtures")
    shutil.copy(REPO / "engine" / "data" / "demo.onnx", d / "model.onnx")
    onnx_models.mlp(d / "mlp.onnx")
    rng = np.random.default_rng(9)
    np.save(d / "in.npy", rng.random((16, 3, 112, 112), dtype=np.float32))
    from PIL import Image

    (d / "photos").mkdir()
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (40 + i, 50, 3), dtype=np.uint8)).save(d / "photos" / f"{i}.png")
    import pyarrow as pa
    import pyarrow.parquet as pq

    x = rng.standard_normal((20, 16)).astype(np.float32)
    pq.write_table(pa.table({"id": np.arange(20), "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 16)}),
                   d / "table.parquet")
    rows = [{"id": i, **{f"f{k}": float(x[i, k]) for k in range(16)}} for i in range(20)]
    (d / "in.csv").write_text("id," + ",".join(f"f{k}" for k in range(16)) + "\n" + "".join(
        ",".join(str(v) for v in r.values()) + "\n" for r in rows))
    houses = rng.random((12, 5)).astype(np.float32)  # docs/cli.md's --columns example: x is [N, 5]
    onnx_models.mlp(d / "houses.onnx", in_dim=5)
    (d / "houses.csv").write_text("id,rooms,area,age,lat,lon\n" + "".join(
        f"{i}," + ",".join(repr(float(v)) for v in houses[i]) + "\n" for i in range(12)))
    with gzip.open(d / "items.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return d


def _doc_folder(tmp_path: Path, fixtures: Path) -> Path:
    work = tmp_path / "work"
    shutil.copytree(fixtures, work)
    return work


def run_block(block: Block, work: Path) -> subprocess.CompletedProcess[str]:
    """Run one block in `work` (a python script, or shell lines); write a file block there."""
    if block.file is not None:
        target = work / block.file
        target.parent.mkdir(parents=True, exist_ok=True)
        (target.parent / "__init__.py").touch()
        with open(target, "a") as f:
            f.write(block.text)
        return subprocess.CompletedProcess([], 0, "", "")
    model = block.directive.partition("model.onnx=")[2].split()[0] if "model.onnx=" in block.directive else ""
    shutil.copy(work / f"{model}.onnx" if model else REPO / "engine" / "data" / "demo.onnx", work / "model.onnx")
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
           "PYTHONPATH": os.pathsep.join([str(work), str(REPO)])}
    if block.lang == "python":
        script = work / f"example_{block.line}.py"
        script.write_text(block.text)
        cmd = [sys.executable, script.name]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.text]
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_example_of_the_docs_runs_as_written(doc: Path, fixtures: Path, tmp_path: Path) -> None:
    work = _doc_folder(tmp_path, fixtures)
    ran = 0
    for block in blocks(doc):
        if block.skip is not None or not (block.runs or block.file):
            continue
        done = run_block(block, work)
        assert done.returncode == 0, (f"{block.where} failed (exit {done.returncode}):\n{block.text}\n"
                                      f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}")
        ran += block.runs
    if any(b.runs and b.skip is None for b in blocks(doc)):
        assert ran, f"{doc}: no example ran"


@pytest.mark.slow
def test_the_starlette_example_serves_as_written(tmp_path: Path) -> None:
    """docs/async.md's server and clients: uvicorn (the test extra installs it) serves the
    example app from a checkout; its two curl lines get a prediction and the metrics."""
    pytest.importorskip("uvicorn")
    block = next(b for b in blocks(REPO / "docs" / "async.md") if "uvicorn" in b.text)
    server, *clients = [ln for ln in block.text.splitlines() if ln.strip() and not ln.startswith("#")]
    import socket

    with socket.socket() as s:  # a free port for this run (the docs' 8000 may be taken)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    np.random.default_rng(1).random((3, 112, 112), dtype=np.float32).tofile(tmp_path / "image.f32")
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
           "SLABPOOL_WORKERS": "1"}
    proc = subprocess.Popen(["bash", "-c", f"{server} --port {port}"], cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log = _wait_for_line(proc, "Uvicorn running on")  # bound: uvicorn says startup complete before it binds
        for line in clients:
            line = line.replace("@image.f32", f"@{tmp_path / 'image.f32'}").replace("localhost:8000", f"127.0.0.1:{port}")
            done = subprocess.run(["bash", "-e", "-c", f"{line} --fail --silent --show-error"], capture_output=True,
                                  text=True, timeout=BLOCK_TIMEOUT_S)
            assert done.returncode == 0, f"{line}\n{done.stderr}\n{log}"
            if "/predict" in line:
                assert len(json.loads(done.stdout)["probs"]) == 10
            else:
                assert "slabpool_tasks_completed_total 1" in done.stdout
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # uvicorn's shutdown: the lifespan closes the engine
        proc.communicate(timeout=60)


def _wait_for_line(proc: subprocess.Popen[str], text: str) -> str:
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:  # ends at EOF if the server dies: only a hang reaches the test timeout
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError("the server exited before it served:\n" + "".join(seen))
