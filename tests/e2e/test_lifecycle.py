"""Lifecycle on the real runtime: reclamation, restarts, failed creates and leaks."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, InfraFailure, SandboxState
from dsec.backends.container import oci
from dsec.node.embedded import EmbeddedNode
from tests import leaks
from tests.conftest import BASE, DATA_DIR, Sandboxes, node_config
from tests.support import RestartedNode, eventually, start_dsec_up


async def wait_state(
    client: DSecClient, sandbox_id: str, state: SandboxState, within: float = 30
) -> str | None:
    async def reached() -> bool:
        return (await client.get(sandbox_id)).info.state is state

    await eventually(reached, f"{sandbox_id} to be {state.value}", within)
    return (await client.get(sandbox_id)).info.stop_reason


async def test_idle_ttl_reclaims_and_activity_extends_it(client: DSecClient, make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox(ttl_running_stop=1.5)
    busy_until = time.monotonic() + 2.5
    while time.monotonic() < busy_until:  # activity keeps it alive past its TTL
        assert (await sb.run_shell("true")).exit_code == 0
        await asyncio.sleep(0.2)
    assert await wait_state(client, sb.id, SandboxState.stopped) == "idle_ttl"


async def test_max_lifetime_reclaims_busy_sandbox(
    client: DSecClient, make_sandbox: Sandboxes, node: EmbeddedNode
) -> None:
    before = leaks.snapshot(node.config.data_dir)
    sb = await make_sandbox(max_lifetime_s=1)
    assert await wait_state(client, sb.id, SandboxState.stopped) == "max_lifetime"
    assert leaks.snapshot(node.config.data_dir) == before


async def test_restart_readopts_running_sandboxes(base_layer: str, tmp_path: Path) -> None:
    cfg = node_config(tmp_path, data_dir=tmp_path / "node")
    async with RestartedNode(cfg) as nodes:
        async with DSecClient(nodes.node.url, nodes.node.api_key) as c:
            sb = await c.run_container(DSecContainerRunArgs(container_image=base_layer))
            await sb.write_file("/root/state.txt", "kept")
            await sb.run_shell("nohup sleep 1000 >/dev/null 2>&1 &")
        second = await nodes.restart()  # sandboxes keep running meanwhile
        async with DSecClient(second.url, second.api_key) as c:
            again = await c.get(sb.id)
            assert again.info.state is SandboxState.running
            assert await again.read_file("/root/state.txt") == b"kept"
            r = await again.run_shell("cat /proc/[0-9]*/comm | grep -c '^sleep$'")
            assert r.stdout == "1\n"  # the agent's background process survived the restart
            await again.stop()
    assert leaks.snapshot(cfg.data_dir)["cgroups"] == []


async def test_failed_create_leaves_nothing(
    client: DSecClient, node: EmbeddedNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = leaks.snapshot(node.config.data_dir)
    real = oci.build_config

    def broken(**kw: object) -> dict[str, object]:
        config = real(**kw)  # type: ignore[arg-type]
        config["process"]["args"] = ["/no/such/init"]
        return config

    monkeypatch.setattr(oci, "build_config", broken)
    with pytest.raises(InfraFailure, match="crun run failed"):
        await client.run_container(DSecContainerRunArgs(container_image=BASE))
    monkeypatch.undo()
    assert leaks.snapshot(node.config.data_dir) == before
    failed = [r for r in node.edge.journal.live() if r.state is SandboxState.creating]
    assert failed == []


async def test_no_leaks_after_50_create_stop_cycles(client: DSecClient, node: EmbeddedNode) -> None:
    warm = await client.run_container(DSecContainerRunArgs(container_image=BASE))
    await warm.stop()  # mounts the base layer once; it stays mounted and shared by design
    before = leaks.snapshot(node.config.data_dir)
    for _ in range(50):
        sb = await client.run_container(DSecContainerRunArgs(container_image=BASE))
        await sb.run_shell("echo x > /tmp/x; sleep 1000 &")
        await sb.stop()
    assert leaks.snapshot(node.config.data_dir) == before


async def test_a_killed_edge_loses_no_sandbox(base_layer: str, tmp_path: Path) -> None:
    config, data = tmp_path / "config.json", tmp_path / "node"
    up = await asyncio.to_thread(start_dsec_up, data, DATA_DIR / "layers", config, "crash")
    try:
        async with DSecClient(*_url_key(config)) as c:
            sb = await c.run_container(DSecContainerRunArgs(container_image=base_layer))
            await sb.run_shell("echo before > /root/f; nohup sleep 1000 >/dev/null 2>&1 &")
        up.kill()  # SIGKILL: no shutdown code runs
        await asyncio.to_thread(up.wait)
        up = await asyncio.to_thread(start_dsec_up, data, DATA_DIR / "layers", config, "crash")
        async with DSecClient(*_url_key(config)) as c:
            again = await c.get(sb.id)
            assert again.info.state is SandboxState.running
            r = await again.run_shell("cat /root/f; cat /proc/[0-9]*/comm | grep -c '^sleep$'")
            assert r.stdout == "before\n1\n"
            await again.stop()
    finally:
        if up.poll() is None:
            async with DSecClient(*_url_key(config)) as c:
                for left in await c.list():  # also when an assertion failed midway
                    await left.stop()
        up.send_signal(signal.SIGINT)
        await asyncio.to_thread(up.communicate, timeout=60)
    assert up.returncode == 0
    assert leaks.snapshot(data)["cgroups"] == [] and leaks.snapshot(data)["workdirs"] == []


def _url_key(config: Path) -> tuple[str, str]:
    data = json.loads(config.read_text())
    return data["url"], data["api_key"]
