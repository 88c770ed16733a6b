"""What lets a node hold thousands of sandboxes: no thread per held process, room for PIDs."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from dsec.backends.container.backend import CHILD_SOCKET_TABLES, PID_MAX_WANTED
from dsec.node.embedded import EmbeddedNode
from tests.conftest import Sandboxes


def threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


async def test_held_sessions_cost_no_thread_each(node: EmbeddedNode, make_sandbox: Sandboxes) -> None:
    boxes = [await make_sandbox(memory_limit_mb=64) for _ in range(16)]
    await asyncio.gather(*(sb.run_shell("true") for sb in boxes))  # warm: pools of helper threads
    before = threads()
    more = [await make_sandbox(memory_limit_mb=64) for _ in range(16)]
    await asyncio.gather(*(sb.run_shell("true") for sb in more))  # 16 more session shells held
    # asyncio's default watcher would park a thread per live child: 16 more here.
    assert threads() - before < 8


def test_the_node_raised_pid_max(node: EmbeddedNode) -> None:
    assert int(Path("/proc/sys/kernel/pid_max").read_text()) >= PID_MAX_WANTED


async def test_a_sandbox_has_socket_tables_of_its_own(make_sandbox: Sandboxes) -> None:
    if not all(knob.exists() for knob in CHILD_SOCKET_TABLES):
        pytest.skip("kernel before 6.2: no per-namespace TCP/UDP hash tables")
    sb = await make_sandbox(memory_limit_mb=64)
    out = await sb.run_shell("cat /proc/sys/net/ipv4/tcp_ehash_entries /proc/sys/net/ipv4/udp_hash_entries")
    # Negative when the namespace shares the host's table, whose size the host reports.
    assert [int(n) for n in out.stdout.split()] == list(CHILD_SOCKET_TABLES.values())


async def test_a_held_session_costs_the_edge_two_fds(node: EmbeddedNode, make_sandbox: Sandboxes) -> None:
    boxes = [await make_sandbox(memory_limit_mb=64) for _ in range(9)]
    await boxes[0].run_shell("true")  # warm: the client's connection, the edge's helpers
    before = len(os.listdir("/proc/self/fd"))
    for sb in boxes[1:]:
        await sb.run_shell("true")
    # stdout and stderr pipes only (no stdin, no pidfd): RLIMIT_NOFILE (20,000 here, not
    # raisable) allows ~9,900 held sessions where 4 fds each allowed ~4,900.
    assert len(os.listdir("/proc/self/fd")) - before == 2 * (len(boxes) - 1)
