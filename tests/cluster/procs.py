"""Processes the cluster test starts: each in its own session, its output in a file, ended by PID.

Only processes started here are ever signalled, and only by the PID ``Popen`` returned (for an
edge that is the ``dsec`` process itself: ``nsenter`` execs it). Readiness is the process's
own "is up" line, polled with a deadline; a process that exits first fails the wait at once
with the tail of its output.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tests.support import eventually

UP_RE = re.compile(r"\bis up\b.*?\bat\s+(https?://\S+)", re.DOTALL)
START_DEADLINE_S = 60.0


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    # Unbuffered, so the "is up" line reaches the file when it is printed; wide, so rich does
    # not fold it across lines.
    env.update(PYTHONUNBUFFERED="1", COLUMNS="400", NO_COLOR="1")
    return env


class Proc:
    """One started process and the file its stdout and stderr go to."""

    def __init__(self, name: str, argv: Sequence[str], log: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = log
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(),
                start_new_session=True,  # a signal to the test's group never reaches it
            )
        self.pid = self.popen.pid

    def __repr__(self) -> str:
        return f"Proc({self.name!r}, pid={self.pid})"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def report(self) -> str:
        state = "running" if self.alive() else f"exited {self.popen.returncode}"
        return f"----- {self.name} (pid {self.pid}, {state}): {self.log}\n{self.tail()}"

    async def wait_up(self, timeout: float = START_DEADLINE_S) -> str:
        """The URL from the process's "... is up at URL" line, once it printed it."""

        def up() -> str | None:
            m = UP_RE.search(self.output())
            if m:
                return m.group(1).rstrip(".,;)")
            if not self.alive():
                raise AssertionError(f"{self.name} exited before it was up\n{self.report()}")
            return None

        try:
            url: str = await eventually(up, f"{self.name} to print 'is up'", timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.report()}") from None
        return url

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs (a crash, a power cut of the process)."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)

    def terminate(self, timeout: float = 60.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit code of
        the graceful exit, or None if it had to be killed."""
        if not self.alive():
            return self.popen.returncode
        os.kill(self.pid, signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
