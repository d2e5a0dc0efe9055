"""Where a batch job's items come from: arrays, folders of files, text/JSONL lines, tables, stdin.

    INPUT                 one item is                    a hook gets          --keep may name
    in.npy                a row on axis 0 (memory-mapped) x[i]                 -
    in.npz                row i of every array            {name: a[i]}         -
    dir/ (no hook)        one .npy/.npz file              -                    path
    dir/ (with a hook)    any regular file, recursively   its path, a str      path
    .jsonl/.json/.ndjson  a non-blank line, as JSON       the JSON value       line
    any other file        a non-blank line, a str         the line             line
    -                     a stdin line (JSON, or raw)     the value            line
    .parquet/.csv/.arrow  a table row (pyarrow, batches)  {column: value}      any column

A source is read front to back in `Block`s of consecutive items. Without a hook an array or
table block carries `rows` (each model input's rows on axis 0, a row block); otherwise it
carries `items` (one value per item). `Block.item(j)` is what `Engine.submit` gets for one item
(rows keep their batch axis: `x[j:j+1]`). A value that cannot be read (a bad file, a null
cell) raises from `item(j)`, so that item alone fails.

Tables are read with pyarrow in record batches, never whole; pyarrow is imported only for
them (`pip install 'slabpool[parquet]'`).

Row blocks (no hook, a batchable model): `Source.row_reader(todo)` gives the job's blocks their
rows. A .npy/.npz is read at any rows (`rows(lo, hi)`, views of the mapped file); a table front
to back (`TableSource.spans`): record batches gathered into spans of ~SPAN_BYTES, each model
input's column turned into one contiguous array (fixed-size lists by their values buffer, no
Python per row); a null or ragged cell makes its row a span of its own, holding the error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import queue
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from slabpool.engine.caller.blocks import RowsUnreadable, row_bytes, slice_rows
from slabpool.workers.protocol import TensorSpec

Array = npt.NDArray[Any]
T = TypeVar("T")
BARE = ""  # the `rows` key of a bare array (a single-input model's input, named by the engine)
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
TABLE_SUFFIXES = (".parquet", ".pq", ".csv", ".arrow", ".feather", ".ipc")
READ_ROWS = 4096  # rows per record batch read from a table
SPAN_BYTES = 8 << 20  # input bytes of a table span turned into arrays at once (row blocks)


_NO_KEEP: dict[str, Any] = {}  # the kept values of an item when nothing is kept (never changed)


class JobError(Exception):
    """The job cannot run (bad input, mismatched OUTPUT, ...): one line for the user."""


def require_pyarrow(what: str) -> Any:
    """pyarrow, imported on first use; a clear error names the extra when it is missing."""
    try:
        import pyarrow
    except ImportError:
        raise JobError(f"{what} needs pyarrow: pip install 'slabpool[parquet]'") from None
    return pyarrow


@dataclass
class Block:
    """Items `start .. start + size - 1` of a source."""

    start: int
    size: int
    rows: dict[str, Array] | None = None  # each input's rows on axis 0 (no hook)
    items: list[Any] | None = None  # one value per item (passed through `load`)
    load: Callable[[Any], Any] | None = None
    keep: dict[str, list[Any]] = field(default_factory=dict)  # --keep columns, one value per item

    def item(self, j: int) -> Any:
        """What `Engine.submit` gets for item `start + j`."""
        if self.rows is not None:
            if set(self.rows) == {BARE}:
                return np.ascontiguousarray(self.rows[BARE][j : j + 1])
            return {k: np.ascontiguousarray(a[j : j + 1]) for k, a in self.rows.items()}
        assert self.items is not None
        value = self.items[j]
        return self.load(value) if self.load is not None else value

    def kept(self, j: int) -> dict[str, Any]:
        return {k: v[j] for k, v in self.keep.items()} if self.keep else _NO_KEEP


class Source:
    """The items of INPUT, read front to back. Subclasses set `count` and `fingerprint`."""

    kind = "input"
    keepable: tuple[str, ...] = ()  # what --keep may name
    keep_types: dict[str, Any]  # arrow types of keepable columns, where known (tables)

    def __init__(self, path: Path | None, hook: bool) -> None:
        self.path, self.hook = path, hook
        self.count = 0
        self.fingerprint: dict[str, Any] = {}
        self.keep: tuple[str, ...] = ()
        self.keep_types = {}
        self.inputs: tuple[TensorSpec, ...] = ()
        # rows(lo, hi): rows [lo, hi) of arrays as one feed (views of a mapped file), for the
        # job's row blocks (engine/blocks.py); None where items are not rows of arrays
        self.rows: Callable[[int, int], Any] | None = None

    @property
    def label(self) -> str:
        return "stdin" if self.path is None else str(self.path)

    @property
    def blockable(self) -> bool:
        """Items are rows of arrays (no hook): they can go as row blocks."""
        return self.rows is not None

    def row_reader(self, todo: list[tuple[int, int]]) -> RowReader:
        """The rows of `todo` for row blocks (only when `blockable`)."""
        assert self.rows is not None
        return ArrayRows(todo, self.rows)

    def choose_keep(self, names: Sequence[str]) -> None:
        """Check --keep against what this input offers (before the engine starts)."""
        missing = [n for n in names if n not in self.keepable]
        if missing:
            offer = f"it offers {', '.join(self.keepable)}" if self.keepable else "it has no columns to keep"
            raise JobError(f"--keep {','.join(missing)}: {self.label} ({self.kind}) has no such column; {offer}")
        self.keep = tuple(names)

    def bind(self, inputs: Sequence[TensorSpec]) -> None:
        """The model's inputs, once known (the engine has started); checked where it matters."""
        self.inputs = tuple(inputs)

    def blocks(self, size: int) -> Iterator[Block]:
        raise NotImplementedError

    def items(self, size: int = READ_ROWS) -> Iterator[tuple[int, Callable[[], Any], dict[str, Any]]]:
        """(index, a thunk giving what submit gets, kept values) for every item, in order. The
        thunk reads the item when called, so an unreadable one fails alone, at its submit."""
        for b in self.blocks(size):
            for j in range(b.size):
                yield b.start + j, functools.partial(b.item, j), b.kept(j)


