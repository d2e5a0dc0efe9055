"""Which backend each test module runs on, and why (issue 20).

A module in BOTH_BACKENDS runs its behaviour cases on the local engine and on Ray: each such
case takes the `backend` (or `start_or_ray`) fixture of tests/ray_support/plugin.py, and its
[ray] case runs in the confined Ray run. The text says what runs on Ray and, by test or group,
why the rest does not apply there (a [ray] case that does not apply skips with that reason).
A module in LOCAL_ONLY says why none of it applies to Ray: it belongs to the local transport
(its pipes, shared memory, worker processes, fork), or to no backend (a pure unit, the
package), or to the CLI, the batch job and the server, which build a local Engine.
tests/test_tables.py fails on a module listed nowhere, in both, or with no real reason.
"""

from __future__ import annotations

BOTH_BACKENDS = {
    "test_ray": "the contract suite, parametrized over `backend`, and the Ray-only cases (Ray Data, placement, "
                "node loss, the Ray docs)",
    "test_async": "the asyncio front end (engine.caller.aio) on both; local only: the loop's waits on the queue's "
                  "condition (TaskQueue, one code) and the Starlette example (it builds a local Engine)",
    "test_batching": "dynamic batching: stacking, trailing shapes, a task larger than a batch, a bad item, a batch "
                     "that kills its slot, a replayed batch's bytes: all on both",
    "test_blocks": "infer(batch_size=) on both (sizes 7 and 1000, other models, memory-mapped inputs, LiteRT, auto, "
                   "rows failing alone, block edges, hooks, the door); local only: outputs written in place in "
                   "shared memory (in_place_min_bytes is refused on Ray), the block sizer (a pure unit), and the "
                   "chunk counts of map()",
    "test_cancel_replay": "cancel in every queue (queued, waiting to replay, grouped, in hand) x single, group, "
                          "stacked on both; a map() chunk is the local engine's (chunked_map is False on Ray)",
    "test_contract": "admission, bounded map, cancel with kill, deadlines, close in every state, the contract after "
                     "preprocess, empty batches, context, queue_bytes on both; local only: input leases and arenas "
                     "in shared memory (cancel frees a lease, arena sizes, a small /dev/shm), and the door's table "
                     "(BaseEngine._admit, one code; test_ray runs it on Ray)",
    "test_crash": "a crash at each stage (SIGSEGV, os._exit, SIGKILL, SIGBUS in preprocess, run, postprocess), "
                  "poison, replay seeds, a hung Python task, a long ONNX run stopped, recycling, an owner bug: on "
                  "both; local only: the write_outputs stage (into the shared-memory arena), SIGBUS read as a "
                  "shared-memory fault, faults injected in a local worker's start-up (Ray restarts an actor in its "
                  "constructor), the chaos runs (thousands of tasks under random SIGKILLs: minutes of the confined "
                  "run) and a SIGKILLed supervisor's shared memory",
    "test_engine": "byte-identity (ONNX Runtime, LiteRT), Result, caller-owned outputs, multi-input, map order, "
                   "stats, hooks, a pool without a model, read-only input views, bad models, with-blocks: on both; "
                   "local only: construction settings of the local engine (start_method, in_place_min_bytes), "
                   "import cost and error pickling (no backend), output regions granted per batch (shared memory)",
    "test_fault_matrix": "the stage x fault cells where an actor or the Ray transport takes part, on both; the "
                         "others say why by cell (NOT_ON_RAY: arenas, write_outputs, a worker held with SIGSTOP, "
                         "the caller's side that is one code)",
    "test_faults": "what does not cross (a context, inputs, a result, a result too deep) and a map() refusal at its "
                   "position, on both; local only: arena splits and sizes, a dropped engine's workers reaped by "
                   "this process, Ctrl-C from a worker's initializer (multiprocessing.parent_process), whether "
                   "a SIGSTOPped worker has taken its next batch or holds a task (its status word in shared memory; "
                   "Ray's transport sees a call when it returns: the stall of a running call is test_ray's), a "
                   "task_timeout inside a group (on Ray a call with a task_timeout holds one task), the main guard "
                   "(multiprocessing's spawn), a full disk under `slabpool run`",
    "test_first_contact": "map() results carry their index (through errors and a killing item), map_async, a "
                          "relative model path, a non-tensor output, payloads that cross intact (Ray's object "
                          "store), refusals at submit and after preprocess: on both; local only: chunk sizes 7 and "
                          "auto (one task per item on Ray), the settings' and calls' TypeErrors (BaseEngine, before "
                          "any backend starts: RayEngine's run there without a cluster)",
    "test_map": "map() order, per-item refusals at the door at their position, unordered map, on both; local only: "
                "what counts chunks (several items as one task) and the chunk sizer (a pure unit)",
    "test_metrics_logs": "the Prometheus text, the collector, labelled engines, histograms on both; local only: "
                         "worker log records, which cross a local worker's pipe into the caller's logging (an "
                         "actor's stay in Ray's worker logs)",
    "test_model_pinning": "a slot rebuilt after a crash serves the pinned model (weights, in place, external data) "
                          "and map() after a deploy is one model, on both; local only: the pin as a pure unit and "
                          "under both start methods",
    "test_stop_path": "close(timeout=) while a rebuilt slot hangs in its start-up, on both; local only: the wake-up "
                      "pipe of the local transport's selector, startup_timeout on a rebuilt worker (on Ray it bounds "
                      "the constructor only: Ray places a restarted actor when it can, docs/ray.md), RLIMIT_AS on "
                      "the engine's process (a Ray driver's address space is Ray's)",
    "test_user_code": "a hook's exception whose str() raises, and its SystemExit / KeyboardInterrupt / "
                      "GeneratorExit, each its own task's error, on both; local only: a worker process's exit "
                      "held by a thread a hook left, and a hook's fork whose child returns (an actor is Ray's "
                      "process, started and ended by Ray)",
    "test_weights": "outputs of the shared (prepacked, external-data) and LiteRT forms byte-identical, and the "
                    "slot's account of its weights, on both; local only: PSS of local workers, the cache's files "
                    "(entries, damage, races, the digest: workers.weights without an engine), `slabpool doctor`",
}

