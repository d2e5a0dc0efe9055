"""The models a server holds: one Engine each, and what the protocol reads of it.

Readiness is the engine's truth, read from `stats()` at each probe: a model is ready while its
engine accepts work and at least one slot can serve (READY or BUSY); while every slot is dead
or starting (all workers killed at once, a rebuild under way) it is not. Metadata is read
from `describe()`, so a reload shows the new version at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slabpool.engine.core.states import EngineState
from slabpool.engine.local.pool import Engine
from slabpool.engine.serve import tensors
from slabpool.engine.serve.errors import NotFound

SERVING_STATES = frozenset(("READY", "BUSY"))  # a slot in one of these takes the next task


@dataclass
class Served:
    """One model: its name, the file it loads, its engine."""

    name: str
    path: str
    engine: Engine
    _reloading: asyncio.Lock = field(default_factory=asyncio.Lock)  # (a waiting load holds no thread)
    _swaps: set[asyncio.Future[str]] = field(default_factory=set)  # held: the loop keeps only weak refs

    @property
    def version(self) -> str:
        return self.engine.model_version  # the digest describe() reports, without building a description

    def ready(self) -> bool:
        st = self.engine.stats()
        return st.state == "ACCEPTING" and any(s.state in SERVING_STATES for s in st.slots)

    def metadata(self) -> dict[str, Any]:
        """The protocol's model metadata: datatype names, -1 for dynamic dims, the version."""
        d = self.engine.describe()
        return {
            "name": self.name,
            "versions": [d.model_version],
            "platform": f"{d.runtime}_{Path(self.path).suffix.lstrip('.')}",
            "inputs": [_tensor(s) for s in d.inputs],
            "outputs": [_tensor(s) for s in d.outputs],
        }

    def check_version(self, version: str) -> None:
        if version and version != self.version:
            raise NotFound(f"model {self.name!r} has no version {version!r}; it serves version {self.version!r}")

    async def reload(self, path: str | None = None) -> str:
        """Swap the model slot by slot while it serves (Engine.reload); one reload at a time. A
        load whose request is cancelled (its client gone) leaves its swap running, and the lock
        held until the swap ends: the next load waits for it, as it would have."""
        swap = asyncio.ensure_future(self._swap(path or self.path))
        self._swaps.add(swap)
        swap.add_done_callback(self._ended)
        return await asyncio.shield(swap)

    def _ended(self, swap: asyncio.Future[str]) -> None:
        self._swaps.discard(swap)
        if not swap.cancelled():
            swap.exception()  # (read: a swap whose caller left fails without a "never retrieved" log)

    async def _swap(self, target: str) -> str:
        async with self._reloading:  # (was a thread's lock: each waiting load held one of the loop's
            version = await asyncio.to_thread(self.engine.reload, target)  # executor threads, and with
            self.path = target  # them all held, the shutdown's close never ran: SIGTERM did not exit)
            return version


def _tensor(spec: Any) -> dict[str, Any]:
    return {"name": spec.name, "datatype": tensors.datatype_of(spec.dtype), "shape": tensors.wire_shape(spec.shape)}


class Repository(Mapping[str, Served]):
    """The served models by name; an unknown name is NotFound (404 / NOT_FOUND)."""

    def __init__(self, models: list[Served]) -> None:
        self._models = {m.name: m for m in models}

    def __getitem__(self, name: str) -> Served:
        try:
            return self._models[name]
        except KeyError:
            raise NotFound(f"unknown model {name!r}; this server serves {sorted(self._models)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def ready(self) -> bool:
        return all(m.ready() for m in self._models.values())

    def alive(self) -> bool:
        """No engine has stopped (one the server did not close: it failed, and serves no more)."""
        return all(m.engine.state is not EngineState.CLOSED for m in self._models.values())

    def close(self, timeout: float | None = None, cancel: bool = False) -> None:
        """Close every engine (idempotent): `cancel` drops what is queued; after `timeout` s
        what still runs is cancelled."""
        for m in self._models.values():
            m.engine.close(cancel_pending=cancel, timeout=timeout)
