"""Tags move only when asked; garbage collection frees what nothing names or uses."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from dsec import DSecClient, InvalidRequest, LayerNotFound
from dsec.node.embedded import EmbeddedNode
from tests.conftest import BASE, Sandboxes


def _dir(tmp: Path, text: str) -> Path:
    d = tmp / uuid.uuid4().hex
    (d / "opt").mkdir(parents=True)
    (d / "opt" / "v.txt").write_text(text)
    return d


async def test_versions_are_immutable_and_move_only_by_retag(client: DSecClient, tmp_path: Path) -> None:
    ref = f"tool:{uuid.uuid4().hex[:10]}"
    one = await client.import_layer(_dir(tmp_path, "one"), ref)
    with pytest.raises(InvalidRequest, match="immutable"):
        await client.import_layer(_dir(tmp_path, "two"), ref)
    two = await client.import_layer(_dir(tmp_path, "two"), f"tool-next:{uuid.uuid4().hex[:10]}")
    moved = await client.retag(ref, two.digest)
    assert [x.digest for x in moved] == [two.digest] != [one.digest]
    await client.untag(ref)
    with pytest.raises(LayerNotFound):
        await client.verify_layer(ref)


async def test_gc_never_removes_a_layer_in_use(
    client: DSecClient, make_sandbox: Sandboxes, node: EmbeddedNode, tmp_path: Path
) -> None:
    ref = f"gc-test:{uuid.uuid4().hex[:10]}"
    info = await client.import_layer(_dir(tmp_path, "gc"), ref)
    sb = await make_sandbox(container_image=None, layers=[BASE, ref])
    await client.untag(ref)  # now only the running sandbox holds it
    assert info.digest not in await client.gc_layers(grace_s=0)
    assert (await sb.run_shell("cat /opt/v.txt")).stdout == "gc"
    assert (await client.verify_layer(info.digest)).digest == info.digest
    await sb.stop()
    assert info.digest in await client.gc_layers(grace_s=0)
    with pytest.raises(LayerNotFound):
        await client.verify_layer(info.digest)
    assert (await client.verify_layer(BASE)).names  # tagged layers stay
    assert node.store.has_tag(BASE)
