"""Pausing freezes the sandbox's cgroup (``cgroups.set_frozen``), also when its processes stop
under ptrace as gVisor's ptrace platform keeps its own: every freeze completes and every thaw
lets them run again, never a sandbox left half frozen."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator

import pytest

from dsec.backends.container import cgroups
from tests.support import eventually

FREEZER = cgroups.CGROUP_ROOT / "freezer"
pytestmark = pytest.mark.skipif(
    not (FREEZER / "cgroup.procs").exists(), reason="no cgroup v1 freezer hierarchy on this host"
)

# Joins the cgroup named by argv[1], then traces a shell loop that makes system calls, stopping
# it at each one's entry and exit as strace does (and as gVisor's sentry stops its stubs).
TRACER = r"""
import ctypes, os, sys
open(sys.argv[1], "w").write(str(os.getpid()))
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
PTRACE_TRACEME, PTRACE_SYSCALL, PTRACE_SETOPTIONS, PTRACE_O_EXITKILL = 0, 24, 0x4200, 0x100000
pid = os.fork()
if pid == 0:
    libc.ptrace(PTRACE_TRACEME, 0, None, None)
    os.execv("/bin/sh", ["sh", "-c", "while :; do read x < /dev/null; done"])
os.waitpid(pid, 0)  # stopped at its exec
libc.ptrace(PTRACE_SETOPTIONS, pid, None, PTRACE_O_EXITKILL)  # it dies with its tracer
print("tracing", flush=True)
while True:
    libc.ptrace(PTRACE_SYSCALL, pid, None, None)
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status) or os.WIFSIGNALED(status):
        break
"""


@pytest.fixture
async def sandbox_id() -> AsyncIterator[str]:
    """A sandbox's freezer cgroup, in a bucket of this test's own."""
    sid = f"sb-freezer-{uuid.uuid4().hex[:8]}"
    cgroups.place(sid, f"dsec-test-{uuid.uuid4().hex[:8]}")
    d = cgroups.sandbox_dir("freezer", sid)
    d.mkdir(parents=True)
    try:
        yield sid
    finally:
        (d / "freezer.state").write_text("THAWED")
        for pid in (d / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        await eventually(lambda: not (d / "cgroup.procs").read_text().strip(), "the test's processes to end")
        d.rmdir()
        d.parent.rmdir()
        cgroups.forget(sid)


async def test_a_sandbox_whose_processes_are_traced_freezes_and_thaws_every_time(sandbox_id: str) -> None:
    d = cgroups.sandbox_dir("freezer", sandbox_id)
    tracer = subprocess.Popen([sys.executable, "-c", TRACER, str(d / "cgroup.procs")], stdout=subprocess.PIPE)
    try:
        assert tracer.stdout is not None and tracer.stdout.readline() == b"tracing\n"
        assert len((d / "cgroup.procs").read_text().split()) == 2  # the tracer and its tracee
        # One write of FROZEN left this cgroup FREEZING for good 80 times in 100.
        for _ in range(30):
            await cgroups.set_frozen(sandbox_id, True)
            assert (d / "freezer.state").read_text().strip() == "FROZEN"
            await cgroups.set_frozen(sandbox_id, False)
            assert (d / "freezer.state").read_text().strip() == "THAWED"
    finally:
        (d / "freezer.state").write_text("THAWED")  # a frozen tracer would not die of its kill
        tracer.kill()
        tracer.wait()
