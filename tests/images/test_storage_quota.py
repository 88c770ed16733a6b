"""The store's side of per-project storage quotas (dsec.images.storage_quota).

The apiserver mirrors IAM's ``storage_mib`` into the store (tests/security/
test_layer_storage_quota.py drives that through the routes); here the quotas are set on the
store directly and the charge is checked at each import path: tar, directory (commits), OCI.
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from dsec.iam.base import in_subtree
from dsec.images.catalogue import OWNERS
from dsec.images.oci import import_oci
from dsec.images.owners import Viewer
from dsec.images.store import LayerStore
from dsec.protocol.errors import QuotaExceeded

from .ocikit import F, layer, oci_layout, tar_dir

KIB = 1 << 10


def sees(project: str) -> Viewer:
    return lambda owner: in_subtree(owner, project)


def _tree(root: Path, size: int, seed: bytes = b"") -> Path:
    """A directory of ``size`` random bytes (lz4 leaves them as large as they are)."""
    (root / "opt").mkdir(parents=True)
    (root / "opt/blob").write_bytes(seed + os.urandom(size))
    return root


def _state(store: LayerStore) -> tuple[list[str], list[str], list[str], list[Path]]:
    """Everything an import could leave behind: blobs, tags, owner records, scratch files."""
    return (
        store.blobs.list_digests(),
        [t.ref for t in store.tags()],
        store.blobs.list_records(OWNERS),
        sorted(store.tmp_dir.iterdir()),
    )


def test_imports_are_charged_until_refused_and_a_refusal_leaves_nothing(
    store: LayerStore, tmp_path: Path
) -> None:
    store.set_storage_quota("root/q", 1)
    q = sees("root/q")
    imported = 0
    with pytest.raises(QuotaExceeded) as err:
        for i in range(10):
            store.import_path(_tree(tmp_path / f"s{i}", 300 * KIB), f"t:{i}", owner="root/q", viewer=q)
            imported += 1
    assert imported == 3  # 3 x 300 KiB fit in 1 MiB, the 4th does not
    assert err.value.reason == "storage_mib" and err.value.status == 429
    assert "'root/q'" in err.value.message and "of 1 MiB in use" in err.value.message
    used = store.storage_usage(["root/q"])["root/q"]
    assert 900 * KIB < used <= 1 << 20
    before = _state(store)
    with pytest.raises(QuotaExceeded):  # the same refusal again changes nothing in the store
        store.import_path(_tree(tmp_path / "again", 300 * KIB), "t:9", owner="root/q", viewer=q)
    assert _state(store) == before and before[3] == []
    assert len(before[0]) == 3 and before[1] == ["t:0", "t:1", "t:2"]
    store.set_storage_quota("root/q", None)  # no quota: only the caps apply
    store.import_path(_tree(tmp_path / "free", 300 * KIB), "t:9", owner="root/q", viewer=q)


def test_a_sub_projects_layers_count_against_every_ancestor_with_a_quota(
    store: LayerStore, tmp_path: Path
) -> None:
    store.set_storage_quota("root/p", 1)
    store.set_storage_quota("root/p/d", 4)  # above its parent's: the parent still bounds it
    store.import_path(_tree(tmp_path / "c", 600 * KIB), "c:1", owner="root/p/c", viewer=sees("root/p/c"))
    with pytest.raises(QuotaExceeded, match="'root/p' is at its storage quota"):
        store.import_path(_tree(tmp_path / "d", 600 * KIB), "d:1", owner="root/p/d", viewer=sees("root/p/d"))
    usage = store.storage_usage(["root/p", "root/p/c", "root/p/d", "root/x"])
    assert usage["root/p"] == usage["root/p/c"] > 600 * KIB
    assert usage["root/p/d"] == usage["root/x"] == 0
    assert store.storage_limits("root/p/d/e") == [("root/p/d", 4 << 20), ("root/p", 1 << 20)]


def test_bytes_the_subtree_owns_already_cost_nothing_others_bytes_cost_in_full(
    store: LayerStore, tmp_path: Path
) -> None:
    store.set_storage_quota("root/p", 1)
    store.set_storage_quota("root/o", 1)
    src = _tree(tmp_path / "s", 700 * KIB)
    first = store.import_path(src, "x:1", owner="root/p/c", viewer=sees("root/p/c"))
    # Identical bytes from a sibling under the same quota: stored once, owned twice, counted once.
    again = store.import_path(src, "y:1", owner="root/p/d", viewer=sees("root/p/d"))
    assert again.digest == first.digest and len(store.blobs.list_digests()) == 1
    assert sorted(store.catalogue.owners(first.digest)) == ["root/p/c", "root/p/d"]
    assert store.storage_usage(["root/p"])["root/p"] == first.size
    # Another subtree bringing the same bytes becomes an owner: it pays the full size.
    store.import_path(src, "z:1", owner="root/o", viewer=sees("root/o"))
    assert store.storage_usage(["root/o"])["root/o"] == first.size
    with pytest.raises(QuotaExceeded, match="'root/o'"):
        store.import_path(_tree(tmp_path / "t", 700 * KIB), "z:2", owner="root/o", viewer=sees("root/o"))


def test_a_commit_directory_import_is_charged_like_an_upload(store: LayerStore, tmp_path: Path) -> None:
    store.set_storage_quota("root/q", 0)
    before = _state(store)
    with pytest.raises(QuotaExceeded, match=r"0\.00 MiB of 0 MiB in use"):
        store.import_path(_tree(tmp_path / "s", 10 * KIB), "dsec-fork/x:1", owner="root/q")
    assert _state(store) == before


def test_split_layers_count_their_meta_and_data_blobs(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store", layout="split")
    store.set_storage_quota("root/q", 1)
    info = store.import_path(_tree(tmp_path / "s", 400 * KIB), "s:1", owner="root/q")
    assert info.data_digest is not None
    assert store.storage_usage(["root/q"])["root/q"] == store.layer_bytes(info.digest) == info.size
    assert info.size > 400 * KIB  # the data blob holds the file's bytes as they are
    before = _state(store)
    with pytest.raises(QuotaExceeded):
        store.import_path(_tree(tmp_path / "t", 700 * KIB), "s:2", owner="root/q")
    assert _state(store) == before


def test_an_archive_stops_expanding_at_the_quota(store: LayerStore, tmp_path: Path) -> None:
    store.set_storage_quota("root/q", 1)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:  # 64 MiB of zeros, gzip: about 64 KiB
        info = tarfile.TarInfo("zeros")
        info.size = 64 << 20
        tf.addfile(info, io.BytesIO(bytes(info.size)))
    bomb = tmp_path / "bomb.tar.gz"
    bomb.write_bytes(gzip.compress(buf.getvalue(), 1))
    before = _state(store)
    # The import cap alone (64 MiB + headers) would let it expand whole; the quota stops it.
    with pytest.raises(QuotaExceeded, match="expands past the whole quota") as err:
        store.import_path(bomb, "bomb:1", owner="root/q", max_bytes=65 << 20)
    assert err.value.reason == "storage_mib" and "'root/q'" in err.value.message
    assert _state(store) == before


def test_an_oci_image_is_charged_for_the_layers_it_brings(store: LayerStore, tmp_path: Path) -> None:
    store.set_storage_quota("root/q", 1)
    big = layer(F("opt/blob", os.urandom(700 * KIB)))
    archive = tar_dir(oci_layout(tmp_path / "oci", [big], "gzip"), tmp_path / "oci.tar")
    (info,) = import_oci(store, archive, "img:1", owner="root/q", viewer=sees("root/q"))
    assert store.storage_usage(["root/q"])["root/q"] == info.size
    # Importing the same image again under another name costs nothing: the subtree owns it.
    import_oci(store, archive, "img:2", owner="root/q", viewer=sees("root/q"))
    other = layer(F("opt/other", os.urandom(700 * KIB)))
    archive2 = tar_dir(oci_layout(tmp_path / "oci2", [other], "gzip"), tmp_path / "oci2.tar")
    with pytest.raises(QuotaExceeded, match="'root/q'"):
        import_oci(store, archive2, "img:3", owner="root/q", viewer=sees("root/q"))
    # The refused layer was charged before it was stored: not even the store's cache keeps it.
    assert [t.ref for t in store.tags() if not t.ref.startswith("dsec/oci-layer")] == ["img:1", "img:2"]
    assert store.blobs.list_digests() == [info.digest] and list(store.tmp_dir.iterdir()) == []
    assert sorted(store.catalogue.owners(info.digest)) == ["root", "root/q"]
    assert store.storage_usage(["root/q"])["root/q"] == info.size


def test_usage_counts_each_blob_once_per_subtree_and_collected_blobs_not_at_all(
    store: LayerStore, tmp_path: Path
) -> None:
    a = store.import_path(_tree(tmp_path / "a", 50 * KIB), "a:1", owner="root/t/x")
    b = store.import_path(_tree(tmp_path / "b", 50 * KIB), "b:1", owner="root/t/y")
    store.claim([a.digest], "root/t/y")  # a second owner in the same subtree
    usage = store.storage_usage(["root/t", "root/t/x", "root/t/y", "root"])
    assert usage["root/t"] == usage["root"] == a.size + b.size
    assert (usage["root/t/x"], usage["root/t/y"]) == (a.size, a.size + b.size)
    store.untag("b:1")
    assert store.gc(set(), grace_s=0) == [b.digest]
    assert store.storage_usage(["root/t"])["root/t"] == a.size  # gc frees the room
