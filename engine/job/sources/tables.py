"""Sources of tables: Parquet, CSV and Arrow IPC, read with pyarrow in record batches, never
whole (pyarrow is imported only for them: `pip install 'slabpool[parquet]'`). A row is one
item; the model's input columns become arrays (`column_array`, `column_rows`, `cell_array`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from slabpool.engine.job.sources.base import (
    READ_ROWS,
    SPAN_BYTES,
    Array,
    Block,
    JobError,
    RowReader,
    Source,
    Span,
    SpanRows,
    arrow_name,
    file_fingerprint,
    prefetch,
    require_pyarrow,
)
from slabpool.workers.protocol import TensorSpec


class TableSource(Source):
    """A Parquet, CSV or Arrow table, read in record batches. A row is one item. A model input
    is the column named after it, or (--columns x=a,b,c) the columns a, b, c side by side: row
    j of input x is [a[j], b[j], c[j]]."""

    keepable: tuple[str, ...]

    def __init__(self, path: Path, hook: bool) -> None:
        super().__init__(path, hook)
        self.pa = require_pyarrow(f"reading {path.name}")
        self.name = arrow_name(path, self)  # (the path, as pyarrow opens it)
        self.fingerprint = file_fingerprint(path)
        self.schema = self._schema()
        self.keepable = tuple(self.schema.names)
        self.keep_types = {f.name: f.type for f in self.schema}
        self.gather: dict[str, tuple[str, ...]] = {}  # --columns: model input -> its columns, in order

    def choose_columns(self, columns: dict[str, tuple[str, ...]]) -> None:
        if columns and self.hook:
            raise JobError("--columns feeds the model straight from the table; with --preprocess the hook gets "
                           "each row as a dict: leave out one or the other")
        for name, cols in columns.items():
            missing = [c for c in cols if c not in self.schema.names]
            if missing:
                raise JobError(f"--columns {name}={','.join(cols)}: {self.label} has no column "
                               f"{', '.join(map(repr, missing))} (columns: {', '.join(self.schema.names)})")
            for c in cols:
                t = self.schema.field(c).type
                if not _scalar_number(self.pa, t):
                    raise JobError(f"--columns {name}={','.join(cols)}: column {c!r} holds {t}; each gathered "
                                   "column must hold one number a row (int, float or bool)")
        self.gather = dict(columns)

    def _read_columns(self) -> list[str]:
        """The columns read without a hook: each input's own (or gathered ones), then --keep."""
        own = [c for s in self.inputs for c in self.gather.get(s.name, (s.name,))]
        return list(dict.fromkeys([*own, *self.keep]))

    def _schema(self) -> Any:
        raise NotImplementedError

    def _batches(self, columns: list[str] | None, size: int) -> Iterator[Any]:
        raise NotImplementedError

    def bind(self, inputs: Sequence[TensorSpec]) -> None:
        super().bind(inputs)
        if self.hook:
            return
        names = [s.name for s in inputs]
        unknown = [n for n in self.gather if n not in names]
        if unknown:
            raise JobError(f"--columns {unknown[0]}=...: the model has no input {unknown[0]!r} (inputs: "
                           f"{', '.join(names)})")
        missing = [n for n in names if n not in self.schema.names and n not in self.gather]
        if missing:
            raise JobError(f"{self.label} has no column {', '.join(map(repr, missing))} for the model's "
                           f"input(s) {names} (columns: {', '.join(self.schema.names)}); name the columns "
                           "after the inputs, gather them with --columns INPUT=COL,COL,... or pass --preprocess MOD:FN")
        for spec in inputs:
            if spec.name in self.gather:
                self._check_gathered(spec)
                continue
            leaf = _leaf_type(self.pa, self.schema.field(spec.name).type)
            if leaf is None:
                raise JobError(f"{self.label}: column {spec.name!r} is {self.schema.field(spec.name).type}; "
                               "a model input needs numbers or lists of numbers (or pass --preprocess MOD:FN)")

    def _check_gathered(self, spec: TensorSpec) -> None:
        """--columns x=a,b,c: x takes rows of len(cols) numbers of its own dtype (never cast)."""
        cols = self.gather[spec.name]
        what = f"--columns {spec.name}={','.join(cols)}"
        if len(spec.shape) != 2:
            raise JobError(f"{what}: the model's input {spec.name!r} has shape {_dims(spec.shape)}; gathered "
                           "columns make rows of shape [N, columns]")
        if spec.shape[1] is not None and spec.shape[1] != len(cols):
            raise JobError(f"{what}: {len(cols)} columns, but the model's input {spec.name!r} takes "
                           f"{spec.shape[1]} numbers a row ({_dims(spec.shape)})")
        want = np.dtype(spec.dtype)
        for c in cols:
            got = np.dtype(self.schema.field(c).type.to_pandas_dtype())
            if got != want:
                raise JobError(f"{what}: column {c!r} holds {self.schema.field(c).type} ({got}), the model's input "
                               f"{spec.name!r} takes {want}; nothing is cast: store the column as {want}")

    @property
    def blockable(self) -> bool:
        return not self.hook

    def row_reader(self, todo: list[tuple[int, int]]) -> RowReader:
        return SpanRows(todo, prefetch(self.spans()))

    def spans(self) -> Iterator[Span]:
        """The whole table front to back as Spans: record batches gathered up to ~SPAN_BYTES,
        each input column turned into one array; unreadable rows are spans of their own."""
        columns = self._read_columns()
        start, gathered, nbytes = 0, [], 0
        for batch in self._batches(columns, 16 * READ_ROWS):
            gathered.append(batch)
            nbytes += batch.nbytes
            if nbytes >= SPAN_BYTES:
                yield from self._spans_of(start, gathered)
                start += sum(b.num_rows for b in gathered)
                gathered, nbytes = [], 0
        if gathered:
            yield from self._spans_of(start, gathered)
            start += sum(b.num_rows for b in gathered)
        if start != self.count:
            raise JobError(f"{self.label}: read {start} rows, expected {self.count} (changed while read?)")

    def _spans_of(self, start: int, batches: list[Any]) -> Iterator[Span]:
        table = self.pa.Table.from_batches(batches)
        n = table.num_rows
        keep = {k: table.column(k).to_pylist() for k in self.keep}
        bad: dict[int, ValueError] = {}
        arrays: dict[str, Array] = {}
        for spec in self.inputs:
            got = self._input_rows(table, spec.name, bad)
            if got is None:  # ragged lists: row by row, same-shaped neighbours together
                yield from self._row_spans(start, table, keep)
                return
            arrays[spec.name] = got
        at = 0
        for j in [*sorted(bad), n]:
            if j > at:
                yield Span(start + at, start + j, {k: a[at:j] for k, a in arrays.items()},
                           keep={k: v[at:j] for k, v in keep.items()})
            if j < n:
                yield Span(start + j, start + j + 1, error=bad[j], keep={k: v[j : j + 1] for k, v in keep.items()})
            at = j + 1

    def _row_spans(self, start: int, table: Any, keep: dict[str, list[Any]]) -> Iterator[Span]:
        """Each row read on its own; consecutive rows of the same shapes form one span."""
        cols = {s.name: s.name for s in self.inputs}
        run: list[dict[str, Array]] = []

        def flush(j: int) -> Iterator[Span]:
            if run:
                lo = j - len(run)
                yield Span(start + lo, start + j, {k: np.stack([r[k] for r in run]) for k in cols},
                           keep={k: v[lo:j] for k, v in keep.items()})
                run.clear()

        for j in range(table.num_rows):
            try:
                row = {k: self._input_cell(table, k, j) for k in cols}
            except ValueError as exc:
                yield from flush(j)
                yield Span(start + j, start + j + 1, error=exc, keep={k: v[j : j + 1] for k, v in keep.items()})
                continue
            if run and any(run[0][k].shape != row[k].shape for k in cols):
                yield from flush(j)
            run.append(row)
        yield from flush(table.num_rows)

    def blocks(self, size: int) -> Iterator[Block]:
        columns = None if self.hook else self._read_columns()
        start = 0
        for batch in self._batches(columns, size):
            for off in range(0, batch.num_rows, size):
                part = batch.slice(off, size)
                yield self._block(start, part)
                start += part.num_rows
        if start != self.count:
            raise JobError(f"{self.label}: read {start} rows, expected {self.count} (changed while read?)")

    def _block(self, start: int, batch: Any) -> Block:
        n = batch.num_rows
        keep = {k: batch.column(k).to_pylist() for k in self.keep}
        if self.hook:
            return Block(start, n, items=batch.to_pylist(), keep=keep)
        rows: dict[str, Array] = {}
        for spec in self.inputs:
            arr = self._input_block(batch, spec.name)
            if arr is None:  # ragged lists or nulls: each row on its own
                return Block(start, n, items=self._per_row(batch), load=_raise_errors, keep=keep)
            rows[spec.name] = arr
        return Block(start, n, rows=rows, keep=keep)

    def _per_row(self, batch: Any) -> list[Any]:
        out: list[Any] = []
        for j in range(batch.num_rows):
            try:
                out.append({s.name: self._input_cell(batch, s.name, j)[None] for s in self.inputs})
            except ValueError as exc:
                out.append(exc)
        return out

    # one model input from a table (or batch): its own column, or its gathered ones side by side

    def _input_rows(self, table: Any, name: str, bad: dict[int, ValueError]) -> Array | None:
        cols = self.gather.get(name)
        if cols is None:
            return column_rows(self.pa, table.column(name).combine_chunks(), name, bad)
        parts = [column_rows(self.pa, table.column(c).combine_chunks(), c, bad) for c in cols]
        return np.stack([p for p in parts if p is not None], axis=1)  # scalar columns: never None

    def _input_block(self, batch: Any, name: str) -> Array | None:
        cols = self.gather.get(name)
        if cols is None:
            return column_array(self.pa, batch.column(name))
        parts = [a for c in cols if (a := column_array(self.pa, batch.column(c))) is not None]
        return np.stack(parts, axis=1) if len(parts) == len(cols) else None  # a null: each row on its own

    def _input_cell(self, table: Any, name: str, j: int) -> Array:
        cols = self.gather.get(name)
        if cols is None:
            return cell_array(self.pa, table.column(name), j, name)
        return np.stack([cell_array(self.pa, table.column(c), j, c) for c in cols])


