"""The batch job's durable store: how results become durable and are read back.
(Where items come from: engine.job_sources; Parquet shards and output: engine.job_parquet.)

    OUTPUT: a directory, or FILE.npy|.npz|.parquet with FILE.parts/ beside it
    manifest.json    which job this is (a fingerprint); written once
    journal.jsonl    one line per durable commit: its item ranges, its size and digest, the
                     failures it settled
    shards/*.npz     rows of done items, `__index__` says which (a directory OUTPUT; Parquet
                     OUTPUT: shards/*.parquet hold every settled item, failed ones with null
                     outputs and an `error`)
    direct/          FILE.npy|.npz: each kept output preallocated as one .npy of every row
                     (NN.npy, names and schema in schema.json), rows written in place
    failures.jsonl   index, error class, message, attempts
    report.json      the summary of the last run
    .lock            flock: one writer per OUTPUT

A shard becomes durable in three steps: write a temporary file, fsync, rename (then fsync the
folder); only then is its journal line appended (and fsynced). A .npy/.npz OUTPUT has no
shards: a commit writes its rows straight into the preallocated direct/ files, fdatasyncs
them, then journals the row ranges with a CRC-32 of their bytes (a `direct` line); at the end
failed rows are filled (NaN, 0 for integers) and the file is hard-linked as OUTPUT (.npy) or
streamed into it (.npz): no assembly from shards. On open the journal is read back,
and an entry counts only if its shard has the recorded size and digest (a direct line: if its
rows' bytes have the recorded CRC): a torn write is never read as done, and its shard must hold exactly the items the line claims (else the folder was
changed by something else: a JobError). The journal is then rewritten with the valid entries
alone, so a torn last line cannot swallow the next append.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from slabpool.engine.job import parquet as job_parquet
from slabpool.engine.job.parquet import INDEX_KEY, Schema
from slabpool.engine.job.sources import JobError

Array = npt.NDArray[Any]
__all__ = ["INDEX_KEY", "JobError", "RowError", "Schema", "Store", "read_output", "save_output", "savez"]


class RowError(ValueError):
    """An item's result cannot be stored as a row of the output (ragged, not numeric)."""


# -- rows -----------------------------------------------------------------------------------------


def to_rows(outputs: Any, *, strip_batch: bool, parquet: bool = False,
            reserved: tuple[str, ...] = ()) -> dict[str, Any]:
    """One item's result as output rows. Model outputs carry a batch axis of 1, dropped here.

    A row is a numeric array; for a Parquet OUTPUT also any other value a postprocess returns
    (str, a Python number or list, ...), kept as it is. A non-numeric value bound for .npy/.npz
    stops the job (JobError: it would fail every item), pointing to .parquet."""
    if not isinstance(outputs, dict):
        outputs = {"output": outputs}
    rows: dict[str, Any] = {}
    taken = (INDEX_KEY, job_parquet.ERROR_KEY, *reserved) if parquet else (INDEX_KEY, *reserved)
    for key, value in outputs.items():
        name = key if type(key) is str else str(key)
        if name in taken:
            raise JobError(f"an output is named {name!r}, which the OUTPUT already uses for "
                           f"{'a --keep column' if name in reserved else 'its own column'}: rename it")
        if parquet and not isinstance(value, np.ndarray | np.generic):
            rows[name] = value  # stored as it is
            continue
        try:
            a = np.asarray(value)
        except ValueError as exc:  # ragged nested lists
            raise RowError(f"output {name!r} is not an array ({exc})") from exc
        if strip_batch:
            if a.ndim == 0 or a.shape[0] != 1:
                raise RowError(f"output {name!r} has shape {a.shape}; one item needs a batch axis of 1")
            a = a[0]
        if a.dtype.hasobject or a.dtype.kind in "USV":
            if not parquet:
                raise JobError(f"output {name!r} holds {a.dtype} values ({type(value).__name__}); .npy/.npz "
                               "and folder OUTPUTs keep numbers only: use -o OUT.parquet")
            rows[name] = a.tolist()
            continue
        rows[name] = a
    return rows


