"""Resource bombs: each one is contained by the attacker's own limits, and everything around it
(its neighbour, the host, the edge) carries on; the attacker can still be stopped."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from dsec import DSecClient
from dsec.backends.container import cgroups
from dsec.node.embedded import EmbeddedNode
from tests.conftest import Sandboxes
from tests.security.conftest import Witness, assert_host_process_untouched, assert_node_healthy
from tests.support import eventually


@pytest.mark.slow
async def test_fork_bomb_is_contained_and_the_bomber_can_be_stopped(
    client: DSecClient,
    make_sandbox: Sandboxes,
    witness: Witness,
    host_process: subprocess.Popen[bytes],
) -> None:
    bomber = await make_sandbox(pids_limit=64)
    pids_dir = cgroups.sandbox_dir("pids", bomber.id)
    # The classic bash bomb: it returns at once and multiplies in the background, for good.
    r = await bomber.run_shell(":(){ :|:& };:", timeout=60)
    assert not r.timed_out, r
    await eventually(
        lambda: int((pids_dir / "pids.events").read_text().split()[1]) > 0, "the pids limit to bite"
    )
    assert int((pids_dir / "pids.max").read_text()) == 64
    assert int((pids_dir / "pids.current").read_text()) <= 64

    # While it rages: the neighbour, the host and the node carry on.
    await witness.assert_intact()
    assert_host_process_untouched(host_process)
    # The host still forks.
    proc = await asyncio.create_subprocess_exec("sh", "-c", "for i in 1 2 3; do true & done; wait")
    assert await proc.wait() == 0
    await assert_node_healthy(client, make_sandbox)

    assert int((pids_dir / "pids.current").read_text()) > 1  # still raging when stopped
    info = await bomber.stop()
    assert info.state.value == "stopped"
    assert not cgroups.sandbox_dirs(bomber.id)
    await witness.assert_intact()


async def test_memory_bomb_is_killed_inside_only(
    client: DSecClient,
    make_sandbox: Sandboxes,
    witness: Witness,
    host_process: subprocess.Popen[bytes],
) -> None:
    bomber = await make_sandbox(memory_limit_mb=128)
    r = await bomber.exec(["python3", "-c", "x = []\nwhile True: x.append(bytearray(16 << 20))"], timeout=120)
    assert r.oom_killed and r.exit_code == 137, r
    # Memory in its /dev (a tmpfs) is capped too: no way to park RAM outside its limits.
    r = await bomber.run_shell("head -c 256M /dev/zero > /dev/fill; echo rc=$?; rm -f /dev/fill", timeout=120)
    assert "rc=0" not in r.stdout, r
    assert (await bomber.run_shell("echo usable", timeout=60)).stdout == "usable\n"
    await witness.assert_intact()
    assert_host_process_untouched(host_process)
    await assert_node_healthy(client, make_sandbox)


@pytest.mark.slow
async def test_bounded_disk_bomb_does_not_harm_the_node(
    client: DSecClient,
    make_sandbox: Sandboxes,
    witness: Witness,
    node: EmbeddedNode,
) -> None:
    """`yes > file` for a bounded time (disk quotas are tested elsewhere): the node keeps working
    and a stop gives the space back."""
    bomber = await make_sandbox()
    r = await bomber.run_shell("timeout 2 sh -c 'yes > /tmp/fill'; ls -l /tmp/fill", timeout=120)
    assert not r.timed_out and "/tmp/fill" in r.stdout, r
    # The neighbour still writes and reads back.
    blob = bytes(range(256)) * 4096
    await witness.sb.write_file("/root/after-bomb.bin", blob)
    assert await witness.sb.read_file("/root/after-bomb.bin") == blob
    await witness.assert_intact()
    await assert_node_healthy(client, make_sandbox)

    workdir = Path(node.config.data_dir) / "sandboxes" / bomber.id
    assert workdir.is_dir()
    await bomber.stop()
    assert not workdir.exists()
