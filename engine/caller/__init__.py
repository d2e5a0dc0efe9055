"""The caller's side, the same for every backend: `base.BaseEngine` (the constructor with every
setting, submit's checks, infer, map, cancel, shutdown, describe, metrics), `blocks` (rows on
axis 0 as blocks of rows, bisected on failure) and `aio` (the asyncio API)."""
