"""The `slabpool` command (placeholder until the batch-job CLI lands)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    raise SystemExit("slabpool: the CLI is not built yet")
