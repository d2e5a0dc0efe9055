"""Errors of the shared-memory layer. `slabpool.workers.errors` maps them onto the public tree."""

from __future__ import annotations


class ShmError(Exception):
    """Base of shm's own errors."""


class CapacityError(ShmError):
    """Not enough shared memory: says how much was needed, how much is available, and the fix."""

    def __init__(self, message: str, *, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


class LeaseError(ShmError):
    """A lease was released twice, or a region was used without a lease: a bug."""
