"""The argument types of `slabpool run` (argparse `type=` functions, and the checks across
arguments). argparse names the option in its message (`argument --workers: ...`): each type
says what it accepts and what it got, and raises ArgumentTypeError, never a bare ValueError
(argparse would then name the function). Standard library only (imported before numpy)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_ints(text: str) -> list[int]:
    """N[,N...]: `slabpool bench --workers`."""
    try:
        return [positive_int(w) for w in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None


def batch_size(text: str) -> int | None:
    """--batch-size B, or `auto` (as infer() takes it): the job's default, None."""
    if text.strip().lower() == "auto":
        return None
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None


def columns(text: str) -> tuple[str, ...]:
    names = tuple(c.strip() for c in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected COL[,COL...], got {text!r}")
    return names


def gather(text: str) -> tuple[str, tuple[str, ...]]:
    """--columns INPUT=COL,COL,...: the model input, and the table's columns that form it."""
    name, eq, cols = text.partition("=")
    names = tuple(c.strip() for c in cols.split(","))
    if not eq or not name.strip() or not all(names):
        raise argparse.ArgumentTypeError(f"expected INPUT=COL[,COL...] (a model input, then table columns), "
                                         f"got {text!r}")
    return name.strip(), names


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):  # NaN too
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {text!r}")
    return value


def columns_of(given: list[tuple[str, tuple[str, ...]]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """--columns as given: each model input once."""
    from slabpool.engine.job.sources import JobError  # numpy: imported once the signals are ours

    names = [n for n, _ in given]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise JobError(f"--columns names the input {twice!r} twice: give each input once")
    return tuple(given)
