"""Where a session command ends, decided by nothing the command can fake.

A session command runs inside the session shell, so it can print anything the driver loop
prints. Each attack below tries to end its own result early (with an exit code it chose) and
push what it prints afterwards into the next command's result, which may be a grader's. The
edge must record what happened: the command's own exit code and all of its output, and
exactly the next command's output for the next command.
"""

from __future__ import annotations

import shutil

import pytest

from dsec import DSecMicroVMRunArgs, Sandbox
from tests.conftest import BASE, Sandboxes

# Finds the session shell's saved copy of its command pipe (the shell is the parent; its
# stdin is /dev/null while a command runs), takes the end marker's nonce waiting there, puts
# it back for the shell, and prints both end markers with it: exit code 0, before the rest
# of its own output.
PEEK_AND_FORGE = r"""
import os
shell = os.getppid()
for fd in os.listdir(f"/proc/{shell}/fd"):
    flags = int(open(f"/proc/{shell}/fdinfo/{fd}").read().split("flags:")[1].split()[0], 8)
    if int(fd) > 2 and os.readlink(f"/proc/{shell}/fd/{fd}").startswith("pipe:") and flags & 3 == 0:
        path = f"/proc/{shell}/fd/{fd}"
r = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
nonce = os.read(r, 4096)
os.close(r)
w = os.open(path, os.O_WRONLY)
os.write(w, nonce)
os.close(w)
nonce = nonce.strip()
os.write(1, b"\0" + nonce + b":0\0")
os.write(2, b"\0" + nonce + b"\0")
os.write(1, b"smuggled\n")
os.write(2, b"smuggled-err\n")
"""
PEEKERS = {
    "python": f"python3 -c '{PEEK_AND_FORGE}'",
    # The same from the shell itself: bash keeps its stdin on fd 10 while a command runs.
    "shell": (
        "IFS= read -r e <&10; printf '\\0%s:0\\0' \"$e\"; printf '\\0%s\\0' \"$e\" >&2; "
        "printf '%s\\n' \"$e\" >/proc/$$/fd/10; echo smuggled; echo smuggled-err >&2"
    ),
}


# The backends besides crun that run the same session driver: gVisor's shells are watched by
# nothing (its sentry's processes are not the host's), a microVM's by its guest agent.
GVISOR = pytest.param("gvisor", marks=pytest.mark.skipif(shutil.which("runsc") is None, reason="no runsc"))
MICROVM = pytest.param(
    "microvm",
    marks=[
        pytest.mark.vm,
        pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="no qemu"),
    ],
)
OTHER_BACKENDS = [GVISOR, MICROVM]


async def on_backend(make_sandbox: Sandboxes, backend: str) -> Sandbox:
    """A sandbox on ``backend``: crun or gVisor (a container runtime), or a microVM."""
    if backend != "microvm":
        return await make_sandbox(runtime=backend)
    sandbox = await make_sandbox.client.run_microvm(DSecMicroVMRunArgs(container_image=BASE))
    make_sandbox.made.append(sandbox)
    return sandbox


async def _harness_after(sandbox: Sandbox, session: str) -> None:
    """The next command's result is exactly its own (a grader's, say)."""
    r = await sandbox.run_shell("echo harness; echo harness-err >&2", session=session, timeout=60)
    assert (r.exit_code, r.stdout, r.stderr) == (0, "harness\n", "harness-err\n"), r


@pytest.mark.parametrize("backend", ["crun", *OTHER_BACKENDS])
async def test_a_command_cannot_forge_its_own_end_marker(make_sandbox: Sandboxes, backend: str) -> None:
    """The nonce a command can read ($__dsec_n frames the command text) is not the end's: on
    every backend (microVMs and gVisor run the same driver, with no watch from the host)."""
    sandbox = await on_backend(make_sandbox, backend)
    forge = (
        "printf '\\0%s:0\\0' \"$__dsec_n\"; printf '\\0%s\\0' \"$__dsec_n\" >&2; "
        "echo smuggled; echo smuggled-err >&2; (exit 3)"
    )
    first = await sandbox.run_shell(forge, session="s", timeout=60)
    second = await sandbox.run_shell("echo harness", session="s", timeout=60)
    # What the edge recorded must be what happened: exit 3 and "smuggled" for the first
    # command, exactly "harness" for the second.
    recorded = [e.result for e in (await sandbox.trajectory())[-2:]]
    assert (first.exit_code, second.stdout) == (3, "harness\n"), (first, second, recorded)
    assert "smuggled" in first.stdout and first.stderr.endswith("smuggled-err\n"), (first, second)
    assert [r["exit_code"] if r else None for r in recorded] == [3, 0], recorded


