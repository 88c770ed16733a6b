"""A call's output, as the runner reads it: capped pipes pumped until they end or time runs out.

The call writes to pipes the runner holds (never to files it could fill or race with); the
first ``max_output_bytes`` of each are kept, the rest read and dropped so the writer never
blocks, and the last bytes kept apart for the memory-failure signatures ``judge`` looks for.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import socket
import time


@dataclasses.dataclass
class Stream:
    """One output pipe: the first ``cap`` bytes are kept, the rest read and dropped."""

    fd: int
    cap: int
    data: bytearray = dataclasses.field(default_factory=bytearray)
    tail: bytes = b""  # the last bytes, for memory-failure signatures past the cap
    truncated: bool = False
    eof: bool = False

    def read(self) -> None:
        chunk = os.read(self.fd, 1 << 16)
        self.eof = not chunk
        room = max(self.cap - len(self.data), 0)
        self.truncated = self.truncated or len(chunk) > room
        self.data += chunk[:room]
        self.tail = (self.tail + chunk)[-8192:]

    def text(self) -> str:
        return self.data.decode(errors="replace")


@dataclasses.dataclass
class Proc:
    """One process of a call, run: its output, wait status, rusage, wall time and status marker."""

    out: Stream
    err: Stream
    status: int = 0
    maxrss_kib: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    timed_out: bool = False
    marker: bytes = b""


def pump(streams: list[Stream], until: float, sock: socket.socket | None = None) -> bool:
    """Read the streams until they end or ``until``; with ``sock``, stop when it is readable."""
    with selectors.DefaultSelector() as sel:
        for s in streams:
            if not s.eof:
                sel.register(s.fd, selectors.EVENT_READ, s)
        if sock is not None:
            sel.register(sock, selectors.EVENT_READ, None)
        while sel.get_map() and (left := until - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                if key.data is None:
                    return True
                key.data.read()
                if key.data.eof:
                    sel.unregister(key.fd)
    return False
