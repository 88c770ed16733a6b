"""The local end of ``dsec sandbox shell``: this terminal, raw, joined to a sandbox's PTY.

Raw mode hands every keystroke to the sandbox's terminal as it is typed: ^C, ^Z and ^D are
bytes its line discipline turns into SIGINT, SIGTSTP and end-of-file for the program in front
there, as on a local terminal. Window size changes (SIGWINCH) become resize calls. Keystrokes
and sizes go out through one queue, in the order they happened, so a command typed after a
resize runs at the new size. The local terminal's modes are restored however this ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import shutil
import signal
import stat
import termios
import tty
from collections.abc import Iterator

from dsec.protocol.errors import ProcessNotFound
from dsec.sdk._pty import Pty

_READ = 1 << 16
_EOF = b"\x04"  # what ^D sends; a piped stdin that ends is ended the same way


def window_size(fd: int) -> tuple[int, int]:
    """(rows, cols) of the terminal at ``fd``; 24 x 80 when it is not one."""
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        size = shutil.get_terminal_size((80, 24))
    return max(1, min(size.lines, 4096)), max(1, min(size.columns, 4096))


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:  # a terminal another program left non-blocking
            select.select([], [fd], [])


async def attach(pty: Pty, stdin: int = 0, stdout: int = 1) -> int:
    """Join this process's terminal to ``pty`` until its program ends; its exit code."""
    loop = asyncio.get_running_loop()
    outgoing: asyncio.Queue[bytes | tuple[int, int]] = asyncio.Queue()
    sent_size = window_size(stdout)

    def note_size() -> None:
        nonlocal sent_size
        size = window_size(stdout)
        if size != sent_size:
            sent_size = size
            outgoing.put_nowait(size)

    at_eof = False

    def readable() -> None:
        nonlocal at_eof
        note_size()  # a resize the signal has not reported yet goes before what was typed after it
        data = os.read(stdin, _READ)
        if not data:
            loop.remove_reader(stdin)
            at_eof, data = True, _EOF
        outgoing.put_nowait(data)

    async def send() -> None:
        while True:
            item = await outgoing.get()
            if isinstance(item, bytes):
                await pty.write(item)
            else:
                await pty.resize(*item)

    await pty.resize(*sent_size)
    sender = asyncio.create_task(send())

    def pump_file() -> None:  # a regular file: always readable, and epoll refuses to watch it
        readable()
        if not at_eof:
            loop.call_soon(pump_file)

    with raw_mode(stdin):
        if stat.S_ISREG(os.fstat(stdin).st_mode):
            loop.call_soon(pump_file)
        else:
            loop.add_reader(stdin, readable)
        loop.add_signal_handler(signal.SIGWINCH, note_size)
        output = asyncio.ensure_future(_copy_out(pty, stdout))
        try:
            await asyncio.wait({output, sender}, return_when=asyncio.FIRST_COMPLETED)
            if not output.done():  # the sender only stops on an error
                failure = sender.exception()
                if not isinstance(failure, ProcessNotFound):
                    assert failure is not None
                    raise failure
            await output  # it ended under a keystroke (^D, exit): its end is on the way
        finally:
            output.cancel()
            loop.remove_signal_handler(signal.SIGWINCH)
            loop.remove_reader(stdin)
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender
    assert pty.exit_code is not None
    return pty.exit_code


async def _copy_out(pty: Pty, stdout: int) -> None:
    async for data in pty.output():
        _write_all(stdout, data)
