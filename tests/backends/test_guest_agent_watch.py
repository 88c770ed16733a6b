"""What the guest agent does for a microVM's sessions and processes, run here on the host
(the agent over a unix socket, as PID 1 of a PID namespace of its own): it watches a session
shell from the guest's /proc as the edge watches a container's from the host's (PROTOCOL.md,
WATCH), and gives every process it spawns a Landlock domain of its own.

tests/security/ attacks the same through a real microVM (few: each boots one).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec._linux import landlock_abi
from dsec.backends.microvm import host, kit, shell_watch
from dsec.backends.microvm.channel import AgentChannel, VmProcess
from dsec.executor.process import SandboxProcess
from dsec.executor.session import DRIVER, Session
from dsec.protocol.models import CommandResult
from tests.conftest import DATA_DIR
from tests.security.test_session_end import PEEKERS

ENV = {"PATH": host.GUEST_PATH}


@pytest.fixture
async def channel(agent: Path) -> AsyncIterator[AgentChannel]:
    ch = await AgentChannel.connect(agent, 10.0)
    yield ch
    await ch.close()


def session(channel: AgentChannel, *shell: str) -> Session:
    async def spawn() -> SandboxProcess:
        return await channel.spawn([*shell, "-c", DRIVER], env=ENV, cwd="/", uid=0, gid=0)

    return Session("s", spawn)


async def run(s: Session, command: str, timeout: float = 60) -> CommandResult:
    return await s.run(command, timeout=timeout, max_output=1 << 20, oom_kills=lambda: 0)


async def harness_after(s: Session) -> None:
    r = await run(s, "echo harness; echo harness-err >&2")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "harness\n", "harness-err\n"), r


@pytest.mark.parametrize("end", ["(exit 3)", "exit 3"], ids=["returns", "ends-its-shell"])
@pytest.mark.parametrize("peek", ["python", "shell"])
async def test_a_command_that_reads_its_end_nonce_cannot_end_early(
    channel: AgentChannel, peek: str, end: str
) -> None:
    """Its forged markers come while the shell still runs it; the agent finds the shell back
    in its loop only after the shell's own, and its token ends the command there."""
    s = session(channel, "bash")
    try:
        assert (await run(s, "true")).exit_code == 0
        assert s._view is not None, "the agent does not watch a bash session shell"
        r = await run(s, f"{PEEKERS[peek]}; echo after; echo after-err >&2; {end}")
        assert r.exit_code == 3 and not r.timed_out, r
        assert r.stdout.endswith(":0\0smuggled\nafter\n"), r
        assert r.stderr.endswith("smuggled-err\nafter-err\n"), r
        await harness_after(s)
    finally:
        await s.kill()


@pytest.mark.parametrize(
    "wait",
    ["read -r x <&10", "exec cat <&10 3>/proc/$$/fd/10 >/dev/null"],
    ids=["read-builtin", "exec"],
)
async def test_a_command_waiting_on_the_command_pipe_itself_is_not_an_idle_shell(
    channel: AgentChannel, wait: str
) -> None:
    """Blocked in read(2) of the command pipe, but not where the driver loop waits: taken for
    idle, it would end at the forged exit code 0 and read the next command itself."""
    s = session(channel, "bash")
    try:
        takeover = (
            "IFS= read -r e <&10; printf '\\0%s:0\\0' \"$e\"; printf '\\0%s\\0' \"$e\" >&2; "
            f"echo taken-over; {wait}"
        )
        r = await run(s, takeover, timeout=3)
        assert r.timed_out and r.exit_code is None, r
        await harness_after(s)  # a fresh shell, after the timeout killed that one
    finally:
        await s.kill()


async def test_a_chatty_background_job_does_not_keep_a_command_from_ending(channel: AgentChannel) -> None:
    """Its output keeps the pipes busy while the shell is back: the agent's token comes behind
    what they held at that moment, not behind all the job will ever write."""
    s = session(channel, "bash")
    try:
        await run(s, "(while :; do echo chatter; done) & echo $! >/tmp/dsec-chatty-$$")
        for _ in range(10):
            r = await run(s, "echo fg; (exit 4)")
            assert r.exit_code == 4 and set(r.stdout.split()) <= {"fg", "chatter"} and "fg" in r.stdout, r
    finally:
        await run(s, "kill $(cat /tmp/dsec-chatty-$$); rm /tmp/dsec-chatty-$$")
        await s.kill()


@pytest.mark.parametrize(("shell", "watched"), [(["dash"], True), (["busybox", "sh"], False)])
async def test_shells_that_wait_otherwise_are_not_watched_and_still_work(
    channel: AgentChannel, shell: list[str], watched: bool
) -> None:
    """busybox ash polls before it reads: the agent declines it at once (no calibration wait),
    and the end marker's secret nonce alone ends its commands."""
    s = session(channel, *shell)
    try:
        r = await run(s, "cd /tmp; X=1; echo out; echo err >&2; (exit 3)")
        assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n"), r
        assert (s._view is not None) is watched
        assert (await run(s, 'echo "$X $(pwd)"')).stdout == "1 /tmp\n"
    finally:
        await s.kill()


