"""slabpool.engine: policy in the caller's process; model inference on every core, one session per worker process.

    |============== caller process ===============|====== worker process, slot k ======|
     Engine.submit()       supervisor thread          pipe k        workers.main
     1 validate inputs =>  3 choose a READY slot  =>  RunBatch  =>  5 view input lease
     2 lease input arena,  4 mark task RUNNING                      6 preprocess, check,
       copy inputs in  <=  8 copy outputs out     <=  BatchDone <=    session.run
       Future <==========  9 release leases,                        7 write outputs into
                             complete Future once                     the output region
                                                                      (ORT: written there by
                                                                      the run, IO binding)

     copies per task: the inputs once (caller -> input arena, step 2), the outputs once
     (output arena -> caller, step 8). The worker reads its inputs in place; ONNX Runtime
     writes the outputs in place once it has seen the output shapes of that input signature
     (workers.inplace, counted in stats().outputs_in_place); otherwise one more copy, 7.

     crash path: the sentinel of slot k fires (exit code 0 with tasks in hand included)
       a  slot k -> DEAD; the process is reaped before any lease it held is reused
       b  slot k alone is rebuilt: STARTING -> READY after the new worker's Ready
       c  its tasks replay in acceptance order, attempt + 1 (the same batch composition)
       d  only what was running is charged: the task named by the slot's status word in
          shared memory (or a whole stacked batch, bisected if it kills again); a task
          charged max_attempts times ends as PoisonTask; nothing else fails

     containment (docs/faults.md): one task's data never stops the supervisor
       - a context, and a preprocess's inputs, are pickled alone at step 2 (TypeError there);
         results made by user code are pickled alone at 7 and opened alone at 8: a task whose
         data does not cross fails alone (TaskDataError)
       - outputs of a group or a stacked batch too large for one region: the worker is told
         to split (OutputGrant SPLIT), its tasks go back uncharged; sizes are learnt, later
         groups fit; ShmCapacityError only for outputs larger than the whole arena
       - task_timeout counts the task in hand (status word 1, written by the worker), never a
         group's total; a slot with no progress for stall_after gets no more work and what
         was sent ahead to it is revoked (Revoke) and runs elsewhere, on copies of its inputs

Actors:
- `Engine` (engine.local.pool): the caller's API. Steps 1-2 run in the caller's thread; the
  admission queue (engine.core.admission) bounds what is accepted and not yet running. `map()`
  (engine.caller.base) sends tiny items many to a task (a Chunk: one outcome per item);
  `infer(feeds, batch_size=)` and the batch job send rows on axis 0 as contiguous blocks,
  one task each, cut down to rows when a block fails (engine.caller.blocks).
- `Supervisor` (engine.local.supervisor): one thread; the only one that touches slots and running
  tasks. It waits on every pipe, every process sentinel and a wake-up pipe in one selector.
  Tiny tasks go to a slot in groups (one message each way); with max_batch_size they are
  stacked into one session call. Hot model swaps: engine.local.reload.
- `Slot` (engine.local.slot): one worker process and its private pipe (one per incarnation).
- `slabpool.workers.main`: the worker loop; one session (workers.ort / workers.litert) per process.
- `slabpool.shm.Arena`: two arenas (inputs, outputs), memfd-backed, owned by the supervisor.

Lifecycles (engine.core.states): Engine ACCEPTING -> DRAINING -> CLOSED; Slot NEW -> STARTING ->
READY <-> BUSY -> DEAD -> STARTING ...; Task QUEUED -> RUNNING -> DONE | FAILED | CANCELLED.
Importing `engine` imports no runtime: onnxruntime and LiteRT load inside the workers.
"""

from __future__ import annotations
