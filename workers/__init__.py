"""workers: what runs inside a worker process.

`slabpool.workers.main` is the process entry point (handshake and loop); `slabpool.workers.session` is the one
interface every runtime adapter implements (`slabpool.workers.ort`, `slabpool.workers.litert`), each importing
its runtime lazily; `slabpool.workers.protocol` holds the pipe messages; `slabpool.workers.packing` moves arrays
in and out of shared memory; `slabpool.workers.contract` checks inputs against the model.
"""
