"""shm: shared-memory arenas with explicit leases. Mechanism only: no models, no tasks.

The supervisor owns every `Arena` (create, lease, release, close); workers `Mapping` them
from a passed fd. This package is the only place that creates or unlinks shared memory.
"""

from slabpool.shm.arena import Arena, Lease, check_capacity
from slabpool.shm.errors import CapacityError, LeaseError, ShmError
from slabpool.shm.mapping import Mapping
from slabpool.shm.sweep import InstanceLock, new_instance_id, sweep_dead_instances

__all__ = [
    "Arena",
    "CapacityError",
    "InstanceLock",
    "Lease",
    "LeaseError",
    "Mapping",
    "ShmError",
    "check_capacity",
    "new_instance_id",
    "sweep_dead_instances",
]
