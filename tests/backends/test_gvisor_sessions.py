"""Session shells on gVisor (``gvisor_exec.spawn_session``): what an idle one costs the edge (2
fds, as crun's: runsc exec holds the shell's stdin), and how a shell is let go (by the edge, or
by the edge's death)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.base import CreateContext, sandbox_env
from dsec.backends.container import gvisor_exec
from dsec.backends.container.backend import ContainerBackend
from dsec.backends.container.gvisor_exec import GVisorProcess
from dsec.executor.process import watch_children_with_pidfds
from dsec.executor.session import DRIVER, Session
from tests.support import DEADLINE_S, eventually

from .conformance import Made
from .test_container_conformance import GVisorMade
from .test_enter import ROOT, _dead, backend, layer_dirs, probe  # noqa: F401
from .test_enter_sessions import open_fds, run

pytestmark = pytest.mark.slow


@pytest.fixture
async def made(backend: ContainerBackend, layer_dirs: list[Path], tmp_path: Path) -> AsyncIterator[Made]:  # noqa: F811
    if not backend.gvisor.available:
        pytest.skip(f"runtime='gvisor' is not available here: {backend.gvisor.why_not}")
    m = GVisorMade(backend, layer_dirs, tmp_path)
    try:
        yield m
    finally:
        await m.cleanup()


def spawner(backend: ContainerBackend, ctx: CreateContext) -> Callable[[], Awaitable[GVisorProcess]]:  # noqa: F811
    async def spawn() -> GVisorProcess:
        env = sandbox_env(ctx.spec, ROOT)
        return await gvisor_exec.spawn_session(
            backend.gvisor, ctx.sandbox_id, ["sh", "-c", DRIVER], env=env, cwd="/", user=ROOT
        )

    return spawn


async def ps(backend: ContainerBackend, sandbox_id: str) -> dict[int, str]:  # noqa: F811
    """PID -> command of every process inside, as runsc sees them."""
    proc = await asyncio.create_subprocess_exec(
        *backend.gvisor.base_argv(), "ps", sandbox_id, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    rows = [line.split() for line in out.decode().splitlines()[1:]]
    return {int(r[1]): r[-1] for r in rows if len(r) > 2 and r[1].isdigit()}


async def test_an_idle_gvisor_session_holds_two_edge_fds_and_commands_keep_their_streams(
    backend: ContainerBackend,  # noqa: F811
    made: Made,
) -> None:
    watch_children_with_pidfds()  # as the edge does
    ctx, _ = await made.create()
    spawn = spawner(backend, ctx)
    shells = [await spawn() for _ in range(2)]  # warm
    before = open_fds()
    more = [await spawn() for _ in range(4)]
    # stdout and stderr pipes: runsc exec holds stdin's write end, no pidfd while idle.
    assert open_fds() - before == 2 * len(more)
    session = Session("s", spawn)
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
    assert await run(session, 'echo "$X $(pwd)"; echo to-stderr > /dev/stderr') == (
        0,
        "1 /tmp\n",
        "to-stderr\n",
        False,
    )
    assert open_fds() == before  # the command's stdin fd closed again
    assert await run(session, "while :; do :; done", timeout=0.5) == (None, "", "", True)
    assert await run(session, 'echo "fresh ${X:-shell}"') == (0, "fresh shell\n", "", False)  # next shell
    assert await run(session, "exit 7") == (7, "", "", False)
    for shell in [*shells, *more]:
        shell.kill()
        await asyncio.wait_for(shell.wait(), DEADLINE_S)
    await session.kill()


async def test_a_gvisor_shell_let_go_ends_and_its_children_live_on(
    backend: ContainerBackend,  # noqa: F811
    made: Made,
) -> None:
    watch_children_with_pidfds()
    ctx, _ = await made.create()
    session = Session("s", spawner(backend, ctx))
    assert (await run(session, "sleep 31009 >/dev/null 2>&1 &"))[0] == 0
    shell = session._proc
    assert isinstance(shell, GVisorProcess) and shell.inner_pid is not None
    inner = shell.inner_pid
    session.detach()
    await asyncio.wait_for(shell.wait(), DEADLINE_S)
    left = await ps(backend, ctx.sandbox_id)
    assert inner not in left, "the shell was killed"
    assert "sleep" in left.values(), "its background child lives on"


# An edge of its own (a process, as the real one): starts a gVisor session, says its PIDs, waits.
_EDGE = """
import asyncio, json, sys
from pathlib import Path
from dsec.backends.container import gvisor_exec
from dsec.backends.container.gvisor import GVisor
from dsec.executor.process import watch_children_with_pidfds
from dsec.executor.session import DRIVER
from dsec.native import spawner
from tests.backends.test_enter import ROOT

async def main():
    watch_children_with_pidfds()
    spawn_helper, data_dir, runtime_dir, sid = sys.argv[1:5]
    spawner.start(Path(spawn_helper))
    gv = GVisor(Path(data_dir))
    await gv.probe(Path(runtime_dir))
    env = {"PATH": "/usr/bin:/bin"}
    shell = await gvisor_exec.spawn_session(gv, sid, ["sh", "-c", DRIVER], env=env, cwd="/", user=ROOT)
    print(json.dumps([shell.pid, shell.inner_pid]), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_killed_edge_lets_its_gvisor_session_shells_go(backend: ContainerBackend, made: Made) -> None:  # noqa: F811
    """An edge that dies without letting go (killed) must not leave shells waiting forever."""
    ctx, _ = await made.create()
    args: list[Any] = [backend.spawn_helper, backend.data_dir, backend.runtime_dir, ctx.sandbox_id]
    edge = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _EDGE,
        *map(str, args),
        stdout=asyncio.subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    assert edge.stdout is not None
    try:
        runsc_exec, inner = json.loads(await asyncio.wait_for(edge.stdout.readline(), DEADLINE_S))
        assert inner in await ps(backend, ctx.sandbox_id)
    finally:
        edge.kill()
        await edge.wait()
    await eventually(lambda: _dead(runsc_exec), "runsc exec to die with the edge")

    async def shell_gone() -> bool:
        return inner not in await ps(backend, ctx.sandbox_id)

    await eventually(shell_gone, "the shell to read EOF and end")
