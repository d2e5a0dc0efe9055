"""The model a worker loads: the pinned version, from a cache entry every worker shares.

    caller (engine start, reload):  digest = model_digest(path)          -> SessionSpec.digest
    each worker, each rebuilt slot: pin(spec, form) -> Pinned(path, shared, note)
        <cache_dir>/<digest>-<form>-<runtime>/   one entry, written once, checked before use
            manifest.json                        files, sizes, SHA-256, what the form is
            model.onnx + model.data              "prepacked": ONNX Runtime's CPU form (below)
            <the model's own files>              "copy": the bytes as given, pinned

Why a cache entry, not the path: the file at the path may be replaced (a deploy) while the
engine runs; a slot rebuilt after a crash must still load the version the engine serves
(model_version). The entry is keyed by the digest the caller took, built from a copy of the
source that is hashed as it is copied: a source that no longer has that digest is refused
(ModelChanged), never loaded. A changed file is served only through `reload()`.

Why "prepacked": ONNX Runtime packs weights for its CPU matrix kernels at session creation, a
private copy per process. Saved once with `session.save_external_prepacked_constant_initializers`,
the packed blobs sit in an external data file that every worker maps copy-on-write: one copy of
the weights in memory for all workers, outputs byte-identical (../shared/notes/memory.md). The
form depends on the ORT version and the CPU's features (the `runtime` part of the key).

Writes are atomic: a temporary folder in the cache folder, every file fsynced, then one
rename(); a lock file per entry serialises concurrent engines. A crash or a full disk mid-write
leaves only a `.tmp-*` folder, removed by the next writer; an entry whose manifest does not
match its files is dropped and rebuilt. When the cache cannot be written at all, the worker
loads the source directly, after checking its digest, and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slabpool.workers.session import SessionSpec, model_digest, model_files

log = logging.getLogger("slabpool.workers")

MANIFEST = "manifest.json"
FORMAT = 1  # bump when an entry's layout changes: older entries are then never hit
Convert = Callable[[str, str], bool]  # (source .onnx, destination .onnx) -> wrote shareable data


class ModelChanged(RuntimeError):
    """The model file on disk is not the version the engine pinned: refused, not loaded."""


@dataclass(frozen=True)
class Pinned:
    path: str  # the file to load
    digest: str  # the version it is (== spec.digest when the caller pinned one)
    shared: bool  # its weights are a file every worker maps (one copy in memory)
    note: str  # what was loaded and why, for stats() and describe()
    form: str = "as given"  # "prepacked": optimized once, when the entry was written; else the model's own bytes


def default_cache_dir() -> str:
    """$SLABPOOL_CACHE_DIR, else $XDG_CACHE_HOME/slabpool, else ~/.cache/slabpool."""
    if os.environ.get("SLABPOOL_CACHE_DIR"):
        return os.environ["SLABPOOL_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "slabpool")


def cpu_features() -> str:
    """What the CPU's matrix kernels are chosen by: architecture and ISA flags, hashed."""
    flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    return hashlib.sha256(f"{os.uname().machine} {flags}".encode()).hexdigest()[:12]


def pin(spec: SessionSpec, form: str, runtime: str = "", convert: Convert | None = None,
        why: str = "") -> Pinned:
    """The pinned model for `spec` in `form` ("prepacked" with `convert`, or "copy"); `why`
    says why a copy is not shared. Raises ModelChanged if the source is not `spec.digest`."""
    digest = spec.digest or model_digest(spec.path)
    if spec.cache_dir is None:
        return _direct(spec, digest, f"loaded from {spec.path} (no cache_dir); {why}".rstrip("; "))
    key = f"{digest}-{form}-{hashlib.sha256(f'{FORMAT} {runtime}'.encode()).hexdigest()[:8]}"
    root = Path(spec.cache_dir)
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        entry = _usable(root / key, digest) or _build(spec, root, key, digest, form, convert)
    except OSError as exc:  # read-only or full: no cache, but still the pinned version
        log.warning("slabpool: the weight cache %s cannot be used (%s); loading %s directly",
                    root, exc, spec.path)
        return _direct(spec, digest, f"loaded from {spec.path} (cache unusable: {exc})")
    if form == "copy":  # one entry serves every reason for a copy: say this one's
        return dataclasses.replace(entry, note=f"loaded as given: {why}" if why else "loaded as given")
    return entry


