"""Which guest kernel the microVM kit takes: the newest cloud image of any apt source (so a node
with bookworm-backports gets 6.12, Landlock ABI 6, whose domains scope signals), a kernel
unpacked before when apt cannot answer, and the modules such a kernel has built in."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dsec.backends.microvm import kit
from dsec.protocol.errors import InfraFailure

pytestmark = pytest.mark.skipif(shutil.which("dpkg") is None, reason="no dpkg (Debian's version order)")

# `apt-cache show linux-image-cloud-amd64` on bookworm with bookworm-backports (pin 100)
SHOW = """Package: linux-image-cloud-amd64
Version: 6.12.95-1~bpo12+1
Depends: linux-image-6.12.95+deb12-cloud-amd64 (= 6.12.95-1~bpo12+1)
Description: Linux for x86-64 cloud (meta-package)
 This package depends on the latest Linux kernel.

Package: linux-image-cloud-amd64
Version: 6.1.192-3
Depends: linux-image-6.1.0-57-cloud-amd64 (= 6.1.192-3)

Package: linux-image-cloud-amd64
Version: 6.1.176-1
Depends: linux-image-6.1.0-50-cloud-amd64 (= 6.1.176-1)
"""


def fake_apt(monkeypatch: pytest.MonkeyPatch, show: str | None) -> list[list[str]]:
    calls: list[list[str]] = []

    def run(argv: list[str], cwd: Path | None = None) -> str:
        calls.append(argv)
        if argv[:2] == ["apt-cache", "show"] and show is not None:
            return show
        raise InfraFailure(f"{' '.join(argv)} failed: offline", reason="guest_kit")

    monkeypatch.setattr(kit, "_run", run)
    return calls


def unpacked(kit_dir: Path, package: str) -> Path:
    version = package.removeprefix("linux-image-")
    root = kit_dir / "kernel" / package
    (root / "lib" / "modules" / version).mkdir(parents=True)
    (root / ".complete").write_text(package + "\n")
    return root


def test_the_cloud_kernel_is_the_newest_of_any_source(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_apt(monkeypatch, SHOW)
    assert (
        kit._kernel_package("linux-image-cloud-amd64", newest=True) == "linux-image-6.12.95+deb12-cloud-amd64"
    )


def test_a_node_that_gains_backports_moves_to_its_kernel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    unpacked(tmp_path, "linux-image-6.1.0-57-cloud-amd64")
    new = unpacked(tmp_path, "linux-image-6.12.95+deb12-cloud-amd64")
    calls = fake_apt(monkeypatch, SHOW)
    assert kit._ensure_kernel(tmp_path, "cloud") == (new, "6.12.95+deb12-cloud-amd64")
    assert not [c for c in calls if c[:2] == ["apt-get", "download"]]  # unpacked already


def test_without_apt_a_kernel_unpacked_before_serves(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    unpacked(tmp_path, "linux-image-6.1.0-57-cloud-amd64")
    newer = unpacked(tmp_path, "linux-image-6.12.95+deb12-cloud-amd64")  # by Debian's order
    unpacked(tmp_path, "linux-image-6.1.0-57-amd64")  # the other flavour's
    fake_apt(monkeypatch, None)
    assert kit._ensure_kernel(tmp_path, "cloud")[0] == newer
    # A download that fails (offline) keeps it too; with nothing unpacked it is an error.
    fake_apt(monkeypatch, SHOW.replace("6.12.95+deb12", "6.12.99+deb12"))
    assert kit._ensure_kernel(tmp_path, "cloud")[0] == newer
    (tmp_path / "empty").mkdir()
    with pytest.raises(InfraFailure, match="offline"):
        kit._ensure_kernel(tmp_path / "empty", "cloud")


def test_the_initramfs_names_the_modules_the_kernel_has_built_in(tmp_path: Path) -> None:
    """busybox modprobe answers success for a module modules.builtin lists: 6.12's cloud kernel
    has virtio_console built in, which init requires."""
    version = "6.12.95+deb12-cloud-amd64"
    moddir = tmp_path / "lib" / "modules" / version
    (moddir / "kernel" / "fs" / "erofs").mkdir(parents=True)
    (moddir / "kernel" / "fs" / "erofs" / "erofs.ko.xz").write_bytes(b"module")
    (moddir / "modules.dep").write_text("kernel/fs/erofs/erofs.ko.xz:\n")
    (moddir / "modules.builtin").write_text(
        "kernel/drivers/char/virtio_console.ko\nkernel/drivers/virtio/virtio_pci.ko\nkernel/fs/ext2/ext2.ko\n"
    )
    agent = tmp_path / "agent"
    agent.write_bytes(b"\x7fELF")
    entries = {name: data for name, _, data in kit._initramfs_entries(tmp_path, version, agent)}
    assert entries[f"lib/modules/{version}/modules.builtin"].decode().splitlines() == [
        "kernel/drivers/char/virtio_console.ko",
        "kernel/drivers/virtio/virtio_pci.ko",
    ]
    assert f"lib/modules/{version}/kernel/fs/erofs/erofs.ko.xz" in entries
