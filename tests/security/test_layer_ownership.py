"""Layers belong to projects: another project's layers, tags and digests are not usable.

A project's committed layer holds its sandbox's state (``commit``, ``fork``): knowing its
digest or its tag must not let another project list it, start a sandbox on it, or take, move
or delete its tags. Imports cannot smuggle a device node or a file capability into a layer
that later sandboxes mount, nor fill the store from a small upload.
"""

from __future__ import annotations

import gzip
import io
import tarfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec import DSecClient, LayerNotFound
from dsec.apiserver.layer_access import LayerLimits
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import Conflict, Forbidden, TooLarge
from tests.conftest import BASE, Sandboxes

# VFS_CAP_REVISION_2 with cap_net_raw (bit 13) permitted and effective.
_CAP_NET_RAW = bytes.fromhex("0100000200200000000000000000000000000000")


@dataclass
class Tenant:
    project: str
    client: DSecClient
    boxes: Sandboxes


@pytest.fixture
async def tenants(client: DSecClient, node: EmbeddedNode) -> AsyncIterator[tuple[Tenant, Tenant]]:
    """Two sibling projects with a non-admin key each; their sandboxes, tags and projects go
    at the end (the untagged blobs are what `gc` collects)."""
    made: list[Tenant] = []
    tags_before = {r.ref for r in node.store.tags()}
    try:
        for side in ("a", "b"):
            name = f"lo-{side}-{uuid.uuid4().hex[:8]}"
            await client.create_project("root", name)
            key = await client.issue_key(f"root/{name}")
            tenant_client = DSecClient(node.url, key)
            made.append(Tenant(f"root/{name}", tenant_client, Sandboxes(tenant_client)))
        yield made[0], made[1]
    finally:
        for t in made:
            for sb in t.boxes.made:
                await sb.stop()
            await t.client.close()
        for rec in node.store.tags():
            if rec.ref not in tags_before:
                node.store.untag(rec.ref)
        for t in made:
            await client.delete_project(t.project)


def _dir(tmp: Path, text: str) -> Path:
    d = tmp / uuid.uuid4().hex
    (d / "opt").mkdir(parents=True)
    (d / "opt/v.txt").write_text(text)
    return d


async def test_another_projects_committed_layer_is_invisible(
    tenants: tuple[Tenant, Tenant], client: DSecClient
) -> None:
    a, b = tenants
    sb = await a.boxes(container_image=BASE)
    await sb.run_shell("echo a-secret > /opt/state.txt")
    layer = await sb.commit(f"lo-state-{uuid.uuid4().hex[:8]}")
    (tag,) = layer.names

    assert layer.digest not in {x.digest for x in await b.client.layers()}
    assert not {tag} & {n for x in await b.client.layers() for n in x.names}
    for ref in (layer.digest, layer.digest[7:19], tag):
        with pytest.raises(LayerNotFound):
            await b.boxes(container_image=None, layers=[BASE, ref])
        with pytest.raises(LayerNotFound):
            await b.client.verify_layer(ref)

    # The owner, and a key above it (root's admin key), use it by digest, prefix and tag.
    assert layer.digest in {x.digest for x in await a.client.layers()}
    assert layer.digest in {x.digest for x in await client.layers()}
    for ref in (layer.digest, layer.digest[7:19], tag):
        mine = await a.boxes(container_image=None, layers=[BASE, ref])
        assert (await mine.run_shell("cat /opt/state.txt")).stdout == "a-secret\n"
        await mine.stop()


async def test_tags_cannot_be_taken_moved_or_deleted_by_another_project(
    tenants: tuple[Tenant, Tenant], tmp_path: Path
) -> None:
    a, b = tenants
    name = f"lo-tag-{uuid.uuid4().hex[:8]}"
    src = _dir(tmp_path, "a")
    one = await a.client.import_layer(src, f"{name}:1")
    two = await a.client.import_layer(_dir(tmp_path, "a2"), f"{name}-next:1")
    theirs = await b.client.import_layer(_dir(tmp_path, "b"), f"lo-b-{uuid.uuid4().hex[:8]}:1")

    with pytest.raises(Conflict):
        await b.client.retag(f"{name}:1", theirs.digest)
    with pytest.raises(LayerNotFound):
        await b.client.untag(f"{name}:1")
    with pytest.raises(Conflict):  # the same bytes do not hand over the tag either
        await b.client.import_layer(src, f"{name}:1")
    with pytest.raises(Conflict):  # nor a new version under A's name
        await b.client.import_layer(_dir(tmp_path, "b2"), f"{name}:2")
    with pytest.raises(LayerNotFound):  # nor pointing a tag of B's at A's layer
        await b.client.retag(f"lo-b-{uuid.uuid4().hex[:8]}:1", one.digest)
    # Bringing the same bytes makes B an owner of the content, never of A's tag (nor shows it).
    copy = await b.client.import_layer(src, f"lo-b-copy-{uuid.uuid4().hex[:8]}:1")
    assert copy.digest == one.digest  # stored once, and A's tag on it is not shown to B:
    assert len(copy.names) == 1 and not copy.names[0].startswith(name)
    assert [x.digest for x in await a.client.retag(f"{name}:1", one.digest)] == [one.digest]

    # A, with no admin key, moves and removes its own tags.
    assert [x.digest for x in await a.client.retag(f"{name}:1", two.digest)] == [two.digest]
    assert await a.client.untag(f"{name}:1") == [two.digest]


