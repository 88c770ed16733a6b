"""A cgroup of its own for each command the edge starts in a crun sandbox (issue 25).

``dsec-enter --own-cgroup NAME`` moves the helper into the cgroup2 child NAME of the sandbox's
cgroup2 directory after the usual cgroup check and before it forks, so the command and all it
forks live there. A hybrid host's cgroup2 tree has no controllers: nothing is charged or
limited differently (the v1 hierarchies and the sandbox's own directory above still are).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
from pathlib import Path
from typing import Any

from dsec.backends.container import cgroups
from dsec.executor.process import kill_tree


class CommandCgroup:
    """The cgroup2 directory of one command (or one session shell) and all it starts:
    ``dsec-enter --own-cgroup`` puts it there before it forks, and no process can leave it
    (a sandbox does not see its cgroups). Sessions and process groups a command makes stay
    in it, so a kill here ends everything it started (and nothing another command did),
    which killing a process tree missed: a double fork (``(setsid cmd &)``) is the init's child."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def new(cls, sandbox_id: str) -> CommandCgroup | None:
        """A fresh name below the sandbox's cgroup2 directory; None where it has none (a host
        without a cgroup2 tree)."""
        parent = cgroups.UNIFIED / cgroups.rel(sandbox_id)
        return cls(parent / f"cmd-{secrets.token_hex(6)}") if parent.is_dir() else None

    def kill(self) -> None:
        """SIGKILL all in it, forks under way included (cgroup.kill: Linux 5.14+; before, a
        few rounds over its process list)."""
        try:
            (self.path / "cgroup.kill").write_text("1")
            return
        except FileNotFoundError:
            if not self.path.is_dir():
                return  # never made (the start failed) or removed already
        except OSError:
            pass
        for _ in range(10):
            try:
                pids = (self.path / "cgroup.procs").read_text().split()
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)

    def remove(self) -> None:
        """Removed once empty; a background job it left keeps it until the sandbox's destroy
        (:func:`cgroups.remove`) or until it ends and the next command's removal."""
        with contextlib.suppress(OSError):
            self.path.rmdir()


class EnteredCommand:
    """A process :func:`spawn_command` started, as a :class:`SandboxProcess` whose tree is
    its cgroup (:class:`CommandCgroup`)."""

    def __init__(self, proc: asyncio.subprocess.Process, cgroup: CommandCgroup | None) -> None:
        self._proc = proc
        self.cgroup = cgroup
        self.stdin, self.stdout, self.stderr = proc.stdin, proc.stdout, proc.stderr
        self.pid = proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        code = await self._proc.wait()
        if self.cgroup is not None:
            self.cgroup.remove()
        return code

    async def communicate(self, input: bytes | None = None) -> tuple[bytes, bytes]:
        out, err = await self._proc.communicate(input)
        if self.cgroup is not None:
            self.cgroup.remove()
        return out, err

    def __getattr__(self, name: str) -> Any:
        return getattr(self._proc, name)  # the rest of asyncio's Process (send_signal, ...)

    def kill(self) -> None:
        self._proc.kill()

    def kill_tree(self) -> None:
        kill_tree(self.pid)  # the helper too, which is outside the sandbox's pid namespace
        if self.cgroup is not None:
            self.cgroup.kill()
