"""Where a RayEngine's slots can go: what one slot's actor asks of Ray, and how many such
actors the cluster holds in all. The constructor waits for that many (at least one); the
others stay STARTING until Ray can place them (docs/ray.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import ray


def slot_request(
    cpus_per_slot: float, actor_options: Mapping[str, Any] | Callable[[int], Mapping[str, Any]] | None,
) -> dict[str, float]:
    """The resources one slot's actor asks of Ray (num_cpus, num_gpus, memory, resources), as
    `RayTransport._new_actor` merges them (slot 0's, when `actor_options` is a function)."""
    extra = dict((actor_options(0) if callable(actor_options) else actor_options) or {})
    want = {"CPU": float(extra.get("num_cpus", cpus_per_slot)), "GPU": float(extra.get("num_gpus") or 0),
            "memory": float(extra.get("memory") or 0),
            **{k: float(v) for k, v in (extra.get("resources") or {}).items()}}
    return {k: v for k, v in want.items() if v > 0}


def placeable(slots: int, request: dict[str, float]) -> tuple[int, str]:
    """How many of `slots` actors asking `request` each the cluster holds in all (at least 1:
    an autoscaler may add a node for the first), and what says why not all ('' if all fit)."""
    total = resources()
    fits = slots
    short = ""
    for name, amount in request.items():
        n = int(total.get(name, 0.0) // amount)
        if n < fits:
            fits = n
            short = (f"the Ray cluster holds {n} of {slots} slots: each asks {name}={amount:g}, the cluster "
                     f"has {name}={total.get(name, 0.0):g} in all")
    return max(1, fits), short


def resources(free: bool = False) -> dict[str, float]:
    """The cluster's resources (or those free now), without Ray's per-node bookkeeping ones."""
    got = ray.available_resources() if free else ray.cluster_resources()  # type: ignore[no-untyped-call]
    return {k: float(v) for k, v in got.items() if not k.startswith(("node:", "accelerator_type:"))}
