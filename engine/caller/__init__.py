"""The caller's side, the same for every backend: `base.BaseEngine` (the constructor with every
setting, submit's checks, infer, map, cancel, shutdown, describe, metrics), `blocks` (rows on
axis 0 as blocks of rows, bisected on failure), `aio` (the asyncio API), `request` (the one
internal Request every way in builds, and the JobEngine interface the batch job uses) and
`faults` (fault injection for slabpool's own tests)."""
