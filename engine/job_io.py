"""The batch job's files: where items come from, and how results become durable.

    INPUT                          OUTPUT (a directory, or FILE.npy|.npz with FILE.parts/ beside it)
    .npy   items on axis 0          manifest.json    which job this is (a fingerprint); written once
    .npz   named inputs, axis 0     journal.jsonl    one line per durable shard: its item ranges, its
    dir/   one .npy/.npz per item                    size and digest, the failures it settled
    .jsonl one JSON value per line  shards/*.npz     rows of done items, `__index__` says which
    .txt   one string per line      failures.jsonl   index, error class, message, attempts
                                    report.json      the summary of the last run
                                    .lock            flock: one writer per OUTPUT

A shard becomes durable in three steps: write a temporary file, fsync, rename (then fsync the
folder); only then is its journal line appended (and fsynced). On open the journal is read back,
and an entry counts only if its shard has the recorded size and digest: a torn write is never
read as done. The journal is then rewritten with the valid entries alone, so a torn last line
cannot swallow the next append.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]
Schema = dict[str, tuple[str, tuple[int, ...]]]  # output name -> (dtype str, row shape)
INDEX_KEY = "__index__"
_savez = cast(Callable[..., None], np.savez)  # numpy's stub types **arrays as its own flags


class JobError(Exception):
    """The job cannot run (bad input, mismatched OUTPUT, ...): one line for the user."""


class RowError(ValueError):
    """An item's result cannot be stored as a row of the output (ragged, not numeric)."""


# -- inputs ---------------------------------------------------------------------------------------


class Source:
    """Items of a job by index. `item(i)` is what `Engine.submit` gets for item i.

    A source whose items are rows on axis 0 of arrays (.npy, .npz, without a preprocess) also
    reads `rows(lo, hi)`: rows [lo, hi) as one feed (views of the file where it is memory-
    mapped); the job then sends them as blocks (engine/blocks.py), not item by item."""

    def __init__(self, path: Path, count: int, get: Callable[[int], Any], fingerprint: dict[str, Any],
                 rows: Callable[[int, int], Any] | None = None):
        self.path = path
        self.count = count
        self._get = get
        self.fingerprint = fingerprint
        self.rows = rows

    def item(self, index: int) -> Any:
        return self._get(index)


def open_source(path: Path, *, preprocess: bool, ranks: dict[str, int] | None = None) -> Source:
    """Open INPUT. Without a preprocess an item keeps the batch axis (shape (1, ...))."""
    if not path.exists():
        raise JobError(f"input not found: {path}")
    try:
        if path.is_dir():
            return _dir_source(path, preprocess, {} if ranks is None else ranks)
        if path.suffix == ".npy":
            return _npy_source(path, preprocess)
        if path.suffix == ".npz":
            return _npz_source(path, preprocess)
        return _text_source(path, preprocess)
    except (OSError, ValueError, EOFError) as exc:
        raise JobError(f"cannot read input {path}: {exc}") from exc


