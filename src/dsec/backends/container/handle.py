"""A container sandbox's handle: its init (crun) or sentry and gofer (runsc), and what every
later process needs to know to enter it the same way (``native/enter.py``)."""

from __future__ import annotations

from typing import Literal

from dsec.backends.handle import Handle


class ContainerHandle(Handle):
    # pid/start_time: crun's init, or runsc's sentry (whose death is the sandbox's)
    cpu_class: str = "ls"
    core_cookie: bool = False  # LS on an SMT node: later processes share the init's core cookie
    allow_setuid: bool = False  # the spec opted in: dsec-enter leaves no_new_privs off
    disk_limit_mb: int | None = None  # a quota'd volume (volumes.py), re-applied at every thaw
    runtime: Literal["gvisor"] | None = None  # absent: crun (as every handle before gVisor)
    gofer_pid: int = 0  # runsc's gofer, whose root is the sandbox's (the host's way to its files)
    gofer_start_time: int | None = None

    def disk_limit(self) -> int | None:
        return self.disk_limit_mb
