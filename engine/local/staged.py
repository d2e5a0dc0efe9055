"""A local task's inputs as step 2 staged them (the core sees only an opaque handle,
`Task.inputs`): their layout in the input arena, the lease that holds them, and the context
sealed for the workers. Released once, by the local transport, when no worker reads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slabpool.shm import Lease
from slabpool.workers.protocol import Packed


@dataclass(eq=False, slots=True)
class Staged:
    packed: Packed  # the inputs' skeleton and where each array lies in the input arena
    lease: Lease | None  # None: no arrays, or released
    context: Any = None  # the context sealed at submit (protocol.Sealed), as sent to workers
