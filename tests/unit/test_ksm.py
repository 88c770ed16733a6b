"""The ksmd the edge runs: started where it was stopped, claimed by every node using it, stopped
only when DSec started it and the last node using it lets go, and an operator's setting left
alone. Against a directory shaped like /sys/kernel/mm/ksm, then once against the kernel's own."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec import DSecClient, DSecContainerRunArgs
from dsec.density.ksm import KSM, Ksm
from dsec.density.ksm import users as ksm_users
from dsec.edge.journal import Journal
from tests.support import eventually
from tests.unit.conftest import TINY, Nodes


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    j = Journal(tmp_path / "journal.sqlite")
    try:
        yield j
    finally:
        j.close()


def sysfs(tmp_path: Path, run: str, sharing: int = 0) -> Path:
    root = tmp_path / "ksm"
    root.mkdir(exist_ok=True)
    (root / "run").write_text(f"{run}\n")
    (root / "pages_sharing").write_text(f"{sharing}\n")
    return root


def run_of(root: Path) -> str:
    return (root / "run").read_text().strip()


def test_a_stopped_ksmd_is_started_and_stopped_again_by_its_owner(tmp_path: Path, journal: Journal) -> None:
    root = sysfs(tmp_path, "0")
    ksm = Ksm(True, journal, root)
    ksm.ensure()
    assert (run_of(root), ksm.running) == ("1", True)
    ksm.release()
    assert (run_of(root), ksm.running) == ("0", False)


def test_an_edge_restarted_on_its_journal_still_owns_the_ksmd_it_started(
    tmp_path: Path, journal: Journal
) -> None:
    root = sysfs(tmp_path, "0")
    Ksm(True, journal, root).ensure()  # the edge stops with sandboxes left: no release
    again = Ksm(True, journal, root)
    again.ensure()
    assert again.running
    again.release()
    assert run_of(root) == "0"


def test_a_ksmd_found_running_is_used_and_left_running(tmp_path: Path, journal: Journal) -> None:
    root = sysfs(tmp_path, "1")
    ksm = Ksm(True, journal, root)
    ksm.ensure()
    assert ksm.running
    ksm.release()
    assert run_of(root) == "1"


def test_an_operator_who_took_it_over_keeps_it(tmp_path: Path, journal: Journal) -> None:
    root = sysfs(tmp_path, "0")
    Ksm(True, journal, root).ensure()
    (root / "run").write_text("2\n")  # unmerge everything: the operator's call now
    again = Ksm(True, journal, root)
    again.ensure()
    assert not again.running
    (root / "run").write_text("1\n")
    again.release()
    assert run_of(root) == "1"


def test_ksmd_runs_until_the_last_node_using_it_lets_go(tmp_path: Path, journal: Journal) -> None:
    # A `dsec up` beside the test suite: two nodes on one host, one ksmd.
    root = sysfs(tmp_path, "0")
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    a = Ksm(True, journal, root, owner=first)
    a.ensure()
    b = Ksm(True, journal, root, owner=second)
    b.ensure()
    assert b.running and a.other_users() == [str(second.resolve())]
    a.release()  # the node that started it closes first: the other still uses it
    assert run_of(root) == "1"
    b.release()
    assert run_of(root) == "0"


def test_a_claim_whose_data_directory_is_gone_does_not_keep_ksmd(tmp_path: Path, journal: Journal) -> None:
    root = sysfs(tmp_path, "0")
    gone, live = tmp_path / "gone", tmp_path / "live"
    gone.mkdir(), live.mkdir()
    Ksm(True, journal, root, owner=gone).ensure()  # a node that never closed
    gone.rmdir()
    ksm = Ksm(True, journal, root, owner=live)
    ksm.ensure()
    ksm.release()
    assert run_of(root) == "0"


def test_disabled_or_absent_ksm_changes_nothing(tmp_path: Path, journal: Journal) -> None:
    root = sysfs(tmp_path, "0")
    off = Ksm(False, journal, root)
    off.ensure()
    assert (run_of(root), off.running) == ("0", False)
    absent = Ksm(True, journal, tmp_path / "no-ksm")
    absent.ensure()
    absent.release()
    assert not absent.running
    assert absent.stats() == {"running": False, "saved_bytes": 0}


def test_stats_count_the_pages_ksm_saves(tmp_path: Path, journal: Journal) -> None:
    root = sysfs(tmp_path, "1", sharing=256)
    ksm = Ksm(True, journal, root)
    ksm.ensure()
    assert ksm.stats() == {"running": True, "saved_bytes": 256 * os.sysconf("SC_PAGE_SIZE")}


@pytest.fixture
def stopped_ksmd() -> Iterator[None]:
    """The kernel's ksmd stopped for the test, and as it was again afterwards."""
    if not (KSM / "run").exists():
        pytest.skip("the kernel has no KSM (CONFIG_KSM)")
    users = ksm_users()
    if users:  # stopping it would take it from them, and their claim keeps it running at the end
        pytest.skip(f"another node on this machine uses ksmd: {users}")
    before = run_of(KSM)
    (KSM / "run").write_text("0")
    try:
        yield
    finally:
        (KSM / "run").write_text(before)


async def test_an_edge_runs_ksmd_until_it_closes_with_no_sandbox_left(
    stopped_ksmd: None, nodes: Nodes
) -> None:
    node = await nodes.start()
    assert run_of(KSM) == "1" and node.edge.stats()["ksm"]["running"]
    async with DSecClient(node.url, node.api_key, timeout=30) as client:
        await client.run_container(DSecContainerRunArgs(container_image=TINY))

        async def polled() -> dict[str, Any] | None:
            return next((n["ksm"] for n in await client.nodes() if "ksm" in n), None)

        assert (await eventually(polled, "the node's first poll"))["running"] is True  # an operator's view
    await nodes.close(node)  # a restart: the sandbox runs on, and so does ksmd
    assert run_of(KSM) == "1"
    again = await nodes.start()
    assert again.edge.stats()["ksm"]["running"]
    await nodes.close(again, stop_sandboxes=True)
    assert run_of(KSM) == "0"


async def test_an_edge_told_not_to_leaves_ksmd_stopped(stopped_ksmd: None, nodes: Nodes) -> None:
    node = await nodes.start(ksm=False)
    assert run_of(KSM) == "0" and not node.edge.stats()["ksm"]["running"]
