"""A source of lines: a text or JSONL file, or stdin; each non-blank line is one item."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slabpool.engine.job.sources.base import Block, JobError, Source, block_bounds, file_fingerprint


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
        for s, e in block_bounds(self.count, size):
            keep = {"line": self.lines[s:e]} if self.keep else {}
            yield Block(s, e - s, items=self.values[s:e], keep=keep)
