"""The layer store's file catalogue: retag/untag, gc, two nodes over one shared store, verify,
and the one-time import of the SQLite catalogue of the earlier design."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dsec.images.blobstore import FakeBlobStore, LocalDirBlobStore, SharedMountBlobStore
from dsec.images.catalogue import LEGACY_MARKER
from dsec.images.store import LayerStore
from dsec.protocol.errors import InfraFailure, InvalidRequest, LayerNotFound

from .blobstore_conformance import Clock, make_clock
from .conftest import make_tree


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return make_clock(monkeypatch)


def tree(tmp_path: Path, name: str, extra: str = "") -> Path:
    root = make_tree(tmp_path / name)
    if extra:
        (root / "extra").write_text(extra)
    return root


def names(store: LayerStore) -> dict[str, list[str]]:
    return {i.digest: i.names for i in store.list()}


# ---- layout -------------------------------------------------------------------------------------


def test_catalogue_is_files_beside_the_blobs(store: LayerStore, tmp_path: Path) -> None:
    info = store.import_path(tree(tmp_path, "src"), "team/base:2024.1")
    record = store.root / "catalogue" / "tags" / "team%2Fbase" / "2024.1.json"
    body = json.loads(record.read_text())
    assert body["digests"] == [info.digest] and body["created_at"] == info.created_at
    assert body["ref"] == "team/base:2024.1"
    assert (store.root / "catalogue" / "refs" / info.digest[7:] / "team%2Fbase" / "2024.1").exists()
    assert not (store.root / "catalog.sqlite").exists()
    assert store.blob_path(info.digest) == store.root / "blobs" / "sha256" / f"{info.digest[7:]}.erofs"
    assert store.tmp_dir == store.root / "tmp"


def test_dotted_versions_and_slashed_names_stay_records(store: LayerStore, tmp_path: Path) -> None:
    info = store.import_path(tree(tmp_path, "src"), "a/b/c:..")
    store.tag(info.digest, "a:.hidden")
    assert store.resolve("a/b/c:..").digest == info.digest
    assert store.resolve("a:.hidden").digest == info.digest
    assert sorted(store.resolve(info.digest).names) == ["a/b/c:..", "a:.hidden"]
    with pytest.raises(LayerNotFound, match=r"known versions of a: \.hidden"):
        store.resolve("a:x")


# ---- retag / untag ------------------------------------------------------------------------------


def test_retag_moves_a_tag_only_when_asked(store: LayerStore, tmp_path: Path) -> None:
    one = store.import_path(tree(tmp_path, "one"), "app:1")
    two = store.import_path(tree(tmp_path, "two", "changed"), "app:2")
    store.tag(one.digest, "app:latest")
    with pytest.raises(InvalidRequest, match="immutable"):
        store.tag(two.digest, "app:latest")  # creating is never moving
    assert store.resolve("app:latest").digest == one.digest
    moved = store.retag("app:latest", "app:2")
    assert [m.digest for m in moved] == [two.digest]
    assert store.resolve("app:latest").digest == two.digest
    assert names(store) == {one.digest: ["app:1"], two.digest: ["app:2", "app:latest"]}
    assert store.resolve(one.digest).names == ["app:1"]
    store.retag("app:latest", [one.digest])  # by a list of layer refs, too
    assert store.resolve("app:latest").digest == one.digest
    store.retag("app:new", "app:1")  # retag also creates
    assert store.resolve("app:new").digest == one.digest
    with pytest.raises(LayerNotFound):
        store.retag("app:latest", "app:3")
    assert store.resolve("app:latest").digest == one.digest


def test_a_tag_changed_by_another_process_is_seen_at_once(store: LayerStore, tmp_path: Path) -> None:
    """Tags read once are kept parsed (a create reads its image's tag): each change made by
    another store over the same directory (another apiserver) shows at the next read."""
    other = LayerStore(store.root)
    one = store.import_path(tree(tmp_path, "one"), "app:1", owner="root/a")
    two = store.import_path(tree(tmp_path, "two", "changed"), "app:2", owner="root/a")
    b_only = lambda owner: owner == "root/b"  # noqa: E731
    store.tag(one.digest, "app:latest", owner="root/a")
    assert store.resolve_image("app:latest")[0].digest == one.digest  # now kept parsed
    with pytest.raises(LayerNotFound):
        store.resolve_image("app:latest", viewer=b_only)
    other.retag("app:latest", "app:2")
    assert store.resolve_image("app:latest")[0].digest == two.digest
    other.mark_public("app:latest")
    assert store.resolve_image("app:latest", viewer=b_only)[0].digest == two.digest
    other.untag("app:latest")
    assert not store.has_tag("app:latest")
    other.tag(one.digest, "app:latest", owner="root/b")  # the name again, another owner
    assert store.catalogue.get("app", "latest").owner == "root/b"  # type: ignore[union-attr]
    assert store.resolve_image("app:latest", viewer=b_only)[0].digest == one.digest


def test_untag_leaves_the_blob_for_gc(store: LayerStore, tmp_path: Path) -> None:
    info = store.import_path(tree(tmp_path, "src"), "gone:1")
    assert store.untag("gone:1") == [info.digest]
    assert not store.has_tag("gone:1")
    with pytest.raises(LayerNotFound):
        store.resolve("gone:1")
    with pytest.raises(LayerNotFound):
        store.untag("gone:1")
    assert store.resolve(info.digest).names == []  # stored, untagged: gc will take it
    assert store.blob_path(info.digest).exists()
    assert store.import_path(tree(tmp_path, "src2"), "gone:1").digest == info.digest  # name is free


def test_images_share_the_tag_namespace(store: LayerStore, tmp_path: Path) -> None:
    base = store.import_path(tree(tmp_path, "base"), "base:1")
    ws = store.import_path(tree(tmp_path, "ws", "workspace"), "ws:1")
    layers = store.tag_image("env:1", [base.digest, "ws:1"])
    assert [i.digest for i in layers] == [base.digest, ws.digest]
    assert [i.digest for i in store.resolve_image("env:1")] == [base.digest, ws.digest]
    assert [i.digest for i in store.resolve_image("base:1")] == [base.digest]
    assert store.has_image("env:1") and not store.has_tag("env:1")  # has_tag: layers only
    assert store.has_tag("base:1") and not store.has_image("base:1")
    store.tag_image("env:1", [base.digest, ws.digest])  # same content: a no-op
    with pytest.raises(InvalidRequest, match="immutable"):
        store.tag_image("env:1", [ws.digest])
    with pytest.raises(InvalidRequest, match="immutable"):
        store.tag_image("base:1", [base.digest, ws.digest])
    with pytest.raises(InvalidRequest, match="immutable"):
        store.tag_image("base:1", [base.digest])  # a layer tag is not an image, even of one
    with pytest.raises(InvalidRequest, match="immutable"):
        store.tag(base.digest, "env:1")
    store.tag_image("solo:1", [base.digest])  # an image of one layer is still an image
    assert store.has_image("solo:1") and not store.has_tag("solo:1")
    assert [i.digest for i in store.resolve_image("solo:1")] == [base.digest]
    with pytest.raises(LayerNotFound, match="image of 2 layers"):
        store.resolve("env:1")
    assert names(store) == {base.digest: ["base:1"], ws.digest: ["ws:1"]}  # layer names only
    assert {t.ref: (t.kind, list(t.digests)) for t in store.tags()} == {
        "base:1": ("layer", [base.digest]),
        "env:1": ("image", [base.digest, ws.digest]),
        "solo:1": ("image", [base.digest]),
        "ws:1": ("layer", [ws.digest]),
    }
    store.retag("env:1", "base:1")  # an image can become a layer tag, explicitly
    assert [i.digest for i in store.resolve_image("env:1")] == [base.digest]
    assert store.resolve("env:1").digest == base.digest and store.has_tag("env:1")
    store.retag("base:2", "solo:1")  # retagging to an image makes an image
    assert store.has_image("base:2")
    store.retag("base:3", [base.digest, ws.digest])
    assert store.has_image("base:3") and len(store.resolve_image("base:3")) == 2


# ---- gc -----------------------------------------------------------------------------------------


def test_gc_removes_only_old_unreferenced_blobs(store: LayerStore, tmp_path: Path, clock: Clock) -> None:
    tagged = store.import_path(tree(tmp_path, "a", "a"), "tagged:1")
    mounted = store.import_path(tree(tmp_path, "b", "b"), "mounted:1")
    in_image = store.import_path(tree(tmp_path, "c", "c"), "c:1")
    old = store.import_path(tree(tmp_path, "d", "d"), "old:1")
    store.tag_image("img:1", [tagged.digest, in_image.digest])
    for ref in ("mounted:1", "c:1", "old:1"):
        store.untag(ref)
    assert store.gc({mounted.digest}) == []  # everything is younger than the grace period
    clock(601)
    assert store.gc({mounted.digest}) == [old.digest]
    assert not store.blob_path(old.digest).exists()
    assert {i.digest for i in store.list()} == {tagged.digest, mounted.digest, in_image.digest}
    with pytest.raises(LayerNotFound):
        store.resolve(old.digest)
    assert store.gc(set()) == [mounted.digest]  # no longer in use: collected
    store.untag("img:1")
    assert store.gc(set()) == [in_image.digest]
    assert store.gc(set()) == [] and store.resolve("tagged:1").digest == tagged.digest
    assert store.blobs.list_records("refs") == [f"refs/{tagged.digest[7:]}/tagged/1"]  # index pruned


def test_gc_grace_period_protects_an_import_before_its_tag(
    store: LayerStore, tmp_path: Path, clock: Clock
) -> None:
    info = store.import_path(tree(tmp_path, "src"), "x:1")
    store.untag("x:1")
    clock(3600)  # old and unreferenced ...
    store.blobs.put(_copy(store.blob_path(info.digest), store.tmp_dir / "rebuilt"))  # ... put again
    assert store.gc(set()) == []  # an importer is about to tag it
    assert store.gc(set(), grace_s=0) == [info.digest]  # an explicit grace of 0 does not wait
    assert store.gc_grace_s == 600


def test_tagging_an_old_blob_refreshes_it(store: LayerStore, tmp_path: Path, clock: Clock) -> None:
    info = store.import_path(tree(tmp_path, "src"), "x:1")
    store.untag("x:1")
    clock(3600)
    store.tag(info.digest, "x:2")  # a tag racing with gc must win: it refreshed the stamp first
    store.untag("x:2")
    assert store.gc(set()) == []
    clock(601)
    assert store.gc(set()) == [info.digest]


def test_import_survives_a_gc_between_put_and_tag(
    store: LayerStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tree(tmp_path, "src")
    first = store.import_path(src, "x:1")
    store.untag("x:1")
    real_create = store.catalogue.create

    def create_after_gc(*args: object, **kw: object) -> object:
        assert store.blobs.delete(first.digest)  # a collector on another node, just now
        return real_create(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(store.catalogue, "create", create_after_gc)
    info = store.import_path(src, "x:2")
    assert info.digest == first.digest and info.names == ["x:2"]
    assert store.blob_path(info.digest).exists()


def test_stale_index_entries_never_show_and_gc_drops_them(store: LayerStore, tmp_path: Path) -> None:
    info = store.import_path(tree(tmp_path, "src"), "x:1")
    stale = store.root / "catalogue" / "refs" / info.digest[7:] / "ghost" / "1"
    stale.parent.mkdir(parents=True)
    stale.touch()  # a writer crashed between its index entry and its tag
    assert store.resolve(info.digest).names == ["x:1"]
    store.gc(set())
    assert not stale.exists()
    assert store.resolve("x:1").names == ["x:1"]


def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


# ---- verify -------------------------------------------------------------------------------------


def test_verify_refuses_a_corrupted_blob(store: LayerStore, tmp_path: Path) -> None:
    info = store.import_path(tree(tmp_path, "src"), "x:1")
    assert store.verify("x:1") == info
    blob = store.blob_path(info.digest)
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as f:
        f.seek(1500)
        byte = f.read(1)
        f.seek(1500)
        f.write(bytes([byte[0] ^ 0x80]))
    with pytest.raises(InfraFailure) as exc:
        store.verify("x:1")
    assert exc.value.reason == "corrupt"
    assert info.digest in exc.value.message and "corrupt" in exc.value.message
    assert "import the layer again" in exc.value.message


# ---- several nodes over one shared store ----------------------------------------------------------


@pytest.fixture
def two_nodes(tmp_path: Path) -> tuple[LayerStore, LayerStore]:
    """Two nodes that mount the same shared filesystem at different paths (bind mounts)."""
    export = tmp_path / "export"
    export.mkdir()
    mnts = []
    for node in ("node-a", "node-b"):
        mnt = tmp_path / node
        mnt.mkdir()
        subprocess.run(["mount", "--bind", str(export), str(mnt)], check=True)
        mnts.append(mnt)
    a = LayerStore.over(SharedMountBlobStore(mnts[0], create=True))
    b = LayerStore(blobs=SharedMountBlobStore(mnts[1]))
    return a, b


def test_two_nodes_share_one_catalogue(two_nodes: tuple[LayerStore, LayerStore], tmp_path: Path) -> None:
    a, b = two_nodes
    info = a.import_path(tree(tmp_path, "base"), "base:1")
    assert b.resolve("base:1") == info  # node b sees node a's layer at once
    assert b.blob_path(info.digest).is_relative_to(b.root)  # read in place through b's mount
    assert b.blob_path(info.digest).read_bytes() == a.blob_path(info.digest).read_bytes()
    assert b.import_path(tree(tmp_path, "same"), "base-copy:1").digest == info.digest  # stored once
    assert len(a.list()) == 1 and len(a.blobs.list_digests()) == 2  # one split layer: meta + data
    assert a.resolve(info.digest).names == ["base:1", "base-copy:1"]
    ws = b.import_path(tree(tmp_path, "ws", "ws"), "ws:1")
    b.tag_image("env:1", ["base:1", "ws:1"])
    assert [i.digest for i in a.resolve_image("env:1")] == [info.digest, ws.digest]
    with pytest.raises(InvalidRequest, match="immutable"):
        a.import_path(tree(tmp_path, "other", "other"), "ws:1")  # versions are immutable everywhere
    a.retag("ws:1", "base:1")
    assert b.resolve("ws:1").digest == info.digest
    b.untag("env:1")
    assert not a.has_tag("env:1")
    assert a.list() == b.list()


def test_nodes_in_separate_processes_import_one_layer_once(
    two_nodes: tuple[LayerStore, LayerStore], tmp_path: Path
) -> None:
    a, b = two_nodes
    src = tree(tmp_path, "src")
    script = (
        "import sys; from pathlib import Path\n"
        "from dsec.images.blobstore import SharedMountBlobStore\n"
        "from dsec.images.store import LayerStore\n"
        "s = LayerStore.over(SharedMountBlobStore(Path(sys.argv[1])))\n"
        "print(s.import_path(Path(sys.argv[2]), sys.argv[3]).digest)\n"
    )
    jobs = [(a.root, "proc:1"), (b.root, "proc:1"), (a.root, "proc:2"), (b.root, "proc:2")]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(root), str(src), ref], stdout=subprocess.PIPE, text=True
        )
        for root, ref in jobs
    ]
    digests = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(digests) == 1
    assert a.resolve("proc:1").names == ["proc:1", "proc:2"] == b.resolve("proc:2").names
    assert len(b.list()) == 1 and len(b.blobs.list_digests()) == 2  # one split layer: meta + data


def test_layer_store_over_the_fake(tmp_path: Path) -> None:
    store = LayerStore.over(FakeBlobStore(tmp_path / "fake"))
    info = store.import_path(tree(tmp_path, "src"), "x:1")
    assert store.resolve("x:1") == info and store.blob_path(info.digest).is_file()
    assert store.verify(info.digest) == info
    store.untag("x:1")
    assert store.gc(set(), grace_s=0) == [info.digest]


def test_root_and_blobs_must_agree(tmp_path: Path) -> None:
    blobs = LocalDirBlobStore(tmp_path / "a")
    with pytest.raises(ValueError, match="root"):
        LayerStore(tmp_path / "b", blobs=blobs)
    assert LayerStore(tmp_path / "a", blobs=blobs).root == tmp_path / "a"


# ---- migration from catalog.sqlite --------------------------------------------------------------

_OLD_SCHEMA = """
CREATE TABLE blobs (digest TEXT PRIMARY KEY, size INTEGER NOT NULL, created_at REAL NOT NULL);
CREATE TABLE tags (
    name TEXT NOT NULL, version TEXT NOT NULL, digest TEXT NOT NULL REFERENCES blobs(digest),
    created_at REAL NOT NULL, PRIMARY KEY (name, version)
);
CREATE INDEX tags_by_digest ON tags(digest);
"""
_OLD_IMAGES = """
CREATE TABLE images (
    name TEXT NOT NULL, version TEXT NOT NULL, digests TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (name, version)
);
"""


def _old_store(
    root: Path, *, with_images: bool, keep_open: list[sqlite3.Connection] | None = None
) -> tuple[list[str], str]:
    """A store as the SQLite design left it: blobs, catalog.sqlite (WAL), no file catalogue."""
    blob_dir = root / "blobs" / "sha256"
    blob_dir.mkdir(parents=True)
    (root / "tmp").mkdir()
    digests = []
    for i in range(3):
        data = f"old layer {i}".encode() * 100
        hexdigest = hashlib.sha256(data).hexdigest()
        (blob_dir / f"{hexdigest}.erofs").write_bytes(data)
        digests.append(f"sha256:{hexdigest}")
    missing = "sha256:" + "ab" * 32
    db = sqlite3.connect(root / "catalog.sqlite", isolation_level=None)
    db.execute("PRAGMA journal_mode = WAL")
    db.executescript(_OLD_SCHEMA + (_OLD_IMAGES if with_images else ""))
    for i, d in enumerate(digests):
        db.execute("INSERT INTO blobs VALUES (?, ?, ?)", (d, 1100, 1_700_000_000.0 + i))
    rows = [
        ("debian", "bookworm", digests[0], 1_700_000_000.5),
        ("ws", "1", digests[1], 1_700_000_001.5),
        ("ws-copy", "1", digests[1], 1_700_000_002.5),
        ("team/tool", "2.0", digests[2], 1_700_000_003.5),
        ("lost", "1", missing, 1_700_000_004.5),
    ]
    db.executemany("INSERT INTO tags VALUES (?, ?, ?, ?)", rows)
    if with_images:
        db.execute(
            "INSERT INTO images VALUES (?, ?, ?, ?)", ("env", "1", json.dumps(digests[:2]), 1_700_000_005.5)
        )
    if keep_open is not None:  # a process of the old design still has it open, with a pending log
        db.execute("PRAGMA wal_autocheckpoint = 0")
        db.execute("INSERT INTO tags VALUES (?, ?, ?, ?)", ("late", "1", digests[0], 1_700_000_009.0))
        assert (root / "catalog.sqlite-wal").stat().st_size > 0
        keep_open.append(db)
    else:
        db.close()
    return digests, missing


@pytest.mark.parametrize("with_images", [False, True])
def test_sqlite_catalogue_is_imported_once(tmp_path: Path, with_images: bool) -> None:
    root = tmp_path / "layers"
    digests, missing = _old_store(root, with_images=with_images)
    before = {p.name: p.read_bytes() for p in root.iterdir() if p.name.startswith("catalog.sqlite")}
    blobs_before = sorted(p.name for p in (root / "blobs" / "sha256").iterdir())
    with LayerStore(root) as store:
        assert store.resolve("debian:bookworm").digest == digests[0]
        assert store.resolve("debian:bookworm").created_at == 1_700_000_000.5
        assert store.resolve("ws:1").names == ["ws:1", "ws-copy:1"]  # by name, then version
        assert store.resolve("team/tool:2.0").digest == digests[2]
        assert not store.has_tag("lost:1")  # its blob is gone: skipped, and said so
        assert store.migrated is not None and store.migrated["tags"] == 5 + with_images
        assert store.migrated["skipped"] == [f"lost:1 (blob {missing} is missing)"]
        if with_images:
            assert [i.digest for i in store.resolve_image("env:1")] == digests[:2]
            assert store.has_image("env:1") and not store.has_tag("env:1")
        assert [i.digest for i in store.list()] == digests
        store.untag("ws-copy:1")  # the new catalogue is the truth from now on
        store.import_path(tree(tmp_path, "new"), "new:1")
    with LayerStore(root) as again:  # the next open does not import again
        assert again.migrated is None
        assert not again.has_tag("ws-copy:1") and again.has_tag("new:1")
        assert again.resolve("debian:bookworm").digest == digests[0]
    assert json.loads((root / "catalogue" / LEGACY_MARKER).read_text())["imported"]
    after = {p.name: p.read_bytes() for p in root.iterdir() if p.name.startswith("catalog.sqlite")}
    assert after == before  # the SQLite file is left alone
    assert set(blobs_before) <= {p.name for p in (root / "blobs" / "sha256").iterdir()}


def test_sqlite_catalogue_with_a_pending_log_is_read_whole(tmp_path: Path) -> None:
    root = tmp_path / "layers"
    conns: list[sqlite3.Connection] = []
    digests, _ = _old_store(root, with_images=False, keep_open=conns)
    try:
        store = LayerStore(root)
        assert store.resolve("late:1").digest == digests[0]  # only in the write-ahead log
    finally:
        conns[0].close()


def test_concurrent_opens_import_the_sqlite_catalogue_consistently(tmp_path: Path) -> None:
    root = tmp_path / "layers"
    _old_store(root, with_images=True)
    errors: list[BaseException] = []
    stores: list[LayerStore] = []

    def open_store() -> None:
        try:
            stores.append(LayerStore(root))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=open_store) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(stores) == 4
    refs = {t.ref for t in stores[0].tags()}
    assert refs == {"debian:bookworm", "ws:1", "ws-copy:1", "team/tool:2.0", "env:1"}
    assert all({t.ref for t in s.tags()} == refs for s in stores)


def test_sqlite_tags_that_clash_with_the_new_catalogue_keep_the_new(tmp_path: Path) -> None:
    root = tmp_path / "layers"
    digests, _ = _old_store(root, with_images=False)
    blobs = LocalDirBlobStore(root)
    from dsec.images.catalogue import Catalogue

    Catalogue(blobs).create("debian", "bookworm", [digests[2]])  # written by a newer DSec already
    store = LayerStore(root)
    assert store.resolve("debian:bookworm").digest == digests[2]
    assert store.migrated is not None and len(store.migrated["kept_newer"]) == 1  # type: ignore[arg-type]


def test_local_scratch_for_a_store_on_another_filesystem(tmp_path: Path) -> None:
    """A shared store may build on local disk: the finished image is copied in once."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs a scratch directory on another filesystem")
    scratch = shm / f"dsec-scratch-{os.getpid()}"
    try:
        store = LayerStore(tmp_path / "store", scratch=scratch)
        info = store.import_path(tree(tmp_path, "src"), "x:1")
        assert store.tmp_dir == scratch and not list(scratch.iterdir())
        assert store.blob_path(info.digest).is_file() and store.verify("x:1") == info
        assert sorted(p.name for p in store.blob_dir.iterdir()) == [f"{info.digest[7:]}.erofs"]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
