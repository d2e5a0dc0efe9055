"""The worker's share of one call (issue 21, docs/latency.md "The worker's share"): what was
made cheaper keeps its behaviour.

- decode rebuilds the messages from flat tuples: they must be the same messages (of the
  same type, equal field by field, immutable), for every kind of task and outcome on the
  wire;
- the output planner lays out once per input signature and rejects small outputs before it
  makes any view: the threshold (in_place_min_bytes) still holds to the byte."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from slabpool import Engine
from slabpool.workers.errors import ErrorKind
from slabpool.workers.protocol import (
    ArrayRef,
    BatchDone,
    FaultSpec,
    Hole,
    Outcome,
    Packed,
    RemoteError,
    RunBatch,
    TaskSpec,
    decode,
    encode,
    flat_skeleton,
    seal,
)

_REF = ArrayRef(128, "<f4", (1, 64))
_PACKED = {
    "flat": Packed(flat_skeleton(("x",)), (_REF,)),
    "holes out of order": Packed({"b": Hole(1), "a": Hole(0)}, (_REF, ArrayRef(384, "<i8", (3,)))),
    "nested": Packed({"x": [Hole(0), {"k": 7}]}, (_REF,)),
    "no arrays": Packed({"meta": "m"}, ()),
}
_TASKS = {
    "bare": {},
    "sealed context": {"context": seal({"tenant": "a"}, "the context")},
    "fault": {"fault": FaultSpec("run", "raise", "/tmp/once")},
    "deadline and step": {"deadline": 1234.5, "step": 64},
}


@pytest.mark.parametrize("packed", list(_PACKED), ids=str)
@pytest.mark.parametrize("extra", list(_TASKS), ids=str)
@pytest.mark.parametrize("n", [1, 3])
def test_a_decoded_run_batch_is_the_message_sent(packed: str, extra: str, n: int) -> None:
    tasks = tuple(TaskSpec(i, i % 2, 99 + i, _PACKED[packed], **_TASKS[extra]) for i in range(n))
    for msg in (RunBatch(7, tasks, n > 1), RunBatch(8, tasks, False, 4096, 1 << 20)):
        _same_message(decode(encode(msg)), msg)


@pytest.mark.parametrize("n", [1, 4])
def test_a_decoded_batch_done_is_the_message_sent(n: int) -> None:
    err = RemoteError(ErrorKind.CAPACITY, "ShmCapacityError", "too big", "tb", needed=9, available=3)
    kinds = [Outcome(0, _PACKED["flat"]), Outcome(1, None, err), Outcome(2, _PACKED["nested"]),
             Outcome(3, _PACKED["holes out of order"])]
    msg = BatchDone(5, tuple(kinds[:n]), 0.25, 1 << 30, in_place=n - 1)
    _same_message(decode(encode(msg)), msg)


def _same_message(got: Any, want: Any) -> None:
    assert type(got) is type(want) and got == want
    wants = [want, *getattr(want, "tasks", ()), *getattr(want, "outcomes", ())]
    parts = [got, *getattr(got, "tasks", ()), *getattr(got, "outcomes", ())]
    assert [type(p) for p in parts] == [type(w) for w in wants]
    for part, sent in zip(parts, wants, strict=True):
        for name in type(part)._fields:  # every field, by name: equal values of equal types
            assert type(getattr(part, name)) is type(getattr(sent, name)) and getattr(part, name) == getattr(sent, name)
        with pytest.raises(AttributeError):  # immutable (a NamedTuple's fields are read-only)
            setattr(part, type(part)._fields[0], 0)
        assert part._replace() == part


@pytest.mark.parametrize("extra", [0, 1], ids=["at the threshold", "one byte above"])
def test_in_place_min_bytes_holds_to_the_byte(models: Any, extra: int) -> None:
    x = {"x": np.ones((1, 256 * 1024), np.float32)}  # payload: y = 2x, 1 MiB out
    with Engine(models.payload, workers=1, in_place_min_bytes=x["x"].nbytes + extra) as eng:
        for _ in range(3):  # the first learns the shapes
            assert eng.infer(x)["y"].tobytes() == (x["x"] * 2).tobytes()
        assert eng.stats().outputs_in_place == (2 if extra == 0 else 0)
