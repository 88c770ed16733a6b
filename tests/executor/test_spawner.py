"""Tests of dsec.native.spawner: children forked by ``dsec-spawn`` behave as asyncio's own.

The edge relies on: pipes, exit codes, the environment and cwd given, the fds passed (and no
other fd of the edge), a new session when asked, errors raised as Popen raises them, and the
process being the edge's own child (it waits for it, its PR_SET_PDEATHSIG follows the edge).
An adopted child is the spawner's instead: its exit code still comes back, and what it leaves
behind is reaped by the spawner.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from tests.support import eventually

from dsec import _linux
from dsec.executor.process import watch_children_with_pidfds
from dsec.native import spawner

PIPE = asyncio.subprocess.PIPE
ENV = {"PATH": "/usr/bin:/bin", "ONLY": "this"}


@pytest.fixture(scope="module", autouse=True)
def running(tmp_path_factory: pytest.TempPathFactory) -> None:
    watch_children_with_pidfds()
    spawner.start(spawner.build_helper(tmp_path_factory.mktemp("spawn-bin")))
    assert spawner._spawner is not None


async def sh(script: str, **kw: object) -> tuple[int, str, str]:
    proc = await spawner.create_subprocess_exec("sh", "-c", script, stdout=PIPE, stderr=PIPE, env=ENV, **kw)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_output_exit_code_environment_and_cwd(tmp_path: Path) -> None:
    code, out, err = await sh("echo out; echo err >&2; env | sort; pwd; exit 7", cwd=tmp_path)
    assert code == 7
    assert out.splitlines() == [
        "out",
        "ONLY=this",
        f"PATH={ENV['PATH']}",
        "PWD=" + str(tmp_path),
        str(tmp_path),
    ]
    assert err == "err\n"


async def test_the_child_is_the_edges_own_and_holds_only_its_stdio_and_passed_fds() -> None:
    r, w = os.pipe()  # the edge's fds are close-on-exec: none may reach the child but w
    try:
        # (through /proc: dash redirects fds 0-9 only)
        code, out, _ = await sh(f"echo $PPID; ls /proc/$$/fd; echo x > /proc/$$/fd/{w}", pass_fds=(w,))
    finally:
        os.close(w)
    assert os.read(r, 10) == b"x\n", out
    os.close(r)
    ppid, *fds = out.split()
    assert code == 0
    assert int(ppid) == os.getpid()
    assert sorted(int(fd) for fd in fds) == [0, 1, 2, w]


async def test_stdin_pipe_and_a_new_session() -> None:
    proc = await spawner.create_subprocess_exec(
        "sh", "-c", "cat; ps -o sid= -p $$", stdin=PIPE, stdout=PIPE, env=ENV, start_new_session=True
    )
    out, _ = await proc.communicate(b"typed\n")
    typed, sid = out.decode().split()
    assert (typed, int(sid)) == ("typed", proc.pid)  # the session leader is the process itself


async def test_a_missing_program_or_cwd_raises_as_popen_does(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await spawner.create_subprocess_exec("no-such-program-here", env=ENV)
    with pytest.raises(FileNotFoundError) as missing:
        await spawner.create_subprocess_exec(str(tmp_path / "absent"), env=ENV)
    assert missing.value.filename == str(tmp_path / "absent")
    with pytest.raises(FileNotFoundError) as cwd:
        await spawner.create_subprocess_exec("true", cwd=tmp_path / "gone", env=ENV)
    assert cwd.value.filename == str(tmp_path / "gone")
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError):
        await spawner.create_subprocess_exec(str(script), env=ENV)


async def test_kill_and_signals_reach_the_child() -> None:
    proc = await spawner.create_subprocess_exec("sleep", "600", env=ENV)
    proc.kill()
    assert await proc.wait() == -9


async def test_a_dead_spawner_is_started_again() -> None:
    running = spawner._spawner
    assert running is not None
    running._proc.kill()
    running._proc.wait()
    assert await sh("echo again") == (0, "again\n", "")
    assert spawner._spawner is not running


def test_a_fork_of_the_edge_does_not_use_its_spawner() -> None:
    # Its children would be the edge's (CLONE_PARENT), not the fork's: the fork forks itself.
    pid = os.fork()
    if pid == 0:
        os._exit(0 if spawner._running() is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert spawner._running() is not None


def _adopted(script: str, out: int | None = None) -> spawner.Adopted:
    fds = {0: 0, 1: out if out is not None else 1, 2: 2}
    child = spawner.spawn_adopted("/bin/sh", ["sh", "-c", script], ENV, fds)
    assert child is not None
    return child


async def _adopted_output(script: str) -> tuple[int, str]:
    r, w = os.pipe()
    try:
        child = _adopted(script, w)
    finally:
        os.close(w)
    code = await child.wait()
    with os.fdopen(r) as said:
        return code, said.read()


async def test_an_adopted_child_is_the_spawners_and_its_exit_code_comes_back() -> None:
    code, ppid = await _adopted_output("echo $PPID; exit 7")
    assert (code, int(ppid)) == (7, spawner._spawner._proc.pid)  # type: ignore[union-attr]
    killed = _adopted("sleep 600")
    killed.kill()
    assert await killed.wait() == -9


async def test_what_an_adopted_child_leaves_behind_is_reaped_by_the_spawner() -> None:
    # crun run --detach leaves the sandbox's init (and an intermediate of its own): they go to
    # the spawner, a child subreaper, not to the host's init, and the spawner reaps them.
    code, out = await _adopted_output("sleep 600 >/dev/null 2>&1 & echo $!")
    assert code == 0
    left = int(out)
    pidfd = os.pidfd_open(left)
    try:
        assert _linux.stat_fields(left)[1] == str(spawner._spawner._proc.pid)  # type: ignore[index,union-attr]
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)
    await eventually(lambda: not Path(f"/proc/{left}").exists(), "the left-behind process reaped, no zombie")


async def test_an_adopted_program_that_cannot_start_raises_as_popen_does(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as missing:
        spawner.spawn_adopted(str(tmp_path / "absent"), ["absent"], ENV, {})
    assert missing.value.filename == str(tmp_path / "absent")


async def test_an_adopted_childs_wait_fails_clearly_when_the_spawner_dies_first() -> None:
    child = _adopted("sleep 600")
    orphan = os.pidfd_open(child.pid)  # it outlives the spawner (reparented): end it after
    try:
        running = spawner._spawner
        assert running is not None
        running._proc.kill()
        running._proc.wait()
        with pytest.raises(OSError, match="before reporting"):
            await child.wait()
    finally:
        signal.pidfd_send_signal(orphan, signal.SIGKILL)
        os.close(orphan)
        child.close()
    assert await sh("echo again") == (0, "again\n", "")  # a new spawner
