"""Named shell sessions: one long-lived shell per session keeps cwd, variables and functions.

A command costs no process start: the edge writes it to the session shell's stdin (a pipe)
and the driver loop below ``eval``s it; commands get /dev/null as stdin so they do not eat
the command stream by accident.

Where a command ends is decided by what the command cannot fake:

- the end markers (``\0E:RC\0`` on stdout, ``\0E\0`` on stderr) carry a fresh nonce E that the
  edge sends behind the command but the shell reads only after ``eval`` returned: the command
  never has it in a variable, and printing a marker takes reading the command pipe itself;
- a container's shell is also watched from the host (:mod:`dsec.executor.idle`), a microVM's
  by its guest agent: a marker counts only once the shell waits for its next command where its
  loop does. The edge (or the agent) then puts a token of its own into both output streams,
  behind everything the shell wrote, and the last marker before it is the shell's: output
  after an earlier (forged) one is output.

Output read past a command's end (a background job's) is the next command's, as it is when
it arrives later. What a command can still do to later commands of its session (it shares
their shell) is in docs/decisions.md.

On timeout the whole session tree is killed (a shell stuck in a builtin loop cannot be
interrupted otherwise) and the next command on that name starts a fresh session.

A command ends when its shell does (``exit``, a kill): a container's shell is watched for that
through a pidfd while a command runs (an idle one holds none), since its pipes may stay open
after it, held by a background job it started; what the shell wrote is all in them by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import re
import secrets
import struct
import termios
import time
from collections.abc import Awaitable, Callable

from dsec.executor.fdwait import PipeReader
from dsec.executor.idle import HasShellPid, HasShellWatch, ShellExit, ShellView, ShellWatch, backoff
from dsec.executor.process import (
    CHUNK,
    ByteStream,
    CappedBuffer,
    SandboxProcess,
    kill_process_tree,
    shell_exit_code,
)
from dsec.protocol.models import CommandResult

# POSIX sh, so images without bash still get sessions (through /bin/sh). The second read of
# __dsec_n takes the end marker's nonce, which waited in the pipe while the command ran.
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
  IFS= read -r __dsec_n
  printf '\0%s:%d\0' "$__dsec_n" "$__dsec_rc"
  printf '\0%s\0' "$__dsec_n" >&2
done
"""

Spawner = Callable[[], Awaitable[SandboxProcess]]

_CODE = re.compile(rb":(-?\d{1,10})\0")
_CODE_SO_FAR = re.compile(rb"(?::-?\d{0,10})?")  # what may still become a code
_CARRIED = CHUNK  # of output read past a command's end, kept for the next command
_EXIT_GRACE_S = 2.0  # from a session shell's closed output to its exit (see _end_shell)


class SessionDied(Exception):
    """The session shell exited (``exit``, OOM kill, a killed edge) before finishing a command."""