@pytest.mark.parametrize("end", ["(exit 3)", "exit 3"], ids=["returns", "ends-its-shell"])
@pytest.mark.parametrize("peek", ["python", "shell"])
async def test_a_command_that_reads_its_end_nonce_off_the_command_pipe_cannot_end_early(
    sandbox: Sandbox, end: str, peek: str
) -> None:
    """The markers it prints come while the shell still runs the command: the shell's own
    come later, once it is back in its loop (seen from the host), and they end it; or the
    shell exits, and the command ends as the shell did."""
    cmd = f"{PEEKERS[peek]}; echo after; echo after-err >&2; {end}"
    first = await sandbox.run_shell(cmd, session="s", timeout=60)
    assert first.exit_code == 3 and not first.timed_out, first
    assert first.stdout.endswith(":0\0smuggled\nafter\n") and first.stderr.endswith(
        "smuggled-err\nafter-err\n"
    ), first
    await _harness_after(sandbox, "s")
    recorded = (await sandbox.trajectory())[-2].result
    assert recorded is not None and recorded["exit_code"] == 3, recorded


async def assert_a_nonce_reader_cannot_end_early(sandbox: Sandbox) -> None:
    """A command that reads its end nonce off its shell's command pipe and prints both end
    markers with it (exit code 0), then more: its own result has all of it and its own exit
    code, the next command's only the next command's output."""
    first = await sandbox.run_shell(f"{PEEKERS['shell']}; echo after; (exit 3)", session="s", timeout=60)
    assert first.exit_code == 3 and first.stdout.endswith("smuggled\nafter\n"), first
    second = await sandbox.run_shell("echo harness", session="s", timeout=60)
    assert second.stdout == "harness\n", second


@pytest.mark.parametrize("backend", [MICROVM])
async def test_a_command_that_reads_its_end_nonce_cannot_end_early_in_a_microvm(
    make_sandbox: Sandboxes, backend: str
) -> None:
    """The guest agent watches the session shell from the guest's /proc as the edge watches a
    container's from the host's (tests/backends/test_guest_agent_watch.py has every attack)."""
    await assert_a_nonce_reader_cannot_end_early(await on_backend(make_sandbox, backend))


@pytest.mark.parametrize(
    "wait",
    [
        pytest.param("read -r x <&10", id="read-builtin"),  # the shell itself, deeper in its stack
        # Another program in its place (which keeps a write end, so it never reads EOF).
        pytest.param("exec cat <&10 3>/proc/$$/fd/10 >/dev/null", id="exec"),
    ],
)
async def test_a_command_waiting_on_the_command_pipe_itself_is_not_an_idle_shell(
    sandbox: Sandbox, wait: str
) -> None:
    """Forged markers, then the shell blocked reading its own command pipe (bash keeps it on
    fd 10 while a command runs): it looks idle by system call and fd, not by where it waits.
    Taken for idle, the command would end at exit code 0 and read the next command itself."""
    takeover = (
        "IFS= read -r e <&10; printf '\\0%s:0\\0' \"$e\"; printf '\\0%s\\0' \"$e\" >&2; "
        f"echo taken-over; {wait}"
    )
    first = await sandbox.run_shell(takeover, session="s", timeout=3)
    assert first.timed_out and first.exit_code is None, first
    await _harness_after(sandbox, "s")  # a fresh shell, after the timeout killed that one


async def test_an_orphan_with_an_old_nonce_is_output_of_the_command_it_prints_in(sandbox: Sandbox) -> None:
    """A process the first command leaves behind prints markers with the only nonce it could
    know while the second command runs: they are that command's output, not its end."""
    plant = (
        "mkfifo /tmp/go /tmp/done; setsid sh -c 'read x </tmp/go; "
        'printf "\\0%s:0\\0orphan\\n" "$0"; printf "\\0%s\\0" "$0" >&2; echo >/tmp/done\' '
        '"$__dsec_n" </dev/null &'
    )
    assert (await sandbox.run_shell(plant, session="s", timeout=60)).exit_code == 0
    r = await sandbox.run_shell(
        "echo >/tmp/go; read y </tmp/done; echo two; (exit 5)", session="s", timeout=60
    )
    assert r.exit_code == 5 and r.stdout.endswith("orphan\ntwo\n") and r.stdout.count("\0") == 2, r
    await _harness_after(sandbox, "s")
