"""FrameReader against the real writer: multiprocessing.Connection.send_bytes on a real pipe."""

from __future__ import annotations

import multiprocessing
import os
import struct
import threading
import time

import pytest

from slabpool.workers.wire import CHUNK, FrameReader, Spin, polling_peers, runnable, spin_until


@pytest.fixture
def pipe():  # type: ignore[no-untyped-def]
    reader_end, writer_end = multiprocessing.Pipe(duplex=True)
    yield FrameReader(reader_end.fileno()), writer_end, reader_end
    for c in (reader_end, writer_end):
        if not c.closed:
            c.close()


def test_one_read_takes_every_frame_already_in_the_pipe(pipe) -> None:  # type: ignore[no-untyped-def]
    reader, writer, _ = pipe
    sent = [b"", b"a", os.urandom(1000), b"xyz" * 5000]
    for s in sent:
        writer.send_bytes(s)
    got: list[bytes] = []
    while len(got) < len(sent):
        got += reader.read()
    assert got == sent


def test_a_frame_split_across_reads_is_put_back_together(pipe) -> None:  # type: ignore[no-untyped-def]
    reader, writer, _ = pipe
    payload = os.urandom(3 * CHUNK + 17)  # longer than one read
    wire = struct.pack("!i", len(payload)) + payload

    def dribble() -> None:  # in pieces of 999 bytes, header included
        for i in range(0, len(wire), 999):
            os.write(writer.fileno(), wire[i : i + 999])

    t = threading.Thread(target=dribble)
    t.start()
    frames: list[bytes] = []
    reads = 0
    while not frames:
        frames = reader.read()
        reads += 1
    t.join()
    assert frames == [payload] and reads > 1


def test_the_long_header_form_is_understood(pipe) -> None:  # type: ignore[no-untyped-def]
    reader, writer, _ = pipe
    payload = b"long form"
    os.write(writer.fileno(), struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload)
    assert reader.read() == [payload]


def test_recv_and_poll_serve_a_blocking_reader(pipe) -> None:  # type: ignore[no-untyped-def]
    reader, writer, _ = pipe
    assert not reader.poll()
    for i in range(3):
        writer.send_bytes(bytes([i]))
    assert reader.poll()
    assert [reader.recv() for _ in range(3)] == [b"\0", b"\1", b"\2"]
    assert not reader.poll()


def test_spinning_catches_a_frame_written_while_it_polls(pipe) -> None:  # type: ignore[no-untyped-def]
    """spin_until: True at once for a frame already there; True for one another thread writes
    while it polls (the worker's wait after answering a lent call, the lender's for its answer);
    False once its end passes with a quiet writer, and nothing read."""
    reader, writer, _ = pipe
    reader.spin.cpus = 1 << 20  # (never crowded, on a loaded host too: recv(spin) polls)
    writer.send_bytes(b"there")
    assert spin_until(reader.fd, time.perf_counter() - 1.0)  # (its end already passed: one look)
    assert reader.recv(spin=0.5) == b"there"
    assert not spin_until(reader.fd, time.perf_counter() + 0.002)
    polling = threading.Event()
    t = threading.Thread(target=lambda: (polling.wait(10), writer.send_bytes(b"late")))
    t.start()
    polling.set()
    try:
        assert spin_until(reader.fd, time.perf_counter() + 30.0)  # (a deadlock guard, not a timing)
        assert reader.recv(spin=30.0) == b"late"
    finally:
        t.join()
    assert not reader.poll() and reader.spin.caught == 2  # (each recv(spin) polled, and caught its frame)


