"""Awaiting one file descriptor on the running loop: readable (a pipe with data, a pidfd whose
process exited) or writable (a full pipe with room again)."""

from __future__ import annotations

import asyncio


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
