"""The async file interface the edge uses on any sandbox, whatever runs it.

A container's files are reached from the host (:class:`HostFileOps` over
:class:`~dsec.executor.files.SandboxFiles`, blocking system calls run in threads); a microVM's
go through its guest agent. Both give exactly these calls, with the same errors (the DSec
tree) and the same streaming: content moves in chunks of at most :data:`CHUNK` bytes, so a
large file never sits in memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable
from typing import BinaryIO, Protocol

from dsec.executor._handles import AtomicWriter
from dsec.executor.files import SandboxFiles
from dsec.protocol.models import FileStat

CHUNK = 1 << 20
DEFAULT_FILE_MODE = 0o644


async def one_chunk(data: bytes) -> AsyncGenerator[bytes, None]:
    """``data`` as :meth:`FileOps.write_stream` takes it (the edge's own small files)."""
    yield data


class FileOps(Protocol):
    def read_stream(self, path: str) -> AsyncGenerator[bytes, None]:
        """A regular file's content in chunks; errors (missing, not a file) from the first."""
        ...

    async def write_stream(
        self, path: str, chunks: AsyncIterable[bytes], mode: int = DEFAULT_FILE_MODE
    ) -> FileStat:
        """Write ``path`` atomically: all of ``chunks``, or (on any error, also one raised by
        ``chunks``, which propagates) nothing."""
        ...

    async def stat(self, path: str) -> FileStat: ...

    async def exists(self, path: str) -> bool: ...

    async def list_dir(self, path: str) -> list[FileStat]: ...

    async def mkdir(self, path: str, parents: bool = True) -> FileStat: ...

    async def remove(self, path: str, recursive: bool = False) -> None: ...

    async def move(self, source: str, destination: str) -> FileStat:
        """Rename ``source`` to ``destination``; the moved entry's stat."""
        ...

    async def set_xattrs(self, path: str, prefix: str, attrs: dict[str, str]) -> None:
        """Make ``attrs`` the regular file's ``prefix`` extended attributes (others of it go)."""
        ...

    async def xattrs(self, path: str, prefix: str) -> dict[str, str]: ...


class HostFileOps:
    """:class:`FileOps` over a sandbox root the host can reach (containers)."""

    def __init__(self, files: SandboxFiles) -> None:
        self.files = files

    # Each hop to a thread and back costs 0.1-1 ms of CPU on a loaded 2-core host, more than
    # most of these calls' system calls (docs/decisions.md): the calls are grouped so that a
    # small file is read in one hop and written in two.

    async def read_stream(self, path: str) -> AsyncGenerator[bytes, None]:
        fh, chunk = await asyncio.to_thread(self._open_read, path)
        try:
            while chunk:
                yield chunk
                if len(chunk) < CHUNK:
                    break  # a buffered read returns less than asked only at the end of the file
                chunk = await asyncio.to_thread(fh.read, CHUNK)
        finally:
            fh.close()

    def _open_read(self, path: str) -> tuple[BinaryIO, bytes]:
        fh = self.files.open_read(path)
        try:
            return fh, fh.read(CHUNK)
        except BaseException:
            fh.close()
            raise

    async def write_stream(
        self, path: str, chunks: AsyncIterable[bytes], mode: int = DEFAULT_FILE_MODE
    ) -> FileStat:
        writer = await asyncio.to_thread(self.files.open_write, path, mode)
        try:
            last = b""  # written a hop late: the last chunk goes with the commit and the stat
            async for chunk in chunks:
                if last:
                    await asyncio.to_thread(writer.write, last)
                last = chunk
            return await asyncio.to_thread(self._finish_write, writer, last, path)
        except BaseException:
            # Also on cancellation (a caller that went away): no half-written file stays (an
            # abort after the commit does nothing).
            await asyncio.to_thread(writer.abort)
            raise

    def _finish_write(self, writer: AtomicWriter, last: bytes, path: str) -> FileStat:
        if last:
            writer.write(last)
        writer.commit()
        return self.files.stat(path)

    async def stat(self, path: str) -> FileStat:
        return await asyncio.to_thread(self.files.stat, path)

    async def set_xattrs(self, path: str, prefix: str, attrs: dict[str, str]) -> None:
        await asyncio.to_thread(self.files.set_xattrs, path, prefix, attrs)

    async def xattrs(self, path: str, prefix: str) -> dict[str, str]:
        return await asyncio.to_thread(self.files.xattrs, path, prefix)

    async def exists(self, path: str) -> bool:
        return await asyncio.to_thread(self.files.exists, path)

    async def list_dir(self, path: str) -> list[FileStat]:
        return await asyncio.to_thread(self.files.list_dir, path)

    async def mkdir(self, path: str, parents: bool = True) -> FileStat:
        return await asyncio.to_thread(self._mkdir, path, parents)

    def _mkdir(self, path: str, parents: bool) -> FileStat:
        self.files.mkdir(path, parents)
        return self.files.stat(path)

    async def remove(self, path: str, recursive: bool = False) -> None:
        await asyncio.to_thread(self.files.remove, path, recursive)

    async def move(self, source: str, destination: str) -> FileStat:
        return await asyncio.to_thread(self._move, source, destination)

    def _move(self, source: str, destination: str) -> FileStat:
        self.files.move(source, destination)
        return self.files.stat(destination)