def test_a_pipe_numbered_past_fd_setsize_is_polled_spun_on_and_read(past_fd_setsize) -> None:  # type: ignore[no-untyped-def]
    """A slot's pipe in a process holding a thousand files open is numbered past select()'s
    FD_SETSIZE: poll(), the spin, recv() and a dead writer's last frames work there (select()
    raised ValueError: every infer() of such a process failed)."""
    reader_end, writer_end = multiprocessing.Pipe(duplex=False)
    fd = os.dup(reader_end.fileno())
    reader_end.close()
    assert fd >= 1024
    try:
        reader = FrameReader(fd)
        reader.spin.cpus = 1 << 20  # (never crowded: recv(spin) polls)
        assert not reader.poll() and not spin_until(fd, time.perf_counter() + 0.001)
        writer_end.send_bytes(b"past")
        assert spin_until(fd, time.perf_counter() + 30.0)  # (a deadlock guard, not a timing)
        assert reader.recv(spin=0.5) == b"past" and reader.spin.caught == 1
        writer_end.send_bytes(b"last")
        writer_end.close()
        assert reader.read_to_end() == [b"last"]
    finally:
        os.close(fd)
        if not writer_end.closed:
            writer_end.close()


def test_a_spin_on_a_pipe_closed_meanwhile_ends_at_once_for_a_look() -> None:
    """A lender spins on its slot's pipe without the owner lock; the owner closes that pipe at
    the worker's death. The spin ends at once (True: look), and the lender finds its lend over
    under the lock (select() raised EBADF into the caller's infer())."""
    reader_end, writer_end = multiprocessing.Pipe(duplex=False)
    fd = reader_end.fileno()
    reader_end.close()
    try:
        assert spin_until(fd, time.perf_counter() + 30.0)  # (a deadlock guard, not a timing)
    finally:
        writer_end.close()


def test_spinning_stops_while_it_does_not_pay_and_resumes_when_it_does(pipe) -> None:  # type: ignore[no-untyped-def]
    """Spin: after k misses in a row the next 2**k - 1 waits sleep at once (k up to 6: a
    sparse caller pays a spin about once in 64 calls); one catch and it spins each time again."""
    reader, writer, _ = pipe
    spin = Spin(cpus=1 << 20)  # (never crowded: the back-off alone)
    skipped = []
    for k in range(1, 8):
        assert not spin.wait(reader.fd, 0.0005)  # (a quiet writer: the spin runs out)
        assert spin.misses == min(k, Spin.MAX_MISSES)
        n = 0
        while spin.skip:
            assert not spin.wait(reader.fd, 30.0)  # (skipped: returns at once, a 30 s spin never runs)
            n += 1
        skipped.append(n)
    assert skipped == [1, 3, 7, 15, 31, 63, 63]
    writer.send_bytes(b"now")
    assert spin.wait(reader.fd, 30.0) and (spin.misses, spin.skip, spin.caught) == (0, 0, 1)
    assert reader.recv() == b"now"


def test_no_spin_while_the_host_has_more_tasks_runnable_than_cpus(pipe) -> None:  # type: ignore[no-untyped-def]
    """Spin looks at the host's runnable tasks (/proc/loadavg, the looker counted) every SAMPLE
    waits: with more than its CPUs at two looks in a row it never polls, even for bytes already
    there (the core is someone else's to have); the back-off is left as it was. One such look
    alone is no crowd (a moment's: the looker's own woken callers)."""
    reader, writer, _ = pipe
    assert runnable() >= 1  # (this test's own thread is running)
    writer.send_bytes(b"there")
    crowded = Spin(cpus=0)
    got = [crowded.wait(reader.fd, 30.0) for _ in range(3 * Spin.SAMPLE)]  # (the bytes stay unread)
    assert got == [True] * Spin.SAMPLE + [False] * (2 * Spin.SAMPLE) and crowded.crowded
    assert (crowded.caught, crowded.misses, crowded.skip) == (Spin.SAMPLE, 0, 0)
    roomy = Spin(cpus=1 << 20)
    assert roomy.wait(reader.fd, 30.0) and not roomy.crowded and roomy.caught == 1
    assert reader.recv() == b"there"