def _raise_errors(value: Any) -> Any:
    if isinstance(value, BaseException):
        raise value
    return value


class ParquetSource(TableSource):
    kind = "a Parquet table"

    def __init__(self, path: Path, hook: bool) -> None:
        super().__init__(path, hook)
        self.count = int(self._file().metadata.num_rows)

    def _file(self) -> Any:
        import pyarrow.parquet as pq

        return pq.ParquetFile(self.name)

    def _schema(self) -> Any:
        return self._file().schema_arrow

    def _batches(self, columns: list[str] | None, size: int) -> Iterator[Any]:
        yield from self._file().iter_batches(batch_size=size, columns=columns)


class ArrowSource(TableSource):
    """Arrow IPC (Feather v2): the file format, or the stream format."""

    kind = "an Arrow table"

    def __init__(self, path: Path, hook: bool) -> None:
        super().__init__(path, hook)
        try:
            r = self.pa.ipc.open_file(self.name)
            self.count = sum(r.get_batch(i).num_rows for i in range(r.num_record_batches))
        except self.pa.ArrowInvalid:
            self.count = sum(b.num_rows for b in self._stream(None))

    def _stream(self, columns: list[str] | None) -> Iterator[Any]:
        try:
            r = self.pa.ipc.open_file(self.name)
            batches: Iterator[Any] = (r.get_batch(i) for i in range(r.num_record_batches))
        except self.pa.ArrowInvalid:
            batches = iter(self.pa.ipc.open_stream(self.name))
        for b in batches:
            yield b.select(columns) if columns is not None else b

    def _schema(self) -> Any:
        try:
            return self.pa.ipc.open_file(self.name).schema
        except self.pa.ArrowInvalid:
            return self.pa.ipc.open_stream(self.name).schema

    def _batches(self, columns: list[str] | None, size: int) -> Iterator[Any]:
        yield from self._stream(columns)


