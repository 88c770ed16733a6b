from __future__ import annotations

import fcntl
import io
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest

from dsec.images.store import LayerStore
from dsec.protocol.errors import InvalidRequest, LayerNotFound

from .conftest import gnu_tar, make_tree


def blobs(store: LayerStore) -> list[str]:
    return sorted(p.name for p in store.blob_dir.iterdir())


def test_same_directory_twice_is_one_blob(store: LayerStore, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    a = store.import_path(src, "tools:1")
    b = store.import_path(src, "tools:1")  # same tag, same content: a no-op
    c = store.import_path(src, "tools-alias:2")
    assert a.digest == b.digest == c.digest
    assert blobs(store) == [f"{a.digest[7:]}.erofs"]
    assert c.names == ["tools:1", "tools-alias:2"]  # by name, then version
    assert c.size == store.blob_path(a.digest).stat().st_size
    assert not list(store.tmp_dir.iterdir())


@pytest.mark.parametrize("compress", ["", "--gzip", "--xz", "--bzip2", "--zstd"])
def test_tar_import_equals_directory_import(store: LayerStore, tmp_path: Path, compress: str) -> None:
    src = make_tree(tmp_path / "src")
    from_dir = store.import_path(src, "layer:dir")
    archive = gnu_tar(src, tmp_path / "layer.tar", *([compress] if compress else []))
    from_tar = store.import_path(archive, "layer:tar")
    assert from_tar.digest == from_dir.digest
    assert len(blobs(store)) == 1


def test_tar_without_root_entry_is_reproducible(store: LayerStore, tmp_path: Path) -> None:
    def archive(path: Path) -> Path:
        with tarfile.open(path, "w") as tf:
            info = tarfile.TarInfo("deep/dir/file")  # parents only implied
            info.size, info.mtime = 3, 1_600_000_000
            tf.addfile(info, io.BytesIO(b"abc"))
        return path

    a = store.import_path(archive(tmp_path / "a.tar"), "implicit:1")
    b = store.import_path(archive(tmp_path / "b.tar"), "implicit:2")
    assert a.digest == b.digest


def _evil_tar(path: Path, *members: tuple[str, bytes | str | None, bytes]) -> Path:
    """members: (name, type, linkname-or-data)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            if kind == tarfile.SYMTYPE or kind == tarfile.LNKTYPE:
                info.type, info.linkname = kind, payload.decode()
                tf.addfile(info)
            elif kind == tarfile.DIRTYPE:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            else:
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    return path


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ([("../escape", None, b"x")], "'..' component"),
        ([("ok/../../escape", None, b"x")], "'..' component"),
        ([("/abs", None, b"x")], "absolute path"),
        ([("link", tarfile.SYMTYPE, b"/tmp"), ("link/escape", None, b"x")], "symlink"),
        ([("link", tarfile.SYMTYPE, b".."), ("link/escape", None, b"x")], "symlink"),
        ([("hl", tarfile.LNKTYPE, b"../../etc/passwd")], "'..' component"),
        ([("l", tarfile.SYMTYPE, b"/etc"), ("hl", tarfile.LNKTYPE, b"l/passwd")], "symlink"),
    ],
)
def test_unsafe_tar_is_rejected(
    store: LayerStore, tmp_path: Path, members: list[tuple[str, bytes | str | None, bytes]], why: str
) -> None:
    archive = _evil_tar(tmp_path / "evil.tar", *members)
    with pytest.raises(InvalidRequest) as exc:
        store.import_path(archive, "evil:1")
    assert why in exc.value.message
    assert not (tmp_path / "escape").exists() and not Path("/tmp/escape").exists()
    assert not store.has_tag("evil:1") and not blobs(store)
    assert not list(store.tmp_dir.iterdir())


def test_symlink_replaced_by_file_is_not_followed(store: LayerStore, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    archive = _evil_tar(tmp_path / "t.tar", ("f", tarfile.SYMTYPE, str(victim).encode()), ("f", None, b"new"))
    store.import_path(archive, "replace:1")
    assert victim.read_text() == "untouched"


def test_not_a_tar_is_invalid(store: LayerStore, tmp_path: Path) -> None:
    (tmp_path / "junk").write_bytes(os.urandom(4096))
    with pytest.raises(InvalidRequest, match="tar archive"):
        store.import_path(tmp_path / "junk", "junk:1")
    with pytest.raises(InvalidRequest, match="no such file"):
        store.import_path(tmp_path / "missing", "junk:1")


def test_resolve_by_tag_digest_and_prefix(store: LayerStore, tmp_path: Path) -> None:
    info = store.import_path(make_tree(tmp_path / "src"), "team/base:2024.1")
    hexdigest = info.digest.removeprefix("sha256:")
    for ref in ["team/base:2024.1", info.digest, hexdigest, hexdigest[:12], "sha256:" + hexdigest[:12]]:
        assert store.resolve(ref) == info, ref
    assert store.resolve(hexdigest[:12].upper()) == info
    assert store.has_tag("team/base:2024.1") and not store.has_tag("team/base:2024.2")
    assert store.list() == [info]


def test_unknown_refs_are_layer_not_found(store: LayerStore, tmp_path: Path) -> None:
    store.import_path(make_tree(tmp_path / "src"), "base:1")
    for ref in ["base:2", "other:1", "sha256:" + "0" * 64, "0" * 12, "base"]:
        with pytest.raises(LayerNotFound) as exc:
            store.resolve(ref)
        assert "dsec layer ls" in exc.value.message, ref
    with pytest.raises(LayerNotFound, match="known versions of base: 1"):
        store.resolve("base:2")
    with pytest.raises(LayerNotFound, match="a version is required: base:1"):
        store.resolve("base")


@pytest.mark.parametrize("ref", ["", "name", ":1", "-x:1", "x:", "x:a b", "x:1:2", "sha256:1.0", "a/b c:1"])
def test_malformed_tags_are_rejected_before_any_work(store: LayerStore, tmp_path: Path, ref: str) -> None:
    with pytest.raises(InvalidRequest):
        store.import_path(tmp_path / "does-not-matter", ref)
    assert not list(store.tmp_dir.iterdir())


def test_malformed_digest_is_invalid_not_missing(store: LayerStore) -> None:
    with pytest.raises(InvalidRequest) as exc:
        store.resolve("sha256:xyz")
    assert not isinstance(exc.value, LayerNotFound)


def test_versions_are_immutable(store: LayerStore, tmp_path: Path) -> None:
    first = store.import_path(make_tree(tmp_path / "one"), "app:1.0")
    other = make_tree(tmp_path / "two")
    (other / "extra").write_text("changed")
    with pytest.raises(InvalidRequest, match="immutable"):
        store.import_path(other, "app:1.0")
    assert store.resolve("app:1.0").digest == first.digest
    second = store.import_path(other, "app:1.1")
    assert second.digest != first.digest
    with pytest.raises(InvalidRequest, match="immutable"):
        store.tag(second.digest, "app:1.0")
    assert [i.digest for i in store.list()] == [first.digest, second.digest]


def test_concurrent_threads_import_once(store: LayerStore, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    results: list[str] = []
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results.append(store.import_path(src, f"par:{i % 2}").digest)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and len(blobs(store)) == 1


def test_a_directory_is_held_from_its_stripping_until_it_is_read(
    store: LayerStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stripping a name moves the directory's mtime until it is put back: another import of
    # the same tree reading it then would store another digest under the same tag (CI saw
    # "par:1 already names the layer ..." once in ~2,300 runs of the test above).
    src = make_tree(tmp_path / "src")
    tried: list[bool] = []
    store_tree = LayerStore._store_tree

    def reading(self: LayerStore, *args: Any, **kwargs: Any) -> Any:
        fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            tried.append(True)
        except BlockingIOError:
            tried.append(False)
        finally:
            os.close(fd)
        return store_tree(self, *args, **kwargs)

    monkeypatch.setattr(LayerStore, "_store_tree", reading)
    store.import_path(src, "held:1")
    assert tried == [False]  # another import would have waited
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and is let in once the import is done
    finally:
        os.close(fd)


def test_two_processes_share_one_store(store: LayerStore, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    script = (
        "import sys; from pathlib import Path; from dsec.images.store import LayerStore\n"
        "s = LayerStore(Path(sys.argv[1]))\n"
        "print(s.import_path(Path(sys.argv[2]), 'proc:1').digest)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(store.root), str(src)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    digests = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(digests) == 1
    assert store.resolve("proc:1").digest in digests
    assert len(blobs(store)) == 1