LOCAL_ONLY = {
    "test_admission": "the admission queue on its own (engine.core.admission): no backend",
    "test_auto_shape": 'workers="auto" and batch_size="auto" size the pool from this host\'s usable CPUs and '
                       "memory and a local worker's RSS; a Ray pool's size is the cluster's (cpus_per_slot, "
                       "placement: test_ray)",
    "test_bench": "the benchmarks' smoke runs (python -m bench): local engine and in-process contenders",
    "test_cli": "the CLI/job: `slabpool run` builds a local Engine (engine.job.cli)",
    "test_cli_safety": "the CLI/job: output safety of `slabpool run`, local engine only",
    "test_cli_signals": "the CLI/job: signals to `slabpool run` at each stage, local engine only",
    "test_combine": "callers combined under load take the local engine's lent slots and its data-marked faults "
                    "(tests/express_hooks.py patches the local worker's session); a RayEngine's infer() goes alone",
    "test_conventions": "the local engine's conventions: hook modules from the current folder, more workers "
                        "than CPUs, runtime chatter of local workers",
    "test_core_policy": "the owner core without processes (dispatch, the call bus, the ledger): no backend",
    "test_deadlock": "pipes and their outbox: the local transport's",
    "test_docs": "the docs' examples as written; the Ray doc runs in test_ray",
    "test_express": "the express lane takes a local slot's pipe and arenas (engine.local.express; a RayEngine's "
                    "calls take the owner's path)",
    "test_fastpath": "the fast path lends a local slot's pipe to its caller (Ray's transport lends none: "
                     "a unit case there)",
    "test_fork": "fork of the caller's process: the local engine's workers and shared memory (engine.local.forks)",
    "test_formats": "the CLI/job: `slabpool run` over files and tables, local engine only",
    "test_inplace": "IO binding into shared memory: outputs come back through Ray's object store",
    "test_job_blocks": "the CLI/job: row blocks and item chunks of `slabpool run`, local engine only",
    "test_job_columns": "the CLI/job: --columns of `slabpool run`, local engine only",
    "test_job_options": "the CLI/job: `slabpool run`'s options, local engine only",
    "test_job_shapes": "the CLI/job: outputs of changing shape to Parquet, local engine only",
    "test_job_tables": "the CLI/job: tables as row blocks, local engine only",
    "test_models": "the test-model builders against the runtimes in-process: no backend",
    "test_package": "the package, its layers and imports: no backend",
    "test_passthrough": "outputs bound in place in shared memory (workers/ort.py): the local transport's",
    "test_reload_local": "swaps where the worker processes are ours to start and kill (the contract on both "
                         "backends is in test_ray)",
    "test_serve": "`slabpool serve` builds a local Engine",
    "test_serve_bench": "`python -m bench.serve`: local engine only",
    "test_serve_cli": "`slabpool serve`'s arguments: local engine only",
    "test_serve_eager": "serve's protocol and eager start; the inference route on a local Engine",
    "test_serve_faults": "`slabpool serve` with local workers SIGKILLed or segfaulting",
    "test_serve_proto": "the committed gRPC message code: no backend",
    "test_shm": "shared memory (the allocator, arenas, leases): the local transport's",
    "test_startup_errors": "a local worker dying before its handshake (engine.local.mainguard, transport)",
    "test_sweep": "the POSIX shared-memory sweep: the local transport's",
    "test_tables": "enums and tables, no process: no backend",
    "test_wire": "the frame reader of the local transport's pipes",
    "test_worker_lean": "the local worker's lean path for one plain task (workers.lean), on its pipe protocol",
    "test_worker_share": "the worker's share of a call, on the local workers' pipe protocol",
}
