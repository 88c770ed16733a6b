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
from typing import Protocol

from dsec.executor.files import SandboxFiles
from dsec.protocol.models import FileStat

CHUNK = 1 << 20
DEFAULT_FILE_MODE = 0o644


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

    async def read_stream(self, path: str) -> AsyncGenerator[bytes, None]:
        fh = await asyncio.to_thread(self.files.open_read, path)
        try:
            while chunk := await asyncio.to_thread(fh.read, CHUNK):
                yield chunk
        finally:
            fh.close()

    async def write_stream(
        self, path: str, chunks: AsyncIterable[bytes], mode: int = DEFAULT_FILE_MODE
    ) -> FileStat:
        writer = await asyncio.to_thread(self.files.open_write, path, mode)
        try:
            async for chunk in chunks:
                await asyncio.to_thread(writer.write, chunk)
            await asyncio.to_thread(writer.commit)
        except BaseException:
            # Also on cancellation (a caller that went away): no half-written file stays.
            await asyncio.to_thread(writer.abort)
            raise
        return await asyncio.to_thread(self.files.stat, path)

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
        await asyncio.to_thread(self.files.mkdir, path, parents)
        return await asyncio.to_thread(self.files.stat, path)

    async def remove(self, path: str, recursive: bool = False) -> None:
        await asyncio.to_thread(self.files.remove, path, recursive)

    async def move(self, source: str, destination: str) -> FileStat:
        await asyncio.to_thread(self.files.move, source, destination)
        return await asyncio.to_thread(self.files.stat, destination)
