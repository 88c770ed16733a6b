"""A client for a real FnCall runner on the host, as the edge starts it in a pool sandbox.

The runner is the sandbox's program, run here with the system ``/usr/bin/python3`` (stdlib
only, like the sandbox's) as root, so calls really drop to an unprivileged uid. Each runner
gets a uid of its own: the runner kills every process of its call uid after each call, and
RLIMIT_NPROC counts per uid, so two test processes must never share one. Every runner is ended
by closing its stdin, and the ``runner`` fixture checks that it exits 0 and leaves no process
behind.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from dsec.edge.fncall import RUNNER_PATH
from dsec.protocol.fncall import FnResult, FnRunnerReady, FnTask

SYSTEM_PYTHON = "/usr/bin/python3"
CALL_DEADLINE_S = 60.0  # a call that has not answered by then is a hang, not slowness

_serial = itertools.count()


def fresh_uid() -> int:
    """A uid that no runner running at the same time uses (in this or another test process)."""
    return 3_000_000 + (os.getpid() % 100_000) * 16 + next(_serial) % 16


def procs_of(uid: int) -> list[int]:
    """Processes whose real uid is ``uid``, from /proc (what the runner itself checks)."""
    found = []
    for name in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except (OSError, ValueError):
            continue
        uid_line = next((line for line in status.splitlines() if line.startswith("Uid:")), "")
        if uid_line.split()[1:2] == [str(uid)]:
            found.append(int(name))
    return found


class Runner:
    """One runner process and a line-at-a-time client for it."""

    def __init__(
        self,
        workdir: Path,
        preload: str = "json,fractions",
        *,
        non_root_uid: int | None = None,
        runner_path: Path = RUNNER_PATH,
        mergeable: int | None = None,
        without_sys_admin: bool = False,
    ) -> None:
        """As root with a fresh call uid; or, with ``non_root_uid``, the whole runner as that uid.
        ``mergeable``: the pool's hash seed, as an edge running ksmd passes it.
        ``without_sys_admin``: root without CAP_SYS_ADMIN, so no namespace per call, as in a
        pool sandbox."""
        self.workdir = workdir
        self.uid = fresh_uid() if non_root_uid is None else non_root_uid
        argv = [SYSTEM_PYTHON, str(runner_path), "--workdir", str(workdir), "--preload", preload]
        if mergeable is not None:
            argv += ["--mergeable", str(mergeable)]
        if non_root_uid is None:
            argv += ["--uid", str(self.uid), "--gid", str(self.uid)]
        else:
            argv = ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", *argv]
        if without_sys_admin:
            argv = ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buf = b""
        self.ready = FnRunnerReady.model_validate(self.read_line())

    def read_line(self, timeout: float = CALL_DEADLINE_S) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the runner did not answer within {timeout} s")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise EOFError(f"the runner exited ({self.proc.wait()})")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        decoded: dict[str, Any] = json.loads(line)
        return decoded

    def send_line(self, line: bytes) -> FnResult:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line)
        self.proc.stdin.flush()
        return FnResult.model_validate(self.read_line())

    def call(self, **task: Any) -> FnResult:
        return self.send_line(FnTask(**task).model_dump_json().encode() + b"\n")

    def close(self) -> int:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # EOF is how the edge ends a runner
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a hung runner: the fixture reports the odd status
            self.proc.kill()
            return self.proc.wait()


def kill_leftovers(uid: int) -> list[int]:
    """Kill whatever still runs as ``uid`` (so a failing test cleans up too); return what was found."""
    found = procs_of(uid)
    for _ in range(100):
        pids = procs_of(uid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)  # killed processes need their parent (not us) to reap them
    return found
