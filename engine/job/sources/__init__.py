"""Where a batch job's items come from: arrays, folders of files, text/JSONL lines, tables, stdin.

    INPUT                 one item is                    a hook gets          --keep may name
    in.npy                a row on axis 0 (memory-mapped) x[i]                 -
    in.npz                row i of every array            {name: a[i]}         -
    dir/ (no hook)        one .npy/.npz file              -                    path
    dir/ (with a hook)    any regular file, recursively   its path, a str      path
    .jsonl/.json/.ndjson  a non-blank line (JSON)         the JSON value       line
    any other file        a non-blank line, a str         the line             line
    -                     a stdin line (JSON, or raw)     the value            line
    a pipe (<(zcat ..))   read once and held, as stdin    the value            line
    .parquet/.csv/.arrow  a table row (pyarrow, batches)  {column: value}      any column

A source is read front to back in `Block`s of consecutive items. Without a hook an array or
table block carries `rows` (each model input's rows on axis 0, a row block); otherwise it
carries `items` (one value per item). `Block.item(j)` is what `Engine.submit` gets for one item
(rows keep their batch axis: `x[j:j+1]`). A value that cannot be read (a bad file, a null
cell) raises from `item(j)`, so that item alone fails. A JSONL line travels as its text and is
parsed in the workers, before the hook (`Source.decode`): a line that is not JSON fails alone.

`base` holds what every source offers (`Source`, `Block`, and `RowReader` for row blocks);
`arrays` (.npy, .npz, folders), `lines` (text, JSONL, stdin) and `tables` (Parquet, CSV,
Arrow, with pyarrow) the kinds; `open_source` picks one.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

from slabpool.engine.job.sources.arrays import ArrayFolderSource, FileFolderSource, NpySource, NpzSource
from slabpool.engine.job.sources.base import Block, JobError, RowReader, Source, require_pyarrow
from slabpool.engine.job.sources.lines import LinesSource
from slabpool.engine.job.sources.tables import ArrowSource, CsvSource, ParquetSource

__all__ = ["Block", "JobError", "RowReader", "Source", "open_source", "require_pyarrow"]
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
TABLE_SUFFIXES = (".parquet", ".pq", ".csv", ".arrow", ".feather", ".ipc")


def open_source(path: Path, *, hook: bool, text: bool = False) -> Source:
    """Open INPUT (`-` is stdin). `text`: lines are raw strings, not JSON (stdin, .jsonl)."""
    if str(path) != "-" and not path.exists():
        raise JobError(f"input not found: {path}")
    try:
        if str(path) == "-":
            return LinesSource(None, hook, as_json=not text, data=sys.stdin.buffer.read())
        if path.is_dir():
            return FileFolderSource(path, hook) if hook else ArrayFolderSource(path, hook)
        suffix = path.suffix.lower()
        if not path.is_file():  # a pipe (`<(zcat in.jsonl.gz)`, a FIFO, /dev/stdin): it reads once, as
            # stdin does, and its lines are JSON as stdin's are unless its name says text (or --text)
            if suffix in (".npy", ".npz", *TABLE_SUFFIXES):
                raise JobError(f"{path} is not a regular file (a pipe?): a {suffix} INPUT is read more than "
                               "once and at any row; save it to a file first")
            with open(path, "rb") as f:
                data = f.read()
            return LinesSource(path, hook, as_json=(suffix in JSON_SUFFIXES or not suffix) and not text, data=data)
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
    except (OSError, ValueError, EOFError, UnicodeDecodeError, zipfile.BadZipFile) as exc:  # pyarrow's: ValueErrors
        raise JobError(f"cannot read input {path}: {exc}") from exc
