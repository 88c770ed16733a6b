"""Named shell sessions: one long-lived shell per session keeps cwd, variables and functions.

A command costs no process start: the edge writes it to the session shell's stdin and the
driver loop below ``eval``s it, then prints an end marker carrying a fresh random nonce on
stdout and stderr. Everything before the markers is the command's output. The shell reads
commands from a pipe the edge holds, so nothing inside the sandbox can inject into another
session, and commands get /dev/null as stdin so they cannot eat the command stream.

On timeout the whole session tree is killed (a shell stuck in a builtin loop cannot be
interrupted otherwise) and the next command on that name starts a fresh session.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable

from dsec.executor.process import CHUNK, CappedBuffer, SandboxProcess, kill_process_tree, shell_exit_code
from dsec.protocol.models import CommandResult

# POSIX sh, so images without bash still get sessions (through /bin/sh).
DRIVER = r"""
while IFS= read -r __dsec_n; do
  __dsec_c=
  while IFS= read -r __dsec_l; do
    [ "$__dsec_l" = "$__dsec_n" ] && break
    __dsec_c="$__dsec_c$__dsec_l
"
  done
  eval "$__dsec_c" </dev/null 9>&-
  __dsec_rc=$?
  printf '\0%s:%d\0' "$__dsec_n" "$__dsec_rc"
  printf '\0%s\0' "$__dsec_n" >&2
done
"""

Spawner = Callable[[], Awaitable[SandboxProcess]]


class SessionDied(Exception):
    """The session shell exited (``exit``, OOM kill, a killed edge) before finishing a command."""


async def _read_to_marker(
    stream: asyncio.StreamReader, marker: bytes, buf: CappedBuffer, *, with_code: bool
) -> int | None:
    """Copy output into ``buf`` until ``marker`` (and, for stdout, ``<code>\\0``) arrives."""
    window = b""
    while True:
        try:
            chunk = await stream.read(CHUNK)
        except asyncio.CancelledError:
            # Stopped because the shell died (the other stream saw EOF first): what this
            # stream held back while looking for a marker is output, not marker.
            buf.add(window)
            raise
        if not chunk:
            buf.add(window)
            raise SessionDied
        window += chunk
        idx = window.find(marker)
        if idx < 0:
            # Keep a tail that may hold the start of a marker split across reads.
            safe = max(0, len(window) - len(marker) + 1)
            buf.add(window[:safe])
            window = window[safe:]
            continue
        if not with_code:
            buf.add(window[:idx])
            return None
        end = window.find(b"\0", idx + len(marker))
        while end < 0:
            more = await stream.read(CHUNK)
            if not more:
                raise SessionDied
            window += more
            end = window.find(b"\0", idx + len(marker))
        buf.add(window[:idx])
        return int(window[idx + len(marker) : end])


class Session:
    def __init__(self, name: str, spawner: Spawner) -> None:
        self.name = name
        self._spawner = spawner
        self._proc: SandboxProcess | None = None
        self.lock = asyncio.Lock()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def _ensure(self) -> SandboxProcess:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await self._spawner()
        return self._proc

    async def run(
        self, command: str, *, timeout: float | None, max_output: int, oom_kills: Callable[[], int]
    ) -> CommandResult:
        async with self.lock:
            started = time.monotonic()
            proc = await self._ensure()
            assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
            nonce = secrets.token_hex(16)
            if not command.endswith("\n"):
                command += "\n"
            oom_before = oom_kills()
            out, err = CappedBuffer(max_output), CappedBuffer(max_output)
            readers = [
                asyncio.create_task(
                    _read_to_marker(proc.stdout, b"\0" + nonce.encode() + b":", out, with_code=True)
                ),
                asyncio.create_task(
                    _read_to_marker(proc.stderr, b"\0" + nonce.encode() + b"\0", err, with_code=False)
                ),
            ]
            try:
                proc.stdin.write(f"{nonce}\n{command}{nonce}\n".encode())
                await proc.stdin.drain()
                async with asyncio.timeout(timeout):
                    code, _ = await asyncio.gather(*readers)
                timed_out = False
            except TimeoutError:
                await self._stop_readers(readers)
                await self.kill()
                code, timed_out = None, True
            except (SessionDied, BrokenPipeError, ConnectionResetError):
                # One stream ended; the other reader must let go of its pipe before the reap
                # drains it (a stream has one reader at a time).
                await self._stop_readers(readers)
                self._proc = None
                code, timed_out = await _reap(proc, out, err), False
            finally:
                await self._stop_readers(readers)
            return CommandResult(
                exit_code=code,
                stdout=out.text(),
                stderr=err.text(),
                timed_out=timed_out,
                oom_killed=oom_kills() > oom_before,
                truncated=out.truncated or err.truncated,
                duration_s=time.monotonic() - started,
            )

    @staticmethod
    async def _stop_readers(readers: list[asyncio.Task[int | None]]) -> None:
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)

    def detach(self) -> None:
        """Let the shell go without killing anything: on EOF it exits, its children live on."""
        if self._proc is not None and self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc = None

    async def kill(self) -> None:
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        if proc.returncode is None:
            kill_process_tree(proc)
        await _reap(proc)


async def _reap(
    proc: SandboxProcess, out: CappedBuffer | None = None, err: CappedBuffer | None = None
) -> int | None:
    """Wait for a finished or killed session shell; its exit code in shell form, if known.

    What it still wrote goes into ``out``/``err`` when given (a shell that exited mid-command).
    """

    async def drain(stream: asyncio.StreamReader | None, buf: CappedBuffer | None) -> None:
        # asyncio's wait() returns only once every pipe reached EOF; a pipe whose reader
        # stopped (full buffer, transport paused) never does unless someone reads it.
        try:
            while stream is not None and (chunk := await stream.read(CHUNK)):
                if buf is not None:
                    buf.add(chunk)
        except RuntimeError:
            pass  # a command still running in the session is reading it: it drains the pipe

    with contextlib.suppress(ProcessLookupError, TimeoutError):
        async with asyncio.timeout(10):
            await asyncio.gather(drain(proc.stdout, out), drain(proc.stderr, err))
            await proc.wait()
    code = proc.returncode
    return None if code is None else shell_exit_code(code)
