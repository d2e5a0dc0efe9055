"""The job's OUTPUT once every item is settled, and a job read back.

`publish` makes the single .npy/.npz OUTPUT from the direct/ files; `read_output` reads a
directory OUTPUT (or a FILE.parts) back as arrays, row i = item i.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from slabpool.engine.job.parquet import Schema
from slabpool.engine.job.store import shards
from slabpool.engine.job.store.direct import item_runs
from slabpool.engine.job.store.files import Array, fsync_dir, savez, temp_beside, write_atomic, write_error
from slabpool.engine.job.store.journal import Store
from slabpool.engine.job.store.rows import blank


def publish(store: Store, output: Path) -> tuple[bool, str | None]:
    """The single-file OUTPUT from the direct/ files (rows of older shards copied in first,
    failed rows filled): hard-linked (.npy) or streamed (.npz). (written?, a note)."""
    legacy = [e for e in store.entries if e.shard is not None]
    schema = store.schema() if not legacy else shards.npz_schema(store.shards / str(legacy[0].shard))
    if schema is None:
        return False, None
    files = store.direct_files(schema)
    assert files is not None
    for idx, arrays in store.shard_rows():
        order = np.argsort(idx, kind="stable")
        files.write(idx[order], {k: v[order] for k, v in arrays.items()}, item_runs(idx[order]))
    files.fill([f.index for f in store.failures()])
    files.sync()
    if store.direct == "npz":
        write_atomic(output, lambda f: savez(f, files.arrays()))
        return True, None
    tmp = temp_beside(output)
    try:
        os.link(files.paths[0], tmp)
    except OSError:  # no hard links here: a copy
        try:
            shutil.copyfile(files.paths[0], tmp)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise write_error(output, exc) from exc
    os.replace(tmp, output)
    fsync_dir(output.parent)
    if len(files.schema) > 1:
        return True, (f"{output.name} holds output {files.names[0]!r}, the first of {len(files.schema)}; "
                      "use a .npz OUTPUT to keep all")
    return True, None


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
        store.load(readonly=True)
        return assemble(store, count, None) or {}
    finally:
        store.close()


def save_output(path: Path, arrays: dict[str, Array]) -> str | None:
    """Write the single-file OUTPUT atomically; return a note when .npy keeps only one output."""
    if path.suffix.lower() == ".npz":
        write_atomic(path, lambda f: savez(f, arrays))
        return None
    first = next(iter(arrays))
    write_atomic(path, lambda f: np.save(f, arrays[first]))
    if len(arrays) > 1:
        return f"{path.name} holds output {first!r}, the first of {len(arrays)}; use a .npz OUTPUT to keep all"
    return None