def _file_fp(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _npy_source(path: Path, preprocess: bool) -> Source:
    arr = np.load(path, mmap_mode="r")
    if arr.ndim == 0:
        raise JobError(f"{path} holds a scalar; items must lie on axis 0")

    def get(i: int) -> Any:
        return np.array(arr[i]) if preprocess else np.ascontiguousarray(arr[i : i + 1])

    def rows(lo: int, hi: int) -> Any:
        return arr[lo:hi]  # a view of the memory-mapped file: one copy, into shared memory

    return Source(path, int(arr.shape[0]), get, _file_fp(path), None if preprocess else rows)


def _npz_source(path: Path, preprocess: bool) -> Source:
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    if not arrays:
        raise JobError(f"{path} holds no arrays")
    counts = {k: (a.shape[0] if a.ndim else -1) for k, a in arrays.items()}
    if len(set(counts.values())) != 1 or -1 in counts.values():
        raise JobError(f"{path}: every array needs the same length on axis 0, got {counts}")

    def get(i: int) -> Any:
        if preprocess:
            return {k: np.array(a[i]) for k, a in arrays.items()}
        return {k: np.ascontiguousarray(a[i : i + 1]) for k, a in arrays.items()}

    def rows(lo: int, hi: int) -> Any:
        return {k: a[lo:hi] for k, a in arrays.items()}

    return Source(path, next(iter(counts.values())), get, _file_fp(path), None if preprocess else rows)


def _dir_source(path: Path, preprocess: bool, ranks: dict[str, int]) -> Source:
    files = sorted(p for p in path.iterdir() if p.suffix in (".npy", ".npz") and p.is_file())
    if not files:
        raise JobError(f"{path} holds no .npy or .npz files")

    def batched(name: str, a: Array) -> Array:
        want = ranks.get(name, ranks.get("", -1))
        return a[None] if not preprocess and a.ndim == want - 1 else a

    def get(i: int) -> Any:
        f = files[i]
        if f.suffix == ".npy":
            return batched("", np.load(f))
        with np.load(f) as z:
            return {k: batched(k, z[k]) for k in z.files}

    fp = {"path": str(path.resolve()), "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
    return Source(path, len(files), get, fp)


def _text_source(path: Path, preprocess: bool) -> Source:
    if not preprocess:
        raise JobError(f"{path.name}: a text or JSONL input needs --preprocess module:function")
    as_json = path.suffix in (".jsonl", ".json", ".ndjson")
    numbered = [(n, ln) for n, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip()]
    items: list[Any] = []
    for n, line in numbered:
        try:
            items.append(json.loads(line) if as_json else line)
        except json.JSONDecodeError as exc:
            raise JobError(f"{path}: line {n} is not JSON ({exc})") from exc
    return Source(path, len(items), items.__getitem__, _file_fp(path))


# -- rows -----------------------------------------------------------------------------------------


def to_rows(outputs: Any, *, strip_batch: bool) -> dict[str, Array]:
    """One item's result as output rows. Model outputs carry a batch axis of 1, dropped here."""
    if not isinstance(outputs, dict):
        outputs = {"output": outputs}
    rows: dict[str, Array] = {}
    for name, value in outputs.items():
        a = np.asarray(value)
        if a.dtype.hasobject or a.dtype.kind in "USV":
            raise RowError(f"output {name!r} is not a numeric array (dtype {a.dtype})")
        if strip_batch:
            if a.ndim == 0 or a.shape[0] != 1:
                raise RowError(f"output {name!r} has shape {a.shape}; one item needs a batch axis of 1")
            a = a[0]
        rows[str(name)] = a
    return rows


def schema_of(rows: dict[str, Array]) -> Schema:
    return {k: (a.dtype.str, tuple(a.shape)) for k, a in rows.items()}


def check_rows(rows: dict[str, Array], schema: Schema) -> None:
    got = schema_of(rows)
    if got != schema:
        raise RowError(f"the result does not match the first item's outputs: {got} vs {schema}")


def blank(schema: Schema, count: int) -> dict[str, Array]:
    """Arrays for `count` rows: NaN where the dtype has it, zeros otherwise (failed rows)."""
    out: dict[str, Array] = {}
    for name, (dtype, shape) in schema.items():
        dt = np.dtype(dtype)
        fill: Any = np.nan if dt.kind in "fc" else 0
        out[name] = np.full((count, *shape), fill, dtype=dt)
    return out


# -- atomic files ---------------------------------------------------------------------------------


def write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write to a temporary file beside `path`, fsync, rename over it, fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, lambda f: f.write((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()))


def digest(path: Path, like: str = "crc32:") -> str:
    """A check of a shard's bytes against torn writes: CRC-32 (5x faster than blake2b here,
    which a shard of a million rows felt); journals of earlier versions hold blake2b digests,
    still read (`like` says which kind to compute)."""
    if not like.startswith("crc32:"):
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return f"crc32:{crc:08x}"


# -- the store: manifest, journal, shards ---------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    index: int
    error: str
    message: str
    attempts: int

    def as_json(self) -> dict[str, Any]:
        return {"index": self.index, "error": self.error, "message": self.message, "attempts": self.attempts}


@dataclass(frozen=True)
class Entry:
    """One journal line: a durable shard (or None when every item of it failed)."""

    shard: str | None
    size: int
    digest: str
    ranges: tuple[tuple[int, int], ...]
    failures: tuple[Failure, ...]

    def as_json(self) -> dict[str, Any]:
        return {"v": 1, "shard": self.shard, "size": self.size, "digest": self.digest,
                "ranges": [list(r) for r in self.ranges], "failures": [f.as_json() for f in self.failures]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Entry:
        return cls(d["shard"], int(d["size"]), str(d["digest"]), tuple((int(a), int(b)) for a, b in d["ranges"]),
                   tuple(Failure(**f) for f in d["failures"]))


def ranges_of(indices: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Sorted indices as half-open runs: [0, 1, 2, 5] -> ((0, 3), (5, 6))."""
    idx = np.asarray(indices if isinstance(indices, np.ndarray) else list(indices), dtype=np.int64)
    if not idx.size:
        return ()
    if (np.diff(idx) < 0).any():  # blocks come in order: sorting is rarely needed
        idx = np.sort(idx)
    breaks = np.flatnonzero(np.diff(idx) > 1) + 1  # where a run ends and the next begins (a repeat continues it)
    starts = idx[np.r_[0, breaks]]
    ends = idx[np.r_[breaks - 1, idx.size - 1]] + 1
    return tuple(zip(starts.tolist(), ends.tolist(), strict=True))


@dataclass
class Store:
    """The durable side of a job, in one folder (`parts`)."""

    parts: Path
    entries: list[Entry] = field(default_factory=list)
    invalid: int = 0  # journal entries dropped on open (torn or missing shard)
    _lock_fd: int = -1

    @property
    def shards(self) -> Path:
        return self.parts / "shards"

    @property
    def journal(self) -> Path:
        return self.parts / "journal.jsonl"

    @classmethod
    def open(cls, parts: Path, fingerprint: dict[str, Any], *, resume: bool, overwrite: bool) -> Store:
        manifest = parts / "manifest.json"
        if resume and not manifest.exists():
            raise JobError(f"--resume: nothing to resume in {parts} (no manifest.json)")
        parts.mkdir(parents=True, exist_ok=True)
        store = cls(parts)
        store._lock()
        try:
            if overwrite:
                clear(parts)
            store._check(manifest, fingerprint)
            store.shards.mkdir(exist_ok=True)
            if not manifest.exists():
                write_json(manifest, {"format": "slabpool-job/1", "job": fingerprint})
            store._load()
        except BaseException:
            store.close()
            raise
        return store

    @staticmethod
    def _check(manifest: Path, fingerprint: dict[str, Any]) -> None:
        if not manifest.exists():
            return
        try:
            old = json.loads(manifest.read_text())
        except (OSError, ValueError) as exc:
            raise JobError(f"{manifest} is unreadable ({exc}); pass --overwrite to start over") from exc
        if old.get("job") != fingerprint:
            raise JobError(f"{manifest.parent} holds results of a different job (input, model or hooks "
                           "changed); choose another OUTPUT or pass --overwrite")

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the lock
            self._lock_fd = -1

    def _lock(self) -> None:
        """One writer per OUTPUT; the kernel drops the lock when the process dies."""
        self._lock_fd = os.open(self.parts / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise JobError(f"another slabpool run is writing {self.parts}") from None

    def _load(self, *, readonly: bool = False) -> None:
        raw = self.journal.read_text().splitlines() if self.journal.exists() else []
        for line in raw:
            try:
                entry = Entry.from_json(json.loads(line))
            except (ValueError, KeyError, TypeError):
                self.invalid += 1
                continue
            if entry.shard is not None and not self._valid(entry):
                self.invalid += 1
                continue
            self.entries.append(entry)
        if readonly:
            return
        keep = {e.shard for e in self.entries}
        for p in self.shards.iterdir():  # orphans: written but never journaled, or torn
            if p.name not in keep:
                p.unlink()
        text = "".join(json.dumps(e.as_json()) + "\n" for e in self.entries)
        write_atomic(self.journal, lambda f: f.write(text.encode()))

    def _valid(self, entry: Entry) -> bool:
        assert entry.shard is not None
        p = self.shards / entry.shard
        try:
            return p.stat().st_size == entry.size and digest(p, entry.digest) == entry.digest
        except OSError:
            return False

    def settled(self) -> set[int]:
        """Indices whose outcome (a row, or a failure) is durable."""
        return {i for a, b in self.settled_ranges() for i in range(a, b)}

    def settled_ranges(self) -> list[tuple[int, int]]:
        """The durable indices as sorted, disjoint half-open runs (no set of every index)."""
        merged: list[list[int]] = []
        for a, b in sorted(r for e in self.entries for r in e.ranges):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return [(a, b) for a, b in merged]

    def settled_count(self) -> int:
        return sum(b - a for a, b in self.settled_ranges())

    def failures(self) -> list[Failure]:
        latest = {f.index: f for e in self.entries for f in e.failures}
        return [latest[i] for i in sorted(latest)]

    def schema(self) -> Schema | None:
        for e in self.entries:
            if e.shard is not None:
                with np.load(self.shards / e.shard) as z:
                    return {k: (z[k].dtype.str, tuple(z[k].shape[1:])) for k in z.files if k != INDEX_KEY}
        return None

    def commit(self, indices: Array, columns: dict[str, Array], failures: list[Failure]) -> Entry:
        """Make one shard durable, then journal it. `columns`: every output, row k of each
        belonging to item `indices[k]` (int64); a shard of no rows settles failures only."""
        name, size, dig = None, 0, ""
        if len(indices):
            name = f"shard-{int(indices[0]):09d}-{len(indices):06d}.npz"
            arrays = {**columns, INDEX_KEY: np.asarray(indices, dtype=np.int64)}
            path = self.shards / name
            write_atomic(path, lambda f: _savez(f, **arrays))
            size, dig = path.stat().st_size, digest(path)
        settled = np.concatenate([np.asarray(indices, np.int64), np.asarray([f.index for f in failures], np.int64)])
        entry = Entry(name, size, dig, ranges_of(settled), tuple(failures))
        with open(self.journal, "a") as j:
            j.write(json.dumps(entry.as_json()) + "\n")
            j.flush()
            os.fsync(j.fileno())
        self.entries.append(entry)
        return entry

    def rows(self) -> Iterator[tuple[Array, dict[str, Array]]]:
        """(indices, arrays) of every durable shard, in journal order."""
        for e in self.entries:
            if e.shard is not None:
                with np.load(self.shards / e.shard) as z:
                    yield z[INDEX_KEY], {k: z[k] for k in z.files if k != INDEX_KEY}


def clear(parts: Path) -> None:
    """Forget a previous job in `parts` (only the files a job writes)."""
    if (parts / "shards").is_dir():
        for p in (parts / "shards").iterdir():
            p.unlink()
    for name in ("manifest.json", "journal.jsonl", "failures.jsonl", "report.json"):
        (parts / name).unlink(missing_ok=True)


def assemble(store: Store, count: int, schema: Schema | None) -> dict[str, Array] | None:
    """Every output as one array of `count` rows; failed rows NaN (zeros for integers)."""
    schema = schema or store.schema()
    if schema is None:
        return None
    out = blank(schema, count)
    for idx, arrays in store.rows():
        for k, a in arrays.items():
            out[k][idx] = a
    return out


def read_output(output: str | os.PathLike[str]) -> dict[str, Array]:
    """A job's outputs as arrays, row i = item i, for a directory OUTPUT (or a FILE.parts)."""
    parts = Path(output)
    manifest = json.loads((parts / "manifest.json").read_text())
    store = Store(parts)
    store._load(readonly=True)
    count = int(manifest["job"]["count"])
    return assemble(store, count, None) or {}


def save_output(path: Path, arrays: dict[str, Array]) -> str | None:
    """Write the single-file OUTPUT atomically; return a note when .npy keeps only one output."""
    if path.suffix == ".npz":
        write_atomic(path, lambda f: _savez(f, **arrays))
        return None
    first = next(iter(arrays))
    write_atomic(path, lambda f: np.save(f, arrays[first]))
    if len(arrays) > 1:
        return f"{path.name} holds output {first!r}, the first of {len(arrays)}; use a .npz OUTPUT to keep all"
    return None
