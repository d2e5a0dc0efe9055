"""slabpool.engine: policy in the caller's process; model inference on every core, one session per worker process.

    |============== caller process ===============|====== worker process, slot k ======|
     Engine.submit()       owner thread               pipe k        workers.main
     1 validate inputs =>  3 choose a slot with   =>  RunBatch  =>  5 view input lease
     2 lease input arena,    room, idle first                       6 preprocess, check,
       copy inputs in      4 mark task RUNNING                        session.run,
                       <=  8 copy outputs out     <=  BatchDone <=    postprocess
                             (the transport: Done)
       Future <==========  9 release leases,                        7 write outputs into
                             complete Future once                     the output region
                                                                      (ORT: written there by
                                                                      the run, IO binding)

     fast path (engine.core.fastpath): an idle engine's infer() runs 3-4 on the caller's
     thread and is lent slot k: it waits on pipe k itself and runs 8-9 (the owner's own code,
     under the owner lock); infer_async lends it to the event loop (after two idle accepts
     in a row; taken back once work queues behind it). Under load, or off the happy path (a
     death, a timer, a cancel, close), the owner thread does as drawn. A Ctrl-C that lands
     while the caller does the owner's work (from the accept to the lend's wait, and each step
     under the lock) waits for that stretch's end (engine.core.interrupts): the call is
     abandoned there, the slot goes back to the owner thread, the engine serves on. A lent
     call polls pipe k for up to spin_us before it sleeps, and its worker, after answering a
     lent batch (RunBatch.spin), polls for the next one: two wake-ups saved a call; neither
     polls while its polls run out, nor on a host with more tasks runnable than CPUs
     (workers.wire.Spin: a crowd seen at two looks in a row; the engine's own tasks, another
     lent call's caller and worker, a caller not lent, are not counted: FastPath.peers, to
     the worker RunBatch.peers), nor for a block (never lent; a group of callers' task below
     polls as a call alone's does).

     express lane (engine.local.express): a call of plain inputs (infer, infer_async,
     submit_async) that finds a slot idle and nothing queued (a thread waits for the owner
     lock; a loop only takes it free) is accepted running (never queued) and sent by the
     dispatcher's own send_batch to that slot, lent to it; its happy path's answer is
     copied out by its caller and ended by the dispatcher's `delivered` (no Future to
     complete; a Result, as step 9 makes it, only for submit_async); anything else is the
     fast path's own step. Its worker runs one plain task on a lean path (workers.lean).

     callers combined (engine.caller.combine): under load, infer() calls of plain inputs that
     would queue wait together, a group a signature, and go as ONE task (their inputs
     concatenated, `step` = a caller's rows: a session call each, whose outputs the worker
     checks hold its rows), run by one of them, the leader, the way a call alone runs (the
     express lane, which a leader waits for the owner lock to take, on any idle slot; else
     lent a slot: Lender.LEADER), its worker's lean path too; each caller copies its own rows
     out. Answered, the group's slot goes back parked: out of the owner's selector until the
     owner's next wait (at most PARK_S) or a send that is not a lend, so the next group's
     lend costs no epoll_ctl. At most one task of ours a slot. A group's task that fails (a row's
     error, a worker killed, outputs without the callers' rows, a close) sends each of its
     callers alone, to its own outputs or error. A model slower than SLOW_S a call is not
     combined (its calls stay pipelined to their slots).

     copies per task: the inputs once (caller -> input arena, step 2), the outputs once
     (output arena -> caller, step 8). The worker reads its inputs in place; ONNX Runtime
     writes the outputs in place once it has seen the output shapes of that input signature
     (workers.inplace, counted in stats().outputs_in_place); otherwise one more copy, 7.
     A task of rows (infer(batch_size=), the job) runs as several session calls at 6, `step`
     rows each (TaskSpec.step), its outputs one region; a map() chunk is one task of many items.

     crash path: the sentinel of slot k fires (exit code 0 with tasks in hand included)
       a  the transport reaps the process before any lease it held is reused, and says
          Died (exit code, the task in hand); slot k -> DEAD
       b  slot k alone is rebuilt: STARTING -> READY after the new worker's Ready; it loads
          the model version pinned at start (workers.weights), whatever the file is now; a
          start that fails (its worker dies starting, or the OS refuses the process: out of
          file descriptors) is retried after a back-off while the other slots serve
       c  its tasks replay in acceptance order, attempt + 1 (a stacked batch keeps its
          composition: a replay is byte-identical; groups of tiny tasks are cut anew)
       d  only what was running is charged: the task named by the slot's status word in
          shared memory (or a whole stacked batch, bisected if it kills again); a task
          charged max_attempts times ends as PoisonTask; nothing else fails

     containment (docs/faults.md): one task's data never stops the owner
       - a context, and a preprocess's inputs, are pickled alone at step 2 (TypeError there);
         results made by user code are pickled alone at 7 and opened alone at 8: a task whose
         data does not cross fails alone (TaskDataError)
       - outputs of a group or a stacked batch too large for one region: the worker is told
         to split (OutputGrant SPLIT), its tasks go back uncharged; sizes are learnt, later
         groups fit; ShmCapacityError only for outputs larger than the whole arena, or than
         it can still back (shared memory that ran out after the start)
       - task_timeout counts the task in hand (status word 1, written by the worker), never a
         group's total; a slot with no progress for stall_after gets no more work and what
         was sent ahead to it (its current batch too, if it took no task of it) is revoked
         (Revoke) and runs elsewhere, on copies of its inputs

Where the code is (imports point one way: core <- caller <- local, ray; job on local):
- `engine.core`: the owner both backends share, `coordinator.Coordinator`, a coordinator of
  parts it holds: `owner.OwnerThread` (the thread that changes slots and running tasks, while
  it holds the owner lock, `owner.OwnerLock`; callers hand it callables: `call(fn, *args)`), `fastpath.FastPath`
  (a caller that holds the owner lock acts as the owner: one call without a thread hop;
  `interrupts` keeps a Ctrl-C out of those stretches; `wakefd` is a lender's eventfd), `ledger.TaskLedger` (ends each task once,
  step 9: counters, histograms, Futures completed after the step), `dispatcher.Dispatcher`
  (steps 3-4, and 8-9 on a Done), `watchdog.Watchdog` (task_timeout, stall, start-up bound,
  back-off), `slots.SlotRecord` (a slot's state: one (state, event) table in `states`), and a
  `transport.SlotTransport` (the backend: start, send, revoke, kill; it reports Ready, Done,
  Died as values). The crash path a-d is `Coordinator._on_died`; `stopping` is the stop path
  (no step stops the others; every Future ends). `admission.TaskQueue` bounds what is accepted
  and not yet running (callers blocked on it get places in arrival order, bytes too: no small input
  passes a large one waiting under queue_bytes); pure policy: `dispatch` (steps 3-4: group and batch limits),
  `recovery` (step d: who is charged); `reload.ReloadPlan` is a hot model swap, slot by slot.
- `engine.caller`: the caller's API, the same for both backends (`base.BaseEngine`: steps 1-2,
  `infer`, `map`, `cancel`, `shutdown`). `map()` sends tiny items many to a task (a Chunk: one
  outcome per item); `infer(feeds, batch_size=)` and the batch job send rows on axis 0 as
  contiguous blocks, a session call each, several to a task, cut down to rows when a task
  fails, every row of a call from one model version (blocks a reload swapped under it run
  again: `blocks`); `combine` makes the plain infer() calls that queue under load one task a
  group (a local engine's; a RayEngine's go alone); `aio` the asyncio front end, its threads
  (admission and cancel lanes, stopped by close()) in `lanes`.
- `engine.local`: `pool.Engine` (steps 1-2; `staged.Staged` is a task's inputs in the input
  arena) and its `supervisor` (the core's owner on `transport.LocalTransport`: spawn, reap,
  pipes, output regions and grants, revoked copies, step 8's copy out in `delivery`);
  `express` the express lane (an idle call in the fewest steps, over the same records);
  `selector` is the one selector over every pipe, sentinel and a wake-up pipe; `regions` sizes
  output regions (7); `slot.Slot` is one worker process and its pipe (the owner never blocks
  writing it: what the pipe does not take waits in the slot's outbox until the selector says
  writable); `forks` keeps a forked child off the parent's workers.
- `engine.ray`: `RayEngine`, whose slots are Ray actors (`transport.RayTransport`: actor calls,
  Ray's restarts and pings, an inbox of event values; `instance`: the Ray an engine started,
  shared by the process's RayEngines until the last closes, told apart by job and node id;
  that instance gone under the engine, its transport's wait raises TransportLost and every task
  fails saying so; an actor dead for good is a start that failed), on the same owner as the local engine:
  the same dispatch, timers, replay, quarantine and reload (a slot's actor is replaced once it
  has drained, as a local slot's process is).
- `engine.job`: the batch job, `slabpool run`. `engine.serve`: `slabpool serve`, the Open
  Inference Protocol over HTTP and gRPC, on the public API (one engine per model).
- `slabpool.workers.weights`: the pinned, shared form of the model every worker loads (step b);
  with no usable cache, the source itself, loaded through the descriptor its version was read from.
- `slabpool.workers.main`: the worker loop (`slabpool.workers.lean`: one plain task in the fewest
  steps, its session call or its calls of `step` rows); `slabpool.workers.pipeline` the steps 5-7 every kind
  of worker runs (preprocess -> contract -> run -> postprocess); one session per process; a
  worker whose supervisor died is killed by the kernel (O_ASYNC + SIGKILL on its parent sentinel).
- `slabpool.shm.Arena`: two arenas (inputs, outputs), memfd-backed, owned by the supervisor.

Lifecycles (engine.core.states): Engine ACCEPTING -> DRAINING -> CLOSED; Slot NEW -> STARTING ->
READY <-> BUSY (<-> STALLED) -> (RETIRING) -> (EXITING) -> DEAD -> STARTING ..., one table of
(state, event) -> state; Task QUEUED -> RUNNING -> DONE | FAILED | CANCELLED.
Importing `slabpool.engine` imports no runtime: onnxruntime and LiteRT load inside the workers.
"""

from __future__ import annotations
