"""Session shells through ``dsec-enter --hold-stdin``: what an idle session costs the edge (2
fds, 1 process: the shell is the edge's own child), and how a shell is let go (by the edge,
or by the edge's death)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.base import CreateContext, sandbox_env
from dsec.backends.container.session_shell import SessionShell
from dsec.executor.process import descendants, watch_children_with_pidfds
from dsec.executor.session import DRIVER, Session
from dsec.native import enter
from dsec.native import spawner as spawner_mod
from tests.support import DEADLINE_S, eventually

from .conformance import Made
from .test_enter import ROOT, _dead, backend, helper, layer_dirs, made, probe, sandbox  # noqa: F401

pytestmark = pytest.mark.slow


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def spawner(
    helper: Path,  # noqa: F811
    ctx: CreateContext,
    h: dict[str, Any],
) -> Callable[[], Awaitable[SessionShell]]:
    async def spawn() -> SessionShell:
        env = sandbox_env(ctx.spec, ROOT)
        return await enter.spawn_session(
            ctx.sandbox_id, h, ["sh", "-c", DRIVER], env=env, cwd="/", user=ROOT, helper=helper
        )

    return spawn


async def start(helper: Path, made: Made) -> SessionShell:  # noqa: F811
    return await spawner(helper, *await sandbox(made))()


async def run(
    session: Session, command: str, timeout: float = DEADLINE_S
) -> tuple[int | None, str, str, bool]:
    r = await session.run(command, timeout=timeout, max_output=1 << 20, oom_kills=lambda: 0)
    return r.exit_code, r.stdout, r.stderr, r.timed_out


async def test_an_idle_session_holds_two_edge_fds_and_commands_keep_their_streams(
    helper: Path,  # noqa: F811
    made: Made,  # noqa: F811
) -> None:
    watch_children_with_pidfds()  # as the edge does
    shells = [await start(helper, made) for _ in range(2)]  # warm: the helper's status pipes etc.
    before = open_fds()
    more = [await start(helper, made) for _ in range(4)]
    # stdout and stderr pipes: the shell holds stdin's write end, no pidfd while idle.
    assert open_fds() - before == 2 * len(more)
    for shell in more:  # and one process: the shell, the edge's own child; its helper exited
        assert Path(f"/proc/{shell.pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(os.getpid())
        assert not Path(f"/proc/{shell._group}").exists()  # reaped before spawn_session returned
    session = Session("s", spawner(helper, *await sandbox(made)))
    assert await run(session, "true") == (0, "", "", False)
    before = open_fds()
    assert await run(
        session,
        "cd /tmp; X=1; echo out; echo err >&2; printf 'no newline'; exit_code() { return 3; }; exit_code",
    ) == (
        3,
        "out\nno newline",
        "err\n",
        False,
    )
    assert await run(
        session, 'echo "$X $(pwd)"; echo to-stdout > /dev/stdout; echo to-stderr > /dev/stderr'
    ) == (
        0,
        "1 /tmp\nto-stdout\n",
        "to-stderr\n",
        False,
    )
    assert open_fds() == before  # the command's stdin fd closed again
    # The shell's own hold on its stdin (fd 9) does not reach commands: none can write into it.
    assert await run(session, "ls /proc/self/fd | sort -n | tr '\\n' ' '") == (0, "0 1 2 3 ", "", False)
    assert await run(session, "while :; do :; done", timeout=0.5) == (None, "", "", True)
    assert await run(session, 'echo "fresh ${X:-shell}"') == (0, "fresh shell\n", "", False)  # next shell
    assert await run(session, "exit 7") == (7, "", "", False)
    for shell in [*shells, *more]:
        shell.kill()
        await asyncio.wait_for(shell.wait(), DEADLINE_S)
    await session.kill()


async def test_a_shell_let_go_ends_and_its_children_live_on(helper: Path, made: Made) -> None:  # noqa: F811
    watch_children_with_pidfds()
    session = Session("s", spawner(helper, *await sandbox(made)))
    assert (await run(session, "sleep 1000 >/dev/null 2>&1 &"))[0] == 0
    shell = session._proc
    assert isinstance(shell, SessionShell)
    (sleep,) = await eventually(lambda: [p for p in descendants(shell.pid) if _comm(p) == "sleep"], "sleep")
    session.detach()
    assert await asyncio.wait_for(shell.wait(), DEADLINE_S) == -9  # killed alone
    assert not _dead(sleep)


# An edge of its own (a process, as the real one): starts a session, says the PIDs, waits.
_EDGE = """
import asyncio, json, sys
from pathlib import Path
from dsec.backends.container.handle import ContainerHandle
from dsec.executor.process import descendants, watch_children_with_pidfds
from dsec.executor.session import DRIVER
from dsec.native import enter
from dsec.native import spawner
from dsec.native import spawner as spawner_mod
from tests.backends.test_enter import ROOT

async def main():
    watch_children_with_pidfds()
    spawner.start(Path(sys.argv[1]))
    sid, handle, helper = json.loads(sys.argv[2])
    argv = ["sh", "-c", DRIVER]
    shell = await enter.spawn_session(
        sid, ContainerHandle.of(handle), argv, env={}, cwd="/", user=ROOT, helper=Path(helper)
    )
    print(json.dumps([shell.pid, *descendants(shell.pid)]), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_killed_edge_lets_its_session_shells_go(helper: Path, made: Made, tmp_path: Path) -> None:  # noqa: F811
    """An edge that dies without letting go (killed) must not leave shells waiting forever."""
    ctx, h = await sandbox(made)
    spawn_helper = spawner_mod.build_helper(tmp_path)
    edge = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _EDGE,
        str(spawn_helper),
        json.dumps([ctx.sandbox_id, h.dump(), str(helper)]),
        stdout=asyncio.subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    assert edge.stdout is not None
    try:
        pids = json.loads(await asyncio.wait_for(edge.stdout.readline(), DEADLINE_S))
        assert pids and not any(_dead(pid) for pid in pids), pids
    finally:
        edge.kill()
        await edge.wait()
    for pid in pids:  # the session's processes (reparented, so reaped by the host's init)
        await eventually(lambda pid=pid: _dead(pid), f"{pid} ({_comm(pid)}) to end with the edge")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
