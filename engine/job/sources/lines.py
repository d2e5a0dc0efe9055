"""A source of lines: a text or JSONL file, or stdin; each non-blank line is one item.

A file is read twice, front to back, never held whole: once at the start to count its items
(and check that it is UTF-8), then in blocks as the job goes, READ_CHARS at a time (decoding
and newlines, `\\n`, `\\r\\n` or `\\r`, are handled in C; no Python per line but a split and a
test for blank). stdin cannot be read twice: it is kept in memory, and so is a pipe given as
INPUT (`<(zcat in.jsonl.gz)`, a FIFO, /dev/stdin), whose second read found nothing. A line
travels to the workers as it is, a str; a JSONL line is parsed there (`decode`, before the hook), so the
caller pays neither the parsing nor the pickling of what it parses to. A line that is not JSON
fails alone, as any item the hook fails on.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from slabpool.engine.job.hooks import json_line
from slabpool.engine.job.sources.base import Block, JobError, Source, file_fingerprint

READ_CHARS = 1 << 22  # characters decoded at a time


class LinesSource(Source):
    """Each non-blank line is one item, handed to the hook parsed as JSON, or as the raw
    string. `line` (what --keep may name) is its 1-based line number."""

    keepable = ("line",)

    def __init__(self, path: Path | None, hook: bool, *, as_json: bool, data: bytes | None = None) -> None:
        super().__init__(path, hook)
        self.kind = ("JSON lines" if as_json else "text lines") + (
            " on stdin" if path is None else " from a pipe" if data is not None else "")
        if not hook:
            raise JobError(f"{self.label}: a text or JSONL input needs --preprocess MOD:FN")
        self.decode = json_line if as_json else None
        self._data = data  # (None: a file, read twice)
        self.count = sum(len(texts) for texts, _ in self._pieces(numbered=False))  # not UTF-8: fails here
        if data is None:
            assert path is not None
            self.fingerprint = file_fingerprint(path)
        else:  # (what was read: a pipe is named too, the same data piped again resumes it)
            digest = hashlib.blake2b(data, digest_size=16).hexdigest()
            self.fingerprint = {"stdin": digest, "json": as_json} | ({"path": str(path)} if path is not None else {})

    def changed(self) -> str | None:
        return None if self._data is not None else super().changed()  # (what is held cannot change)

    def _open(self) -> IO[str]:
        # utf-8-sig: a byte order mark at the start (Windows editors write one) is not part of
        # the first line (it was, and a JSONL file's first item failed: "Unexpected UTF-8 BOM")
        if self._data is not None:
            return io.TextIOWrapper(io.BytesIO(self._data), encoding="utf-8-sig")
        assert self.path is not None
        return open(self.path, encoding="utf-8-sig")  # universal newlines: each ending reads as \n

    def _pieces(self, *, numbered: bool) -> Iterator[tuple[list[str], list[int]]]:
        """The non-blank lines, READ_CHARS of text at a time, in order: (their texts, their
        1-based line numbers if `numbered`, else [])."""
        with self._open() as f:
            rest, first = "", 1  # a line cut by the end of a read, and the number of the next line
            while True:
                text = f.read(READ_CHARS)
                lines = (rest + text).split("\n")
                rest = lines.pop() if text else ""  # the last is whole only at the end of the file
                if numbered:
                    kept = [(n, ln) for n, ln in enumerate(lines, first) if not ln.isspace() and ln]
                    yield [ln for _, ln in kept], [n for n, _ in kept]
                else:
                    yield [ln for ln in lines if ln and not ln.isspace()], []
                first += len(lines)
                if not text:
                    return

    def blocks(self, size: int) -> Iterator[Block]:
        start = 0
        for texts, numbers in self._pieces(numbered=bool(self.keep)):
            for lo in range(0, len(texts), size):
                part = texts[lo : lo + size]
                keep = {"line": numbers[lo : lo + size]} if self.keep else {}
                yield Block(start, len(part), items=part, keep=keep)
                start += len(part)