class _Stream:
    """One output stream of a command: its output, and where its end marker may be."""

    def __init__(
        self,
        reader: ByteStream,
        cap: int,
        end: bytes,
        carried: bytes,
        changed: asyncio.Event,
        *,
        with_code: bool,
    ) -> None:
        self.reader = reader
        self.buf = CappedBuffer(cap)
        self.buf.add(carried)
        self._needle = b"\0" + end
        self._with_code = with_code
        self._changed = changed
        self._window = b""  # read, not yet output: it may hold the start of a marker or token
        self.end: tuple[int, bool, int | None] | None = None  # output before the latest marker
        self._after = bytearray()  # output after it: the next command's, if it is the last
        self.token: bytes | None = None  # the edge's own end of stream, once it wrote one
        self.synced = False
        self.eof = False

    async def pump(self, *, until_marker: bool) -> None:
        try:
            while not self.synced and not (until_marker and self.end is not None):
                try:
                    chunk = await self.reader.read(CHUNK)
                except Exception:
                    self.eof = True  # the session ends here (the error is retrieved on stop)
                    raise
                if not chunk:
                    self.eof = True
                    return
                self._scan(self._window + chunk)
                self._changed.set()
        finally:
            self._changed.set()

    def close(self) -> None:
        """No more reading: what was held back while looking for a marker is output."""
        self._emit(self._window)
        self._window = b""

    def finish(self) -> tuple[int | None, bytes]:
        """Cut the output at the latest marker: its code, and the output that came after it."""
        assert self.end is not None
        length, truncated, code = self.end
        del self.buf.data[length:]
        self.buf.truncated = truncated
        return code, bytes(self._after)

    def _emit(self, data: bytes) -> None:
        self.buf.add(data)
        if self.end is not None:
            self._after += data[: max(0, _CARRIED - len(self._after))]

    def _scan(self, window: bytes) -> None:
        pos = 0
        while True:
            at = window.find(self._needle, pos)
            tok = window.find(self.token, pos) if self.token else -1
            if tok >= 0 and (at < 0 or tok < at):
                assert self.token is not None
                self._emit(window[pos:tok])
                rest = window[tok + len(self.token) :]
                self._after += rest[: max(0, _CARRIED - len(self._after))]
                self._window, self.synced = b"", True
                return
            if at < 0:
                keep = max(pos, len(window) - max(len(self._needle), len(self.token or b"")) + 1)
                self._emit(window[pos:keep])
                self._window = window[keep:]
                return
            rest_at = at + len(self._needle)
            if self._with_code:
                found = _CODE.match(window, rest_at)
                stop, code = (found.end(), int(found.group(1))) if found else (-1, None)
                pending = found is None and _CODE_SO_FAR.fullmatch(window, rest_at) is not None
            else:
                stop, code = (rest_at + 1, None) if window[rest_at : rest_at + 1] == b"\0" else (-1, None)
                pending = rest_at == len(window)
            if pending:  # the rest of a marker has not arrived yet
                self._emit(window[pos:at])
                self._window = window[at:]
                return
            if stop < 0:  # not a marker after all: its NUL is output
                self._emit(window[pos : at + 1])
                pos = at + 1
                continue
            self._emit(window[pos:at])
            self.end = (len(self.buf.data), self.buf.truncated, code)
            self._after = bytearray()
            self.buf.add(window[at:stop])  # output, should a later marker be the shell's
            pos = stop


class _Exchange:
    """One command's two output streams and the tasks reading them: each task stops at its
    stream's first end marker, or reads on."""

    def __init__(self, proc: SandboxProcess, cap: int, carried: tuple[bytes, bytes]) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.end = secrets.token_urlsafe(16).encode()
        self.changed = asyncio.Event()
        self.out = _Stream(proc.stdout, cap, self.end, carried[0], self.changed, with_code=True)
        self.err = _Stream(proc.stderr, cap, self.end, carried[1], self.changed, with_code=False)
        self.streams = (self.out, self.err)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def running(self) -> bool:
        return any(not task.done() for task in self._tasks)

    def start(self, *, until_marker: bool) -> None:
        self._tasks = [
            asyncio.create_task(s.pump(until_marker=until_marker)) for s in self.streams if not s.eof
        ]

    async def stop(self) -> None:
        pending = [task for task in self._tasks if not task.done()]
        for task in pending:
            task.cancel()
        if pending:  # gather costs a loop turn even for finished tasks
            await asyncio.gather(*pending, return_exceptions=True)
        for task in self._tasks:
            if not task.cancelled():
                task.exception()  # retrieved: a failed read is the session's end, seen as EOF
        self._tasks = []

    async def close(self) -> None:
        await self.stop()
        self.out.close()
        self.err.close()

    async def until(self, done: Callable[[], bool]) -> None:
        while True:
            self.changed.clear()
            if done():
                return
            await self.changed.wait()


