"""Refuse, before any worker starts, a main module that the workers cannot import again.

Workers start with 'forkserver' or 'spawn': both import the caller's main script again in
the new process, before any code of slabpool's runs there. What fails in that import kills
the worker with exit(1), its traceback on the worker's stderr alone. So the caller checks:

- a script that makes its Engine at the top level, outside `if __name__ == "__main__":`,
  would make one in every worker, which multiprocessing refuses (check_main_guard; it reads
  where Engine() was called from);
- a main module read from no file (`python - <<EOF`: '<stdin>') cannot be imported again at
  all; a hook defined in a main module that workers never import (`python -c`, an interactive
  session, a notebook, `python -m package`) cannot be found there (check_main_importable).
"""

from __future__ import annotations

import ast
import functools
import multiprocessing.process
import os
import sys
from types import FrameType
from typing import Any


def check_main_guard(start_method: str) -> None:
    """RuntimeError, saying what to do, if Engine() runs at the top level of the main script
    outside `if __name__ == "__main__":`. Interactive sessions, `python -c` and notebooks have
    no main script to import again, and `python -m package` is not run again in a worker
(multiprocessing skips a package's __main__): nothing to check."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return
    name = getattr(getattr(main, "__spec__", None), "name", "")
    if name.endswith(".__main__"):  # `python -m package`: multiprocessing never runs it again
        return
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            break
        frame = frame.f_back
    if frame is None or _guarded(frame.f_code.co_filename, frame.f_lineno):
        return
    raise RuntimeError(
        f"Engine() was called at the top level of the script {path} (line {frame.f_lineno}), outside "
        f"`if __name__ == \"__main__\":`. Workers (start_method={start_method!r}) import the main "
        "script again, so each would try to start an engine of its own. Put the code that makes "
        "the Engine under `if __name__ == \"__main__\":` (or in a function called from there).")


@functools.lru_cache(maxsize=8)
def _parse(code_file: str) -> ast.Module | None:
    try:
        with open(code_file, encoding="utf-8") as f:
            return ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None


def _guarded(code_file: str, line: int) -> bool:
    """Whether the top-level statement at `line` may be guarded: it sits (at any depth: inside
    a `try`, a `with`, an `else`) in an `if` whose test reads `__name__`. Refuse only what is
    surely unguarded: True when the source cannot be read or the line is not found."""
    tree = _parse(code_file)
    if tree is None:
        return True
    nodes: list[ast.AST] = list(tree.body)
    while True:
        node = next((n for n in nodes if n.lineno <= line <= (n.end_lineno or n.lineno)), None)  # type: ignore[attr-defined]
        if node is None:
            return True
        if isinstance(node, ast.If) and _reads_name(node.test):
            return True
        nodes = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt | ast.excepthandler)]
        if not nodes:
            return False


def _reads_name(test: ast.expr) -> bool:
    """The test reads `__name__` (`== "__main__"`, `!= ...`, combined with `and`, ...)."""
    return any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(test))


def check_main_importable(start_method: str, hooks: dict[str, Any]) -> None:
    """RuntimeError, saying why and what to do, where the workers could not import the main
    module again (it was read from no file), or a hook (name -> callable) lives in a main
    module they never import."""
    main = sys.modules.get("__main__")
    if main is None:
        return
    name = getattr(getattr(main, "__spec__", None), "name", None)
    path = getattr(main, "__file__", None)
    if name is None and path is not None and not os.path.isfile(_main_path(path)):
        raise RuntimeError(
            f"the main module was read from {path!r}, which is no file that workers can read: "
            f"workers (start_method={start_method!r}) import the caller's main module again from "
            f"its file, so each would die at start-up. Save the script to a file and run that "
            "(`python script.py`, making the Engine under `if __name__ == \"__main__\":`), or "
            "import the code from a module.")
    reimported = (name is None and path is not None) or (name is not None and not _is_package_main(name))
    for what, fn in hooks.items():
        if fn is not None and not reimported and getattr(fn, "__module__", None) == "__main__":
            raise RuntimeError(
                f"{what}={fn!r} is defined in the main module, which workers (start_method="
                f"{start_method!r}) do not import (`python -c`, an interactive session, a notebook, "
                f"or `python -m`): they could not find it. Define it in a module file and pass it, "
                "or pass 'module:function'.")


def _main_path(path: str) -> str:
    """Where multiprocessing looks for the main script (spawn.get_preparation_data)."""
    original: str | None = getattr(multiprocessing.process, "ORIGINAL_DIR", None)  # typeshed lacks it
    if os.path.isabs(path) or original is None:
        return path
    return os.path.join(original, path)


def _is_package_main(name: str) -> bool:
    """multiprocessing never imports `python -m package`'s __main__ again."""
    return name == "__main__" or name.endswith(".__main__")