class CsvSource(TableSource):
    """CSV with a header row; pyarrow infers column types from the first block (8 MiB)."""

    kind = "a CSV table"
    BLOCK = 8 << 20

    def __init__(self, path: Path, hook: bool) -> None:
        self.column_types: dict[str, Any] = {}  # columns parsed as a given type (--columns)
        super().__init__(path, hook)
        self.count = sum(b.num_rows for b in self._reader([self.schema.names[0]]))

    def bind(self, inputs: Sequence[TensorSpec]) -> None:
        """A CSV's text has no binary type: an input's columns (gathered, or the one named
        after it) are parsed as its dtype (a cell that does not parse as one stops the job,
        naming it), not inferred and cast. Was: only gathered ones, so a column for a float32
        input was read as double and refused."""
        names = set(self.schema.names)
        for spec in inputs:
            for c in self.gather.get(spec.name, (spec.name,) if spec.name in names else ()):
                self.column_types[c] = self.pa.from_numpy_dtype(np.dtype(spec.dtype))
        if self.column_types:
            self.schema = self._reader(list(self.schema.names)).schema
        super().bind(inputs)

    def _reader(self, columns: list[str] | None) -> Any:
        from pyarrow import csv

        convert = (csv.ConvertOptions(include_columns=columns, column_types=self.column_types)
                   if columns is not None else None)
        # an empty line is a row (a null cell: it fails alone), not skipped as pyarrow's default
        # has it: a one-column CSV with an empty cell lost that row, and every later row took
        # the output of the one before it (exit 0, nothing said)
        return csv.open_csv(self.name, read_options=csv.ReadOptions(block_size=self.BLOCK),
                            parse_options=csv.ParseOptions(ignore_empty_lines=False), convert_options=convert)

    def _schema(self) -> Any:
        return self._reader(None).schema

    def _batches(self, columns: list[str] | None, size: int) -> Iterator[Any]:
        try:
            yield from self._reader(columns)
        except self.pa.ArrowInvalid as exc:
            raise JobError(f"{self.label}: {exc}") from exc