class Session:
    def __init__(self, name: str, spawner: Spawner) -> None:
        self.name = name
        self._spawner = spawner
        self._proc: SandboxProcess | None = None
        self._fresh = False  # a shell that has not been given a command yet
        self._view: ShellWatch | None = None
        self._carried = (b"", b"")  # stdout and stderr read past the last command's end
        self.lock = asyncio.Lock()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def _ensure(self) -> SandboxProcess:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await self._spawner()
            self._fresh, self._view, self._carried = True, None, (b"", b"")
        return self._proc

    async def run(
        self, command: str, *, timeout: float | None, max_output: int, oom_kills: Callable[[], int]
    ) -> CommandResult:
        async with self.lock:
            started = time.monotonic()
            proc = await self._ensure()
            oom_before = oom_kills()
            ex = _Exchange(proc, max_output, self._carried)
            self._carried = (b"", b"")
            code: int | None = None
            timed_out = ended = False
            try:
                async with asyncio.timeout(timeout):
                    if self._fresh:
                        self._fresh = False
                        self._view = await self._watch(proc)
                    await self._exchange(proc, ex, command)
                ended = True
            except TimeoutError:
                await ex.stop()
                await self.kill()
                timed_out = True
            except (SessionDied, BrokenPipeError, ConnectionResetError):
                # One stream ended; the other pump must let go of its pipe before the reap
                # drains it (a stream has one reader at a time).
                await ex.close()
                self._proc = None
                await _end_shell(proc)
                code = await _reap(proc, ex.out.buf, ex.err.buf)
            finally:
                await ex.close()
            if ended:
                (code, after_out), (_, after_err) = ex.out.finish(), ex.err.finish()
                self._carried = (after_out, after_err)
            return CommandResult(
                exit_code=code,
                stdout=ex.out.buf.text(),
                stderr=ex.err.buf.text(),
                timed_out=timed_out,
                oom_killed=oom_kills() > oom_before,
                truncated=ex.out.buf.truncated or ex.err.buf.truncated,
                duration_s=time.monotonic() - started,
            )

    async def _watch(self, proc: SandboxProcess) -> ShellWatch | None:
        """A view of a fresh shell from outside it (the host's /proc, a guest agent's), if it
        can have one, calibrated after a no-op command: the shell then waits for the next one
        where its loop does, moments after the no-op's markers (no polling through its
        start), and no caller's command ran in it."""
        view: ShellWatch | None = None
        if isinstance(proc, HasShellWatch):
            view = proc.shell_watch()
        elif isinstance(proc, HasShellPid):
            view = ShellView.of(proc)
        if view is None:
            return None
        noop = _Exchange(proc, _CARRIED, (b"", b""))
        try:
            await self._exchange(proc, noop, ":")
        finally:
            await noop.close()
        return view if await view.calibrate() else None

    async def _exchange(self, proc: SandboxProcess, ex: _Exchange, command: str) -> None:
        """Send ``command`` and return once its end is known: its markers, and for a watched
        shell the shell back in its loop with nothing of it left unread (or read up to our
        token)."""
        assert proc.stdin is not None
        nonce = secrets.token_hex(16)
        if not command.endswith("\n"):
            command += "\n"
        ex.start(until_marker=True)
        proc.stdin.write(f"{nonce}\n{command}{nonce}\n".encode() + ex.end + b"\n")
        await proc.stdin.drain()
        out, err = ex.streams
        async with ShellExit.watch(proc, ex.changed) as exited:
            await ex.until(
                lambda: (
                    (out.end is not None and err.end is not None)
                    or out.eof
                    or err.eof
                    or (exited() and all(_unread(s) == 0 for s in ex.streams))
                )
            )
        if out.end is None or err.end is None:
            raise SessionDied
        view = self._view
        if view is None:
            return
        idle: bool | None = False
        for delay in backoff():
            ex.changed.clear()
            idle = await view.idle()
            if idle is not False:
                break
            if not delay:  # about to be back, usually: a few loop turns
                await asyncio.sleep(0)
                continue
            # Still running (a command that printed a marker and runs on): read on, and look
            # again when more output comes or after the delay.
            if not ex.running:
                ex.start(until_marker=False)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await ex.changed.wait()
        await ex.stop()
        if idle is None:
            # Gone without being seen back in its loop: whether it printed a marker of its
            # own before it died is unknown, so the command ended as the shell did.
            raise SessionDied
        if await _drained(ex.streams):
            return  # all it wrote is read: the latest markers are its own
        # Some of it is still unread (or a background job writes on): the last marker before
        # our token, written behind everything the shell wrote, is the shell's.
        token = b"\0" + secrets.token_hex(16).encode() + b"\0"
        out.token = err.token = token
        ex.start(until_marker=False)
        for stream, sent in zip(ex.streams, await view.mark_end(token), strict=True):
            if not sent:
                stream.token = None  # the shell's fd went elsewhere: nothing more comes here
        await ex.until(lambda: all(s.token is None or s.synced or s.eof for s in ex.streams))

    def detach(self) -> None:
        """Let the shell go without killing anything: on EOF it exits, its children live on."""
        if self._proc is not None and self._proc.stdin is not None:
            self._proc.stdin.close()
        if self._proc is not None:
            _close_pipes(self._proc)  # as the edge's end would: nothing reads them after
        self._proc = None

    async def kill(self) -> None:
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        if proc.returncode is None:
            kill_process_tree(proc)
        await _reap(proc)


