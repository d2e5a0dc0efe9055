"""What a job is: `JobSpec` (what `slabpool run` was asked), its checks before any work
(`check_paths`, `FailureLimit` for --max-failures) and its `fingerprint` (what makes two runs
the same job, so that one resumes the other)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from slabpool.engine.job.sources import JobError, Source

SYSTEMATIC = 100  # by default the job stops when this many first settled items all failed


@dataclass(frozen=True)
class FailureLimit:
    """--max-failures: N failed items, or P% of the settled ones (judged from 100 settled on).
    Neither: stop when the first 100 settled items (all of them, if fewer) have all failed."""

    count: int | None = None
    percent: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> FailureLimit:
        if text is None:
            return cls()
        try:
            if text.endswith("%"):
                pct = float(text[:-1])
                if not 0 <= pct <= 100:
                    raise ValueError
                return cls(percent=pct)
            n = int(text)
            if n < 0:
                raise ValueError
            return cls(count=n)
        except ValueError:
            raise JobError(f"--max-failures must be a count (N >= 0) or a percentage (P%), got {text!r}") from None

    def exceeded(self, failed: int, settled: int, todo: int) -> str | None:
        """Why the job must stop, or None."""
        if self.count is not None:
            return f"more than --max-failures {self.count} items failed" if failed > self.count else None
        judged = settled >= min(SYSTEMATIC, todo)
        if self.percent is not None:
            over = judged and 100.0 * failed / max(settled, 1) > self.percent
            return f"{failed} of {settled} settled items failed, over --max-failures {self.percent:g}%" if over else None
        if judged and settled and failed == settled:
            return f"the first {settled} items all failed (a systematic error; see --max-failures)"
        return None


class StopFailures(Exception):
    """Failures crossed the limit: the job stops (exit 1)."""


@dataclass(frozen=True)
class JobSpec:
    model: Path | None
    input: Path
    output: Path
    workers: int | None = None
    batch_size: int | None = None  # rows a block (None: from the measured time per row); items a model call
    preprocess: str | None = None
    postprocess: str | None = None
    resume: bool = False
    overwrite: bool = False
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    max_attempts: int = 3
    task_timeout: float | None = None
    durable_every: float = 1.0  # seconds between commits (at most)
    log_every: float = 2.0  # seconds between log lines when stderr is not a terminal
    command: str = "slabpool run ..."  # shown in the "how to resume" line
    keep: tuple[str, ...] = ()  # input columns copied to a .parquet OUTPUT
    batched: bool = False  # hooks take a list of items (see engine.job.hooks)
    max_failures: str | None = None  # "N" or "P%" (FailureLimit)
    text: bool = False  # INPUT lines are raw strings, not JSON

    @property
    def single_file(self) -> bool:
        return self.output.suffix in (".npy", ".npz", ".parquet")

    @property
    def parquet(self) -> bool:
        return self.output.suffix == ".parquet"

    @property
    def stdin(self) -> bool:
        return str(self.input) == "-"

    @property
    def parts(self) -> Path:
        return self.output.with_name(self.output.name + ".parts") if self.single_file else self.output


def check_paths(spec: JobSpec) -> None:
    """OUTPUT must never be (or lie inside) INPUT or MODEL, nor replace what no job of ours
    wrote; stdin cannot be resumed."""
    if spec.stdin:
        if spec.resume:
            raise JobError("--resume cannot replay stdin: rerun the same command with the same input on "
                           "stdin (what is durable is skipped), or save the input to a file")
    else:
        _check_sources(spec)
    _check_existing(spec)


def _check_sources(spec: JobSpec) -> None:
    """Writing OUTPUT must not destroy INPUT or MODEL, nor add files to the INPUT folder."""
    targets = {spec.output.resolve(), spec.parts.resolve()}
    for what, path in (("INPUT", spec.input.resolve()), ("MODEL", spec.model.resolve() if spec.model else None)):
        if path is None:
            continue
        if path in targets:
            raise JobError(f"OUTPUT {spec.output} is the {what}: it would be overwritten; choose another OUTPUT")
        if path.is_dir() and any(t.is_relative_to(path) for t in targets):
            raise JobError(f"OUTPUT {spec.output} lies inside the {what} folder {spec.input}: its files would "
                           "become items; choose an OUTPUT outside it")


def _check_existing(spec: JobSpec) -> None:
    """An OUTPUT that exists is written over only when a job made it (its parts folder holds a
    manifest: the rerun resumes, and Store.open refuses another job's), or with --overwrite.
    Anything else (a file saved by hand, a folder of other files) would be lost without a word."""
    out = spec.output
    if not (out.exists() or out.is_symlink()):
        return
    if spec.single_file and out.is_dir():
        raise JobError(f"OUTPUT {out} is a folder, not a {out.suffix} file; choose another OUTPUT")
    if not spec.single_file and not out.is_dir():
        raise JobError(f"OUTPUT {out} is a file, not a folder (a folder OUTPUT is named without "
                       ".npy/.npz/.parquet); choose another OUTPUT")
    manifest = spec.parts / "manifest.json"
    if spec.overwrite or manifest.exists():
        return
    if not out.is_dir():
        raise JobError(f"OUTPUT {out} exists and no slabpool job wrote it (no {manifest}): pass --overwrite "
                       "to replace it, or choose another OUTPUT")
    if any(p.name != ".lock" for p in out.iterdir()):  # an empty folder has nothing to lose
        raise JobError(f"OUTPUT {out} is a folder of other files, not a slabpool job's (no {manifest}): pass "
                       "--overwrite to write the job into it (files named like a job's are replaced), or "
                       "choose another OUTPUT")


def fingerprint(spec: JobSpec, source: Source) -> dict[str, Any]:
    """What makes two runs the same job (workers and batch size do not change results' rows)."""
    model = None
    if spec.model is not None:
        st = spec.model.stat()
        model = {"path": str(spec.model.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return {"model": model, "input": source.fingerprint, "count": source.count,
            "preprocess": spec.preprocess, "postprocess": spec.postprocess}