def schema_of(rows: dict[str, Any]) -> Schema:
    """(dtype, shape) of each numeric row; ("py", ()) for a value stored as it is (Parquet)."""
    return {k: (a.dtype.str, tuple(a.shape)) if isinstance(a, np.ndarray) else (job_parquet.PY, ())
            for k, a in rows.items()}


def check_rows(rows: dict[str, Any], schema: Schema) -> None:
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
            try:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            except OSError as exc:
                raise _write_error(path, exc) from exc
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def _write_error(path: Path, exc: OSError) -> OSError:
    """A failed write that names the file and the cause. numpy reports a short write (a full
    disk, a file size limit) as "N requested and M written", with no errno and no path."""
    code = exc.errno
    if code is None and "requested and" in str(exc):
        code = errno.ENOSPC
    why = "no space left on device" if code == errno.ENOSPC else (exc.strerror or str(exc))
    try:
        free = f"; {shutil.disk_usage(path.parent).free} bytes free there"
    except OSError:
        free = ""
    return OSError(code, f"could not write {path}: {why} ({exc}){free}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, lambda f: f.write((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()))


def savez(f: IO[bytes], arrays: dict[str, Array]) -> None:
    """An uncompressed .npz of `arrays`, any names allowed: np.savez(f, **arrays) would take an
    array named `file` or `allow_pickle` as its own argument."""
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, a in arrays.items():
            with z.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(a), allow_pickle=False)


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
    direct: bool = False  # the done rows lie in the direct/ files (digest: their bytes' CRC)

    def as_json(self) -> dict[str, Any]:
        return {"v": 1, "shard": self.shard, "size": self.size, "digest": self.digest,
                "ranges": [list(r) for r in self.ranges], "failures": [f.as_json() for f in self.failures],
                **({"direct": True} if self.direct else {})}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Entry:
        return cls(d["shard"], int(d["size"]), str(d["digest"]), tuple((int(a), int(b)) for a, b in d["ranges"]),
                   tuple(Failure(**f) for f in d["failures"]), bool(d.get("direct", False)))

    def done_ranges(self) -> tuple[tuple[int, int], ...]:
        """The ranges of the rows done (settled, not failed)."""
        if not self.failures:
            return self.ranges
        every = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.ranges])
        return ranges_of(np.setdiff1d(every, [f.index for f in self.failures]))


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