async def test_public_layers_serve_every_project_and_only_admins_publish(
    tenants: tuple[Tenant, Tenant], client: DSecClient, tmp_path: Path
) -> None:
    a, b = tenants
    for t in (a, b):  # the base layer `dsec base` builds is public
        assert BASE in {n for x in await t.client.layers() for n in x.names}
        assert (await (await t.boxes(container_image=BASE)).run_shell("echo ok")).stdout == "ok\n"
    tool = await a.client.import_layer(_dir(tmp_path, "shared tool"), f"lo-pub-{uuid.uuid4().hex[:8]}:1")
    with pytest.raises(Forbidden):
        await a.client.mark_public(tool.names[0])
    with pytest.raises(LayerNotFound):
        await b.boxes(container_image=None, layers=[BASE, tool.digest])
    await client.mark_public(tool.names[0])
    for ref in (tool.digest, tool.names[0]):
        sb = await b.boxes(container_image=None, layers=[BASE, ref])
        assert (await sb.run_shell("cat /opt/v.txt")).stdout == "shared tool"
    with pytest.raises(LayerNotFound):  # public to use, still A's to delete
        await b.client.untag(tool.names[0])


def _leftovers(node: EmbeddedNode) -> tuple[set[str], set[str], set[str]]:
    return (
        {p.name for p in node.store.tmp_dir.iterdir()},
        set(node.store.blobs.list_digests()),
        {r.ref for r in node.store.tags()},
    )


async def test_an_oversized_upload_is_refused_and_leaves_nothing(
    tenants: tuple[Tenant, Tenant], node: EmbeddedNode, tmp_path: Path
) -> None:
    _, b = tenants
    big = tmp_path / "big"
    (big / "opt").mkdir(parents=True)
    (big / "opt/blob").write_bytes(uuid.uuid4().bytes * (3 << 16))  # 3 MiB
    before = _leftovers(node)
    saved = node.api.layer_limits
    node.api.layer_limits = LayerLimits(max_upload_bytes=1 << 20)  # the operator's cap, lowered
    try:
        with pytest.raises(TooLarge, match="cap"):
            await b.client.import_layer(big, f"lo-big-{uuid.uuid4().hex[:8]}:1")
    finally:
        node.api.layer_limits = saved
    assert _leftovers(node) == before


async def test_a_gzip_bomb_is_stopped_and_leaves_nothing(
    tenants: tuple[Tenant, Tenant], node: EmbeddedNode, tmp_path: Path
) -> None:
    _, b = tenants
    bomb = tmp_path / "bomb.tar.gz"
    zeros = 256 << 20
    with gzip.open(bomb, "wb", compresslevel=9) as gz, tarfile.open(fileobj=gz, mode="w|") as tf:
        info = tarfile.TarInfo("zeros")
        info.size = zeros
        tf.addfile(info, _Zeros(zeros))
    assert bomb.stat().st_size < 1 << 20  # about 254 KiB that would expand to 256 MiB
    before = _leftovers(node)
    with pytest.raises(TooLarge, match="expands to more than"):
        await b.client.import_layer(bomb, f"lo-bomb-{uuid.uuid4().hex[:8]}:1")
    assert _leftovers(node) == before


class _Zeros(io.RawIOBase):
    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        n = min(len(buf), self.left)
        buf[:n] = bytes(n)
        self.left -= n
        return n


async def test_device_nodes_and_file_capabilities_are_stripped_at_import(
    tenants: tuple[Tenant, Tenant], tmp_path: Path
) -> None:
    _, b = tenants
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, dev in (("opt/mem", tarfile.CHRTYPE, (1, 1)), ("opt/disk", tarfile.BLKTYPE, (8, 0))):
            node_info = tarfile.TarInfo(name)
            node_info.type, (node_info.devmajor, node_info.devminor), node_info.mode = kind, dev, 0o666
            tf.addfile(node_info)
        ping = tarfile.TarInfo("opt/ping")
        data = b"#!/bin/sh\necho pong\n"
        ping.size, ping.mode = len(data), 0o755
        ping.pax_headers = {
            "SCHILY.xattr.security.capability": _CAP_NET_RAW.decode("utf-8", "surrogateescape"),
            "SCHILY.xattr.user.note": "kept",
        }
        tf.addfile(ping, io.BytesIO(data))
    layer = await b.client.import_layer(archive, f"lo-evil-{uuid.uuid4().hex[:8]}:1")
    sb = await b.boxes(container_image=None, layers=[BASE, layer.digest])
    probe = (
        "import os; print(sorted(os.listdir('/opt'))); p='/opt/ping'; "
        "print(sorted(os.listxattr(p))); print(os.getxattr(p, 'user.note'))"
    )
    out = (await sb.exec(["python3", "-c", probe])).stdout.splitlines()
    assert out == ["['ping']", "['user.note']", "b'kept'"]
    assert (await sb.run_shell("/opt/ping")).stdout == "pong\n"
