"""The base-layer helpers, without running debootstrap (a minute and the network)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.images import base
from dsec.images.base import default_mirror, ensure_base_layer, slim_rootfs
from dsec.images.mount import mount, mounts_under
from dsec.images.store import LayerStore

from .conftest import make_tree


def test_mirror_from_deb822_skips_security(tmp_path: Path) -> None:
    deb822 = tmp_path / "debian.sources"
    deb822.write_text(
        "Types: deb\n# URIs: http://commented.example/debian\n"
        "URIs: http://security.debian.org/debian-security\n\n"
        "Types: deb\nURIs: http://mirror.example/debian http://other.example/debian\nSuites: bookworm\n"
    )
    assert default_mirror(deb822, tmp_path / "none") == "http://mirror.example/debian"


def test_mirror_from_sources_list_and_default(tmp_path: Path) -> None:
    one_line = tmp_path / "sources.list"
    one_line.write_text(
        "# deb http://commented.example/debian bookworm main\n"
        "deb-src http://src.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main\n"
    )
    assert default_mirror(tmp_path / "none", one_line) == "http://mirror.example/debian"
    assert default_mirror(tmp_path / "none", tmp_path / "none") == base.DEFAULT_MIRROR


def test_slim_rootfs_removes_caches_and_host_settings(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    files = {
        "var/cache/apt/archives/bash_5.2_amd64.deb": "deb",
        "var/cache/apt/pkgcache.bin": "bin",
        "var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_InRelease": "list",
        "var/log/dpkg.log": "log",
        "var/log/apt/history.log": "log",
        "tmp/junk": "junk",
        "usr/bin/python3": "keep me",
        "var/lib/dpkg/status": "keep me",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "etc").mkdir()
    host_file = tmp_path / "host-resolv.conf"
    host_file.write_text("nameserver 10.0.0.1\n")
    os.symlink(host_file, root / "etc/resolv.conf")  # must not be written through

    slim_rootfs(root)
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert left == ["etc/hostname", "etc/resolv.conf", "usr/bin/python3", "var/lib/dpkg/status"]
    assert (root / "var/log/apt").is_dir()
    assert (root / "etc/resolv.conf").read_text() == "" and not (root / "etc/resolv.conf").is_symlink()
    assert host_file.read_text() == "nameserver 10.0.0.1\n"


def test_work_dir_removal_unmounts_leftovers_first(tmp_path: Path) -> None:
    work = tmp_path / "base-x"
    (work / "rootfs/proc").mkdir(parents=True)
    mount("tmpfs", work / "rootfs/proc", "tmpfs", 0, "size=1m")  # what a failed debootstrap leaves
    (work / "rootfs/proc/precious").write_text("x")
    base._remove_work_dir(work)
    assert not work.exists() and not mounts_under(tmp_path)


def test_the_current_recipe_is_built_once_and_the_tag_moves_to_it(
    store: LayerStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose debian:bookworm an older package list built gets the current list's
    build once, under a tag of its own, and debian:bookworm moves to it; later calls build
    nothing."""
    old = store.import_path(make_tree(tmp_path / "src"), "debian:bookworm")
    builds: list[tuple[str, ...]] = []

    def fake_debootstrap(
        suite: str, target: Path, mirror: str, say: base.Progress, packages: tuple[str, ...]
    ) -> None:
        builds.append(packages)
        (target / "usr/bin").mkdir(parents=True)
        (target / "usr/bin/installed").write_text(" ".join(packages))

    monkeypatch.setattr(base, "_debootstrap", fake_debootstrap)
    new = ensure_base_layer(store, mirror="http://unused.example/debian")
    assert new.digest != old.digest and builds == [base.BASE_PACKAGES]
    built = base.recipe_ref("debian:bookworm", "bookworm", base.BASE_PACKAGES)
    assert store.resolve("debian:bookworm").digest == store.resolve(built).digest == new.digest
    assert ensure_base_layer(store) == new and len(builds) == 1
    assert {"procps", "curl", "python3-pip", "python3-venv", "ca-certificates"} <= set(base.BASE_PACKAGES)


def test_failed_build_leaves_no_work_dir(store: LayerStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(suite: str, target: Path, mirror: str, say: base.Progress, packages: tuple[str, ...]) -> None:
        (target / "proc").mkdir(parents=True)
        mount("tmpfs", target / "proc", "tmpfs", 0, "size=1m")
        raise RuntimeError("network down")

    monkeypatch.setattr(base, "_debootstrap", failing)
    with pytest.raises(RuntimeError):
        ensure_base_layer(store, "debian:test", mirror="http://unused.example/debian")
    assert not list(store.tmp_dir.iterdir()) and not mounts_under(store.root)
    assert not store.has_tag("debian:test")