async def _drained(streams: tuple[_Stream, ...]) -> bool:
    """Nothing left to read under ``streams`` while no pump runs: their pipes are empty
    (FIONREAD on the edge's own ends) and their readers hold nothing. False where that cannot
    be told (a microVM's streams are fed by its channel)."""
    if any(_unread(s) != 0 for s in streams):
        return False
    # asyncio's subprocess transport hands what it read from a pipe to the StreamReader a loop
    # turn later (BaseSubprocessTransport._pipe_data_received: call_soon). Bytes already out
    # of the pipe may be in neither place: one turn delivers all that left it before it was
    # found empty. Without it, 1 in ~600 forged markers under load ended a command early.
    await asyncio.sleep(0)
    # A private attribute of StreamReader (CPython's asyncio since 3.4).
    return not any(getattr(s.reader, "_buffer", b"") for s in streams)


def _unread(stream: _Stream) -> int | None:
    """Bytes in the pipe under ``stream``'s reader; None where the edge cannot see one."""
    if isinstance(stream.reader, PipeReader):  # a container's session shell
        return stream.reader.unread()
    # Private attributes of StreamReader; only get_extra_info is public.
    transport = getattr(stream.reader, "_transport", None)
    pipe = transport.get_extra_info("pipe") if transport is not None else None
    if pipe is None or getattr(stream.reader, "_buffer", None) is None:
        return None
    try:
        return int(struct.unpack("i", fcntl.ioctl(pipe.fileno(), termios.FIONREAD, b"\0" * 4))[0])
    except (OSError, ValueError):
        return None


async def _end_shell(proc: SandboxProcess) -> None:
    """A container's session shell whose command ended its session (a stream closed under
    it, or it exited): if it still runs after a moment (it closed its stdout, say, but lives
    on), it is killed, alone, rather than left running, forgotten. The moment: a shell that
    exits closes its pipes just before it can be reaped."""
    if not isinstance(proc, HasShellPid) or proc.shell_pid() is None:
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_EXIT_GRACE_S):
            await proc.wait()
            return
    proc.kill()


async def _reap(
    proc: SandboxProcess, out: CappedBuffer | None = None, err: CappedBuffer | None = None
) -> int | None:
    """Wait for a finished or killed session shell; its exit code in shell form, if known.

    What it still wrote goes into ``out``/``err`` when given (a shell that exited mid-command).
    """

    async def drain(stream: ByteStream | None, buf: CappedBuffer | None) -> None:
        # asyncio's wait() returns only once every pipe reached EOF; a pipe whose reader
        # stopped (full buffer, transport paused) never does unless someone reads it.
        try:
            while stream is not None and (chunk := await stream.read(CHUNK)):
                if buf is not None:
                    buf.add(chunk)
        except RuntimeError:
            pass  # a command still running in the session is reading it: it drains the pipe

    streams = ((proc.stdout, out), (proc.stderr, err))
    # Pipes the edge reads itself end with the shell's exit, not at an EOF that a background
    # job holding them may never give: the rest of what the shell wrote is read after it.
    own = all(isinstance(s, PipeReader) for s, _ in streams if s is not None)
    drains = asyncio.gather(*(drain(s, b) for s, b in streams))
    with contextlib.suppress(ProcessLookupError, TimeoutError):
        async with asyncio.timeout(10):
            if not own:
                await drains
            await proc.wait()
    if not drains.done():
        drains.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drains
    for stream, buf in streams:
        if isinstance(stream, PipeReader) and (rest := stream.read_now()) and buf is not None:
            buf.add(rest)
    _close_pipes(proc)  # a descendant the kill missed may hold them open: no reading on
    code = proc.returncode
    return None if code is None else shell_exit_code(code)


def _close_pipes(proc: SandboxProcess) -> None:
    """Close the pipes the edge reads on demand (a container's session shell); asyncio's
    transports close their own at EOF."""
    for stream in (proc.stdout, proc.stderr):
        if isinstance(stream, PipeReader):
            stream.close()
