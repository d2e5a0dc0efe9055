"""Errors a caller's call makes, in the caller's words: the public method's name
(`Engine.map()`, not `BaseEngine.map()`), the setting it probably meant, and what a call takes
when it was handed something else (`eng.map(fn, items)`: map() takes inputs, not a function).

`public` wraps a method at no cost while the call is right: the arguments are looked at again
only after a TypeError, to tell a wrong call from a TypeError raised inside it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from slabpool.engine.core.config import check_settings, context_of, suggest

P = ParamSpec("P")
R = TypeVar("R")


def public(method: Callable[P, R]) -> Callable[P, R]:
    """A method of the caller's API whose wrong calls raise TypeError naming the public class."""
    sig = inspect.signature(method)

    @functools.wraps(method)
    def call(*args: P.args, **kw: P.kwargs) -> R:
        try:
            return method(*args, **kw)
        except TypeError:
            wrong = misuse(sig, method.__name__, args, kw)
            if wrong is None:
                raise  # raised inside the call: not the call's shape
            raise TypeError(wrong) from None

    return call


def misuse(sig: inspect.Signature, name: str, args: tuple[Any, ...], kw: dict[str, Any]) -> str | None:
    """What is wrong with calling `name` with these arguments, in the public API's words
    (None: the call binds; a TypeError came from inside it)."""
    try:
        sig.bind(*args, **kw)
        return None
    except TypeError as exc:
        why = str(exc)
    owner = f"{type(args[0]).__name__}.{name}()" if args else f"{name}()"
    shown = str(sig.replace(parameters=[p.replace(annotation=p.empty) for p in list(sig.parameters.values())[1:]
                                         if not p.name.startswith("_")], return_annotation=sig.empty))
    known = [p for p in sig.parameters if p != "self" and not p.startswith("_")]
    for key in kw:
        if key not in sig.parameters:
            return f"{owner} got an unexpected argument {key!r}{suggest(key, known)} It takes {name}{shown}"
    if len(args) > 1 and callable(args[1]) and name in ("map", "submit", "infer"):
        return (f"{owner} takes the inputs, not a function: the model (and preprocess=/postprocess= of "
                f"the Engine) is what runs on them; call eng.{name}(inputs) (it takes {name}{shown})")
    return f"{owner}: {why}; it takes {name}{shown}"


def map_call(owner: str, items: Any, context: Any) -> None:
    """map()'s and map_async()'s arguments, checked at the call (not at the first item)."""
    not_a_function(owner, items)
    context_of(context)


def not_a_function(owner: str, items: Any) -> None:
    """map(fn): a function where the inputs go (as with Pool.map(fn, items)), refused at the call."""
    if callable(items) and not hasattr(items, "__iter__"):
        raise TypeError(f"{owner} takes the inputs (an iterable of items), not a function: the model, and "
                        "the Engine's preprocess=/postprocess= hooks, are what runs on them; call "
                        "eng.map(items), or give your function as Engine(model, preprocess=fn)")


def check_constructor(cls: type, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
    """An engine's constructor call, checked before __init__ runs: one positional argument
    (the model), and only settings it knows (with the one probably meant)."""
    owner = f"{cls.__name__}()"
    if len(args) > 1:
        raise TypeError(f"{owner} takes the model as its only positional argument, got {len(args)}; every "
                        f"setting is a keyword: {cls.__name__}('model.onnx', workers=2, ...)")
    check_settings(owner, kw, settings_of(cls))


class InitSignature:
    """A class's `__signature__`: that of its __init__ (less self), which a __new__ that only
    checks the call would otherwise hide from help() and inspect.signature()."""

    def __get__(self, obj: object, cls: type) -> inspect.Signature:
        if obj is not None:
            raise AttributeError("__signature__")
        init = next(k.__dict__["__init__"] for k in cls.__mro__ if "__init__" in k.__dict__)
        sig = inspect.signature(init)
        return sig.replace(parameters=list(sig.parameters.values())[1:])


@functools.cache
def settings_of(cls: type) -> frozenset[str]:
    """The keyword parameters of cls.__init__, and of the parents it hands its **settings to."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return frozenset(names - {"self"})
