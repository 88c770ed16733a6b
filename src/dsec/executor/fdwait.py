"""Awaiting one file descriptor on the running loop: readable (a pipe with data, a pidfd whose
process exited) or writable (a full pipe with room again); a pipe read only on demand."""

from __future__ import annotations

import asyncio
import fcntl
import os
import struct
import termios


async def fd_ready(fd: int, *, write: bool = False) -> None:
    """Until ``fd`` is writable (``write``) or readable; the loop stops watching it after."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, ready)
    try:
        await fut
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


class PipeReader:
    """The read end of a pipe, read only while someone awaits :meth:`read`: no transport, no
    protocol, no buffer and no selector registration in between. A held session shell's stdout
    and stderr are two of these; asyncio's StreamReader with its transport and protocol was ~14
    objects per pipe for every full garbage collection to walk, by the thousand sessions
    (docs/decisions.md, "Fewer Python objects per held session"). Closes its fd at EOF."""

    __slots__ = ("_fd", "_waiter")

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd = fd
        self._waiter: asyncio.Future[None] | None = None

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (any positive count; -1: up to 64 KiB) once there are some; b"" at
        EOF or once closed. One reader at a time, as a StreamReader (RuntimeError)."""
        if self._waiter is not None:
            raise RuntimeError("PipeReader.read() called while another coroutine is already waiting")
        while self._fd >= 0:
            try:
                data = os.read(self._fd, n if n > 0 else 1 << 16)
            except BlockingIOError:
                await self._readable()
                continue
            if not data:
                self.close()
            return data
        return b""

    async def _readable(self) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()

        def ready() -> None:
            if not waiter.done():
                waiter.set_result(None)

        loop.add_reader(self._fd, ready)
        try:
            await waiter
        finally:
            self._waiter = None
            if self._fd >= 0:
                loop.remove_reader(self._fd)

    def read_now(self) -> bytes:
        """What the pipe holds at this moment, without waiting (b"" when empty or closed): the
        rest of what a process that ended wrote, with no wait for an EOF that a child of it
        holding the pipe may never give. Not while a :meth:`read` waits."""
        out = bytearray()
        want = self.unread()
        while self._fd >= 0 and len(out) < want:
            try:
                data = os.read(self._fd, want - len(out))
            except BlockingIOError:
                break
            if not data:
                self.close()
                break
            out += data
        return bytes(out)

    def unread(self) -> int:
        """Bytes waiting in the pipe (0 once closed)."""
        if self._fd < 0:
            return 0
        return int(struct.unpack("i", fcntl.ioctl(self._fd, termios.FIONREAD, b"\0" * 4))[0])

    def close(self) -> None:
        """Close the fd; a read waiting on it returns b"". Idempotent."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        if self._waiter is not None:
            asyncio.get_running_loop().remove_reader(fd)
            if not self._waiter.done():
                self._waiter.set_result(None)
        os.close(fd)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)  # -1 also when __init__ failed (not a pipe fd)
        if fd >= 0:  # not read to EOF nor closed: never leak the fd
            os.close(fd)
