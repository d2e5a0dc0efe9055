"""Ctrl-C while a caller acts as the engine's owner (engine.core.fastpath).

Python runs a signal's handler on the main thread between two bytecodes, anywhere; SIGINT's
default handler raises KeyboardInterrupt there. A caller on the main thread is, for part of
each lent call, in the middle of the owner's work: holding the owner lock (a RunBatch half
written, a worker's answer half handled), or holding a slot lent to it that it has not begun
to wait on. An exception there leaves a step half done, which the engine could only take for
a bug and stop on (every later call: EngineInternalError), and a lend nobody waits on. So such
a stretch is marked (`enter` ... `leave`), and a SIGINT inside it is deferred: the engine's
handler notes it, and the stretch's end raises the KeyboardInterrupt, where the call can be
abandoned as a Ctrl-C in `Future.result()` abandons it: its task ends once (its result
dropped), a lend goes back to the owner thread, and the engine serves on.

    caller (main thread)                 SIGINT lands           what happens
    accept, dispatch, the lend handed    in the stretch         noted; raised at its end
    poll(the lent pipe, its eventfd)     outside                KeyboardInterrupt at once: the
                                                                lend goes back (FastPath.wait)
    own the lock, read, finish, let go   in the stretch         noted; raised at its end

The handler is put in place when the main thread enters a stretch and finds Python's own
default there (`signal.default_int_handler`; asked at each stretch: a job or a test may put
its own handler in and take it out again); outside a stretch it does what the default does. A
handler of the user's own is left alone, and is the user's to keep safe (one that raises in a
stretch stops the engine, as before). Stretches are short and never block on anything but the
owner lock (at most one owner step), so a Ctrl-C waits microseconds.
"""

from __future__ import annotations

import importlib
import signal
import threading
from collections.abc import Callable
from types import FrameType

_MAIN = threading.main_thread().ident
_SIGINT = int(signal.SIGINT)
_DEFAULT = signal.default_int_handler
# the C function signal.getsignal wraps: the wrapper's enum lookup costs ~2 us a call, this ~15 ns
_handler: Callable[[int], object] = importlib.import_module("_signal").getsignal


class _Stretches(threading.local):
    depth = 0  # stretches this thread is in (nested: a lend's wait inside an accept's)
    pending = False  # a SIGINT came inside one (only the main thread runs handlers)


_here = _Stretches()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if _here.depth:
        _here.pending = True
        return
    signal.default_int_handler(signum, frame)


def enter() -> None:
    """This thread starts a stretch a KeyboardInterrupt must not cut."""
    if _handler(_SIGINT) is _DEFAULT and threading.get_ident() == _MAIN:
        signal.signal(_SIGINT, _on_sigint)  # (only the main thread runs handlers, and sets them)
    _here.depth += 1


def leave() -> None:
    """This thread ends a stretch; once it is in none, a SIGINT deferred meanwhile is raised
    here, as the KeyboardInterrupt it would have been."""
    here = _here
    here.depth -= 1
    if here.pending and not here.depth:
        here.pending = False
        raise KeyboardInterrupt


def leave_quietly() -> None:
    """`leave`, on the way out of an exception: that exception goes on, and ends the call as
    a SIGINT deferred meanwhile would have (it is not raised as well)."""
    here = _here
    here.depth -= 1
    if not here.depth:
        here.pending = False