class DirectFiles:
    """A .npy/.npz OUTPUT's arrays, preallocated (sparse) in `folder`, one NN.npy per kept
    output: committed rows are written at their place with pwrite, fdatasync'ed, and never
    assembled again. schema.json (written before any row) names them."""

    def __init__(self, folder: Path, schema: Schema, names: list[str], count: int) -> None:
        self.folder, self.schema, self.names, self.count = folder, schema, names, count
        self.paths = [folder / f"{k:02d}.npy" for k in range(len(names))]
        self.fds: list[int] = []
        self.offsets: list[int] = []
        self.row_nbytes = [np.dtype(schema[n][0]).itemsize * int(np.prod(schema[n][1], dtype=np.int64))
                           for n in names]

    @classmethod
    def create(cls, folder: Path, schema: Schema, names: list[str], count: int) -> DirectFiles:
        folder.mkdir(exist_ok=True)
        files = cls(folder, schema, names, count)
        for path, name in zip(files.paths, names, strict=True):
            path.unlink(missing_ok=True)  # a new inode: an old OUTPUT hard-linked to it stays as it was
            dtype, shape = schema[name]
            mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.dtype(dtype), shape=(count, *shape))
            del mm  # a sparse file of the right size: nothing written yet
        write_json(folder / "schema.json", {"schema": {k: [d, list(sh)] for k, (d, sh) in schema.items()},
                                            "names": names, "count": count})
        files._open()
        return files

    @classmethod
    def load(cls, folder: Path) -> DirectFiles | None:
        """The files as created before, or None (never created, or damaged)."""
        try:
            meta = json.loads((folder / "schema.json").read_text())
            schema = {k: (str(d), tuple(int(n) for n in sh)) for k, (d, sh) in meta["schema"].items()}
            files = cls(folder, schema, list(meta["names"]), int(meta["count"]))
            files._open()
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return files

    def _open(self) -> None:
        for path, name in zip(self.paths, self.names, strict=True):
            mm = np.load(path, mmap_mode="r")
            dt, sh = self.schema[name]
            if mm.dtype != np.dtype(dt) or mm.shape != (self.count, *sh):
                raise ValueError(f"{path} holds {mm.dtype} {mm.shape}, not {dt} {(self.count, *sh)}")
            self.offsets.append(int(mm.offset))
            del mm
            self.fds.append(os.open(path, os.O_RDWR))

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def write(self, indices: Array, columns: dict[str, Any], runs: list[tuple[int, int, int]]) -> None:
        """Rows of `columns` (row k is item indices[k]) at their place; `runs`: (first item,
        first row k, length) of each stretch of consecutive items."""
        for name, fd, off, width in zip(self.names, self.fds, self.offsets, self.row_nbytes, strict=True):
            a = np.ascontiguousarray(np.asarray(columns[name], dtype=np.dtype(self.schema[name][0])))
            raw = a.reshape(-1).view(np.uint8).data
            for item, k, n in runs:
                _pwrite_all(fd, raw[k * width : (k + n) * width], off + item * width)

    def sync(self) -> None:
        for fd in self.fds:
            os.fdatasync(fd)

    def crc(self, ranges: Iterable[tuple[int, int]], crc: int = 0) -> int:
        """CRC-32 of the rows of `ranges`, every output in turn (as a commit computes it)."""
        ranges = list(ranges)
        for fd, off, width in zip(self.fds, self.offsets, self.row_nbytes, strict=True):
            for a, b in ranges:
                at, end = off + a * width, off + b * width
                while at < end:
                    block = os.pread(fd, min(end - at, 1 << 22), at)
                    if not block:
                        raise OSError("the file ends before the rows")
                    crc = zlib.crc32(block, crc)
                    at += len(block)
        return crc

    def arrays(self) -> dict[str, Array]:
        return {name: np.load(path, mmap_mode="r") for name, path in zip(self.names, self.paths, strict=True)}

    def fill(self, indices: list[int]) -> None:
        """Failed rows: NaN where the dtype has it, else 0."""
        if not indices:
            return
        rows = blank({n: self.schema[n] for n in self.names}, 1)
        for name, fd, off, width in zip(self.names, self.fds, self.offsets, self.row_nbytes, strict=True):
            raw = rows[name].tobytes()
            for i in indices:
                _pwrite_all(fd, raw, off + i * width)


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _runs(indices: Array) -> list[tuple[int, int, int]]:
    """(first item, first position, length) of each stretch of consecutive items in `indices`."""
    if not len(indices):
        return []
    if int(indices[-1]) - int(indices[0]) == len(indices) - 1 and (len(indices) < 3 or bool(np.all(np.diff(indices) == 1))):
        return [(int(indices[0]), 0, len(indices))]  # a block: one stretch
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    starts = np.r_[0, breaks]
    lengths = np.diff(np.r_[starts, len(indices)])
    return list(zip(indices[starts].tolist(), starts.tolist(), lengths.tolist(), strict=True))


def _crc_of(parts: list[tuple[Array, dict[str, Any]]], names: list[str], schema: Schema) -> int:
    """The CRC `DirectFiles.crc` gives for the done rows of `parts` once written: every output
    in turn, the rows in item order."""
    order = sorted((item, p, k, n) for p, (indices, _) in enumerate(parts) for item, k, n in _runs(indices))
    crc = 0
    for name in names:
        raws = []
        for _, cols in parts:
            a = np.ascontiguousarray(np.asarray(cols[name], dtype=np.dtype(schema[name][0])))
            raws.append((a.reshape(-1).view(np.uint8).data, a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))))
        for _, p, k, n in order:
            raw, width = raws[p]
            crc = zlib.crc32(raw[k * width : (k + n) * width], crc)
    return crc


