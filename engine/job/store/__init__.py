"""The batch job's durable store: how results become durable and are read back.
(Where items come from: engine.job.sources; Parquet shards and output: engine.job.parquet.)

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
rows' bytes have the recorded CRC): a torn write is never read as done, and its shard must
hold exactly the items the line claims (else the folder was changed by something else: a
JobError). The journal is then rewritten with the valid entries

`journal` holds the `Store` (manifest, lock, journal, resume: what is settled), `direct` the
.npy/.npz OUTPUT's preallocated files, `shards` the shard files (.npz; .parquet through
engine.job.parquet), `output` the single-file OUTPUT and reading a job back (`read_output`),
`rows` an item's result as output rows, `files` atomic writes and digests.
"""

from slabpool.engine.job.parquet import INDEX_KEY, Schema
from slabpool.engine.job.sources import JobError
from slabpool.engine.job.store.files import savez, write_atomic, write_json
from slabpool.engine.job.store.journal import DifferentJob, Entry, Failure, Store
from slabpool.engine.job.store.output import assemble, publish, read_output, save_output
from slabpool.engine.job.store.rows import RowError

__all__ = ["INDEX_KEY", "DifferentJob", "Entry", "Failure", "JobError", "RowError", "Schema", "Store", "assemble", "publish",
           "read_output", "save_output", "savez", "write_atomic", "write_json"]
