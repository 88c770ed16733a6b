"""A real cluster on one machine: three edges, each in a network namespace of its own, two
apiservers, one PostgreSQL IAM and one shared layer store, all separate OS processes running
real container sandboxes. An edge and then an apiserver are SIGKILLed while sandboxes run;
the edge comes back on its data directory. The first test checks the network the second uses.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, InfraFailure, Sandbox, SandboxState
from dsec.iam import IamStore, NodeRecord
from dsec.protocol.errors import InfraReason
from dsec.protocol.fncall import FnResult
from dsec.rl import fault_of
from tests.support import eventually

from .harness import HEARTBEAT_S, Cluster, epoch_of, free_port, node_of
from .netns import Netns
from .procs import Proc

_PROBE = """
import json, os, socket, sys
host, port, other, name = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
with socket.create_connection((host, port), timeout=5) as s:
    s.sendall(name.encode())
try:
    socket.create_connection((other, 9), timeout=2).close()
    isolated = None
except OSError as exc:
    isolated = exc.errno
print(json.dumps({"cgroup": sorted(os.listdir("/sys/fs/cgroup")), "isolated": isolated}))
"""


async def _connects(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


async def test_each_namespace_reaches_only_the_host_through_its_veth(
    namespaces: list[Netns], tmp_path: Path
) -> None:
    """What the cluster test relies on: an edge in a namespace reaches the apiservers at its
    host-side address and nothing else, the root namespace reaches it only at its own
    address, and it still sees the host's cgroup tree (which ``ip netns exec`` would hide)."""
    heard: list[str] = []

    async def hear(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heard.append((await reader.read()).decode())
        writer.close()

    server = await asyncio.start_server(hear, "0.0.0.0", 0)
    port = server.sockets[0].getsockname()[1]
    servers: list[Proc] = []
    try:
        for i, ns in enumerate(namespaces):
            other = namespaces[(i + 1) % len(namespaces)]
            argv = ns.enter([sys.executable, "-c", _PROBE, ns.host_ip, str(port), other.ns_ip, ns.name])
            done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, done.stderr
            seen = json.loads(done.stdout)
            assert seen["cgroup"] == sorted(os.listdir("/sys/fs/cgroup"))
            assert seen["isolated"] is not None, f"{ns.name} reached {other.name}'s address"
        names = sorted(ns.name for ns in namespaces)
        await eventually(lambda: sorted(heard) == names, "every namespace to reach the host")

        inner = free_port()
        for ns in namespaces:
            argv = [sys.executable, "-m", "http.server", "--bind", ns.ns_ip, str(inner)]
            servers.append(Proc(f"http-{ns.name}", ns.enter(argv), tmp_path / f"http-{ns.name}.log"))
        for ns in namespaces:
            await eventually(functools.partial(_connects, ns.ns_ip, inner), f"{ns.ns_ip}:{inner} to answer")
        with socket.socket() as s:  # not on the root namespace's loopback: it lives elsewhere
            assert s.connect_ex(("127.0.0.1", inner)) != 0
    finally:
        server.close()
        await server.wait_closed()
        for proc in servers:
            proc.kill()


async def _create(client: DSecClient, image: str, **labels: str) -> Sandbox:
    return await client.run_container(DSecContainerRunArgs(container_image=image, labels=labels))


async def _exists(sb: Sandbox, path: str) -> bool:
    # exec, not the session: the command being waited for holds the default session.
    return (await sb.exec(["test", "-e", path])).exit_code == 0


async def _get_says_lost(client: DSecClient, sandbox_id: str) -> bool:
    try:
        await client.get(sandbox_id)
    except InfraFailure as exc:
        return exc.reason == InfraReason.node_lost
    raise AssertionError(f"{sandbox_id} answered on a killed node")


async def _registry(iam: IamStore) -> dict[str, NodeRecord]:
    return {record.node: record for record in await iam.list_nodes()}


@pytest.mark.slow
async def test_a_cluster_of_processes_survives_losing_an_edge_then_an_apiserver(
    cluster: Cluster, iam: IamStore, base_layer: str
) -> None:
    job = f"job-{os.getpid()}"
    nodes = set(cluster.nodes)
    async with cluster.client(0) as one, cluster.client(1) as two:
        apis = (one, two)

        # 1. Creates through either apiserver land on every edge, under the registered epochs.
        made: dict[str, Sandbox] = {}
        via: dict[str, int] = {}  # sandbox ID -> the apiserver that created it
        for index, client in enumerate(apis):
            placed: set[str] = set()
            for _ in range(12):  # placement is random: enough tries to reach all three
                sb = await _create(client, base_layer, job=job)
                made[sb.id], via[sb.id] = sb, index
                placed.add(node_of(sb.id))
                if placed == nodes:
                    break
            assert placed == nodes, f"apiserver {index} placed creates only on {sorted(placed)}"
        epochs = {node: record.epoch for node, record in (await _registry(iam)).items()}
        assert nodes <= set(epochs)
        for client in apis:  # FnCall goes through placement too, to the edges' warm pools
            calls = await client.fncall_many([{"language": "python", "code": "print(6 * 7)"}] * 6)
            assert [r.stdout if isinstance(r, FnResult) else r for r in calls] == ["42\n"] * 6
        assert {sid: epoch_of(sid) for sid in made} == {sid: epochs[node_of(sid)] for sid in made}

        # 2. An edge dies: its sandboxes fail classified, creates go to the other two.
        victim = "edge2"
        doomed = next(sb for sid, sb in made.items() if node_of(sid) == victim)
        await doomed.write_file("/root/before-kill.txt", "written before the kill\n")
        in_flight = asyncio.create_task(doomed.run_shell("touch /root/started; sleep 1000", timeout=600))
        await eventually(functools.partial(_exists, doomed, "/root/started"), "the command to start")
        cluster.edges[victim].kill()
        for client in apis:
            with pytest.raises(InfraFailure) as lost:
                await client.get(doomed.id)
            assert lost.value.reason == "edge_unreachable", lost.value
        with pytest.raises(InfraFailure) as lost:
            await doomed.run_shell("true")
        assert lost.value.reason == "edge_unreachable", lost.value
        for client in apis:
            for _ in range(3):
                sb = await _create(client, base_layer, job=f"{job}-later")
                assert node_of(sb.id) in nodes - {victim}
            call = await client.fncall({"language": "bash", "code": "echo still"})
            assert call.stdout == "still\n"
        # Once no heartbeat came for NODE_LOST_AFTER_S the cluster declares the node lost: the
        # command cut by the kill, and every later request on its sandboxes, says so.
        with pytest.raises(InfraFailure) as cut:
            await in_flight
        assert cut.value.reason == InfraReason.node_lost and victim in cut.value.message, cut.value
        assert fault_of(cut.value) == "infra"
        for client in apis:
            await eventually(functools.partial(_get_says_lost, client, doomed.id), "the node to be lost")

        # 3. It comes back on the same data directory: same epoch, its sandboxes re-adopted.
        restarted_at = time.time()
        await cluster.start_edge(victim).wait_up()
        record = (await _registry(iam))[victim]
        assert record.epoch == epochs[victim]
        assert record.last_seen >= restarted_at
        for sid in made:
            if node_of(sid) == victim:
                assert (await one.get(sid)).info.state is SandboxState.running
        for client in apis:
            again = await client.get(doomed.id)
            assert again.info.state is SandboxState.running
            assert await again.read_file("/root/before-kill.txt") == b"written before the kill\n"
            assert (await again.run_shell("cat /root/before-kill.txt")).stdout == "written before the kill\n"

        # 4. An apiserver dies: the other serves everything, also what the dead one created.
        first = cluster.apis[0]
        assert first is not None
        first.kill()
        killed_at = time.time()
        from_one = [sid for sid, index in via.items() if index == 0]
        for sid in from_one:
            sb = await two.get(sid)
            assert sb.info.state is SandboxState.running
            assert (await sb.exec(["echo", sid])).stdout == f"{sid}\n"
        stopped = await (await two.get(from_one[0])).stop()
        assert stopped.state is SandboxState.stopped
        for _ in range(3):
            sb = await _create(two, base_layer, job=f"{job}-later")
            assert node_of(sb.id) in nodes

        async def heartbeats_since_the_kill() -> bool:
            seen = await _registry(iam)
            # Two intervals after the kill: a beat already on its way to the dead one does not count.
            return all(seen[node].last_seen > killed_at + 2 * HEARTBEAT_S for node in nodes)

        try:
            await eventually(heartbeats_since_the_kill, "every edge to heartbeat through apiserver 1", 20)
        except AssertionError as exc:
            seen = {node: round(r.last_seen - killed_at, 2) for node, r in (await _registry(iam)).items()}
            raise AssertionError(f"{exc}; last seen, in s after the kill: {seen}") from None

        # 5. One call pauses, resumes or stops a job's sandboxes on every edge.
        labelled = await two.list(labels={"job": job})
        assert {node_of(sb.id) for sb in labelled} == nodes
        paused = await two.pause_all({"job": job})
        assert sorted(i.id for i in paused) == sorted(sb.id for sb in labelled)
        assert {i.state for i in paused} == {SandboxState.paused}
        assert (await labelled[0].run_shell("echo awake")).stdout == "awake\n"  # resumes by itself
        resumed = await two.resume_all({"job": job})
        assert {i.state for i in resumed} == {SandboxState.running} and len(resumed) == len(labelled)
        lease = await two.renew_lease(job, 60)  # every edge answered; none holds a leased sandbox
        assert lease.sandboxes == 0 and lease.unreachable_nodes == []
        ended = await two.stop_all({"job": job})
        assert sorted(info.id for info in ended) == sorted(sb.id for sb in labelled)
        assert {info.state for info in ended} == {SandboxState.stopped}
        assert await two.list(labels={"job": job}) == []
        assert await two.list(labels={"job": f"{job}-later"}) != []  # other jobs untouched