async def test_a_shell_holding_stdout_elsewhere_for_a_moment_is_asked_again_not_given_up(
    channel: AgentChannel,
) -> None:
    """Right after its end markers a driver loop's `printf ... >&2` still holds stdout on the
    stderr pipe; a loaded machine preempts it there. Taken for "not watchable", the session
    would run unwatched for good (CI saw it): it is "not yet", and calibration goes on."""
    script = "{ echo held; read -r x; } >&2; echo back; read -r y"
    proc = await channel.spawn(["bash", "-c", script], env=ENV, cwd="/", uid=0, gid=0)
    try:
        assert proc.stdout is not None and proc.stderr is not None and proc.stdin is not None
        assert await proc.stderr.readline() == b"held\n"
        view = proc.shell_watch()
        assert view is not None
        # Blocked in read(2) of its stdin pipe or about to be, stdout on the stderr pipe.
        assert (await proc._watch(bytes([shell_watch.CALIBRATE])))[0] == shell_watch.NO
        proc.stdin.write(b"x\n")
        await proc.stdin.drain()
        assert await proc.stdout.readline() == b"back\n"
        assert await view.calibrate()  # its pipes back in place, waiting for its next line
    finally:
        proc.kill()
        await proc.wait()


async def test_an_agent_without_watch_leaves_sessions_to_the_nonce(channel: AgentChannel) -> None:
    """A microVM an older edge started runs an agent that knows no WATCH (version 1)."""
    proc = await channel.spawn(["cat"], env=ENV, cwd="/", uid=0, gid=0)
    try:
        assert proc.shell_watch() is not None
        channel.version = "dsec-agent 1"
        assert proc.shell_watch() is None
    finally:
        proc.kill()
        await proc.wait()


REACH = """
import os, sys
try:
    os.close(os.open(f"/proc/{sys.argv[1]}/fd/1", os.O_WRONLY))
    print("opened")
except OSError as e:
    print(os.strerror(e.errno))
"""


async def _reach(channel: AgentChannel, script: str, *args: str) -> str:
    proc = await channel.spawn(["sh", "-c", script, "sh", *args], env=ENV, cwd="/", uid=0, gid=0)
    assert proc.stdout is not None
    out = await proc.stdout.read()
    assert await proc.wait() == 0, out
    return out.decode().strip()


@pytest.mark.skipif(landlock_abi() < 2, reason="the kernel has no Landlock ABI >= 2 (Linux 5.19)")
async def test_a_spawned_process_cannot_reach_another_but_reaches_its_own_children(
    channel: AgentChannel,
) -> None:
    """Without domains of their own, one process could open a later one's stdout and write
    into what it reports (processes of a sandbox share one user)."""
    other: VmProcess = await channel.spawn(["sleep", "600"], env=ENV, cwd="/", uid=0, gid=0)
    try:
        theirs = await _reach(channel, 'exec python3 -c "$1" "$2"', REACH, str(other.pid))
        assert theirs == "Permission denied"
        own = await _reach(channel, 'sleep 600 & python3 -c "$1" $!; kill $!', REACH)
        assert own == "opened"
    finally:
        other.kill()
        await other.wait()


def test_the_node_reports_whether_its_guest_kernel_keeps_processes_apart(tmp_path: Path) -> None:
    """Landlock built in, among the default LSMs, and ABI >= 2 (Linux 5.19): each process the
    agent spawns gets a domain (the backend's ``isolated_entrances``)."""
    boot = tmp_path / "boot"
    boot.mkdir()

    def config(version: str, *lines: str) -> bool:
        (boot / f"config-{version}").write_text("\n".join(lines) + "\n")
        return kit.has_landlock(tmp_path, version)

    on = ("CONFIG_SECURITY_LANDLOCK=y", 'CONFIG_LSM="lockdown,landlock,yama"')
    assert config("6.1.0-57-cloud-amd64", *on)
    assert not config("5.15.0-1-amd64", *on)  # ABI 1: any domain would deny cross-directory renames
    assert not config("6.1.0-57-amd64", on[0], 'CONFIG_LSM="lockdown,yama"')
    assert not config("6.1.0-57-amd64", "# CONFIG_SECURITY_LANDLOCK is not set", on[1])
    assert not kit.has_landlock(tmp_path, "6.2.0")  # no config at all
    for root in sorted((DATA_DIR / "node" / "guest-kit" / "kernel").glob("linux-image-*")):
        version = next((root / "lib" / "modules").iterdir()).name
        assert kit.has_landlock(root, version), root  # Debian 12's kernels, both flavours


CAPS = 'grep -E "^Cap(Eff|Bnd)" /proc/self/status'
# linux/capability.h: the capabilities that let guest root change the guest kernel (and its agent).
KERNEL_CAPS = {"CAP_SYS_RAWIO": 17, "CAP_SYS_ADMIN": 21, "CAP_SYS_BOOT": 22, "CAP_SYS_MODULE": 16}
KERNEL_CAPS |= {"CAP_PERFMON": 38, "CAP_BPF": 39}
KEPT_CAPS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_KILL": 5, "CAP_SETUID": 7}
KEPT_CAPS |= {"CAP_NET_ADMIN": 12, "CAP_SYS_CHROOT": 18, "CAP_SYS_PTRACE": 19, "CAP_SYS_NICE": 23}


async def test_a_spawned_process_has_no_capability_that_changes_the_kernel(channel: AgentChannel) -> None:
    """Root in the guest keeps what a root user expects, and nothing that loads kernel code,
    reads raw memory or I/O ports, or runs BPF and perf programs: not even through a
    setuid-root program (the bounding set)."""
    proc = await channel.spawn(["sh", "-c", CAPS], env=ENV, cwd="/", uid=0, gid=0)
    assert proc.stdout is not None
    out = (await proc.stdout.read()).decode()
    assert await proc.wait() == 0, out
    sets = {line.split(":")[0]: int(line.split()[1], 16) for line in out.splitlines()}
    for name, mask in sets.items():
        assert [cap for cap, bit in KERNEL_CAPS.items() if mask >> bit & 1] == [], (name, out)
        assert [cap for cap, bit in KEPT_CAPS.items() if not mask >> bit & 1] == [], (name, out)