# -- arrow columns -> numpy ------------------------------------------------------------------------


def _scalar_number(pa: Any, t: Any) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t))


def _dims(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _leaf_type(pa: Any, t: Any) -> Any:
    """The numeric type inside (nested) lists, or None when the column is not numeric."""
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    numeric = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
    return t if numeric else None


def column_array(pa: Any, col: Any) -> Array | None:
    """A numeric or (nested) list column as one array (rows on axis 0); None when lists are
    ragged or a value is null (then each row is read on its own)."""
    if col.null_count:
        return None
    t = col.type
    n = len(col)
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        if pa.types.is_fixed_size_list(t):
            k = t.list_size
        else:
            import pyarrow.compute as pc

            lengths = pc.list_value_length(col)
            if n and pc.min_max(lengths)["min"] != pc.min_max(lengths)["max"]:
                return None
            k = lengths[0].as_py() if n else 0
        inner = column_array(pa, col.flatten())
        if inner is None:
            return None
        return inner.reshape((n, k, *inner.shape[1:]))
    if _leaf_type(pa, t) is None:
        return None
    return np.asarray(col.to_numpy(zero_copy_only=False))


def column_rows(pa: Any, col: Any, name: str, bad: dict[int, ValueError]) -> Array | None:
    """A column as one array (rows on axis 0), its null rows zero and listed in `bad` with
    their error; None when its lists are ragged (or hold nulls inside)."""
    if not col.null_count:
        return column_array(pa, col)
    valid = np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    good = column_array(pa, col.filter(pa.array(valid)))
    if good is None:
        return None
    for j in np.flatnonzero(~valid).tolist():
        bad.setdefault(j, ValueError(f"column {name!r} ({col.type}) is null in this row"))
    out = np.zeros((len(col), *good.shape[1:]), dtype=good.dtype)
    out[valid] = good
    return out


def cell_array(pa: Any, col: Any, j: int, name: str) -> Array:
    """Row j of a column as an array of the column's numeric type (ValueError when null/ragged)."""
    value = col[j].as_py()
    if value is None or _has_none(value):
        raise ValueError(f"column {name!r} ({col.type}) is null in this row")
    dtype = np.dtype(_leaf_type(pa, col.type).to_pandas_dtype())
    a = np.asarray(value, dtype=dtype)
    if a.dtype == object:
        raise ValueError("ragged nested lists cannot form an array")
    return a


def _has_none(value: Any) -> bool:
    if isinstance(value, list):
        return any(_has_none(v) for v in value)
    return value is None
