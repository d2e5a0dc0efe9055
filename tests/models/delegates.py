"""Build the fake TFLite external delegate (``fake_delegate.c``) for tests.

``build_fake_delegate(out_dir)`` compiles the C file with ``gcc -shared -fPIC -O2`` into
``out_dir`` and returns the ``.so`` path. The file name carries a hash of the source, so a cached
library is reused until the source changes, and concurrent builders (pytest-xdist, several
workers) never see a half-written file: each compiles to a private name and renames it.

Load it with ``load_delegate(str(path), {"mode": mode})`` for one of :data:`MODES`:

=================  ==============================================================
mode               what the runtime does (ai_edge_litert 2.3)
=================  ==============================================================
noop               loads; Prepare claims no nodes, so the model silently runs on CPU
fail_prepare       ``Interpreter(...)`` raises ``RuntimeError``
refuse             ``load_delegate`` raises ``ValueError`` (message ends "refused")
abort_on_create    ``load_delegate`` kills the process with SIGABRT
abort_on_prepare   ``Interpreter(...)`` kills the process with SIGABRT
=================  ==============================================================
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_delegate.c")
MODES = ("noop", "fail_prepare", "refuse", "abort_on_create", "abort_on_prepare")
CFLAGS = ("-shared", "-fPIC", "-O2")

__all__ = ["CFLAGS", "MODES", "SOURCE", "DelegateBuildError", "build_fake_delegate"]


class DelegateBuildError(RuntimeError):
    """The fake delegate could not be compiled (no C compiler, or gcc failed)."""


def _library_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()
    return f"libfake_delegate-{digest[:12]}.so"


def _compile(target: Path) -> None:
    """Compile :data:`SOURCE` to ``target`` atomically (private temp name, then rename)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise DelegateBuildError("gcc not found on PATH: cannot build the fake delegate")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    cmd = [gcc, *CFLAGS, "-o", str(tmp), str(SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise DelegateBuildError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    os.replace(tmp, target)


def build_fake_delegate(out_dir: str | os.PathLike[str]) -> Path:
    """Return the path of the compiled fake delegate in ``out_dir``, building it if needed."""
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / _library_name()
    if not target.exists():
        _compile(target)
    return target
