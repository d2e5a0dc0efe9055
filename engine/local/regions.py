"""Output regions: where in the output arena each batch's worker writes its outputs.

A batch is sent with a region sized like the outputs of the last batch of the same shapes
(`lease_predicted`; a group of a composition never seen: the sum of its tasks' alone), so the
worker rarely has to ask. When it does ask (NeedOutput, step 7),
`on_need` decides: a region of that size, a wait for space, a split (a batch of several tasks
needing more than half the arena goes back to the queue in halves, uncharged), or a refusal
(one task's outputs larger than the whole arena, or an arena that cannot grow to hold them:
ShmCapacityError). Sizes seen per task and
per item are learnt, so later groups and stacked batches are sized to fit from the start
(engine.core.dispatch.take_limits).

Only the owner thread uses this (inside the local transport); it owns the leases it hands
out until `release`. What a batch holds here lives in its `Sent` record, not in the core's Batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from slabpool.engine.core.task import Batch
from slabpool.shm import Arena, CapacityError, Lease
from slabpool.shm.alloc import align_up
from slabpool.workers.protocol import SPLIT, OutputGrant

T = TypeVar("T")


@dataclass(eq=False)
class Sent:
    """A batch as the local transport holds it: sent to a worker, not yet answered."""

    batch: Batch
    out_lease: Lease | None = None
    out_wanted: int = 0  # output bytes asked for (NeedOutput) while the arena was full
    # revoked (its tasks run elsewhere, on copies): the worker may still read the original
    # inputs until it answers, so their leases wait here
    pinned: list[Lease] = field(default_factory=list)


class OutputRegions:
    def __init__(self, outputs: Arena, reserved: int) -> None:
        self.arena = outputs
        self.max_region = outputs.capacity - align_up(reserved)  # the most one task can have
        self.per_task = 0  # the most output bytes per task seen (a group's average)
        self.per_item = 0  # ... and per item of a stacked batch
        self._predicted: dict[tuple[Any, ...], int] = {}  # output bytes by batch shape

    def learn(self, batch: Batch, nbytes: int) -> None:
        """Output bytes per task and per item, as seen: later groups and batches fit them. A
        batch taken back (revoked: its tasks ran elsewhere or were cancelled) teaches nothing."""
        if not batch.tasks:
            return
        self.per_task = max(self.per_task, nbytes // len(batch.tasks))
        if batch.stack:
            self.per_item = max(self.per_item, nbytes // max(sum(t.rows for t in batch.tasks), 1))

    def observed(self, batch: Batch, used: int) -> None:
        """A batch finished with `used` bytes of outputs: the next of its shapes gets as much."""
        if batch.revoked:
            return
        self._predicted[batch_key(batch)] = used
        if used > self.per_task * len(batch.tasks):
            self.learn(batch, used)

    def lease_predicted(self, sent: Sent, *, ahead: bool = False) -> Lease | None:
        """A region sized like the last outputs of a batch of the same shapes. Batches sent
        ahead of the running one may hold at most half the arena: the other half is always
        there for a running batch's NeedOutput."""
        want = self._predicted.get(batch_key(sent.batch)) or self._summed(sent.batch)
        if not want:
            return None
        if ahead and self.arena.used + want > self.arena.capacity // 2:
            return None
        try:
            lease = self.arena.try_lease(want)
        except CapacityError:  # (the arena cannot grow now: the worker asks, and on_need answers)
            return None
        sent.out_lease = lease
        return lease

    def _summed(self, batch: Batch) -> int:
        """A group's outputs, never seen in this composition (its size is the queue's depth at
        the time), as the sum of its tasks' alone: each task's outputs are laid out one after
        another, 64-byte aligned, as a batch of one lays them. 0: some task's size is unknown."""
        if batch.stack or len(batch.tasks) == 1:
            return 0
        total = 0
        for t in batch.tasks:
            one = self._predicted.get(((t.shape_key, t.rows),))
            if not one:
                return 0
            total += one
        return total

    def on_need(self, sent: Sent, nbytes: int) -> OutputGrant | None:
        """The answer to a worker's NeedOutput; None: no room now (sent.out_wanted is set,
        and `grant_waiting` answers once a region is released)."""
        batch = sent.batch
        if batch.revoked:  # (taken back after its worker began it: nothing reads its outputs)
            return OutputGrant(batch.id, -1, 0, "the batch was taken back: its outputs are not read")
        if sent.out_lease is not None and sent.out_lease.nbytes >= nbytes:
            return OutputGrant(batch.id, sent.out_lease.offset, sent.out_lease.nbytes)
        self.release(sent)
        self.learn(batch, nbytes)
        if len(batch.tasks) > 1 and nbytes > self.arena.capacity // 2:
            return OutputGrant(batch.id, -1, 0, SPLIT)  # its tasks come back, to go apart
        if nbytes > self.max_region:  # one task's outputs, larger than the whole arena
            return OutputGrant(batch.id, -1, self.max_region, (
                f"its outputs take {nbytes} bytes, more than the output arena can ever hold "
                f"({self.max_region} bytes; shm_capacity={self.arena.capacity}); raise shm_capacity"))
        try:
            lease = self.arena.try_lease(nbytes)
        except CapacityError as exc:
            return self._refused(batch, exc)
        if lease is None:  # full: the grant waits for the next release (no lease is held here)
            sent.out_wanted = nbytes
            return None
        sent.out_lease = lease
        return OutputGrant(batch.id, lease.offset, lease.nbytes)

    def _refused(self, batch: Batch, exc: CapacityError) -> OutputGrant:
        """The arena could not grow to hold the region (the host's shared memory ran out after
        the engine started: /dev/shm filled by others, a memory limit): several tasks go again
        apart (each may fit what is backed already), one fails with ShmCapacityError saying so.
        The engine serves on; it stopped here before (the error went up the owner's send)."""
        if len(batch.tasks) > 1:
            return OutputGrant(batch.id, -1, 0, SPLIT)
        return OutputGrant(batch.id, -1, 0, f"its outputs' region could not be backed: {exc}")

    def grant_waiting(self, held: list[tuple[T, Sent]]) -> list[tuple[T, OutputGrant]]:
        """Regions for the batches (each with its slot) that asked while the arena was full,
        in order, while room lasts."""
        grants = []
        for slot, b in held:
            if b.out_wanted and b.out_lease is None:
                try:
                    lease = self.arena.try_lease(b.out_wanted)
                except CapacityError as exc:
                    b.out_wanted = 0
                    grants.append((slot, self._refused(b.batch, exc)))
                    continue
                if lease is None:
                    break
                b.out_lease, b.out_wanted = lease, 0
                grants.append((slot, OutputGrant(b.batch.id, lease.offset, lease.nbytes)))
        return grants

    def release(self, sent: Sent) -> bool:
        """Give back the batch's region (once its run has really ended); True if it had one."""
        if sent.out_lease is None:
            return False
        self.arena.release(sent.out_lease)
        sent.out_lease = None
        return True


def batch_key(batch: Batch) -> tuple[Any, ...]:
    """Batches with equal keys had outputs of equal size so far (sizes predicted from it)."""
    return tuple([(t.shape_key, t.rows) for t in batch.tasks])  # (asked twice a batch: no generator)