def test_the_engines_own_polling_tasks_do_not_count_as_a_crowd(pipe) -> None:  # type: ignore[no-untyped-def]
    """`peers`, the tasks of the looker's own engine that poll too (each other lent call's
    caller and worker: polling_peers), are not counted against the CPUs: a Spin that the host's
    runnable tasks crowd polls once they are all its peers."""
    reader, writer, _ = pipe
    assert [polling_peers(n) for n in range(4)] == [0, 0, 2, 4]
    assert [polling_peers(1, k) for k in (0, 1, 4)] == [0, 0, 3]  # (callers not lent: a group's)
    assert polling_peers(2, 5) == 5
    writer.send_bytes(b"there")
    spin = Spin(cpus=0)
    for _ in range(Spin.SAMPLE + 1):  # (two looks, SAMPLE waits apart: the looker alone is a crowd of 0 CPUs)
        spin.wait(reader.fd, 30.0)
    assert spin.crowded and not spin.wait(reader.fd, 30.0)
    for _ in range(Spin.SAMPLE - 2):  # (the next look comes SAMPLE waits after the last)
        assert not spin.wait(reader.fd, 30.0, peers=1 << 20)
    assert spin.wait(reader.fd, 30.0, peers=1 << 20) and not spin.crowded
    assert reader.recv() == b"there"


def test_a_writer_that_closes_during_the_spin_ends_it_with_eof(pipe) -> None:  # type: ignore[no-untyped-def]
    reader, writer, _ = pipe
    writer.close()
    assert spin_until(reader.fd, time.perf_counter() + 30.0)
    with pytest.raises(EOFError):
        reader.recv(spin=30.0)


def test_end_of_pipe_after_the_last_frames(pipe) -> None:  # type: ignore[no-untyped-def]
    reader, writer, _ = pipe
    writer.send_bytes(b"last words")
    writer.send_bytes(b"really")
    writer.close()
    assert reader.read_to_end() == [b"last words", b"really"]
    with pytest.raises(EOFError):
        reader.read()
    with pytest.raises(EOFError):
        reader.recv()


def test_read_to_end_does_not_block_on_a_live_quiet_writer(pipe) -> None:  # type: ignore[no-untyped-def]
    reader, writer, _ = pipe
    writer.send_bytes(b"one")
    assert reader.read_to_end() == [b"one"]
    assert reader.read_to_end() == []  # nothing there, writer still open: returns at once


def test_a_worker_whose_supervisor_closed_its_pipe_is_told_so_and_logs_nothing(capsys) -> None:  # type: ignore[no-untyped-def]
    """The supervisor stopping a worker now closes its end first: the worker's next send is
    SupervisorGone (its loop and main() then return quietly, as at EOF on a read), not a
    BrokenPipeError whose traceback lands on the worker's stderr (seen under `slabpool run`'s
    'stopping now'); a log record sent then is dropped, not a 'Logging error' on stderr."""
    import logging

    from slabpool.workers.protocol import Ready
    from slabpool.workers.worklog import Outbox, PipeHandler, SupervisorGone

    ours, supervisors = multiprocessing.Pipe(duplex=True)
    supervisors.close()
    outbox = Outbox(ours)
    try:
        with pytest.raises(SupervisorGone, match="closed its end"):
            outbox.send(Ready(os.getpid(), None))
        record = logging.LogRecord("hook", logging.WARNING, __file__, 1, "nobody reads this", None, None)
        PipeHandler(outbox, 0).handle(record)
        assert capsys.readouterr().err == ""
    finally:
        ours.close()


def test_an_end_closed_with_our_frames_unread_is_the_end_of_the_pipe(pipe) -> None:  # type: ignore[no-untyped-def]
    """A socket closed with bytes unread in it makes the other end's read() fail with
    ECONNRESET (a worker's answer still in the pipe when the supervisor stopped): EOFError,
    after the frames the closer had sent."""
    reader, writer, reader_end = pipe
    reader_end.send_bytes(b"an answer the writer never reads")
    writer.send_bytes(b"last words")
    writer.close()
    assert reader.read() == [b"last words"]
    with pytest.raises(EOFError):
        reader.read()
    with pytest.raises(EOFError):
        reader.recv()
