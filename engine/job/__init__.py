"""The batch job, `slabpool run`: `cli` (the command line), `run` (the job: blocks of rows or
chunks of items through an Engine, progress, the report), `sources` (what it reads), `store`
(what it writes, durably and resumably), `parquet` (Parquet output), `hooks` (batched hooks)."""
