"""Refuse a script that makes an Engine outside `if __name__ == "__main__":`.

Workers start with 'forkserver' or 'spawn': both import the caller's main script again in
the new process. A script that makes its Engine at the top level would then make one in every
worker, which multiprocessing refuses; the worker dies during start-up with exit(1), and the
caller sees only that. The check reads where Engine() was called from, once, at construction.
"""

from __future__ import annotations

import ast
import functools
import sys
from types import FrameType


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
