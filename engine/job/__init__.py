"""The batch job, `slabpool run`: read items, map them through a local Engine, keep results
durably and resumably. The flow, step by step, is drawn in `run`.

    cli         the `slabpool` command line (run, inspect, doctor, bench)
    options     the argument types of `run` (what each option accepts, and how it says no)
    spec        JobSpec (what a run was asked), its checks, --max-failures, the job's fingerprint
    run         run_job: steps 1-5, the run and its engine
    dispatch    steps 2-4 by blocks of rows (one task per block) or by items (Engine.map)
    collector   settled outcomes buffered, committed to the store when due
    progress    the progress bar or lines, rates over the running phase
    signals     Ctrl-C/SIGTERM at every stage (installed first by the CLI); where tests hold a job
    report      Report (report.json), JobOutcome, the summary lines
    hooks       batched hooks: a task's item is a list of items
    sources/    what it reads: open_source; base (Source, Block, RowReader), arrays (.npy, .npz,
                folders), lines (text, JSONL, stdin), tables (Parquet, CSV, Arrow)
    store/      what it writes: journal (Store: manifest, journal, resume), direct (.npy/.npz
                written in place), shards, output (publish, read_output), rows, files (atomic)
    parquet     Parquet shards and the .parquet OUTPUT
"""
