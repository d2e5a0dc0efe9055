"""Sources of arrays: a .npy (rows on axis 0, memory-mapped), a .npz (row i of every array),
a folder of .npy/.npz files (no hook: a file is one item), a folder of any files (with a hook:
a file's path is one item)."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from slabpool.engine.job.sources.base import (
    BARE,
    Array,
    Block,
    JobError,
    Source,
    block_bounds,
    file_fingerprint,
    folder_fingerprint,
    input_changed,
    what_changed,
)

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
        self._length = self.array.offset + self.array.nbytes  # (the file's bytes its rows need)

    def _rows(self, lo: int, hi: int) -> Any:
        self._still_whole()
        return self.array[lo:hi]  # a view of the memory-mapped file: one copy, into shared memory

    def _still_whole(self) -> None:
        """Before rows of the mapped file are read: a file truncated since (rewritten in place by
        its producer) raises JobError here; its pages past the end would kill the process with
        SIGBUS in the copy. (A truncation in the microseconds between this look and the copy
        still does: the mapping is the price of a copy-free read.)"""
        assert self.path is not None
        try:
            size = os.stat(self.path).st_size
        except OSError:
            return  # (removed, or replaced and gone: the mapping holds the file it was; the job's end says so)
        if size < self._length:
            raise JobError(input_changed(what_changed(self.fingerprint, {**self.fingerprint, "size": size})))

    def blocks(self, size: int) -> Iterator[Block]:
        for s, e in block_bounds(self.count, size):
            self._still_whole()
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
        for s, e in block_bounds(self.count, size):
            if self.hook:
                items = [{k: np.array(a[i]) for k, a in self.arrays.items()} for i in range(s, e)]
                yield Block(s, e - s, items=items)
            else:
                yield Block(s, e - s, rows={k: a[s:e] for k, a in self.arrays.items()})


# -- folders ---------------------------------------------------------------------------------------


class _Folder(Source):
    """A folder whose files (`_hold`) are its items; its fingerprint is each file's."""

    keepable = ("path",)
    files: list[Path]

    def _hold(self, path: Path, files: list[Path]) -> None:
        self.files, self.count, self.fingerprint = files, len(files), folder_fingerprint(path, files)

    def fingerprint_now(self) -> dict[str, Any]:
        assert self.path is not None
        return folder_fingerprint(self.path, self.files)


class ArrayFolderSource(_Folder):
    """No hook: each .npy/.npz file (top level, by name) is one item's array(s)."""

    kind = "a folder of .npy/.npz files"

    def __init__(self, path: Path, hook: bool) -> None:
        super().__init__(path, hook)
        files = sorted(p for p in path.iterdir() if p.suffix in (".npy", ".npz") and p.is_file())
        if not files:
            raise JobError(f"{path} holds no .npy or .npz files; a folder of other files needs "
                           "--preprocess MOD:FN (it gets each file's path)")
        self._hold(path, files)

    def _batched(self, name: str, a: Array) -> Array:
        """A batch axis is added when the array has one dimension less than the model input."""
        ranks = {s.name: len(s.shape) for s in self.inputs}
        want = ranks.get(name, len(self.inputs[0].shape) if len(self.inputs) == 1 else -1)
        return a[None] if a.ndim == want - 1 else a

    def _load(self, f: Path) -> Any:
        """One file's array(s); a file that is not a readable .npy/.npz (empty, cut short, not a
        zip) raises ValueError naming it: that item alone fails (numpy raises EOFError and
        zipfile.BadZipFile, which are not an item's errors to the job)."""
        try:
            if f.suffix == ".npy":
                return self._batched(BARE, np.load(f))
            with np.load(f) as z:
                return {k: self._batched(k, z[k]) for k in z.files}
        except (EOFError, zipfile.BadZipFile) as exc:
            raise ValueError(f"{f.name} cannot be read as {f.suffix}: {exc}") from exc

    def blocks(self, size: int) -> Iterator[Block]:
        for s, e in block_bounds(self.count, size):
            keep = {"path": [f.name for f in self.files[s:e]]} if "path" in self.keep else {}
            yield Block(s, e - s, items=self.files[s:e], load=self._load, keep=keep)


class FileFolderSource(_Folder):
    """With a hook: every regular file under the folder (recursively, by relative path)."""

    kind = "a folder of files"

    def __init__(self, path: Path, hook: bool) -> None:
        super().__init__(path, hook)
        files = sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise JobError(f"{path} holds no files")
        self._hold(path, files)

    def blocks(self, size: int) -> Iterator[Block]:
        assert self.path is not None
        for s, e in block_bounds(self.count, size):
            keep = {"path": [f.relative_to(self.path).as_posix() for f in self.files[s:e]]} if self.keep else {}
            yield Block(s, e - s, items=[str(f) for f in self.files[s:e]], keep=keep)
