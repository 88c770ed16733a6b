"""Pauses and stops never strand a sandbox or a caller (issue 25).

A caller's request that meets a pause or a stop gets an answer it can act on: its command's
result, or ``SandboxNotFound`` once the sandbox is gone; never an infrastructure failure that
a trainer would mask as the platform's fault. A paused sandbox is still reclaimed on time,
whatever was running in it when it paused. A session command ends with its shell, whatever
the shell's children hold, and a command's timeout ends all it started.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from dsec import CommandResult, DSecClient, Sandbox, SandboxState
from dsec.backends.container import cgroups
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import InfraFailure, InfraReason, SandboxNotFound, SandboxStopped
from dsec.rl import fault_of
from tests.conftest import Sandboxes
from tests.support import eventually

ROUNDS = 5
RACERS = 8


def _inside(node: EmbeddedNode, sb: Sandbox, path: str) -> Path:
    """``path`` in the sandbox, reached from the host through its init (no request: a request
    would resume a paused sandbox)."""
    pid = node.edge._live[sb.id].record.handle.pid
    return Path(f"/proc/{pid}/root{path}")


def _frozen(sb: Sandbox) -> bool:
    state = cgroups.sandbox_dir("freezer", sb.id) / "freezer.state"
    return state.read_text().strip() != "THAWED"


def _host_processes(needle: str) -> list[int]:
    """Host PIDs whose command line contains ``needle`` (what a leftover would show)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if needle.encode() in cmdline:
            found.append(int(entry))
    return found


async def test_commands_racing_a_pause_all_run(make_sandbox: Sandboxes) -> None:
    for _ in range(ROUNDS):
        sb = await make_sandbox()
        pause = sb.pause()
        execs = [sb.exec(["echo", str(i)]) for i in range(RACERS)]
        shells = [sb.run_shell(f"echo s{i}", session=f"s{i}") for i in range(2)]
        paused, *results = await asyncio.gather(pause, *execs, *shells, return_exceptions=True)
        assert not isinstance(paused, BaseException), paused
        wanted = [f"{i}\n" for i in range(RACERS)] + ["s0\n", "s1\n"]
        for want, got in zip(wanted, results, strict=True):
            assert isinstance(got, CommandResult), f"a command racing a pause failed: {got!r}"
            assert (got.exit_code, got.stdout) == (0, want)
        await sb.stop()


async def test_a_pause_lets_the_command_under_way_finish_first(
    make_sandbox: Sandboxes, node: EmbeddedNode
) -> None:
    sb = await make_sandbox()
    wait_for_go = "touch /tmp/started; while [ ! -e /tmp/go ]; do sleep 0.02; done; echo done"
    running = asyncio.create_task(sb.run_shell(wait_for_go, timeout=20))
    await eventually(lambda: _inside(node, sb, "/tmp/started").exists(), "the command to start")
    pausing = asyncio.create_task(sb.pause())
    live = node.edge._live[sb.id]
    # The pause has landed: it either waits for the command (the gate closed) or froze it.
    await eventually(lambda: getattr(live, "closed", False) or _frozen(sb), "the pause to land")
    _inside(node, sb, "/tmp/go").touch()
    result = await running
    assert not result.timed_out, "the command was frozen under the caller"
    assert (result.exit_code, result.stdout) == (0, "done\n")
    assert (await pausing).state is SandboxState.paused


@pytest.mark.parametrize(
    ("limit", "reason"), [({"ttl_running_stop": 2}, "idle_ttl"), ({"max_lifetime_s": 3}, "max_lifetime")]
)
async def test_a_paused_sandbox_with_a_command_under_way_is_reclaimed_on_time(
    client: DSecClient,
    make_sandbox: Sandboxes,
    node: EmbeddedNode,
    monkeypatch: pytest.MonkeyPatch,
    limit: dict[str, float],
    reason: str,
) -> None:
    """A command frozen in a paused sandbox keeps it from neither its idle TTL (counted from the
    pause) nor its max_lifetime_s."""
    monkeypatch.setattr(node.edge.config, "pause_drain_s", 0.0, raising=False)  # no drain first
    sb = await make_sandbox(**limit)
    running = asyncio.create_task(sb.run_shell("touch /tmp/started; sleep 1000", timeout=600))
    await eventually(lambda: _inside(node, sb, "/tmp/started").exists(), "the command to start")
    assert (await sb.pause()).state is SandboxState.paused

    async def stopped() -> bool:
        return (await client.get(sb.id)).info.state is SandboxState.stopped

    await eventually(stopped, f"{reason} to reclaim the paused sandbox")
    assert (await client.get(sb.id)).info.stop_reason == reason
    # The caller is not stranded either: its command ended with the sandbox, which is the
    # platform's doing (issue 27), not the command's.
    with pytest.raises(SandboxStopped) as caught:
        await running
    assert caught.value.reason == InfraReason.reclaimed


async def test_commands_racing_a_stop_answer_not_found_or_their_end(make_sandbox: Sandboxes) -> None:
    for _ in range(ROUNDS):
        sb = await make_sandbox()
        stop = sb.stop()
        execs = [sb.exec(["echo", str(i)]) for i in range(RACERS)]
        shells = [sb.run_shell(f"echo s{i}", session=f"s{i}") for i in range(2)]
        stopped, *results = await asyncio.gather(stop, *execs, *shells, return_exceptions=True)
        assert not isinstance(stopped, BaseException), stopped
        for got in results:
            # Its end, never started, or cut by the stop (the platform's, not the command's).
            ok = isinstance(got, CommandResult | SandboxNotFound) or (
                isinstance(got, SandboxStopped) and got.reason == InfraReason.stopped
            )
            assert ok, f"a command racing a stop: {got!r}"


