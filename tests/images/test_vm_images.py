"""The VM image store: users' bootable disks imported once, checked, collected when unused."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from dsec.images.vm_images import VmImageStore
from dsec.protocol.errors import InvalidRequest, LayerNotFound

pytestmark = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="qemu-utils is not installed")


def raw_disk(path: Path, fill: bytes) -> Path:
    with open(path, "wb") as fh:
        fh.write(fill * 4096)
        fh.truncate(8 << 20)
    return path


def test_an_image_is_stored_once_as_a_standalone_qcow2(tmp_path: Path) -> None:
    store = VmImageStore(tmp_path / "vm-images")
    disk = raw_disk(tmp_path / "a.raw", b"A")
    first = store.import_file(disk, "desk:1")
    again = store.import_file(disk, "desk:2")
    assert first.digest == again.digest and first.virtual_size == 8 << 20
    assert len(list(store.blobs.iterdir())) == 1, "the same bytes are stored once"
    assert store.resolve("desk:2").digest == first.digest
    with pytest.raises(InvalidRequest):  # versions are immutable
        store.import_file(raw_disk(tmp_path / "b.raw", b"B"), "desk:1")
    with pytest.raises(LayerNotFound):
        store.resolve("desk:3")


def test_a_qcow2_naming_a_host_file_is_refused(tmp_path: Path) -> None:
    store = VmImageStore(tmp_path / "vm-images")
    secret = raw_disk(tmp_path / "host-secret.raw", b"S")
    sneaky = tmp_path / "sneaky.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(secret), "-F", "raw", str(sneaky)], check=True
    )
    with pytest.raises(InvalidRequest, match="backing file"):
        store.import_file(sneaky, "sneaky:1")
    assert store.list() == []


def test_gc_removes_an_image_no_tag_names_and_no_vm_uses(tmp_path: Path) -> None:
    store = VmImageStore(tmp_path / "vm-images")
    used = store.import_file(raw_disk(tmp_path / "u.raw", b"U"), "used:1")
    gone = store.import_file(raw_disk(tmp_path / "g.raw", b"G"), "gone:1")
    kept = store.import_file(raw_disk(tmp_path / "k.raw", b"K"), "kept:1")
    assert store.remove("used:1") and store.remove("gone:1")
    assert store.gc(set(), grace_s=600) == [], "young files are spared (an import stores, then tags)"
    old = time.time() - 3600
    for info in (used, gone, kept):
        os.utime(store.blob(info.digest), (old, old))
    assert store.gc({used.digest}, grace_s=600) == [gone.digest]
    assert store.blob(used.digest).exists(), "a running VM boots from it"
    assert store.resolve("kept:1").digest == kept.digest