@dataclass
class Store:
    """The durable side of a job, in one folder (`parts`)."""

    parts: Path
    parquet: bool = False  # shards are Parquet files holding failed rows too (engine.job_parquet)
    keep_types: dict[str, Any] = field(default_factory=dict)  # arrow types of --keep columns
    entries: list[Entry] = field(default_factory=list)
    invalid: int = 0  # journal entries dropped on open (torn or missing shard)
    direct: str | None = None  # "npy" (the first output kept) or "npz" (all): rows go to direct/
    count: int = 0  # items of the job (the direct files' rows)
    _lock_fd: int = -1
    _files: DirectFiles | None = None

    @property
    def shards(self) -> Path:
        return self.parts / "shards"

    @property
    def journal(self) -> Path:
        return self.parts / "journal.jsonl"

    @property
    def direct_folder(self) -> Path:
        return self.parts / "direct"

    @classmethod
    def open(cls, parts: Path, fingerprint: dict[str, Any], *, resume: bool, overwrite: bool,
             parquet: bool = False, keep_types: dict[str, Any] | None = None, direct: str | None = None,
             count: int = 0) -> Store:
        manifest = parts / "manifest.json"
        if resume and overwrite:
            raise JobError("--resume and --overwrite contradict each other: choose one")
        if resume and not manifest.exists():
            raise JobError(f"--resume: nothing to resume in {parts} (no manifest.json)")
        parts.mkdir(parents=True, exist_ok=True)
        store = cls(parts, parquet, dict(keep_types or {}), direct=direct, count=count)
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
        if self._files is not None:
            self._files.close()
            self._files = None
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
        for n, line in enumerate(raw, 1):
            try:
                entry = Entry.from_json(json.loads(line))
            except (ValueError, KeyError, TypeError):
                self.invalid += 1
                continue
            if entry.direct:
                if not self._valid_direct(entry):
                    self.invalid += 1
                    continue
            elif entry.shard is not None and not self._valid(entry):
                self.invalid += 1
                continue
            else:
                self._check_claims(entry, n)
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

    def _valid_direct(self, entry: Entry) -> bool:
        files = self.direct_files()
        try:
            return files is not None and f"crc32:{files.crc(entry.done_ranges()):08x}" == entry.digest
        except OSError:
            return False

    def direct_files(self, schema: Schema | None = None) -> DirectFiles | None:
        """The direct/ files: opened once; created (for `schema`) when there are none yet."""
        if self._files is None:
            self._files = DirectFiles.load(self.direct_folder)
        if self._files is None and schema is not None:
            names = list(schema) if self.direct == "npz" else list(schema)[:1]
            self._files = DirectFiles.create(self.direct_folder, schema, names, self.count)
        return self._files

    def _check_claims(self, entry: Entry, line: int) -> None:
        """A valid line's shard must hold exactly the rows the line claims: else the folder was
        changed outside slabpool, and reading it would give rows that were never computed."""
        claimed = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in entry.ranges] or [np.zeros(0, np.int64)])
        if not self.parquet:
            claimed = np.setdiff1d(claimed, [f.index for f in entry.failures])
        held = np.zeros(0, np.int64) if entry.shard is None else self._indices(self.shards / entry.shard)
        if not np.array_equal(np.unique(held), claimed) or len(held) != len(claimed):
            lost = np.setdiff1d(claimed, held)[:5].tolist() or np.setdiff1d(held, claimed)[:5].tolist()
            raise JobError(f"{self.journal} line {line} claims item(s) {lost} that shard {entry.shard} does "
                           "not hold as journaled; the folder was changed outside slabpool: pass --overwrite "
                           "to start over")

    def _indices(self, path: Path) -> Array:
        if self.parquet:
            return job_parquet.shard_indices(path)
        with np.load(path) as z:
            return np.asarray(z[INDEX_KEY], dtype=np.int64)

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
        if any(e.direct for e in self.entries):
            files = self.direct_files()
            return None if files is None else files.schema
        for e in self.entries:
            if e.shard is not None and self.parquet:
                found = job_parquet.shard_schema(self.shards / e.shard)
                if found is not None:
                    return found
            elif e.shard is not None:
                with np.load(self.shards / e.shard) as z:
                    return {k: (z[k].dtype.str, tuple(z[k].shape[1:])) for k in z.files if k != INDEX_KEY}
        return None

    def commit(self, indices: Array, columns: dict[str, Any], failures: list[Failure], *,
               kept: dict[str, list[Any]] | None = None, schema: Schema | None = None) -> Entry:
        """Make one shard durable, then journal it. `columns`: every output, row k of each
        belonging to item `indices[k]` (int64); a shard of no rows settles failures only.
        Parquet: `columns` may be lists (values stored as they are), `kept` holds the --keep
        columns (the done items' values, then the failures'), `schema` the outputs' (a shard
        is written for failures too)."""
        name, size, dig = None, 0, ""
        if self.parquet:
            name = self._parquet_shard(indices, columns, failures, kept or {}, schema or {})
            path = self.shards / name
            size, dig = path.stat().st_size, digest(path)
        elif len(indices):
            name = f"shard-{int(indices[0]):09d}-{len(indices):06d}.npz"
            arrays = {**columns, INDEX_KEY: np.asarray(indices, dtype=np.int64)}
            path = self.shards / name
            write_atomic(path, lambda f: savez(f, arrays))
            size, dig = path.stat().st_size, digest(path)
        settled = np.concatenate([np.asarray(indices, np.int64), np.asarray([f.index for f in failures], np.int64)])
        entry = Entry(name, size, dig, ranges_of(settled), tuple(failures))
        self._journal(entry)
        return entry

    def commit_direct(self, parts: list[tuple[Array, dict[str, Any]]], failures: list[Failure],
                      schema: Schema | None) -> Entry:
        """Rows straight into the direct/ files (no shard), fdatasync'ed, then journaled with
        their CRC. `parts`: (item indices, outputs with rows on axis 0) as buffered."""
        indices = np.concatenate([i for i, _ in parts]) if parts else np.zeros(0, np.int64)
        if not len(indices):
            return self.commit(indices, {}, failures)
        assert schema is not None
        files = self.direct_files(schema)
        assert files is not None
        if {n: schema[n] for n in files.names} != {n: files.schema[n] for n in files.names}:
            raise JobError(f"{self.direct_folder} was made for outputs {files.schema}, the model gives {schema}; "
                           "pass --overwrite to start over")
        for idx, cols in parts:
            files.write(idx, cols, _runs(idx))
        files.sync()
        crc = _crc_of(parts, files.names, files.schema)
        settled = np.concatenate([indices, np.asarray([f.index for f in failures], np.int64)])
        size = sum(len(indices) * w for w in files.row_nbytes)
        entry = Entry(None, size, f"crc32:{crc:08x}", ranges_of(settled), tuple(failures), direct=True)
        self._journal(entry)
        return entry

    def _journal(self, entry: Entry) -> None:
        with open(self.journal, "a") as j:
            j.write(json.dumps(entry.as_json()) + "\n")
            j.flush()
            os.fsync(j.fileno())
        self.entries.append(entry)

    def publish(self, output: Path) -> tuple[bool, str | None]:
        """The single-file OUTPUT from the direct/ files (rows of older shards copied in first,
        failed rows filled): hard-linked (.npy) or streamed (.npz). (written?, a note)."""
        legacy = [e for e in self.entries if e.shard is not None]
        schema = self.schema() if not legacy else self._shard_schema()
        if schema is None:
            return False, None
        files = self.direct_files(schema)
        assert files is not None
        for idx, arrays in self._shard_rows():
            order = np.argsort(idx, kind="stable")
            files.write(idx[order], {k: v[order] for k, v in arrays.items()}, _runs(idx[order]))
        files.fill([f.index for f in self.failures()])
        files.sync()
        if self.direct == "npz":
            write_atomic(output, lambda f: savez(f, files.arrays()))
            return True, None
        tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        try:
            os.link(files.paths[0], tmp)
        except OSError:  # no hard links here: a copy
            shutil.copyfile(files.paths[0], tmp)
        os.replace(tmp, output)
        fsync_dir(output.parent)
        if len(files.schema) > 1:
            return True, (f"{output.name} holds output {files.names[0]!r}, the first of {len(files.schema)}; "
                          "use a .npz OUTPUT to keep all")
        return True, None

    def _shard_schema(self) -> Schema | None:
        for e in self.entries:
            if e.shard is not None:
                with np.load(self.shards / e.shard) as z:
                    return {k: (z[k].dtype.str, tuple(z[k].shape[1:])) for k in z.files if k != INDEX_KEY}
        return None

    def _shard_rows(self) -> Iterator[tuple[Array, dict[str, Array]]]:
        for e in self.entries:
            if e.shard is not None:
                with np.load(self.shards / e.shard) as z:
                    yield z[INDEX_KEY], {k: z[k] for k in z.files if k != INDEX_KEY}

    def _parquet_shard(self, indices: Array, columns: dict[str, Any], failures: list[Failure],
                       kept: dict[str, list[Any]], schema: Schema) -> str:
        count = len(indices) + len(failures)
        keep = {k: kept.get(k) or [None] * count for k in self.keep_types}
        failed = [(f.index, f"{f.error}: {f.message}") for f in failures]
        first = min([*([int(np.min(indices))] if len(indices) else []), *(f.index for f in failures)])
        name = f"shard-{first:09d}-{count:06d}.parquet"
        write_atomic(self.shards / name,
                     lambda f: job_parquet.write_shard(f, indices, columns, failed, keep, self.keep_types, schema))
        return name

    def shard_paths(self) -> list[Path]:
        return [self.shards / e.shard for e in self.entries if e.shard is not None]

    def rows(self) -> Iterator[tuple[Array, dict[str, Array]]]:
        """(indices, arrays) of every durable shard (or direct line), in journal order."""
        files = self.direct_files() if any(e.direct for e in self.entries) else None
        mapped = files.arrays() if files is not None else {}
        for e in self.entries:
            if e.direct:
                for a, b in e.done_ranges():
                    yield np.arange(a, b, dtype=np.int64), {k: np.asarray(v[a:b]) for k, v in mapped.items()}
        yield from self._shard_rows()


def clear(parts: Path) -> None:
    """Forget a previous job in `parts` (only the files a job writes). Files are unlinked, never
    rewritten: an OUTPUT hard-linked to a direct/ file keeps its bytes."""
    for folder in ("shards", "direct"):
        if (parts / folder).is_dir():
            for p in (parts / folder).iterdir():
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
    count = int(manifest["job"]["count"])
    store = Store(parts, count=count)
    try:
        store._load(readonly=True)
        return assemble(store, count, None) or {}
    finally:
        store.close()


def save_output(path: Path, arrays: dict[str, Array]) -> str | None:
    """Write the single-file OUTPUT atomically; return a note when .npy keeps only one output."""
    if path.suffix == ".npz":
        write_atomic(path, lambda f: savez(f, arrays))
        return None
    first = next(iter(arrays))
    write_atomic(path, lambda f: np.save(f, arrays[first]))
    if len(arrays) > 1:
        return f"{path.name} holds output {first!r}, the first of {len(arrays)}; use a .npz OUTPUT to keep all"
    return None
