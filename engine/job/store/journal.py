"""The store's journal: which items of a job are durable, kept so that a run resumes.

`Store.open` takes the OUTPUT's folder (one writer: a flock), checks the manifest against the
job's fingerprint, and reads the journal back (`load`): a line counts only if its shard (or its
direct rows) checks out. `commit` makes a shard durable, `commit_direct` rows of the direct/
files, each then journaled (`Entry`, with the `Failure`s it settled).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from slabpool.engine.job import parquet as job_parquet
from slabpool.engine.job.parquet import Schema
from slabpool.engine.job.sources import JobError
from slabpool.engine.job.store import shards
from slabpool.engine.job.store.direct import DirectFiles, crc_of, item_runs
from slabpool.engine.job.store.files import append_synced, digest, write_atomic, write_json

Array = npt.NDArray[Any]
FORMAT = "slabpool-job/2"  # manifest.json's format (engine.job.spec.fingerprint says what "job" holds)


class DifferentJob(JobError):
    """OUTPUT's manifest is another job's; `manifest` is what it holds (the caller says how
    the jobs differ)."""

    def __init__(self, message: str, manifest: Any) -> None:
        super().__init__(message)
        self.manifest = manifest


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


@dataclass
class Store:
    """The durable side of a job, in one folder (`parts`)."""

    parts: Path
    parquet: bool = False  # shards are Parquet files holding failed rows too (engine.job.parquet)
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
                write_json(manifest, {"format": FORMAT, "job": fingerprint})
            store.load()
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
        if old.get("job") != fingerprint or old.get("format") != FORMAT:
            raise DifferentJob(f"{manifest.parent} holds results of a different job", old)

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

    def load(self, *, readonly: bool = False) -> None:
        """Read the journal back: keep the lines whose shard (or direct rows) checks out; unless
        `readonly`, remove orphan shards and rewrite the journal with the valid lines alone."""
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
        held = np.zeros(0, np.int64) if entry.shard is None else shards.indices(self.shards / entry.shard,
                                                                                 parquet=self.parquet)
        if not np.array_equal(np.unique(held), claimed) or len(held) != len(claimed):
            lost = np.setdiff1d(claimed, held)[:5].tolist() or np.setdiff1d(held, claimed)[:5].tolist()
            raise JobError(f"{self.journal} line {line} claims item(s) {lost} that shard {entry.shard} does "
                           "not hold as journaled; the folder was changed outside slabpool: pass --overwrite "
                           "to start over")

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
                return shards.npz_schema(self.shards / e.shard)
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
            failed = [(f.index, f"{f.error}: {f.message}") for f in failures]
            name = shards.write_parquet(self.shards, indices, columns, failed, kept or {}, self.keep_types, schema or {})
            path = self.shards / name
            size, dig = path.stat().st_size, digest(path)
        elif len(indices):
            name = shards.write_npz(self.shards, indices, columns)
            path = self.shards / name
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
            files.write(idx, cols, item_runs(idx))
        files.sync()
        crc = crc_of(parts, files.names, files.schema)
        settled = np.concatenate([indices, np.asarray([f.index for f in failures], np.int64)])
        size = sum(len(indices) * w for w in files.row_nbytes)
        entry = Entry(None, size, f"crc32:{crc:08x}", ranges_of(settled), tuple(failures), direct=True)
        self._journal(entry)
        return entry

    def _journal(self, entry: Entry) -> None:
        append_synced(self.journal, (json.dumps(entry.as_json()) + "\n").encode())
        self.entries.append(entry)

    def shard_rows(self) -> Iterator[tuple[Array, dict[str, Array]]]:
        """(indices, arrays) of every durable .npz shard, in journal order."""
        for e in self.entries:
            if e.shard is not None:
                yield shards.npz_rows(self.shards / e.shard)

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
        yield from self.shard_rows()


def clear(parts: Path) -> None:
    """Forget a previous job in `parts` (only the files a job writes). Files are unlinked, never
    rewritten: an OUTPUT hard-linked to a direct/ file keeps its bytes."""
    for folder in ("shards", "direct"):
        if (parts / folder).is_dir():
            for p in (parts / folder).iterdir():
                p.unlink()
    for name in ("manifest.json", "journal.jsonl", "failures.jsonl", "report.json"):
        (parts / name).unlink(missing_ok=True)
