"""What every INPUT offers the job: `Source` (items read front to back in `Block`s) and, for
row blocks, a `RowReader`.

A source is read front to back in `Block`s of consecutive items. Without a hook an array or
table block carries `rows` (each model input's rows on axis 0, a row block); otherwise it
carries `items` (one value per item). `Block.item(j)` is what `Engine.submit` gets for one item
(rows keep their batch axis: `x[j:j+1]`). A value that cannot be read (a bad file, a null
cell) raises from `item(j)`, so that item alone fails.

Row blocks (no hook, a batchable model): `Source.row_reader(todo)` gives the job's blocks their
rows. A .npy/.npz is read at any rows (`rows(lo, hi)`, views of the mapped file: `ArrayRows`);
a table front to back (`TableSource.spans` in engine.job.sources.tables): record batches
gathered into spans of ~SPAN_BYTES, each model input's column turned into one contiguous array
(fixed-size lists by their values buffer, no Python per row); a null or ragged cell makes its
row a span of its own, holding the error (`SpanRows`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import weakref
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


def arrow_name(path: Path, owner: object) -> str:
    """`path` as pyarrow opens a file by name: UTF-8 text only. A name that is not (bytes that
    decode to no text, as a Latin-1 file name has) is reached through a descriptor opened here
    and held while `owner` lives: /proc/self/fd/N, which pyarrow opens at its own offset. Was:
    UnicodeEncodeError out of pyarrow, after the job had run."""
    if _utf8(str(path)):
        return str(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    weakref.finalize(owner, os.close, fd)
    return f"/proc/self/fd/{fd}"


@contextlib.contextmanager
def arrow_opened(path: Path) -> Iterator[str]:
    """`arrow_name` for one read: its descriptor (if any) is closed after it."""
    if _utf8(str(path)):
        yield str(path)
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _utf8(name: str) -> bool:
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


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
        # job's row blocks (engine/caller/blocks.py); None where items are not rows of arrays
        self.rows: Callable[[int, int], Any] | None = None
        # decode(item): what the hook gets for an item as it travels (a JSONL line parsed), run
        # in the workers before the hook; None: the item as it is
        self.decode: Callable[[Any], Any] | None = None

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

    def choose_columns(self, columns: dict[str, tuple[str, ...]]) -> None:
        """--columns INPUT=COL,COL,...: only a table offers columns to gather."""
        if columns:
            raise JobError(f"--columns gathers a table's columns into a model input; {self.label} is {self.kind} "
                           "(--columns takes a Parquet, CSV or Arrow INPUT)")

    def bind(self, inputs: Sequence[TensorSpec]) -> None:
        """The model's inputs, once known (the engine has started); checked where it matters."""
        self.inputs = tuple(inputs)

    def blocks(self, size: int) -> Iterator[Block]:
        raise NotImplementedError

    def changed(self) -> str | None:
        """What of INPUT is not as it was when the job opened it (rewritten, truncated, replaced
        or removed since: its size or modification time), in words; None if nothing is (stdin
        was read whole at the start). The job looks before it writes OUTPUT: a file changed
        under it would have given some items from the old content and some from the new."""
        if self.path is None:
            return None
        try:
            now = self.fingerprint_now()
        except OSError as exc:
            return f"{exc.filename or self.label} can no longer be read ({exc.strerror})"
        return None if now == self.fingerprint else what_changed(self.fingerprint, now)

    def fingerprint_now(self) -> dict[str, Any]:
        """`fingerprint` as INPUT is now (a file's: its size and modification time)."""
        assert self.path is not None
        return file_fingerprint(self.path)


def file_fingerprint(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def folder_fingerprint(path: Path, files: Sequence[Path]) -> dict[str, Any]:
    """A folder's: each file's path (relative), size and modification time."""
    stats = [f.stat() for f in files]
    return {"path": str(path.resolve()), "files": [
        [f.relative_to(path).as_posix(), st.st_size, st.st_mtime_ns] for f, st in zip(files, stats, strict=True)]}


def what_changed(was: dict[str, Any], now: dict[str, Any]) -> str:
    """Two fingerprints of one INPUT (file_fingerprint's or folder_fingerprint's), the change in words."""
    if "files" in was:
        for (name, size, mtime), (_, size2, mtime2) in zip(was["files"], now["files"], strict=True):
            if (size, mtime) != (size2, mtime2):
                return f"{was['path']}/{name} " + _change(size, size2)
        return f"{was['path']} changed"
    return f"{was['path']} " + _change(was["size"], now["size"])


def input_changed(what: str) -> str:
    """The one line of a job whose INPUT changed under it: OUTPUT is not written (a resume would
    be refused too: the input's fingerprint is no longer the job's)."""
    return (f"INPUT changed while the job ran: {what}. OUTPUT was not written: its items would mix the "
            "input as it was and as it is. Rerun with --overwrite to start over on the input as it is now")


def _change(size: int, now: int) -> str:
    return f"was {size:,} bytes, now {now:,}" if size != now else f"was rewritten ({size:,} bytes, modified since)"


def block_bounds(count: int, size: int) -> Iterator[tuple[int, int]]:
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
    """The rows of `todo` (sorted, disjoint runs) for the job's row blocks (engine/caller/blocks.py).

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
