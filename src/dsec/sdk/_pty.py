"""Terminals in a sandbox: a program on a pseudo-terminal the edge holds (``sb.open_pty()``).

The program's output comes as one NDJSON stream (the process table's events, see
:mod:`dsec.protocol.processes`); keystrokes, window sizes and signals are calls of their own.
The edge keeps the terminal, so a dropped stream does not end the program; :meth:`Pty.close`
(and leaving ``async with``) hangs it up as a closing terminal would.
"""

from __future__ import annotations

import contextlib
import json
import signal as signals
from collections.abc import AsyncGenerator, AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING

from dsec.protocol.errors import DSecError, InfraFailure, error_from_wire
from dsec.protocol.ops import ResizeProcess, SendProcessInput, SignalProcess
from dsec.protocol.processes import ProcessEvent, ProcessStart, PtySize
from dsec.sdk._transport import Transport

# bash when the image has it (job control, history, line editing), else the POSIX shell.
LOGIN_SHELL = ["/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash -l; fi; exec sh -l"]


async def _events(lines: AsyncIterator[bytes]) -> AsyncGenerator[ProcessEvent, None]:
    async for line in lines:
        obj = json.loads(line)
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):  # the stream's last word
            raise error_from_wire(500, obj)
        yield ProcessEvent.model_validate(obj)


class Pty:
    """A program on a terminal in a sandbox: read :meth:`output`, :meth:`write` keystrokes.

    ``exit_code`` is set once the output has ended: the program's exit status, or ``128 + N``
    for a death by signal N (what a shell reports)."""

    pid: int
    exit_code: int | None
    error: str | None  # why it ended, when not by itself (its sandbox stopped)

    def __init__(
        self, transport: Transport, sandbox_id: str, pid: int, events: AsyncGenerator[ProcessEvent, None]
    ) -> None:
        self._t = transport
        self._sandbox_id = sandbox_id
        self.pid = pid
        self._events = events
        self.exit_code = None
        self.error = None

    def __repr__(self) -> str:
        return f"Pty(pid={self.pid}, exit_code={self.exit_code})"

    async def __aenter__(self) -> Pty:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def output(self) -> AsyncIterator[bytes]:
        """The terminal's bytes as they come, until the program ends (then ``exit_code`` is set)."""
        async for event in self._events:
            if event.t == "pty" and event.data:
                yield event.data
            elif event.t == "end":
                self.exit_code = 128 + event.signal if event.signal else (event.exit_code or 0)
                self.error = event.error
                return
        if self.exit_code is None:
            raise InfraFailure(f"terminal {self.pid}: its stream ended without the program's end")

    async def wait(self) -> int:
        """Discard the output until the program ends; its exit code."""
        async for _ in self.output():
            pass
        assert self.exit_code is not None
        return self.exit_code

    async def write(self, data: bytes | str) -> None:
        """Type ``data`` (bytes as a terminal sends them: ``b"\\x03"`` is ^C, ``b"\\x04"`` ^D)."""
        op = SendProcessInput(pid=self.pid, data=data.encode() if isinstance(data, str) else data)
        await self._t.call(self._sandbox_id, op)

    async def resize(self, rows: int, cols: int) -> None:
        """Set the terminal's size; the program gets SIGWINCH."""
        await self._t.call(self._sandbox_id, ResizeProcess(pid=self.pid, rows=rows, cols=cols))

    async def signal(self, signal: int) -> None:
        """Send ``signal`` to the program and everything it started; SIGHUP also hangs its
        terminal up (what :meth:`close` sends)."""
        await self._t.call(self._sandbox_id, SignalProcess(pid=self.pid, signal=signal))

    async def close(self) -> None:
        """Hang up, as a closing terminal does: a program still running gets SIGHUP and its
        terminal's reads end (also for one that ignores SIGHUP), then the stream is dropped."""
        try:
            if self.exit_code is None:
                with contextlib.suppress(DSecError):  # gone already: ended, or its sandbox stopped
                    await self.signal(signals.SIGHUP)
        finally:
            await self._events.aclose()


class SandboxPtyCalls:
    """Mixed into :class:`~dsec.sdk.client.Sandbox`."""

    if TYPE_CHECKING:
        _t: Transport
        _base: str
        id: str

    async def open_pty(
        self,
        argv: list[str] | None = None,
        *,
        rows: int = 24,
        cols: int = 80,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
    ) -> Pty:
        """Start ``argv`` (default: a login shell) on a terminal of ``rows`` x ``cols``.

        ``TERM`` is ``xterm-256color`` unless ``env`` sets it; ``user`` defaults to the
        sandbox's ``init_user``, ``cwd`` to the sandbox's ``workdir``, else that user's home."""
        req = ProcessStart(
            argv=argv or LOGIN_SHELL,
            env=env or {},
            cwd=cwd,
            user=user,
            pty=PtySize(rows=rows, cols=cols),
        )
        lines = self._t.lines("POST", self._base + "/processes", json_body=req.model_dump(exclude_none=True))
        events = _events(lines)
        try:
            first = await anext(events, None)
        except BaseException:
            await events.aclose()
            raise
        if first is None or first.t != "start":
            await events.aclose()
            raise InfraFailure(f"a terminal's stream began with {first!r}, not its start")
        return Pty(self._t, self.id, first.pid, events)
