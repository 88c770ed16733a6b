"""One process the edge starts in a sandbox cannot reach into another it started.

Everything in a sandbox runs as the same user, so without more a process the agent left behind
could trace a later grader's command, write its memory or open the pipes of its session shell
and decide what it reports. Each exec, held process and session shell gets a Landlock domain
of its own (``dsec_enter.c --own-domain``): it traces and opens the /proc fds of its own
descendants only. Nothing else changes for the sandbox (renames across directories work).
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest

from dsec import CommandResult, Sandbox
from dsec.backends.container.backend import ContainerBackend
from dsec.native.enter import entrances_isolated
from tests.conftest import Sandboxes
from tests.security.conftest import PRELUDE, collect
from tests.security.test_escape_process import PTRACE
from tests.security.test_session_end import MICROVM, on_backend

pytestmark = pytest.mark.skipif(
    not entrances_isolated(), reason="the kernel has no Landlock ABI >= 2 (Linux 5.19, lsm=landlock)"
)

# Replaces printf, which the session driver calls to print a command's end marker, so that
# every later end marker of that session says exit code 0.
ZERO_PRINTF = (
    'printf() { if [ "$1" = \'\\0%s:%d\\0\' ]; then command printf "$1" "$2" 0; '
    'else command printf "$@"; fi; }'
)

# Every way in on a process of the same user: ptrace, its /proc fds and memory, its memory over
# process_vm_readv (EPERM when refused; allowed, it reads an unmapped address: EFAULT).
REACH = r"""
libc.process_vm_readv.restype = ctypes.c_ssize_t

def reach(pid):
    out = {"ptrace": seize(pid)}
    ways = (("fd", f"/proc/{pid}/fd/1", os.O_WRONLY), ("mem", f"/proc/{pid}/mem", os.O_RDWR))
    for what, path, flags in ways:
        try:
            os.close(os.open(path, flags))
            out[what] = "opened"
        except OSError as e:
            out[what] = err(e)
    buf = ctypes.create_string_buffer(1)
    local = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 1)
    remote = (ctypes.c_void_p * 2)(0x1000, 1)
    ctypes.set_errno(0)
    n = libc.process_vm_readv(pid, local, 1, remote, 1, 0)
    out["vm_readv"] = errno.errorcode.get(ctypes.get_errno(), "?") if n < 0 else "read"
    return out
"""

# Left running by the agent: waits for the grader's command (a marker in its command line that
# its own does not contain), tries every way in on it and, as the control, on a child of its own.
LEFT_BEHIND = r"""
import time
print("ready", flush=True)
marker = "GRADER" + "-MARK"
grader = None
while grader is None:
    for pid in pids():
        try:
            if marker in open(f"/proc/{pid}/cmdline").read():
                grader = pid
        except OSError:
            pass
    time.sleep(0.01)
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
out = {"grader": reach(grader), "own_child": reach(child)}
os.kill(child, 9)
os.waitpid(child, 0)
open("/tmp/reached", "w").close()
print(json.dumps(out))
"""

GRADER = """# GRADER-MARK
import os, time
print(os.getpid(), flush=True)
while not os.path.exists("/tmp/reached"):
    time.sleep(0.01)
print("graded", flush=True)
"""


async def assert_another_sessions_pipe_is_out_of_reach(sandbox: Sandbox) -> None:
    """A command of one session writes commands into another session's shell ahead of the edge's
    (through /proc/SHELL/fd/0): refused, and the other session's results stay its own."""
    assert (await sandbox.run_shell("true", session="grader", timeout=60)).exit_code == 0
    # Two lines of framing around the function, then the end nonce: what the edge writes.
    payload = base64.b64encode(f"x\n{ZERO_PRINTF}\nx\ny\n".encode()).decode()
    inject = (
        "for p in /proc/[0-9]*; do "
        '  [ "${p#/proc/}" != "$$" ] && grep -qa __dsec_n "$p/cmdline" 2>/dev/null && other=${p#/proc/}; '
        "done; "
        'test -n "$other" || exit 99; '
        f"echo {payload} | base64 -d > /proc/$other/fd/0 && echo injected"
    )
    r = await sandbox.run_shell(inject, session="agent", timeout=60)
    assert r.exit_code == 1 and "Permission denied" in r.stderr and r.stdout == "", r
    r = await sandbox.run_shell("echo grading; (exit 3)", session="grader", timeout=60)
    assert (r.exit_code, r.stdout) == (3, "grading\n"), r


async def test_a_session_cannot_write_into_another_sessions_shell(sandbox: Sandbox) -> None:
    await assert_another_sessions_pipe_is_out_of_reach(sandbox)


async def test_a_process_left_behind_cannot_reach_a_later_command(sandbox: Sandbox) -> None:
    await assert_a_later_command_is_out_of_reach(sandbox)


@pytest.mark.parametrize("backend", [MICROVM])
async def test_a_process_left_behind_cannot_reach_a_later_command_in_a_microvm(
    make_sandbox: Sandboxes, backend: str
) -> None:
    """The guest agent gives each process it spawns a Landlock domain of its own (the guest
    kernel has Landlock among its LSMs)."""
    await assert_a_later_command_is_out_of_reach(await on_backend(make_sandbox, backend))


async def assert_a_later_command_is_out_of_reach(sandbox: Sandbox) -> None:
    """A process the agent left running tries every way in on a grader's command that starts
    later: all refused, while its own child it may still trace; the grader's result is its own."""
    attacker = sandbox.exec_stream(["python3", "-c", PRELUDE + PTRACE + REACH + LEFT_BEHIND], timeout=120)
    first = await anext(attacker)
    assert not isinstance(first, CommandResult) and first.data == b"ready\n", first
    attacked = asyncio.create_task(collect(attacker))
    grader = await sandbox.exec(["python3", "-c", GRADER], timeout=120)
    result, stdout = await attacked
    assert result.exit_code == 0, (result, stdout)
    out = json.loads(stdout.splitlines()[-1])
    # gVisor has no process_vm_readv (ENOSYS), which then tells nothing either way.
    own, vm_readv = out["own_child"], out["own_child"]["vm_readv"]
    assert own == {"ptrace": own["ptrace"], "fd": "opened", "mem": "opened", "vm_readv": vm_readv}, out
    assert own["ptrace"].startswith("attached:") and vm_readv in ("EFAULT", "ENOSYS"), out
    refused = {"ptrace": "EPERM", "fd": "EACCES", "mem": "EACCES", "vm_readv": "EPERM"}
    assert out["grader"] == refused | ({"vm_readv": "ENOSYS"} if vm_readv == "ENOSYS" else {}), out
    assert grader.exit_code == 0 and grader.stdout.endswith("\ngraded\n"), grader


async def test_a_command_still_renames_and_links_across_directories(sandbox: Sandbox) -> None:
    """The domain handles only cross-directory renames and links, and grants them everywhere."""
    r = await sandbox.run_shell(
        "mkdir -p /tmp/a /tmp/b /root/c && echo x > /tmp/a/f && mv /tmp/a/f /tmp/b/f && "
        "ln /tmp/b/f /tmp/a/g && mv /tmp/a /root/c/a && cat /root/c/a/g /tmp/b/f",
        timeout=60,
    )
    assert (r.exit_code, r.stdout) == (0, "x\nx\n"), r


def test_the_node_reports_it(tmp_path: Path) -> None:
    """Operators (and placement) see whether a node keeps its sandboxes' processes apart."""
    assert ContainerBackend(tmp_path).capabilities()["isolated_entrances"] is True
