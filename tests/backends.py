"""Which backend each test module runs on, and why (issue 20).

tests/test_ray.py runs its cases on both backends (`Engine` and `RayEngine`); every other
module runs on the local engine only. Each is listed here with the reason: what it tests
belongs to the local transport (its pipes, shared memory, worker processes, fork), or to
no backend (a pure unit, the package), or to the CLI, the batch job and the server, which
build a local Engine. A module whose behaviour does apply to Ray but is not run there says
"applies, not yet run on Ray: ..." instead. tests/test_tables.py fails on a test module
listed nowhere.
"""

from __future__ import annotations

APPLIES = "applies, not yet run on Ray: "

BOTH_BACKENDS = {
    "test_ray": "the contract suite, parametrized over `backend` (local and Ray)",
}

LOCAL_ONLY = {
    "test_admission": "the admission queue on its own (engine.core.admission): no backend",
    "test_async": APPLIES + "the asyncio front end (engine.caller.aio is the same on both backends)",
    "test_auto_shape": APPLIES + 'batch_size="auto"; the pool shape is measured on local worker processes',
    "test_batching": APPLIES + "dynamic batching beyond the one stacking case test_ray runs on both",
    "test_bench": "the benchmarks' smoke runs (python -m bench): local engine and in-process contenders",
    "test_blocks": APPLIES + "infer(batch_size=) byte-identity over sizes and runtimes (test_ray runs one case)",
    "test_cancel_replay": APPLIES + "cancel in every queue; the cases that kill reach into local worker pids",
    "test_cli": "the CLI/job: `slabpool run` builds a local Engine (engine.job.cli)",
    "test_cli_safety": "the CLI/job: output safety of `slabpool run`, local engine only",
    "test_cli_signals": "the CLI/job: signals to `slabpool run` at each stage, local engine only",
    "test_contract": APPLIES + "lifecycle, admission, deadlines, context (test_ray runs a subset)",
    "test_conventions": "the local engine's conventions: hook modules from the current folder, more workers "
                        "than CPUs, runtime chatter of local workers",
    "test_core_policy": "the owner core without processes (dispatch, the call bus, the ledger): no backend",
    "test_crash": APPLIES + "crash isolation at every stage (test_ray runs SIGKILL mid-task and poison); the "
                  "SIGSEGV/os._exit stages are faults of local worker processes",
    "test_deadlock": "pipes and their outbox: the local transport's",
    "test_docs": "the docs' examples as written; the Ray doc runs in test_ray",
    "test_engine": APPLIES + "one session per worker, byte-identity, nothing left behind (processes, shm)",
    "test_fastpath": "the fast path lends a local slot's pipe to its caller (Ray's transport lends none: "
                     "a unit case there)",
    "test_fault_matrix": APPLIES + "the stage x fault table; its shared-memory stages are the local transport's",
    "test_faults": APPLIES + "issue 13's regressions; several are of the local transport's pipes and shm",
    "test_first_contact": APPLIES + "results matched to inputs, errors in the caller's words, payloads that "
                          "cross intact (through Ray's object store instead of shared memory there)",
    "test_fork": "fork of the caller's process: the local engine's workers and shared memory (engine.local.forks)",
    "test_formats": "the CLI/job: `slabpool run` over files and tables, local engine only",
    "test_inplace": "IO binding into shared memory: outputs come back through Ray's object store",
    "test_job_blocks": "the CLI/job: row blocks and item chunks of `slabpool run`, local engine only",
    "test_job_columns": "the CLI/job: --columns of `slabpool run`, local engine only",
    "test_job_options": "the CLI/job: `slabpool run`'s options, local engine only",
    "test_job_shapes": "the CLI/job: outputs of changing shape to Parquet, local engine only",
    "test_job_tables": "the CLI/job: tables as row blocks, local engine only",
    "test_map": APPLIES + "map() ordering, indices and per-item errors; chunks are the local engine's "
                "(chunked_map is False on Ray)",
    "test_metrics_logs": APPLIES + "the Prometheus text and collector (test_ray checks the same families); "
                         "worker log records are the local workers'",
    "test_model_pinning": APPLIES + "a model file replaced at its path, then a slot rebuilt after a crash "
                          "(the crash is a local worker's)",
    "test_models": "the test-model builders against the runtimes in-process: no backend",
    "test_package": "the package, its layers and imports: no backend",
    "test_passthrough": "outputs bound in place in shared memory (workers/ort.py): the local transport's",
    "test_reload_local": "swaps where the worker processes are ours to start and kill (the contract on both "
                         "backends is in test_ray)",
    "test_serve": "`slabpool serve` builds a local Engine",
    "test_serve_bench": "`python -m bench.serve`: local engine only",
    "test_serve_cli": "`slabpool serve`'s arguments: local engine only",
    "test_serve_faults": "`slabpool serve` with local workers SIGKILLed or segfaulting",
    "test_serve_proto": "the committed gRPC message code: no backend",
    "test_shm": "shared memory (the allocator, arenas, leases): the local transport's",
    "test_startup_errors": "a local worker dying before its handshake (engine.local.mainguard, transport)",
    "test_stop_path": APPLIES + "a stop path that cannot be stopped; its stuck starts and late wake-ups are "
                      "triggered in local worker processes",
    "test_sweep": "the POSIX shared-memory sweep: the local transport's",
    "test_tables": "enums and tables, no process: no backend",
    "test_weights": APPLIES + "the weight cache (share_weights); whether Ray actors use it is not tested",
    "test_wire": "the frame reader of the local transport's pipes",
    "test_worker_share": "the worker's share of a call, on the local workers' pipe protocol",
}