def _direct(spec: SessionSpec, digest: str, note: str) -> Pinned:
    """The source itself, checked against the pinned version. A model of one file (no external
    data) is opened once, hashed through that descriptor and loaded through it (/proc/self/fd:
    the descriptor stays open for the worker's life), so a deploy that replaces the file between
    the check and the load cannot be served under the pinned version (was, a hostile run with
    the cache read-only and the file swapped in a loop: 15-32 answers of 17,600 from the new
    model, labelled with the old version). External data files are opened by the runtime
    itself, by name: for them the check stays a look before the load."""
    if model_files(spec.path) == [os.path.basename(spec.path)]:
        fd = os.open(spec.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with open(os.dup(fd), "rb") as f:
                now = hashlib.file_digest(f, "sha256").hexdigest()[:16]  # (model_digest of one file)
        except BaseException:
            os.close(fd)
            raise
        if spec.digest and now != digest:
            os.close(fd)
            raise _changed(spec, digest, now)
        return Pinned(f"/proc/self/fd/{fd}", now, False, note)
    if spec.digest:  # else `digest` was taken from the file just now
        now = model_digest(spec.path)
        if now != digest:
            raise _changed(spec, digest, now)
    return Pinned(spec.path, digest, False, note)


@contextlib.contextmanager
def named_as_given(pinned: Pinned, path: str) -> Iterator[None]:
    """Around a load of `pinned`: a runtime's error that names /proc/self/fd/N (`_direct`) names
    the user's model file instead."""
    try:
        yield
    except Exception as exc:
        if pinned.path != path and pinned.path in str(exc):
            raise RuntimeError(str(exc).replace(pinned.path, path)) from None
        raise


def _changed(spec: SessionSpec, pinned: str, now: str) -> ModelChanged:
    return ModelChanged(
        f"the model file {spec.path} changed on disk since the engine loaded it (version {pinned}, now "
        f"{now}): this slot cannot start on the version the engine serves; call reload() to serve the "
        "new file on every slot")


def _usable(entry: Path, digest: str) -> Pinned | None:
    """The entry, if its manifest matches its files; a broken one is left for _build to drop."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("format") != FORMAT or manifest.get("digest") != digest:
        return None
    for name, want in manifest["files"].items():
        try:
            if (entry / name).stat().st_size != want["size"] or _sha256(entry / name) != want["sha256"]:
                return None
        except OSError:
            return None
    return _pinned(entry, manifest)


def _build(spec: SessionSpec, root: Path, key: str, digest: str, form: str, convert: Convert | None) -> Pinned:
    with _locked(root / f"{key}.lock"):
        found = _usable(root / key, digest)  # another engine may have built it while we waited
        if found is not None:
            return found
        _remove(root / key)  # stale or damaged
        for leftover in root.glob(f".tmp-{key}-*"):  # a writer that died mid-write (we hold the lock)
            _remove(leftover)
        tmp = root / f".tmp-{key}-{os.getpid()}"
        try:
            manifest = _write(spec, tmp, digest, form, convert)
            _publish(tmp, root / key)
        finally:
            _remove(tmp)
        log.info("slabpool: weight cache entry %s written (%s)", root / key, manifest["note"])
        return _pinned(root / key, manifest)  # its files were hashed as the manifest was written


def _pinned(entry: Path, manifest: dict[str, Any]) -> Pinned:
    return Pinned(str(entry / manifest["model"]), manifest["digest"], bool(manifest["shared"]), manifest["note"],
                  "prepacked" if manifest["form"] == "prepacked" else "as given")


def _write(spec: SessionSpec, tmp: Path, digest: str, form: str, convert: Convert | None) -> dict[str, Any]:
    tmp.mkdir(mode=0o700)
    src = tmp / "src" if form == "prepacked" else tmp
    names = _copy_source(spec, src, digest)
    if form == "prepacked" and convert is not None:
        try:
            shared = convert(str(src / names[0]), str(tmp / "model.onnx"))
        except Exception as exc:  # noqa: BLE001 - any runtime error: name the user's file, not our copy
            need = sum(p.stat().st_size for p in src.rglob("*") if p.is_file()) + (1 << 20)
            if shutil.disk_usage(tmp).free < need:  # (the runtime's write of it failed: the cache is full)
                raise OSError(errno.ENOSPC, f"no room for the prepacked model ({exc})") from None
            raise RuntimeError(str(exc).replace(str(src), str(Path(spec.path).absolute().parent))) from None
        shutil.rmtree(src)
        model = "model.onnx"
        note = ("prepacked weights in a memory-mapped file every worker shares" if shared else
                "loaded as given: no weight large enough to prepack and share")
    else:
        shared, model, note = False, names[0], "loaded as given"
    files = {p.relative_to(tmp).as_posix(): p for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest: dict[str, Any] = {
        "format": FORMAT, "digest": digest, "form": form, "model": model, "shared": shared, "note": note,
        "source": os.path.abspath(spec.path),
        "files": {name: {"size": p.stat().st_size, "sha256": _sha256(p)} for name, p in files.items()},
    }
    for p in files.values():
        _fsync(p)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST)
    for d in {p.parent for p in files.values()} | {tmp}:
        _fsync(d)
    return manifest


def _copy_source(spec: SessionSpec, dst: Path, digest: str) -> list[str]:
    """Copy the model's files, hashing what was copied: the copy is the pinned version or is refused."""
    dst.mkdir(parents=True, exist_ok=True, mode=0o700)
    got = model_digest(spec.path, copy_to=str(dst))
    if got != digest:
        raise _changed(spec, digest, got)
    return model_files(spec.path)


def _publish(tmp: Path, entry: Path) -> None:
    os.rename(tmp, entry)  # atomic: the entry appears whole or not at all
    _fsync(entry.parent)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the kernel drops it if the holder dies
        yield
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
