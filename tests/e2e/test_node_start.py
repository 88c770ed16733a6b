"""A node that fails to start, or is stopped while it starts, leaves nothing of its own behind
(LXCFS, cgroups, mounts)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.backends.container import cgroups
from dsec.images.mount import mounts_under
from dsec.images.store import LayerStore
from dsec.node.cluster import ApiServerConfig, ClusterApiServer
from dsec.node.embedded import EmbeddedNode
from tests.cluster.harness import free_port
from tests.cluster.hostscan import end_leftovers, node_parents, processes_mentioning
from tests.cluster.procs import Proc
from tests.conftest import node_config
from tests.leaks import own_parents
from tests.support import DSEC, eventually

SECRET = "a-secret-for-the-start-tests"


def _mounts_under(path: Path) -> list[str]:
    return [m.mount_point for m in mounts_under(path)]


async def test_a_node_that_cannot_listen_leaves_nothing_behind(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    with socket.socket() as taken:  # the port the node is told to serve on is someone else's
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = node_config(tmp_path, data_dir=data_dir)
        cfg.port = taken.getsockname()[1]
        cfg.host = "127.0.0.1"
        node = EmbeddedNode(cfg)
        with pytest.raises(OSError):
            await node.start()  # the edge, its LXCFS and its cgroups were up by then
    assert _mounts_under(data_dir) == [], "LXCFS and layer mounts go with the failed start"
    assert own_parents(data_dir) == [], "so do the node's cgroups"


@pytest.fixture
async def apiserver(tmp_path: Path) -> AsyncIterator[str]:
    cfg = ApiServerConfig(SECRET, LayerStore(tmp_path / "api-layers"), str(tmp_path / "iam.sqlite"), port=0)
    server = ClusterApiServer(cfg)
    await server.start()
    try:
        yield server.url
    finally:
        await server.close()


def _edge(tmp_path: Path, apiserver_url: str) -> Proc:
    """``dsec edge`` on a data directory under ``tmp_path``, as a scaler's provider starts it."""
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    argv = [
        DSEC, "edge",
        "--node", "starting",
        "--data-dir", str(tmp_path / "edge"),
        "--port", str(free_port()),
        "--apiserver", apiserver_url,
        "--secret-file", str(secret),
        "--swap", "none", "--fncall-pool-size", "0", "--no-microvm", "--no-vm",
    ]  # fmt: skip
    return Proc("edge", argv, tmp_path / "edge.log")


def _left(tmp_path: Path) -> dict[str, list[str]]:
    found = {
        "mounts": _mounts_under(tmp_path),
        "processes": processes_mentioning(tmp_path),
        "cgroup parents": node_parents("starting", tmp_path / "edge"),  # in every hierarchy
    }
    return {what: items for what, items in found.items() if items}


async def test_an_edge_stopped_while_it_waits_to_register_exits_cleanly(tmp_path: Path) -> None:
    edge = _edge(tmp_path, f"http://127.0.0.1:{free_port()}")  # no apiserver answers there
    try:
        await eventually(lambda: "could not register" in edge.output(), "a failed registration", 60)
        assert edge.terminate() == 0, edge.report()  # SIGTERM's default action: -15
        assert "stopped while starting" in edge.output(), edge.report()
        assert _left(tmp_path) == {}
    finally:
        edge.kill()
        end_leftovers(tmp_path, [cgroups.parent_name("starting", tmp_path / "edge")])


async def test_an_edge_stopped_once_it_started_lxcfs_gives_the_host_back(
    tmp_path: Path, apiserver: str
) -> None:
    # A scaler stopping a node it just started: the SIGTERM comes in the middle of the start
    # (the node is preparing the host) or just after it; either way nothing of it stays.
    edge = _edge(tmp_path, apiserver)
    try:
        pid_file = tmp_path / "edge" / "run" / "lxcfs.pid"
        await eventually(pid_file.exists, "the edge to start LXCFS", 120)
        assert edge.alive(), edge.report()
        assert edge.terminate() == 0, edge.report()
        assert _left(tmp_path) == {}, edge.report()
    finally:
        edge.kill()
        end_leftovers(tmp_path, [cgroups.parent_name("starting", tmp_path / "edge")])
