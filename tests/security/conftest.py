"""What every escape test shares: attack probes run inside a sandbox, a witness sandbox next to
the attacker, a host process beside the node, and checks that the node is unharmed.

Each test runs its attack inside a real container sandbox and then asserts two things: the
attempt failed, and nothing outside the attacker changed (the witness's files, shell and
processes, the host process, the node's ability to create and drive sandboxes).
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsec import CommandResult, DSecClient, Sandbox
from dsec.sdk.client import ExecChunk
from tests.conftest import Sandboxes

# Prepended to every probe: a raw syscall() that reports errno instead of raising.
PRELUDE = r"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]

def syscall(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return r, errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno())) if r < 0 else None

def err(exc):
    return errno.errorcode.get(exc.errno, str(exc.errno)) if isinstance(exc, OSError) else repr(exc)

def pids():
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
"""


async def probe(sb: Sandbox, body: str, *args: object, stdin: str | None = None, timeout: float = 60) -> Any:
    """Run a Python probe (PRELUDE + ``body``) in ``sb``; it prints one JSON document last."""
    r = await sb.exec(["python3", "-c", PRELUDE + body, *map(str, args)], stdin=stdin, timeout=timeout)
    assert r.exit_code == 0 and not r.timed_out, r
    return json.loads(r.stdout.splitlines()[-1])


async def collect(stream: AsyncIterator[ExecChunk | CommandResult]) -> tuple[CommandResult, str]:
    """The rest of an exec stream: its result and the stdout it carried."""
    out = bytearray()
    result: CommandResult | None = None
    async for item in stream:
        if isinstance(item, CommandResult):
            result = item
        elif item.stream == "stdout":
            out.extend(item.data)
    assert result is not None, "exec stream ended without a result"
    return result, out.decode(errors="replace")


@dataclass
class Witness:
    """A sandbox next to the attacker: a file, a shell session with a variable, a process."""

    sb: Sandbox
    token: str
    pid: str

    async def assert_intact(self) -> None:
        assert await self.sb.read_file("/root/witness.txt") == self.token.encode()
        # The same session shell (it holds the variable) and the same background process.
        r = await self.sb.run_shell(
            f'echo "$WITNESS"; kill -0 {self.pid} && echo running', session="w", timeout=60
        )
        assert r.stdout == f"{self.token}\nrunning\n", r
        r = await self.sb.exec(["bash", "-c", "echo $((6 * 7))"], timeout=60)
        assert r.stdout == "42\n", r


@pytest.fixture
async def witness(make_sandbox: Sandboxes) -> Witness:
    sb = await make_sandbox()
    token = f"witness-{uuid.uuid4().hex}"
    await sb.write_file("/root/witness.txt", token)
    r = await sb.run_shell(
        f"export WITNESS={token}; sleep 1000000 >/dev/null 2>&1 & echo $!", session="w", timeout=60
    )
    return Witness(sb, token, r.stdout.strip())


@pytest.fixture
def host_process() -> Iterator[subprocess.Popen[bytes]]:
    """A process on the host beside the node, outside every sandbox."""
    proc = subprocess.Popen(["sleep", "1000000"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def assert_host_process_untouched(proc: subprocess.Popen[bytes]) -> None:
    assert proc.poll() is None, "the host process died"
    status = Path(f"/proc/{proc.pid}/status").read_text()
    assert "\nTracerPid:\t0\n" in status, status
    state = re.search(r"\nState:\t(\S)", status)
    assert state is not None and state.group(1) in "SR", status  # not stopped, not traced


async def assert_node_healthy(client: DSecClient, make_sandbox: Sandboxes) -> None:
    """The node answers, reports healthy, and still creates and drives a fresh sandbox."""
    nodes = await client.nodes()
    assert nodes and all(n["healthy"] for n in nodes), nodes
    fresh = await make_sandbox()
    r = await fresh.run_shell("echo fresh; bash --version | head -1", timeout=60)
    assert r.exit_code == 0 and r.stdout.startswith("fresh\nGNU bash"), r
    assert (await client.get(fresh.id)).info.state.value == "running"


def host_ipv4_addresses() -> list[str]:
    """Every IPv4 address of the host's interfaces (loopback included)."""
    out = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    return sorted({a["local"] for link in json.loads(out) for a in link.get("addr_info", [])})
