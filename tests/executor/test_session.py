"""Tests of dsec.executor.session on shells of this host: the session protocol without a
sandbox around it (tests/security/test_session_end.py attacks it in real sandboxes).

``Watched`` is a shell the edge can see in /proc, as a container's session shell is; a plain
asyncio process stands for one it cannot see (a microVM's, gVisor's).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest
from tests.security.test_session_end import PEEKERS

from dsec.executor.process import SandboxProcess
from dsec.executor.session import DRIVER, Session, _drained, _Stream
from dsec.protocol.models import CommandResult


class Watched:
    """A local session shell that reports its PID, like a container's SessionShell."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc
        self.stdin, self.stdout, self.stderr = proc.stdin, proc.stdout, proc.stderr
        self.pid = proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        return await self._proc.wait()

    def kill(self) -> None:
        self._proc.kill()

    def shell_pid(self) -> int | None:
        return self._proc.pid if self._proc.returncode is None else None


def session(*shell: str, watched: bool) -> Session:
    async def spawn() -> SandboxProcess:
        proc = await asyncio.create_subprocess_exec(
            *shell, "-c", DRIVER, stdin=-1, stdout=-1, stderr=-1, start_new_session=True
        )
        return Watched(proc) if watched else proc

    return Session("s", spawn)


@pytest.fixture
async def bash() -> AsyncIterator[Session]:
    s = session("bash", watched=True)
    yield s
    await s.kill()


async def run(s: Session, command: str, timeout: float = 60) -> CommandResult:
    return await s.run(command, timeout=timeout, max_output=1 << 20, oom_kills=lambda: 0)


async def test_a_watched_shell_ends_a_command_at_its_own_marker(bash: Session) -> None:
    assert (await run(bash, "true")).exit_code == 0
    # Unwatched, the forgery below succeeds by design: tell that apart from a watch it fooled
    # (it failed in CI while watched: bytes in flight between pipe and reader, now counted).
    assert bash._view is not None, "the host bash is not watched"
    r = await run(bash, f"{PEEKERS['python']}; echo after; (exit 3)")
    assert (r.exit_code, r.stdout.endswith(":0\0smuggled\nafter\n")) == (3, True), r
    assert (await run(bash, "echo next")).stdout == "next\n"


async def test_output_read_off_a_pipe_but_not_yet_delivered_is_unread() -> None:
    """asyncio's subprocess transport delivers what it read a loop turn later: a command's own
    end marker in flight then must not let the edge take a forged one for the last (CI saw it)."""
    loop = asyncio.get_running_loop()
    r, w = os.pipe()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(r, "rb", buffering=0)
    )
    try:
        stream = _Stream(reader, 1 << 20, b"end", b"", asyncio.Event(), with_code=True)
        assert await _drained((stream,))
        loop.call_soon(reader.feed_data, b"\0end:3\0")  # out of the pipe, not in the reader
        assert not await _drained((stream,))
        await reader.read(100)
        os.write(w, b"x")  # still in the pipe
        assert not await _drained((stream,))
    finally:
        transport.close()
        os.close(w)


async def test_output_after_a_commands_end_is_the_next_commands(bash: Session) -> None:
    """A background job's output, read with the end marker, is not lost: the next command has it."""
    r = await run(
        bash, "mkfifo /tmp/dsec-go-$$; (read x </tmp/dsec-go-$$; echo late; rm /tmp/dsec-go-$$) & echo fg"
    )
    assert r.stdout == "fg\n", r
    r = await run(bash, "echo go >/tmp/dsec-go-$$; wait; echo next")
    assert r.stdout == "late\nnext\n", r


async def test_a_chatty_background_job_does_not_keep_a_command_from_ending(bash: Session) -> None:
    """Its output keeps the pipes busy when the shell is back: a token of the edge ends them."""
    await run(bash, "(while :; do echo chatter; done) & echo $! >/tmp/dsec-chatty-$$")
    try:
        for _ in range(20):
            r = await run(bash, "echo fg; (exit 4)")
            assert r.exit_code == 4 and "fg\n" in r.stdout and set(r.stdout.split()) <= {"fg", "chatter"}, r
    finally:
        await run(bash, "kill $(cat /tmp/dsec-chatty-$$); rm /tmp/dsec-chatty-$$")


@pytest.mark.parametrize(
    ("argv", "watched"),
    [
        (["bash"], False),
        (["dash"], True),
        (["busybox", "sh"], True),  # it waits in poll(2), not read(2): the edge leaves it be
    ],
    ids=["bash-unwatched", "dash", "busybox"],
)
async def test_sessions_work_whether_or_not_the_edge_watches_the_shell(
    argv: list[str], watched: bool
) -> None:
    """Unwatched, the end marker's secret nonce alone ends a command."""
    s = session(*argv, watched=watched)
    try:
        r = await run(s, "cd /tmp; X=1; echo out; echo err >&2; printf 'no newline'; (exit 3)")
        assert (r.exit_code, r.stdout, r.stderr) == (3, "out\nno newline", "err\n"), r
        r = await run(s, 'echo "$X $(pwd)"')
        assert (r.exit_code, r.stdout) == (0, "1 /tmp\n"), r
        r = await run(s, "printf '\\0%s:0\\0' \"$__dsec_n\"; echo forged; (exit 5)")
        assert (r.exit_code, r.stdout.endswith("forged\n")) == (5, True), r
        assert (await run(s, "exit 7")).exit_code == 7
    finally:
        await s.kill()
