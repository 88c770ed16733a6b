"""The network namespace the calls of a sandbox share while none of them left a socket in it.

Held by the zygote (``zygote.py``), entered by each call process before it learns its task.
"""

from __future__ import annotations

import os

from .libc import CLONE_NEWNET, libc


class SharedNet:
    """The network namespace calls share while no socket of an earlier call is in it.

    Creating a namespace per call cost ~1 ms of CPU (its loopback, sysctls, and the kernel's
    teardown after the call). The zygote holds one instead, and before each call reads its
    socket counts: once the runner has proven every process of the last call gone, a socket
    there outlives them (descriptors in flight in a cycle of unix sockets, TCP TIME_WAIT), and
    the calls from then on get a fresh namespace. So a call never meets anything an earlier
    one bound or left queued; the IPC namespace (System V objects outlive their processes)
    stays per call. Counts that are not per namespace (alloc, mem) are left out."""

    def __init__(self, ns: int, stats: list[int]) -> None:
        self.ns, self.stats = ns, stats

    @staticmethod
    def create() -> SharedNet | None:
        """A fresh namespace (the zygote stays in its own); None when one cannot be made."""
        here = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.unshare(CLONE_NEWNET) != 0:
                return None
            fds: list[int] = []
            try:
                fds.append(os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC))
                for name in ("sockstat", "sockstat6"):  # no sockstat6 without IPv6
                    try:
                        fds.append(os.open(f"/proc/self/net/{name}", os.O_RDONLY | os.O_CLOEXEC))
                    except FileNotFoundError:
                        pass
            except OSError:
                for fd in fds:
                    os.close(fd)
                fds = []
            finally:
                if libc.setns(here, CLONE_NEWNET) != 0:  # never serve from a call's namespace
                    os._exit(1)
            return SharedNet(fds[0], fds[1:]) if len(fds) > 1 else None
        finally:
            os.close(here)

    def empty(self) -> bool:
        """No per-namespace count (sockets used, TCP inuse/orphan/tw, UDP, RAW, FRAG) above 0."""
        for fd in self.stats:
            for line in os.pread(fd, 4096, 0).split(b"\n"):
                fields = line.split()[1:]
                for key, value in zip(fields[::2], fields[1::2], strict=False):
                    if key not in (b"alloc", b"mem") and value != b"0":
                        return False
        return True

    def renew(self) -> SharedNet | None:
        for fd in (self.ns, *self.stats):
            os.close(fd)
        return SharedNet.create()


_shared_net: SharedNet | None = None  # the zygote's; its spares enter it
