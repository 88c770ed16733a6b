"""A project's layers are bounded by its storage quota (and by every ancestor's).

Imports and commits fill a shared store: without a bound one project (or an agent committing
in a loop) fills it for every other. The quota is set by the parent like the sandbox quotas,
shown in the project's usage, and enforced before anything is stored: a refused import or
commit leaves no blob, no tag and no owner record behind.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from dsec import DSecClient
from dsec.apiserver.projects import sync_storage_quotas
from dsec.images.catalogue import OWNERS
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import Forbidden, InvalidRequest, QuotaExceeded
from tests.conftest import BASE, Sandboxes

KIB = 1 << 10


@dataclass
class Tenant:
    project: str
    client: DSecClient
    boxes: Sandboxes


@pytest.fixture
async def tenants(client: DSecClient, node: EmbeddedNode) -> AsyncIterator[tuple[Tenant, Tenant]]:
    """A project with a 1 MiB storage quota and a sub-project without one (bounded by it),
    a non-admin key each; their sandboxes, tags and projects go at the end (the untagged
    blobs are what `gc` collects, as in test_layer_ownership.py)."""
    tags_before = {r.ref for r in node.store.tags()}
    top = f"root/sq-{uuid.uuid4().hex[:8]}"
    await client.create_project("root", top.rsplit("/", 1)[1], storage_mib=1)
    made: list[Tenant] = []
    try:
        for project in (top, f"{top}/child"):
            if project != top:
                await made[0].client.create_project(top, "child")  # the parent's own key may
            c = DSecClient(node.url, await client.issue_key(project))
            made.append(Tenant(project, c, Sandboxes(c)))
        yield made[0], made[1]
    finally:
        for t in made:
            for sb in t.boxes.made:
                await sb.stop()
            await t.client.close()
        for rec in node.store.tags():
            if rec.ref not in tags_before:
                node.store.untag(rec.ref)
        await client.delete_project(top)
    assert top not in await _mirrored(node)


async def _mirrored(node: EmbeddedNode) -> dict[str, int]:
    return await asyncio.to_thread(node.store.storage_quotas)


def _random_dir(tmp: Path, size: int) -> Path:
    d = tmp / uuid.uuid4().hex
    (d / "opt").mkdir(parents=True)
    (d / "opt/blob").write_bytes(os.urandom(size))  # lz4 stores random bytes as large as they are
    return d


def _store_state(node: EmbeddedNode) -> tuple[list[str], set[str], list[str], list[Path]]:
    s = node.store
    tags = {r.ref for r in s.tags()}
    return s.blobs.list_digests(), tags, s.blobs.list_records(OWNERS), list(s.tmp_dir.iterdir())


def _name() -> str:
    return f"sq-{uuid.uuid4().hex[:8]}"


async def test_imports_count_until_refused_and_the_refusal_leaves_nothing(
    tenants: tuple[Tenant, Tenant], node: EmbeddedNode, tmp_path: Path
) -> None:
    top, _ = tenants
    imported = []
    with pytest.raises(QuotaExceeded) as err:
        for _ in range(10):
            imported.append(await top.client.import_layer(_random_dir(tmp_path, 300 * KIB), f"{_name()}:1"))
    assert len(imported) == 3  # 3 x 300 KiB fit in 1 MiB, the 4th does not
    assert err.value.status == 429 and err.value.reason == "storage_mib"
    assert repr(top.project) in err.value.message and "of 1 MiB in use" in err.value.message

    before = _store_state(node)
    with pytest.raises(QuotaExceeded):
        await top.client.import_layer(_random_dir(tmp_path, 300 * KIB), f"{_name()}:1")
    assert _store_state(node) == before  # no blob, no tag, no owner record, no scratch file

    usage = await top.client.project_usage()
    assert usage["storage_bytes"] == sum(x.size for x in imported)
    (listed,) = [p for p in await top.client.list_projects() if p["id"] == top.project]
    assert listed["quota"]["storage_mib"] == 1 and listed["usage"] == usage


async def test_a_sub_projects_imports_count_against_its_parents_quota(
    tenants: tuple[Tenant, Tenant], tmp_path: Path
) -> None:
    top, child = tenants
    mine = await child.client.import_layer(_random_dir(tmp_path, 600 * KIB), f"{_name()}:1")
    with pytest.raises(QuotaExceeded, match=f"'{top.project}' is at its storage quota"):
        await child.client.import_layer(_random_dir(tmp_path, 600 * KIB), f"{_name()}:1")
    with pytest.raises(QuotaExceeded, match=f"'{top.project}'"):
        await top.client.import_layer(_random_dir(tmp_path, 600 * KIB), f"{_name()}:1")
    assert (await top.client.project_usage())["storage_bytes"] == mine.size
    assert (await top.client.project_usage(child.project))["storage_bytes"] == mine.size
    # The child cannot raise the bound it is under, neither its own quota nor past the parent's.
    with pytest.raises(Forbidden):
        await child.client.set_quota(child.project, storage_mib=100)
    with pytest.raises(InvalidRequest, match="storage_mib"):
        await top.client.set_quota(child.project, storage_mib=2)
    await top.client.set_quota(child.project, storage_mib=1)


async def test_reimporting_identical_bytes_costs_nothing(
    tenants: tuple[Tenant, Tenant], node: EmbeddedNode, tmp_path: Path
) -> None:
    top, child = tenants
    src = _random_dir(tmp_path, 700 * KIB)
    first = await child.client.import_layer(src, f"{_name()}:1")
    # Less than 700 KiB is left under the quota; the same bytes again are already the subtree's.
    again = await top.client.import_layer(src, f"{_name()}:1")
    third = await child.client.import_layer(src, f"{_name()}:1")
    assert first.digest == again.digest == third.digest
    assert (await top.client.project_usage())["storage_bytes"] == first.size
    assert sorted(node.store.catalogue.owners(first.digest)) == [top.project, child.project]


async def test_a_commit_over_the_quota_is_refused_and_leaves_nothing(
    tenants: tuple[Tenant, Tenant], node: EmbeddedNode
) -> None:
    top, _ = tenants
    sb = await top.boxes(container_image=BASE)
    await sb.run_shell("head -c 2097152 /dev/urandom > /opt/big.bin")
    before = _store_state(node)
    with pytest.raises(QuotaExceeded, match=f"'{top.project}' is at its storage quota"):
        await sb.commit(_name())
    assert _store_state(node) == before
    await sb.run_shell("rm /opt/big.bin && echo small > /opt/small.txt")
    layer = await sb.commit(_name())  # what fits is committed, owned and counted
    assert node.store.catalogue.owners(layer.digest) == [top.project]
    assert (await top.client.project_usage())["storage_bytes"] == layer.size


async def test_the_quota_is_validated_mirrored_and_resynced_from_iam(
    tenants: tuple[Tenant, Tenant], client: DSecClient, node: EmbeddedNode
) -> None:
    top, child = tenants
    headers = {"Authorization": f"Bearer {node.api_key}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(node.url, headers=headers) as http:
        # Raw JSON: what a client may send past the SDK's own model.
        for bad in ("-1", str(1 << 41), "1.5", '"lots"', "1e400"):
            body = f'{{"project": "{top.project}", "quota": {{"storage_mib": {bad}}}}}'
            async with http.post("/v1/projects/quota", data=body) as resp:
                answer = await resp.json()
            assert resp.status == 400 and answer["error"]["code"] == "invalid_request", answer
            assert "storage_mib" in answer["error"]["message"], answer
    assert (await _mirrored(node))[top.project] == 1  # nothing half-written
    await client.set_quota(top.project, storage_mib=3)
    assert (await _mirrored(node))[top.project] == 3
    # A mirror that lost a change (an apiserver died between IAM and the store) is rebuilt from
    # IAM when an apiserver starts.
    node.store.set_storage_quota(top.project, None)
    node.store.set_storage_quota(child.project, 1)
    await sync_storage_quotas(node.iam, node.store)
    mirrored = await _mirrored(node)
    assert mirrored[top.project] == 3 and child.project not in mirrored
