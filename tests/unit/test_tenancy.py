"""Projects, quotas and visibility through the API (fake backend: the control plane only)."""

from __future__ import annotations

import asyncio

import pytest

from dsec import (
    DSecClient,
    DSecContainerRunArgs,
    DSecError,
    InvalidRequest,
    QuotaExceeded,
    SandboxNotFound,
    SandboxState,
)
from dsec.node.embedded import EmbeddedNode
from dsec.sdk.client import Sandbox
from tests.support import eventually

from .conftest import TINY

ARGS = DSecContainerRunArgs(container_image=TINY, cpu_cores_limit=0.5, memory_limit_mb=64)


async def team_client(admin: DSecClient, node: EmbeddedNode, name: str, **quota: float) -> DSecClient:
    await admin.create_project("root", name, **quota)  # type: ignore[arg-type]
    key = await admin.issue_key(f"root/{name}")
    return await DSecClient(node.url, key).open()


async def test_quota_bounds_a_project_and_frees_on_stop(client: DSecClient, node: EmbeddedNode) -> None:
    team = await team_client(client, node, "team", sandboxes=2)
    try:
        a = await team.run_container(ARGS)
        await team.run_container(ARGS)
        with pytest.raises(QuotaExceeded, match="root/team") as err:
            await team.run_container(ARGS)
        assert err.value.reason == "sandboxes"
        await a.stop()
        c = await team.run_container(ARGS)  # the stop gave the slot back
        assert c.info.project == "root/team" and c.info.labels == {}
        usage = await team.project_usage()
        assert usage["sandboxes"] == 2
        for sb in await team.list():
            await sb.stop()
    finally:
        await team.close()


async def test_keys_see_only_their_subtree(client: DSecClient, node: EmbeddedNode) -> None:
    mine = await client.run_container(ARGS)  # the admin's, in root
    team = await team_client(client, node, "seers", sandboxes=5)
    try:
        theirs = await team.run_container(ARGS)
        assert [s.id for s in await team.list()] == [theirs.id]
        with pytest.raises(SandboxNotFound):
            await team.get(mine.id)
        with pytest.raises(SandboxNotFound):  # not even by knowing the ID
            await Sandbox(team._t, mine.info).run_shell("true")
        assert theirs.id in {s.id for s in await client.list()}  # root sees its subtree
        with pytest.raises(DSecError):
            await team.create_project("root", "escape")  # not under its own project
        with pytest.raises(DSecError):
            await team.create_project("root/seers", "greedy", sandboxes=50)  # above its parent
        await team.create_project("root/seers", "rollout-1", sandboxes=1)
        with pytest.raises(InvalidRequest, match=r"dsec\."):
            await team.run_container(ARGS.model_copy(update={"labels": {"dsec.project": "root"}}))
        await theirs.stop()
    finally:
        await team.close()
        await mine.stop()


async def test_concurrent_creates_never_overshoot(client: DSecClient, node: EmbeddedNode) -> None:
    team = await team_client(client, node, "burst", sandboxes=3)
    try:
        results = await asyncio.gather(*(team.run_container(ARGS) for _ in range(10)), return_exceptions=True)
        made = [r for r in results if not isinstance(r, BaseException)]
        assert len(made) == 3
        assert all(isinstance(r, QuotaExceeded) for r in results if isinstance(r, BaseException))
        for sb in made:
            await sb.stop()
    finally:
        await team.close()


async def test_reaped_sandboxes_give_their_quota_back(client: DSecClient, node: EmbeddedNode) -> None:
    team = await team_client(client, node, "reaped", sandboxes=1)
    try:
        sb = await team.run_container(ARGS.model_copy(update={"max_lifetime_s": 0.2}))

        async def gone() -> bool:
            return (await team.get(sb.id)).info.state is SandboxState.stopped

        await eventually(gone, "the edge to reap the sandbox")
        await node.api.tenancy.reconcile(node.api.edges, grace_s=0)  # what the periodic loop does
        again = await team.run_container(ARGS)
        await again.stop()
    finally:
        await team.close()
