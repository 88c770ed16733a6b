"""Fixtures for the layer tests: they use the real mkfs.erofs and real mounts, so they need root.

Every test runs under ``tmp_path``; the autouse fixture detaches whatever is still mounted below
it afterwards, also when the test failed half-way, so no mount outlives a test.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.images.mount import mounts_under, unmount_tree
from dsec.images.mounts import LayerMounts
from dsec.images.store import LayerStore
from tests.support import erofs_usable

if not erofs_usable():
    pytest.skip("layer tests need root, mkfs.erofs and EROFS support", allow_module_level=True)


@pytest.fixture(autouse=True)
def _no_leftover_mounts(tmp_path: Path) -> Iterator[None]:
    try:
        yield
    finally:
        unmount_tree(tmp_path)
        assert not mounts_under(tmp_path)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LayerStore]:
    s = LayerStore(tmp_path / "store")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def layer_mounts(tmp_path: Path) -> Iterator[LayerMounts]:
    m = LayerMounts(tmp_path / "mnt")
    try:
        yield m
    finally:
        m.unmount_all(lazy=True)


NS = 1_000_000_000


def make_tree(root: Path) -> Path:
    """A small tree with every kind of metadata a layer must keep."""
    root.mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "etc/hostname").write_text("box\n")
    (root / "bin").mkdir()
    tool = root / "bin/tool"
    tool.write_bytes(b"#!/bin/sh\necho hi\n" * 500)
    os.chown(tool, 1234, 5678)
    os.chmod(tool, 0o4755)  # after chown, which would clear setuid
    os.link(tool, root / "bin/tool-hardlink")
    os.symlink("tool", root / "bin/relative-link")
    os.symlink("/etc/hostname", root / "bin/absolute-link")
    os.mknod(root / "deleted", stat.S_IFCHR | 0o600, os.makedev(0, 0))  # overlayfs whiteout
    os.mknod(root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mkfifo(root / "fifo", 0o640)
    (root / "empty").mkdir(mode=0o700)
    (root / "opaque").mkdir()
    os.setxattr(root / "opaque", "trusted.overlay.opaque", b"y")
    os.setxattr(root / "etc/hostname", "user.note", b"\x00\xffbinary")
    os.setxattr(root / "etc/hostname", "security.capability", _CAP_NET_RAW)
    for i, p in enumerate(sorted(root.rglob("*"))):
        os.utime(p, ns=(0, (1_600_000_000 + i) * NS + 123_456_789), follow_symlinks=False)
    os.utime(root, ns=(0, 1_700_000_000 * NS + 987_654_321))
    return root


# VFS_CAP_REVISION_2 with cap_net_raw (bit 13) permitted and effective: a real-world xattr.
_CAP_NET_RAW = bytes.fromhex("0100000200200000000000000000000000000000")


def gnu_tar(src: Path, out: Path, *extra: str) -> Path:
    subprocess.run(
        [
            "tar",
            "--format=pax",
            "--xattrs",
            "--xattrs-include=*",
            "--numeric-owner",
            *extra,
            "-C",
            str(src),
            "-cf",
            str(out),
            ".",
        ],
        check=True,
    )
    return out
