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
    if frame is None or _guarded_lines(path, frame.f_code.co_filename).get(frame.f_lineno, True):
        return
    raise RuntimeError(
        f"Engine() was called at the top level of the script {path} (line {frame.f_lineno}), outside "
        f"`if __name__ == \"__main__\":`. Workers (start_method={start_method!r}) import the main "
        "script again, so each would try to start an engine of its own. Put the code that makes "
        "the Engine under `if __name__ == \"__main__\":` (or in a function called from there).")


@functools.lru_cache(maxsize=8)
def _guarded_lines(path: str, code_file: str) -> dict[int, bool]:
    """Top-level statement lines of the script -> whether they are under the main guard. Empty
    (everything passes) when the source cannot be read or is not the code that runs."""
    try:
        with open(code_file, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return {}
    lines: dict[int, bool] = {}
    for node in tree.body:
        guarded = isinstance(node, ast.If) and _is_main_test(node.test)
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
            lines[line] = guarded
    return lines


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = {s.id for s in sides if isinstance(s, ast.Name)}
    consts = {s.value for s in sides if isinstance(s, ast.Constant)}
    return names == {"__name__"} and consts == {"__main__"}
