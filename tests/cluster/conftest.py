"""Fixtures for the cluster-on-one-machine tests: PostgreSQL, network namespaces, the cluster.

Teardown runs in the reverse order of setup, also after a failure: the cluster (sandboxes
stopped through the API, edges SIGTERMed, apiservers ended), then the namespaces, then the
leak check against a snapshot taken before anything started. PostgreSQL lives for the session.
A machine that cannot make namespaces fails these tests; they are never skipped.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from dsec.iam import IamStore, open_iam_store
from dsec.images.base import TOOLCHAIN_PACKAGES, TOOLCHAIN_REF, ensure_base_layer
from dsec.images.mount import mounts_under
from dsec.images.store import LayerStore
from tests import leaks
from tests.conftest import DATA_DIR
from tests.iam.pgserver import PgServer, running_pg_server

from . import hostscan, netns
from .harness import NODES, Cluster, forget_earlier_nodes, seed_shared_store


@pytest.fixture(scope="session")
def cluster_pg() -> Iterator[PgServer]:
    with running_pg_server() as server:
        yield server


def _workdirs(data_dir: Path) -> list[str]:
    found = leaks.snapshot(data_dir)["workdirs"]
    assert isinstance(found, list)
    return [str(w) for w in found]


def _mounts_at(path: str | Path) -> int:
    """How many mounts are stacked at ``path`` (mount point: /proc/self/mountinfo's field 5)."""
    with open("/proc/self/mountinfo") as f:
        return sum(1 for line in f if line.split()[4] == str(path))


@pytest.fixture
def no_host_leaks(tmp_path: Path) -> Iterator[None]:
    """Nothing of the cluster may be left on the host: what is provably ours first (named),
    then tests/leaks.py's host-wide snapshot, as the other real-runtime tests check it."""
    # (os.path.ismount cannot tell: `ip netns` bind-mounts the directory onto itself.)
    netns_dir_mounts = _mounts_at(netns.NETNS_DIR)
    before = leaks.snapshot(tmp_path)
    mounts, procs = hostscan.mount_table(), hostscan.sandbox_processes()
    yield
    after = leaks.snapshot(tmp_path)
    # `ip netns add` makes /run/netns a mount point of its own once per boot, for good.
    after["mounts"] = int(str(after["mounts"])) - (_mounts_at(netns.NETNS_DIR) - netns_dir_mounts)
    edge_dirs = sorted((tmp_path / "edges").glob("*"))
    ours = {
        "mounts under the test's directory": [m.mount_point for m in mounts_under(tmp_path)],
        "cgroups of the cluster's sandboxes": hostscan.sandbox_cgroups(NODES),
        "processes naming the test's directory": hostscan.processes_mentioning(tmp_path),
        "sandbox work directories": [f"{d.name}/{w}" for d in edge_dirs for w in _workdirs(d)],
    }
    assert {k: v for k, v in ours.items() if v} == {}
    # Host-wide: exact when this suite runs alone; the lists say whose a difference is.
    now = hostscan.mount_table()
    assert after == before, (
        f"mounts added {sorted(now - mounts)}, gone {sorted(mounts - now)};"
        f" sandbox processes added {sorted(hostscan.sandbox_processes() - procs)}"
    )


@pytest.fixture
def namespaces(no_host_leaks: None) -> Iterator[list[netns.Netns]]:
    spaces = netns.plan(len(NODES))
    netns.create_all(spaces)
    inodes = [hostscan.netns_inode(ns.path) for ns in spaces]
    try:
        yield spaces
    finally:
        # Whatever still runs in a namespace was started by this test (an edge's child that
        # outlived it): end it by PID, delete the namespaces, then fail.
        stray = hostscan.processes_in_netns(inodes)
        described = [f"{pid} {hostscan.cmdline(pid)}" for pid in stray]
        for pid in stray:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        left = netns.delete_all(spaces)
        assert described == [], f"processes left in the cluster's namespaces: {described}"
        assert left == [], f"network namespaces or links left behind: {left}"


@pytest.fixture
async def iam(cluster_pg: PgServer) -> AsyncIterator[IamStore]:
    store = await open_iam_store(cluster_pg.dsn)
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
async def admin_key(iam: IamStore) -> str:
    return await iam.issue_key(admin=True, name="cluster test")


@pytest.fixture
async def cluster(
    base_layer: str,
    cluster_pg: PgServer,
    namespaces: list[netns.Netns],
    admin_key: str,
    tmp_path: Path,
) -> AsyncIterator[Cluster]:
    await forget_earlier_nodes(cluster_pg.dsn)
    seed_shared_store(tmp_path / "shared-layers", base_layer)
    with LayerStore(DATA_DIR / "layers") as store:  # each edge keeps a one-sandbox FnCall pool
        ensure_base_layer(store, TOOLCHAIN_REF, packages=TOOLCHAIN_PACKAGES)
    seed_shared_store(tmp_path / "shared-layers", TOOLCHAIN_REF)
    c = Cluster(tmp_path, namespaces, cluster_pg.dsn, tmp_path / "shared-layers", admin_key)
    try:
        await c.start()
        yield c
    finally:
        problems = await c.close()
        print(c.reports())  # pytest shows it only when something failed
        assert problems == [], "\n".join(problems)
