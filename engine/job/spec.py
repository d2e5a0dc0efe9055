"""What a job is: `JobSpec` (what `slabpool run` was asked), its checks before any work
(`check_paths`, `FailureLimit` for --max-failures) and its `fingerprint` (what makes two runs
the same job, so that one resumes the other)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from slabpool.engine.job import hooks as job_hooks
from slabpool.engine.job.sources import JobError, Source
from slabpool.engine.job.store.journal import FORMAT

BATCHED_DEFAULT = 64  # items per hook call with batched hooks when --batch-size is not given
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
    columns: tuple[tuple[str, tuple[str, ...]], ...] = ()  # --columns: (model input, table columns)

    @property
    def file_format(self) -> str | None:
        """"npy", "npz" or "parquet" for a single-file OUTPUT (its suffix in any case, as an
        INPUT's is read), None for a folder."""
        suffix = self.output.suffix.lower()
        return suffix[1:] if suffix in (".npy", ".npz", ".parquet") else None

    @property
    def single_file(self) -> bool:
        return self.file_format is not None

    @property
    def parquet(self) -> bool:
        return self.file_format == "parquet"

    @property
    def stdin(self) -> bool:
        return str(self.input) == "-"

    @property
    def parts(self) -> Path:
        return self.output.with_name(self.output.name + ".parts") if self.single_file else self.output


def check_paths(spec: JobSpec) -> None:
    """OUTPUT must never be (or lie inside) INPUT or MODEL, nor replace what no job of ours
    wrote, nor be stdout; stdin cannot be resumed."""
    if str(spec.output) == "-":  # (a folder named "-" was made)
        raise JobError("-o -: OUTPUT is a folder or a .npy/.npz/.parquet file, not stdout (a job keeps "
                       "its progress beside OUTPUT, to resume it)")
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


# Each key of the fingerprint, as the refusal of a resume names it. Every option that shapes
# what is stored is here; those that do not (--workers, --start-method, --max-attempts,
# --task-timeout, --max-failures, --durable-every, --log-every, and --batch-size where it only
# sizes the model's calls) may change between runs.
OPTIONS = {
    "model": "MODEL", "input": "INPUT", "count": "the item count", "output": "the OUTPUT format",
    "preprocess": "--preprocess", "postprocess": "--postprocess", "batched": "--batched (hooks that take a list)",
    "hook_batch": "--batch-size (the items a batched hook gets at once)", "keep": "--keep", "text": "--text",
    "columns": "--columns",
}


def is_batched(spec: JobSpec) -> bool:
    """The hooks take a list of items: --batched, or a hook that says `batched = True`."""
    return spec.batched or job_hooks.hook_batched(spec.preprocess) or job_hooks.hook_batched(spec.postprocess)


def hook_batch(spec: JobSpec) -> int | None:
    """The items a batched hook gets at once (None: the hooks are not batched)."""
    return (spec.batch_size or BATCHED_DEFAULT) if is_batched(spec) else None


def fingerprint(spec: JobSpec, source: Source) -> dict[str, Any]:
    """What makes two runs the same job: the model's bytes, the input, and every option that
    shapes what is stored (OPTIONS). A batched hook's list size is one (a tokenizer pads each
    list to its longest item); the size of a model call is not (a row's result does not
    depend on the rows it is computed with)."""
    batched = is_batched(spec)
    return {"model": model_fingerprint(spec.model), "input": source.fingerprint, "count": source.count,
            "output": output_kind(spec), "preprocess": spec.preprocess, "postprocess": spec.postprocess,
            "batched": batched, "hook_batch": (spec.batch_size or BATCHED_DEFAULT) if batched else None, "keep": list(spec.keep), "text": spec.text,
            "columns": {k: list(v) for k, v in spec.columns} or None}


def output_kind(spec: JobSpec) -> str:
    return spec.file_format or "folder"


def model_fingerprint(model: Path | None) -> dict[str, Any] | None:
    """The model by its bytes and its external data files', wherever it lies (a copy, a move or
    a touch is the same model; a rewrite is not)."""
    if model is None:
        return None
    from slabpool.workers.session import model_digest  # the engine's model version: external data included

    return {"size": model.stat().st_size, "sha256": model_digest(str(model))}


def refusal(parts: Path, old: Any, new: dict[str, Any]) -> str:
    """Why OUTPUT's job is not this one: each option that differs, with its old and new value."""
    where = f"{parts} holds results of a different job"
    if not isinstance(old, dict) or old.get("format") != FORMAT:
        return (f"{where}: made by an earlier slabpool, whose manifest does not record every option that "
                "shapes the output; pass --overwrite to start over, or choose another OUTPUT")
    job = old.get("job") or {}
    diffs = [f"{OPTIONS.get(k, k)} was {_shown(k, job.get(k))}, now {_shown(k, new.get(k))}"
             for k in (*OPTIONS, *(k for k in {*job, *new} if k not in OPTIONS))
             if job.get(k) != new.get(k)]
    return f"{where} ({'; '.join(diffs)}); rerun with the same options, choose another OUTPUT or pass --overwrite"


def _shown(key: str, value: Any) -> str:
    if value is None or value == []:
        return "(none)"
    if isinstance(value, bool):
        return "on" if value else "off"
    if key == "keep":
        return ",".join(map(str, value))
    if key == "model" and isinstance(value, dict):
        return f"sha256 {str(value.get('sha256'))[:12]}... ({value.get('size')} bytes)"
    if key == "input" and isinstance(value, dict):
        what = value.get("path") or "stdin"
        if "files" in value:
            return f"{what} ({len(value['files'])} files)"
        if "stdin" in value:
            return f"{what} (blake2b {str(value['stdin'])[:12]})"
        return f"{what} ({value.get('size')} bytes, mtime_ns {value.get('mtime_ns')})"
    if key == "columns" and isinstance(value, dict):
        return " ".join(f"{k}={','.join(v)}" for k, v in value.items())
    return str(value)
