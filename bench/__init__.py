"""slabpool's benchmark: slabpool and the tools a user would pick instead, side by side, in one run.

    python -m bench [--quick] [--workers 1,2] [--workloads mlp,noop] [--seconds 3] [--out DIR]

    for each workload (workloads.py: model builder, items, serial reference):
        serial reference  (1 in-process session, 1 thread): the outputs every contender must match
        for workers in 1..cores:
            for each contender (contenders/: one module per family):
                setup -> first results (start-up, reported apart) -> warm-up, every output checked
                -> timed run of ~`seconds` (items/s, latency, peak RSS of the process tree;
                   sampled outputs checked) -> close
    crash.py:   recovery from SIGKILL vs cold start; throughput with one kill per second vs none
    memory.py:  per-worker RSS beyond the session itself; shared memory in use
    report.py:  text table, results/latest.{json,md,png}

"limit" = workers x the serial rate. Every number comes from the same run; no test asserts one.
Importing `bench` (or `bench.contenders.remote`, inside pool workers) stays light: the heavy
libraries (matplotlib, loky, pebble, ray) load only where they are used.
"""