@pytest.mark.parametrize("how", ["exec", "session"])
async def test_a_command_caught_by_a_stop_while_it_starts_answers_not_found_or_its_end(
    make_sandbox: Sandboxes, node: EmbeddedNode, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The race made certain: the stop comes while the command's process (an exec's, or a
    new session's shell) is being started."""
    sb = await make_sandbox()
    edge, backend = node.edge, node.edge.backend
    live = edge._live[sb.id]
    method = "spawn" if how == "exec" else "spawn_session"
    start = getattr(backend, method)
    stopping: list[asyncio.Task[object]] = []

    async def caught(sandbox_id: str, *args: object, **kw: object) -> object:
        if sandbox_id == sb.id and not stopping:
            stopping.append(asyncio.create_task(edge.stop(sb.id)))
            # The stop runs as far as it goes: to its end, or to waiting for this start.
            await eventually(
                lambda: (
                    stopping[0].done()
                    or (live.record.state is SandboxState.stopping and getattr(live, "entering", 0))
                ),
                "the stop to run",
            )
        return await start(sandbox_id, *args, **kw)

    monkeypatch.setattr(backend, method, caught)
    try:
        if how == "exec":
            result = await sb.exec(["echo", "hi"])
        else:
            result = await sb.run_shell("echo hi")
    except SandboxNotFound:
        pass  # it never started
    except SandboxStopped as exc:
        assert exc.reason == InfraReason.stopped  # started, then cut by the stop: not its doing
    else:
        assert result.exit_code != 0 or result.stdout == "hi\n"
    assert (await stopping[0]).state is SandboxState.stopped


async def test_a_session_command_ends_with_its_shell_whatever_its_children_hold(sandbox: Sandbox) -> None:
    await sandbox.run_shell("(while :; do echo tick; sleep .3; done) &")
    result = await sandbox.run_shell("exit 3", timeout=15)
    assert not result.timed_out, "the session waited for a background job's stdout"
    assert result.exit_code == 3
    again = await sandbox.run_shell("echo fresh")  # the next command gets a fresh shell
    assert again.stdout.endswith("fresh\n") and again.exit_code == 0


@pytest.mark.parametrize("how", ["exec", "session"])
async def test_a_timeout_kills_what_the_command_started_detached_or_not(sandbox: Sandbox, how: str) -> None:
    marks = {"setsid": "4321", "double_fork": "4322", "own_group": "4323"}
    # Their output goes elsewhere: what is tested is that they die, not that the command's
    # pipes close (a leftover holding them kept a timed-out exec from ever answering).
    started = (
        f"{{ setsid sleep {marks['setsid']} & "
        f"(setsid sleep {marks['double_fork']} &) ; "
        f"(set -m; sleep {marks['own_group']} &) ; }} >/dev/null 2>&1; "
        "sleep 1000"
    )
    if how == "exec":
        result = await sandbox.exec(["bash", "-c", started], timeout=2)
    else:
        result = await sandbox.run_shell(started, timeout=2)
    assert result.timed_out
    for what, mark in marks.items():
        # SIGKILLed by the time the command answered; gone once the kernel finished them off.
        await eventually(lambda m=mark: not _host_processes(f"sleep {m}"), f"{what}: 'sleep {mark}' to die")
    # Another session's background work is not the timed-out command's: it lives on.
    await sandbox.run_shell("sleep 4324 &", session="other")
    await sandbox.run_shell("sleep 1000", session="victim", timeout=1)
    assert _host_processes("sleep 4324"), "a timeout killed another session's process"


# ------------------------------------------------------------------- faults are the platform's


async def _started(sb: Sandbox, *markers: str) -> None:
    async def there() -> bool:
        r = await sb.exec(["sh", "-c", " && ".join(f"test -e {m}" for m in markers)], timeout=60)
        return r.exit_code == 0

    await eventually(there, f"commands in {sb.id} started")


async def test_a_command_cut_by_another_requests_stop_is_an_infra_failure(
    client: DSecClient, make_sandbox: Sandboxes
) -> None:
    """Issue 27: a command in flight when someone else stops the sandbox did not fail by the
    agent's doing; it answers InfraFailure(stopped), which fault_of masks, not exit 137."""
    sb = await make_sandbox()
    shell = asyncio.ensure_future(sb.run_shell("touch /tmp/s; sleep 300", timeout=600))
    execd = asyncio.ensure_future(sb.exec(["sh", "-c", "touch /tmp/e; exec sleep 300"], timeout=600))
    await _started(sb, "/tmp/s", "/tmp/e")
    await (await client.get(sb.id)).stop()  # another handle, as another request
    for fut in (shell, execd):
        with pytest.raises(InfraFailure) as caught:
            await fut
        assert caught.value.reason == InfraReason.stopped, caught.value
        assert fault_of(caught.value) == "infra"


async def test_a_command_cut_by_a_reclaim_is_an_infra_failure(make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox(max_lifetime_s=3)
    with pytest.raises(InfraFailure) as caught:
        await sb.run_shell("sleep 300", timeout=600)
    assert caught.value.reason == InfraReason.reclaimed and "max_lifetime" in str(caught.value)
    assert fault_of(caught.value) == "infra"
    # What the agent caused stays the agent's: a command that fails by itself is a result.
    other = await make_sandbox()
    r = await other.run_shell("exit 3", timeout=60)
    assert r.exit_code == 3 and fault_of(r) == "agent"
