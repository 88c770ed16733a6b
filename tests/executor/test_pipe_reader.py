"""Tests of dsec.executor.fdwait.PipeReader, the on-demand reader of a held session shell's
stdout and stderr: what the session relies on from a StreamReader (data as it comes, b"" at
the end, one reader at a time), the bytes waiting for FIONREAD, and its fd closed however the
reading ends (at EOF, by close, by a cancelled read followed by close)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from dsec.executor.fdwait import PipeReader


class Pipe:
    """A reader over a fresh pipe, with the pipe's read fd and its write end."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_CLOEXEC)
        self.reader = PipeReader(self.r)

    def close_writer(self) -> None:
        if self.w >= 0:
            os.close(self.w)
            self.w = -1


@pytest.fixture
def pipe() -> Iterator[Pipe]:
    made = Pipe()
    yield made
    made.reader.close()
    made.close_writer()


def fd_open(fd: int) -> bool:
    return os.path.exists(f"/proc/self/fd/{fd}")


async def test_reads_what_arrives_and_reports_it_waiting(pipe: Pipe) -> None:
    reader, w = pipe.reader, pipe.w
    os.write(w, b"hello")
    assert reader.unread() == 5
    assert await reader.read(3) == b"hel"
    assert reader.unread() == 2
    assert await reader.read(100) == b"lo"
    pending = asyncio.ensure_future(reader.read(100))
    await asyncio.sleep(0)
    assert not pending.done()  # nothing written yet: it waits
    os.write(w, b"later")
    assert await pending == b"later"


async def test_end_of_file_is_empty_and_closes_the_fd(pipe: Pipe) -> None:
    reader, r, w = pipe.reader, pipe.r, pipe.w
    os.write(w, b"last")
    pipe.close_writer()
    assert await reader.read(100) == b"last"
    assert await reader.read(100) == b""
    assert not fd_open(r)
    assert await reader.read(100) == b""  # and stays so
    assert reader.unread() == 0


async def test_close_ends_a_waiting_read(pipe: Pipe) -> None:
    reader, r = pipe.reader, pipe.r
    waiting = asyncio.ensure_future(reader.read(100))
    await asyncio.sleep(0)
    reader.close()
    assert await asyncio.wait_for(waiting, 10) == b""
    assert not fd_open(r)
    reader.close()  # idempotent


async def test_one_reader_at_a_time_and_a_cancelled_read_loses_nothing(
    pipe: Pipe,
) -> None:
    reader, w = pipe.reader, pipe.w
    first = asyncio.ensure_future(reader.read(100))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError):
        await reader.read(100)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    os.write(w, b"kept")
    assert await reader.read(100) == b"kept"  # the loop no longer watched it for the cancelled one


def test_an_unclosed_reader_does_not_leak_its_fd() -> None:
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        reader = PipeReader(r)
        del reader
        assert not fd_open(r)
    finally:
        os.close(w)
