"""Shared fixtures: a real embedded DSec node (crun, EROFS, overlayfs) for the session.

The node's data directory persists between runs (``DSEC_TEST_DATA_DIR``, default
/var/lib/dsec-test) so the base layer is built once per machine; every sandbox a test creates
is stopped by the fixtures, also when the test fails.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from dsec.backends.container import cgroups
from dsec.density.ksm import KSM
from dsec.density.ksm import users as ksm_users
from dsec.density.swap import SwapConfig, active_swaps
from dsec.images.base import ensure_base_layer
from dsec.images.store import LayerStore
from dsec.node.embedded import EmbeddedNode, NodeConfig
from dsec.sdk.client import DSecClient, Sandbox
from tests.netpolicy.mirror import egress_config

BASE = "debian:bookworm"
DATA_DIR = Path(os.environ.get("DSEC_TEST_DATA_DIR", "/var/lib/dsec-test"))
TEST_SWAP = DATA_DIR / "swap" / "test.swap"


def node_config(tmp: Path, data_dir: Path = DATA_DIR / "node") -> NodeConfig:
    return NodeConfig(
        data_dir=data_dir,
        layer_dir=DATA_DIR / "layers",
        port=0,
        node="test",
        config_file=tmp / "config.json",
        # Pause pushes memory to swap: a small swap file the session's first node turns on and
        # its last close turns off (a node that finds it on uses it and leaves it).
        edge={"reap_interval_s": 0.1, "swap": SwapConfig("file", 1024, TEST_SWAP)},
        # MicroVMs too, under TCG: the KVM probe would cost its deadline on a PVM host.
        microvm=True,
        vm=True,
        microvm_accel="tcg",
        # The session node's kits: a node on a fresh data dir would otherwise build two.
        guest_kit_dir=DATA_DIR / "node" / "guest-kit",
    )


@pytest.fixture(scope="session", autouse=True)
def ksmd_as_found() -> Iterator[None]:
    """Every edge starts the kernel's ksmd if it is stopped, and stops it when it closes with no
    sandbox left; whatever a failed or killed test left, the run ends with ksmd as it began,
    unless a node still claims it (a `dsec up` or another suite beside this one)."""
    run = KSM / "run"
    before = run.read_text().strip() if run.exists() else None
    yield
    if before is not None and run.read_text().strip() != before and not ksm_users():
        run.write_text(before)


@pytest.fixture(scope="session")
def base_layer() -> str:
    with LayerStore(DATA_DIR / "layers") as store:
        ensure_base_layer(store, BASE)
    return BASE


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dsec")


@pytest.fixture(scope="session")
async def node(base_layer: str, session_tmp: Path) -> AsyncIterator[EmbeddedNode]:
    cfg = node_config(session_tmp)
    cfg.edge["egress"] = egress_config()  # permissions naming the mirror of tests/netpolicy
    emb = EmbeddedNode(cfg)
    await emb.start()
    try:
        yield emb
    finally:
        await emb.close(stop_sandboxes=True)
        # The node turned it off if it turned it on; a run killed before that (nobody owns the
        # swap it left on) must not leave it to the next one either.
        if str(TEST_SWAP) in active_swaps():
            await asyncio.to_thread(subprocess.run, ["swapoff", str(TEST_SWAP)], check=True)
    # An edge that stops with no sandboxes leaves no cgroup behind, not even its parent (another
    # node's on the machine, e.g. a `dsec up` beside the suite, is not this one's to count).
    assert list(cgroups.CGROUP_ROOT.glob(f"*/{cgroups.parent_name(cfg.node, cfg.data_dir)}")) == []


@pytest.fixture(scope="session")
async def client(node: EmbeddedNode) -> AsyncIterator[DSecClient]:
    async with DSecClient(node.url, node.api_key) as c:
        yield c


class Sandboxes:
    """Creates sandboxes for one test and stops every one of them afterwards."""

    def __init__(self, client: DSecClient) -> None:
        self.client = client
        self.made: list[Sandbox] = []

    async def __call__(self, **kw: object) -> Sandbox:
        from dsec.sdk.args import DSecContainerRunArgs

        kw.setdefault("container_image", BASE)
        sb = await self.client.run_container(DSecContainerRunArgs(**kw))  # type: ignore[arg-type]
        self.made.append(sb)
        return sb


@pytest.fixture
async def make_sandbox(client: DSecClient) -> AsyncIterator[Sandboxes]:
    boxes = Sandboxes(client)
    try:
        yield boxes
    finally:
        for sb in boxes.made:
            await sb.stop()


@pytest.fixture
async def sandbox(make_sandbox: Sandboxes) -> Sandbox:
    return await make_sandbox()


@pytest.fixture
def host_secret(tmp_path: Path) -> Iterator[Path]:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host only\n")
    yield secret