def file_fingerprint(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _spans(count: int, size: int) -> Iterator[tuple[int, int]]:
    for s in range(0, count, size):
        yield s, min(s + size, count)


# -- row blocks ------------------------------------------------------------------------------------


@dataclass
class Span:
    """Rows [lo, hi) of a source as arrays (each model input's rows on axis 0), or the error
    that makes them unreadable (a null or ragged cell: a span of one row)."""

    lo: int
    hi: int
    arrays: dict[str, Array] | None = None
    error: ValueError | None = None
    keep: dict[str, list[Any]] = field(default_factory=dict)  # --keep values, one per row


class RowReader:
    """The rows of `todo` (sorted, disjoint runs) for the job's row blocks (engine/blocks.py).

    `runs()` yields the runs that blocks are cut from, in order; `read(lo, hi)` gives the rows
    [lo, hi) of one run as a feed (raises RowsUnreadable for rows that cannot be read);
    `kept(lo, hi)` their --keep values; `release(upto)`: rows before `upto` are settled."""

    def __init__(self, todo: list[tuple[int, int]]) -> None:
        self.todo = todo

    def runs(self) -> Iterator[tuple[int, int]]:
        return iter(self.todo)

    def read(self, lo: int, hi: int) -> Any:
        raise NotImplementedError

    def kept(self, lo: int, hi: int) -> dict[str, list[Any]]:
        return {}

    def release(self, upto: int) -> None:
        pass

    def row_bytes(self) -> int:
        raise NotImplementedError

    def first(self) -> Any:
        """The feed of the first readable row (None when there is none): checked up front."""
        raise NotImplementedError


class ArrayRows(RowReader):
    """Rows read anywhere, as views of a memory-mapped .npy or of an .npz's arrays."""

    def __init__(self, todo: list[tuple[int, int]], rows: Callable[[int, int], Any]) -> None:
        super().__init__(todo)
        self._rows = rows

    def read(self, lo: int, hi: int) -> Any:
        return self._rows(lo, hi)

    def row_bytes(self) -> int:
        at = self.todo[0][0] if self.todo else 0
        first = self._rows(at, at)
        return row_bytes(first if isinstance(first, dict) else {BARE: first})

    def first(self) -> Any:
        return self._rows(self.todo[0][0], self.todo[0][0] + 1) if self.todo else None


class SpanRows(RowReader):
    """Rows read front to back as `Span`s (a table): a span is kept until its rows settle."""

    def __init__(self, todo: list[tuple[int, int]], spans: Iterator[Span]) -> None:
        super().__init__(todo)
        self._spans = spans
        self._ahead: deque[Span] = deque()  # read, not yet cut into runs
        self._held: deque[Span] = deque()  # cut into runs, rows not all settled

    def runs(self) -> Iterator[tuple[int, int]]:
        todo = deque(self.todo)
        while todo and (span := self._next()) is not None:
            while todo and todo[0][1] <= span.lo:
                todo.popleft()
            parts = []
            for a, b in todo:
                if a >= span.hi:
                    break
                if min(b, span.hi) > max(a, span.lo):
                    parts.append((max(a, span.lo), min(b, span.hi)))
            if parts:
                self._held.append(span)
                yield from parts

    def _next(self) -> Span | None:
        return self._ahead.popleft() if self._ahead else next(self._spans, None)

    def _span(self, lo: int, hi: int) -> Span:
        for span in self._held:
            if span.lo <= lo and hi <= span.hi:
                return span
        raise LookupError(f"rows [{lo}, {hi}) are not held (released, or never read)")

    def read(self, lo: int, hi: int) -> Any:
        span = self._span(lo, hi)
        if span.arrays is None:
            raise RowsUnreadable(span.error or ValueError("unreadable rows"))
        return slice_rows(span.arrays, lo - span.lo, hi - span.lo)

    def kept(self, lo: int, hi: int) -> dict[str, list[Any]]:
        span = self._span(lo, hi)
        return {k: v[lo - span.lo : hi - span.lo] for k, v in span.keep.items()}

    def release(self, upto: int) -> None:
        while self._held and self._held[0].hi <= upto:
            self._held.popleft()

    def _first_readable(self) -> Span | None:
        """The first span with arrays, read ahead (kept for runs())."""
        for ahead in self._ahead:
            if ahead.arrays is not None:
                return ahead
        while (span := next(self._spans, None)) is not None:
            self._ahead.append(span)
            if span.arrays is not None:
                return span
        return None

    def row_bytes(self) -> int:
        span = self._first_readable()
        return 1 if span is None or span.arrays is None else row_bytes(span.arrays)

    def first(self) -> Any:
        span = self._first_readable()
        return None if span is None or span.arrays is None else slice_rows(span.arrays, 0, 1)


def prefetch(items: Iterator[T], depth: int = 2) -> Iterator[T]:
    """`items` produced ahead in a thread, at most `depth` waiting: reading a table (pyarrow
    decodes without the GIL) overlaps the job's dispatch. Errors are raised where they fall."""
    q: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put((0, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((1, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            q.put((2, exc))

    thread = threading.Thread(target=produce, name="slabpool-read", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = q.get()
            if kind == 1:
                return
            if kind == 2:
                raise value
            yield value
    finally:
        stop.set()
        while thread.is_alive():
            try:
                q.get(timeout=0.1)
            except queue.Empty:
                pass
        thread.join()


# -- arrays ----------------------------------------------------------------------------------------


class NpySource(Source):
    kind = "a .npy array"

    def __init__(self, path: Path, hook: bool) -> None:
        super().__init__(path, hook)
        self.array = np.load(path, mmap_mode="r")
        if self.array.ndim == 0:
            raise JobError(f"{path} holds a scalar; items must lie on axis 0")
        self.count, self.fingerprint = int(self.array.shape[0]), file_fingerprint(path)
        self.rows = None if hook else self._rows

    def _rows(self, lo: int, hi: int) -> Any:
        return self.array[lo:hi]  # a view of the memory-mapped file: one copy, into shared memory

    def blocks(self, size: int) -> Iterator[Block]:
        for s, e in _spans(self.count, size):
            if self.hook:
                yield Block(s, e - s, items=[np.array(self.array[i]) for i in range(s, e)])
            else:
                yield Block(s, e - s, rows={BARE: self.array[s:e]})


class NpzSource(Source):
    kind = "a .npz archive"

    def __init__(self, path: Path, hook: bool) -> None:
        super().__init__(path, hook)
        with np.load(path) as z:
            self.arrays = {k: z[k] for k in z.files}
        if not self.arrays:
            raise JobError(f"{path} holds no arrays")
        counts = {k: (a.shape[0] if a.ndim else -1) for k, a in self.arrays.items()}
        if len(set(counts.values())) != 1 or -1 in counts.values():
            raise JobError(f"{path}: every array needs the same length on axis 0, got {counts}")
        self.count, self.fingerprint = next(iter(counts.values())), file_fingerprint(path)
        self.rows = None if hook else self._rows

    def _rows(self, lo: int, hi: int) -> Any:
        return {k: a[lo:hi] for k, a in self.arrays.items()}

    def blocks(self, size: int) -> Iterator[Block]:
        for s, e in _spans(self.count, size):
            if self.hook:
                items = [{k: np.array(a[i]) for k, a in self.arrays.items()} for i in range(s, e)]
                yield Block(s, e - s, items=items)
            else:
                yield Block(s, e - s, rows={k: a[s:e] for k, a in self.arrays.items()})


# -- folders ---------------------------------------------------------------------------------------


class ArrayFolderSource(Source):
    """No hook: each .npy/.npz file (top level, by name) is one item's array(s)."""

    kind = "a folder of .npy/.npz files"
    keepable = ("path",)

    def __init__(self, path: Path, hook: bool) -> None:
        super().__init__(path, hook)
        self.files = sorted(p for p in path.iterdir() if p.suffix in (".npy", ".npz") and p.is_file())
        if not self.files:
            raise JobError(f"{path} holds no .npy or .npz files; a folder of other files needs "
                           "--preprocess MOD:FN (it gets each file's path)")
        self.count = len(self.files)
        self.fingerprint = {"path": str(path.resolve()),
                            "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in self.files]}

    def _batched(self, name: str, a: Array) -> Array:
        """A batch axis is added when the array has one dimension less than the model input."""
        ranks = {s.name: len(s.shape) for s in self.inputs}
        want = ranks.get(name, len(self.inputs[0].shape) if len(self.inputs) == 1 else -1)
        return a[None] if a.ndim == want - 1 else a

    def _load(self, f: Path) -> Any:
        if f.suffix == ".npy":
            return self._batched(BARE, np.load(f))
        with np.load(f) as z:
            return {k: self._batched(k, z[k]) for k in z.files}

    def blocks(self, size: int) -> Iterator[Block]:
        for s, e in _spans(self.count, size):
            keep = {"path": [f.name for f in self.files[s:e]]} if "path" in self.keep else {}
            yield Block(s, e - s, items=self.files[s:e], load=self._load, keep=keep)


class FileFolderSource(Source):
    """With a hook: every regular file under the folder (recursively, by relative path)."""

    kind = "a folder of files"
    keepable = ("path",)

    def __init__(self, path: Path, hook: bool) -> None:
        super().__init__(path, hook)
        files = sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise JobError(f"{path} holds no files")
        self.files = files
        self.count = len(files)
        stats = [f.stat() for f in files]
        self.fingerprint = {"path": str(path.resolve()), "files": [
            [f.relative_to(path).as_posix(), st.st_size, st.st_mtime_ns] for f, st in zip(files, stats, strict=True)]}

    def blocks(self, size: int) -> Iterator[Block]:
        assert self.path is not None
        for s, e in _spans(self.count, size):
            keep = {"path": [f.relative_to(self.path).as_posix() for f in self.files[s:e]]} if self.keep else {}
            yield Block(s, e - s, items=[str(f) for f in self.files[s:e]], keep=keep)


# -- lines: text, JSONL, stdin ---------------------------------------------------------------------


class LinesSource(Source):
    """Each non-blank line is one item: parsed as JSON, or the raw string. `line` is 1-based."""

    keepable = ("line",)

    def __init__(self, path: Path | None, hook: bool, *, as_json: bool, data: bytes | None = None) -> None:
        super().__init__(path, hook)
        self.kind = ("JSON lines" if as_json else "text lines") + (" on stdin" if path is None else "")
        if not hook:
            raise JobError(f"{self.label}: a text or JSONL input needs --preprocess MOD:FN")
        raw = data if data is not None else path.read_bytes() if path is not None else b""
        numbered = [(n, ln) for n, ln in enumerate(raw.decode("utf-8").splitlines(), 1) if ln.strip()]
        self.values: list[Any] = []
        for n, text in numbered:
            try:
                self.values.append(json.loads(text) if as_json else text)
            except json.JSONDecodeError as exc:
                raise JobError(f"{self.label}: line {n} is not JSON ({exc})") from exc
        self.lines = [n for n, _ in numbered]
        self.count = len(self.values)
        if path is not None:
            self.fingerprint = file_fingerprint(path)
        else:
            self.fingerprint = {"stdin": hashlib.blake2b(raw, digest_size=16).hexdigest(), "json": as_json}

    def blocks(self, size: int) -> Iterator[Block]:
        for s, e in _spans(self.count, size):
            keep = {"line": self.lines[s:e]} if self.keep else {}
            yield Block(s, e - s, items=self.values[s:e], keep=keep)


# -- tables ----------------------------------------------------------------------------------------


class TableSource(Source):
    """A Parquet, CSV or Arrow table, read in record batches. A row is one item."""

    keepable: tuple[str, ...]

    def __init__(self, path: Path, hook: bool) -> None:
        super().__init__(path, hook)
        self.pa = require_pyarrow(f"reading {path.name}")
        self.fingerprint = file_fingerprint(path)
        self.schema = self._schema()
        self.keepable = tuple(self.schema.names)
        self.keep_types = {f.name: f.type for f in self.schema}

    def _schema(self) -> Any:
        raise NotImplementedError

    def _batches(self, columns: list[str] | None, size: int) -> Iterator[Any]:
        raise NotImplementedError

    def bind(self, inputs: Sequence[TensorSpec]) -> None:
        super().bind(inputs)
        if self.hook:
            return
        names = [s.name for s in inputs]
        missing = [n for n in names if n not in self.schema.names]
        if missing:
            raise JobError(f"{self.label} has no column {', '.join(map(repr, missing))} for the model's "
                           f"input(s) {names} (columns: {', '.join(self.schema.names)}); name the columns "
                           "after the inputs or pass --preprocess MOD:FN")
        for spec in inputs:
            leaf = _leaf_type(self.pa, self.schema.field(spec.name).type)
            if leaf is None:
                raise JobError(f"{self.label}: column {spec.name!r} is {self.schema.field(spec.name).type}; "
                               "a model input needs numbers or lists of numbers (or pass --preprocess MOD:FN)")

    @property
    def blockable(self) -> bool:
        return not self.hook

    def row_reader(self, todo: list[tuple[int, int]]) -> RowReader:
        return SpanRows(todo, prefetch(self.spans()))

    def spans(self) -> Iterator[Span]:
        """The whole table front to back as Spans: record batches gathered up to ~SPAN_BYTES,
        each input column turned into one array; unreadable rows are spans of their own."""
        columns = list(dict.fromkeys([*(s.name for s in self.inputs), *self.keep]))
        start, gathered, nbytes = 0, [], 0
        for batch in self._batches(columns, 16 * READ_ROWS):
            gathered.append(batch)
            nbytes += batch.nbytes
            if nbytes >= SPAN_BYTES:
                yield from self._spans_of(start, gathered)
                start += sum(b.num_rows for b in gathered)
                gathered, nbytes = [], 0
        if gathered:
            yield from self._spans_of(start, gathered)
            start += sum(b.num_rows for b in gathered)
        if start != self.count:
            raise JobError(f"{self.label}: read {start} rows, expected {self.count} (changed while read?)")

    def _spans_of(self, start: int, batches: list[Any]) -> Iterator[Span]:
        table = self.pa.Table.from_batches(batches)
        n = table.num_rows
        keep = {k: table.column(k).to_pylist() for k in self.keep}
        bad: dict[int, ValueError] = {}
        arrays: dict[str, Array] = {}
        for spec in self.inputs:
            got = column_rows(self.pa, table.column(spec.name).combine_chunks(), spec.name, bad)
            if got is None:  # ragged lists: row by row, same-shaped neighbours together
                yield from self._row_spans(start, table, keep)
                return
            arrays[spec.name] = got
        at = 0
        for j in [*sorted(bad), n]:
            if j > at:
                yield Span(start + at, start + j, {k: a[at:j] for k, a in arrays.items()},
                           keep={k: v[at:j] for k, v in keep.items()})
            if j < n:
                yield Span(start + j, start + j + 1, error=bad[j], keep={k: v[j : j + 1] for k, v in keep.items()})
            at = j + 1

    def _row_spans(self, start: int, table: Any, keep: dict[str, list[Any]]) -> Iterator[Span]:
        """Each row read on its own; consecutive rows of the same shapes form one span."""
        cols = {s.name: table.column(s.name) for s in self.inputs}
        run: list[dict[str, Array]] = []

        def flush(j: int) -> Iterator[Span]:
            if run:
                lo = j - len(run)
                yield Span(start + lo, start + j, {k: np.stack([r[k] for r in run]) for k in cols},
                           keep={k: v[lo:j] for k, v in keep.items()})
                run.clear()

        for j in range(table.num_rows):
            try:
                row = {k: cell_array(self.pa, c, j) for k, c in cols.items()}
            except ValueError as exc:
                yield from flush(j)
                yield Span(start + j, start + j + 1, error=exc, keep={k: v[j : j + 1] for k, v in keep.items()})
                continue
            if run and any(run[0][k].shape != row[k].shape for k in cols):
                yield from flush(j)
            run.append(row)
        yield from flush(table.num_rows)

    def blocks(self, size: int) -> Iterator[Block]:
        if self.hook:
            columns = None
        else:
            columns = list(dict.fromkeys([*(s.name for s in self.inputs), *self.keep]))
        start = 0
        for batch in self._batches(columns, size):
            for off in range(0, batch.num_rows, size):
                part = batch.slice(off, size)
                yield self._block(start, part)
                start += part.num_rows
        if start != self.count:
            raise JobError(f"{self.label}: read {start} rows, expected {self.count} (changed while read?)")

    def _block(self, start: int, batch: Any) -> Block:
        n = batch.num_rows
        keep = {k: batch.column(k).to_pylist() for k in self.keep}
        if self.hook:
            return Block(start, n, items=batch.to_pylist(), keep=keep)
        rows: dict[str, Array] = {}
        for spec in self.inputs:
            arr = column_array(self.pa, batch.column(spec.name))
            if arr is None:  # ragged lists or nulls: each row on its own
                return Block(start, n, items=self._per_row(batch), load=_raise_errors, keep=keep)
            rows[spec.name] = arr
        return Block(start, n, rows=rows, keep=keep)

    def _per_row(self, batch: Any) -> list[Any]:
        out: list[Any] = []
        cols = {s.name: batch.column(s.name) for s in self.inputs}
        for j in range(batch.num_rows):
            try:
                out.append({k: cell_array(self.pa, c, j)[None] for k, c in cols.items()})
            except ValueError as exc:
                out.append(exc)
        return out


def _raise_errors(value: Any) -> Any:
    if isinstance(value, BaseException):
        raise value
    return value


class ParquetSource(TableSource):
    kind = "a Parquet table"

    def __init__(self, path: Path, hook: bool) -> None:
        super().__init__(path, hook)
        self.count = int(self._file().metadata.num_rows)

    def _file(self) -> Any:
        import pyarrow.parquet as pq

        return pq.ParquetFile(self.path)

    def _schema(self) -> Any:
        return self._file().schema_arrow

    def _batches(self, columns: list[str] | None, size: int) -> Iterator[Any]:
        yield from self._file().iter_batches(batch_size=size, columns=columns)


class ArrowSource(TableSource):
    """Arrow IPC (Feather v2): the file format, or the stream format."""

    kind = "an Arrow table"

    def __init__(self, path: Path, hook: bool) -> None:
        super().__init__(path, hook)
        try:
            r = self.pa.ipc.open_file(self.path)
            self.count = sum(r.get_batch(i).num_rows for i in range(r.num_record_batches))
        except self.pa.ArrowInvalid:
            self.count = sum(b.num_rows for b in self._stream(None))

    def _stream(self, columns: list[str] | None) -> Iterator[Any]:
        try:
            r = self.pa.ipc.open_file(self.path)
            batches: Iterator[Any] = (r.get_batch(i) for i in range(r.num_record_batches))
        except self.pa.ArrowInvalid:
            batches = iter(self.pa.ipc.open_stream(self.path))
        for b in batches:
            yield b.select(columns) if columns is not None else b

    def _schema(self) -> Any:
        try:
            return self.pa.ipc.open_file(self.path).schema
        except self.pa.ArrowInvalid:
            return self.pa.ipc.open_stream(self.path).schema

    def _batches(self, columns: list[str] | None, size: int) -> Iterator[Any]:
        yield from self._stream(columns)


class CsvSource(TableSource):
    """CSV with a header row; pyarrow infers column types from the first block (8 MiB)."""

    kind = "a CSV table"
    BLOCK = 8 << 20

    def __init__(self, path: Path, hook: bool) -> None:
        super().__init__(path, hook)
        self.count = sum(b.num_rows for b in self._reader([self.schema.names[0]]))

    def _reader(self, columns: list[str] | None) -> Any:
        from pyarrow import csv

        convert = csv.ConvertOptions(include_columns=columns) if columns is not None else None
        return csv.open_csv(self.path, read_options=csv.ReadOptions(block_size=self.BLOCK),
                            convert_options=convert)

    def _schema(self) -> Any:
        return self._reader(None).schema

    def _batches(self, columns: list[str] | None, size: int) -> Iterator[Any]:
        try:
            yield from self._reader(columns)
        except self.pa.ArrowInvalid as exc:
            raise JobError(f"{self.label}: {exc}") from exc


# -- arrow columns -> numpy ------------------------------------------------------------------------


def _leaf_type(pa: Any, t: Any) -> Any:
    """The numeric type inside (nested) lists, or None when the column is not numeric."""
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    numeric = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
    return t if numeric else None


def column_array(pa: Any, col: Any) -> Array | None:
    """A numeric or (nested) list column as one array (rows on axis 0); None when lists are
    ragged or a value is null (then each row is read on its own)."""
    if col.null_count:
        return None
    t = col.type
    n = len(col)
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        if pa.types.is_fixed_size_list(t):
            k = t.list_size
        else:
            import pyarrow.compute as pc

            lengths = pc.list_value_length(col)
            if n and pc.min_max(lengths)["min"] != pc.min_max(lengths)["max"]:
                return None
            k = lengths[0].as_py() if n else 0
        inner = column_array(pa, col.flatten())
        if inner is None:
            return None
        return inner.reshape((n, k, *inner.shape[1:]))
    if _leaf_type(pa, t) is None:
        return None
    return np.asarray(col.to_numpy(zero_copy_only=False))


def column_rows(pa: Any, col: Any, name: str, bad: dict[int, ValueError]) -> Array | None:
    """A column as one array (rows on axis 0), its null rows zero and listed in `bad` with
    their error; None when its lists are ragged (or hold nulls inside)."""
    if not col.null_count:
        return column_array(pa, col)
    valid = np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    good = column_array(pa, col.filter(pa.array(valid)))
    if good is None:
        return None
    for j in np.flatnonzero(~valid).tolist():
        bad.setdefault(j, ValueError(f"column {name!r} ({col.type}) is null in this row"))
    out = np.zeros((len(col), *good.shape[1:]), dtype=good.dtype)
    out[valid] = good
    return out


def cell_array(pa: Any, col: Any, j: int) -> Array:
    """Row j of a column as an array of the column's numeric type (ValueError when null/ragged)."""
    value = col[j].as_py()
    if value is None or _has_none(value):
        raise ValueError(f"column {col.type} is null in this row")
    dtype = np.dtype(_leaf_type(pa, col.type).to_pandas_dtype())
    a = np.asarray(value, dtype=dtype)
    if a.dtype == object:
        raise ValueError("ragged nested lists cannot form an array")
    return a


def _has_none(value: Any) -> bool:
    if isinstance(value, list):
        return any(_has_none(v) for v in value)
    return value is None


# -- open ------------------------------------------------------------------------------------------


def open_source(path: Path, *, hook: bool, text: bool = False) -> Source:
    """Open INPUT (`-` is stdin). `text`: lines are raw strings, not JSON (stdin, .jsonl)."""
    if str(path) == "-":
        return LinesSource(None, hook, as_json=not text, data=sys.stdin.buffer.read())
    if not path.exists():
        raise JobError(f"input not found: {path}")
    try:
        if path.is_dir():
            return FileFolderSource(path, hook) if hook else ArrayFolderSource(path, hook)
        suffix = path.suffix.lower()
        if suffix == ".npy":
            return NpySource(path, hook)
        if suffix == ".npz":
            return NpzSource(path, hook)
        if suffix in (".parquet", ".pq"):
            return ParquetSource(path, hook)
        if suffix == ".csv":
            return CsvSource(path, hook)
        if suffix in (".arrow", ".feather", ".ipc"):
            return ArrowSource(path, hook)
        return LinesSource(path, hook, as_json=suffix in JSON_SUFFIXES and not text)
    except JobError:
        raise
    except (OSError, ValueError, EOFError, UnicodeDecodeError) as exc:  # pyarrow's errors are ValueErrors
        raise JobError(f"cannot read input {path}: {exc}") from exc
