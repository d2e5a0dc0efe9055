"""A .npy/.npz OUTPUT written in place: each kept output preallocated as one .npy of every
row in `direct/`, committed rows written at their place (pwrite, fdatasync) and checked by a
CRC-32 of their bytes; never assembled from shards."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from slabpool.engine.job.parquet import Schema
from slabpool.engine.job.store.files import write_error, write_json
from slabpool.engine.job.store.rows import blank

Array = npt.NDArray[Any]


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
            try:
                mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.dtype(dtype), shape=(count, *shape))
            except OSError as exc:
                raise write_error(path, exc) from exc
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
        for name, path, fd, off, width in zip(self.names, self.paths, self.fds, self.offsets, self.row_nbytes,
                                              strict=True):
            a = np.ascontiguousarray(np.asarray(columns[name], dtype=np.dtype(self.schema[name][0])))
            raw = a.reshape(-1).view(np.uint8).data
            for item, k, n in runs:
                _pwrite_all(path, fd, raw[k * width : (k + n) * width], off + item * width)

    def sync(self) -> None:
        """fdatasync every file; a failure (a full disk found at writeback) names the file."""
        for path, fd in zip(self.paths, self.fds, strict=True):
            try:
                os.fdatasync(fd)
            except OSError as exc:
                raise write_error(path, exc) from exc

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
        for name, path, fd, off, width in zip(self.names, self.paths, self.fds, self.offsets, self.row_nbytes,
                                              strict=True):
            raw = rows[name].tobytes()
            for i in indices:
                _pwrite_all(path, fd, raw, off + i * width)


def _pwrite_all(path: Path, fd: int, data: memoryview | bytes, offset: int) -> None:
    """Every byte at `offset`. The files are sparse: a row takes its disk space only when it is
    written, so a full disk shows here, and the error must name the file (the kernel's does not)."""
    view = memoryview(data)
    try:
        while view.nbytes:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
    except OSError as exc:
        raise write_error(path, exc) from exc


def item_runs(indices: Array) -> list[tuple[int, int, int]]:
    """(first item, first position, length) of each stretch of consecutive items in `indices`."""
    if not len(indices):
        return []
    if int(indices[-1]) - int(indices[0]) == len(indices) - 1 and (len(indices) < 3 or bool(np.all(np.diff(indices) == 1))):
        return [(int(indices[0]), 0, len(indices))]  # a block: one stretch
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    starts = np.r_[0, breaks]
    lengths = np.diff(np.r_[starts, len(indices)])
    return list(zip(indices[starts].tolist(), starts.tolist(), lengths.tolist(), strict=True))


def crc_of(parts: list[tuple[Array, dict[str, Any]]], names: list[str], schema: Schema) -> int:
    """The CRC `DirectFiles.crc` gives for the done rows of `parts` once written: every output
    in turn, the rows in item order."""
    order = sorted((item, p, k, n) for p, (indices, _) in enumerate(parts) for item, k, n in item_runs(indices))
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
