"""workers: what runs inside a worker process.

`workers.main` is the process entry point (handshake and loop); `workers.session` is the one
interface every runtime adapter implements (`workers.ort`, `workers.litert`), each importing
its runtime lazily; `workers.protocol` holds the pipe messages; `workers.packing` moves arrays
in and out of shared memory; `workers.contract` checks inputs against the model.
"""
