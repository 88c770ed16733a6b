"""The store's side of layer ownership and of what an import may carry in.

The apiserver passes each key's viewer (tests/security/test_layer_ownership.py drives the
routes); here the store's rules are checked directly, and the commit path's directory import,
whose staging copy shares inodes with the running sandbox.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dsec.iam.base import in_subtree
from dsec.images.mounts import LayerMounts
from dsec.images.oci import import_oci
from dsec.images.owners import Viewer
from dsec.images.store import LayerStore
from dsec.protocol.errors import Conflict, LayerNotFound, TooLarge

from .conftest import _CAP_NET_RAW
from .ocikit import F, layer, oci_layout, tar_dir


def sees(project: str) -> Viewer:
    return lambda owner: in_subtree(owner, project)


def _tree(root: Path, text: str) -> Path:
    (root / "opt").mkdir(parents=True)
    (root / "opt/v.txt").write_text(text)
    return root


def test_a_layer_is_seen_by_its_owners_subtree_only(store: LayerStore, tmp_path: Path) -> None:
    a, child, b = sees("root/a"), sees("root/a/job"), sees("root/b")
    info = store.import_path(_tree(tmp_path / "s", "a"), "a-tool:1", owner="root/a/job", viewer=child)
    for viewer in (a, child, None):  # the owner, a project above it, and the node itself
        assert store.resolve(info.digest, viewer=viewer).digest == info.digest
        assert info.digest in {x.digest for x in store.list(viewer=viewer)}
    for ref in (info.digest, info.digest[7:19], "a-tool:1", "a-tool"):
        with pytest.raises(LayerNotFound) as err:
            store.resolve_image(ref, viewer=b)
        # Not even the versions of the name leak ("known versions", "a version is required").
        assert "a-tool:1" not in err.value.message.replace(repr(ref), "")
    assert store.list(viewer=b) == []
    store.mark_public("a-tool:1")
    assert store.resolve("a-tool:1", viewer=b).digest == info.digest
    assert store.resolve(info.digest, viewer=b).names == ["a-tool:1"]
    with pytest.raises(LayerNotFound):  # public to use, not to remove
        store.untag("a-tool:1", viewer=b)


def test_a_name_stays_with_the_project_that_took_it(store: LayerStore, tmp_path: Path) -> None:
    a, b = sees("root/a"), sees("root/b")
    src = _tree(tmp_path / "s", "a")
    store.import_path(src, "name:1", owner="root/a", viewer=a)
    with pytest.raises(Conflict):
        store.import_path(src, "name:1", owner="root/b", viewer=b)
    with pytest.raises(Conflict):
        store.import_path(_tree(tmp_path / "t", "b"), "name:2", owner="root/b", viewer=b)
    assert store.catalogue.get("name", "1").owner == "root/a"  # type: ignore[union-attr]
    assert store.catalogue.versions("name") == ["1"]


def test_legacy_layers_are_the_root_projects(store: LayerStore, tmp_path: Path) -> None:
    info = store.import_path(_tree(tmp_path / "s", "old"), "old:1")  # as before owners existed
    assert store.resolve("old:1", viewer=sees("root")).digest == info.digest
    with pytest.raises(LayerNotFound):
        store.resolve(info.digest, viewer=sees("root/a"))


def test_a_commit_strips_devices_and_capabilities_without_touching_the_sandbox(
    store: LayerStore, layer_mounts: LayerMounts, tmp_path: Path
) -> None:
    upper = tmp_path / "upper"  # the sandbox's upper directory
    (upper / "bin").mkdir(parents=True)
    ping = upper / "bin/ping"
    ping.write_bytes(b"#!/bin/sh\n")
    os.setxattr(ping, "security.capability", _CAP_NET_RAW)
    os.mknod(upper / "disk", stat.S_IFBLK | 0o600, os.makedev(8, 0))
    os.mknod(upper / "gone", stat.S_IFCHR, os.makedev(0, 0))  # a deletion: must stay
    staging = tmp_path / "staging"  # what the edge packs: hard links into the upper
    (staging / "bin").mkdir(parents=True)
    for name in ("bin/ping", "disk", "gone"):
        os.link(upper / name, staging / name)
    mtime = os.stat(staging).st_mtime_ns

    info = store.import_path(staging, "packed:1", owner="root/a")
    mnt = layer_mounts.acquire(info.digest, store.blob_path(info.digest))
    assert sorted(os.listdir(mnt)) == ["bin", "gone"]
    assert os.listxattr(mnt / "bin/ping") == [] and (mnt / "bin/ping").read_bytes() == b"#!/bin/sh\n"
    assert os.getxattr(ping, "security.capability") == _CAP_NET_RAW  # the sandbox's file as it was
    assert (upper / "disk").exists() and os.stat(staging).st_mtime_ns == mtime


@pytest.mark.parametrize("compression", ["gzip", "tar"])
def test_an_image_layer_past_the_expansion_cap_is_refused_and_leaves_nothing(
    store: LayerStore, tmp_path: Path, compression: str
) -> None:
    zeros = layer(F("zeros", bytes(4 << 20)))  # gzip makes 4 MiB of zeros about 4 KiB
    archive = tar_dir(oci_layout(tmp_path / "oci", [zeros], compression), tmp_path / "oci.tar")
    with pytest.raises(TooLarge, match="more than"):
        import_oci(store, archive, "bomb:1", owner="root/a", viewer=sees("root/a"), max_bytes=1 << 20)
    assert list(store.tmp_dir.iterdir()) == [] and store.blobs.list_digests() == []
    assert store.tags() == []
    (info,) = import_oci(store, archive, "bomb:1", owner="root/a", viewer=sees("root/a"), max_bytes=8 << 20)
    assert [x.digest for x in store.resolve_image("bomb:1", viewer=sees("root/a"))] == [info.digest]
