"""asyncio front end of the Engine (placeholder until the async work lands)."""

from __future__ import annotations


class AsyncEngineMixin:
    """Async methods of `Engine`: infer_async, submit_async, map_async, `async with`."""
