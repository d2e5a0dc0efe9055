"""Sources of arrays: a .npy (rows on axis 0, memory-mapped), a .npz (row i of every array),
a folder of .npy/.npz files (no hook: a file is one item), a folder of any files (with a hook:
a file's path is one item)."""

from __future__ import annotations

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

    def _rows(self, lo: int, hi: int) -> Any:
        return self.array[lo:hi]  # a view of the memory-mapped file: one copy, into shared memory

    def blocks(self, size: int) -> Iterator[Block]:
        for s, e in block_bounds(self.count, size):
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
        for s, e in block_bounds(self.count, size):
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
        for s, e in block_bounds(self.count, size):
            keep = {"path": [f.relative_to(self.path).as_posix() for f in self.files[s:e]]} if self.keep else {}
            yield Block(s, e - s, items=[str(f) for f in self.files[s:e]], keep=keep)
