"""HostTree: paths below a directory a sandbox wrote are resolved without ever leaving it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.edge.changes import walk_changes
from dsec.images.commit import scrub
from dsec.images.hosttree import HostTree
from dsec.protocol.models import ChangeKind


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret").write_text("host only")
    (d / "sub").mkdir()
    return d


@pytest.fixture
def tree(tmp_path: Path, outside: Path) -> Path:
    top = tmp_path / "upper"
    (top / "real" / "deep").mkdir(parents=True)
    (top / "real" / "file").write_text("mine")
    (top / "abs").symlink_to(outside)  # absolute: the host's directory
    (top / "rel").symlink_to("../outside")  # relative: climbs out
    (top / "real" / "up").symlink_to("/")
    os.mkfifo(top / "fifo")
    return top


def test_no_component_is_ever_a_link(tree: Path) -> None:
    with HostTree(tree) as t:
        for path in ("abs/secret", "rel/secret", "real/up/etc/passwd", "abs", "abs/sub"):
            assert t.read_bytes(path, 100) is None
            assert not t.is_dir(path)
        assert not t.exists("abs/secret") and t.exists("abs")  # the link itself is there
        assert t.scan("abs") == [] and t.scan("real/up") == []
        assert t.read_bytes("/real/file", 100) == b"mine"
        with pytest.raises(ValueError, match=r"\.\."):
            t.lstat("real/../../outside")


def test_a_fifo_or_device_is_never_opened_for_reading(tree: Path) -> None:
    with HostTree(tree) as t:
        assert t.read_bytes("fifo", 10) is None  # would block forever if opened
        st = t.lstat("fifo")
        assert st is not None


def test_the_top_itself_may_not_be_a_link(tmp_path: Path, outside: Path) -> None:
    (tmp_path / "link").symlink_to(outside)
    with pytest.raises(OSError):
        HostTree(tmp_path / "link")


def test_walk_lists_links_as_entries_and_never_descends_through_them(tree: Path) -> None:
    with HostTree(tree) as t:
        seen = {d: [n for n, _ in entries] for d, entries in t.walk()}
    assert set(seen) == {"", "real", "real/deep"}
    assert seen[""] == ["abs", "fifo", "real", "rel"]
    assert "secret" not in str(seen)


def test_remove_takes_the_link_not_its_target(tree: Path, outside: Path) -> None:
    with HostTree(tree) as t:
        t.remove("abs")
        t.remove("real")
        t.remove("missing")
    assert (outside / "secret").read_text() == "host only"
    assert not os.path.lexists(tree / "abs") and not (tree / "real").exists()


def test_changes_below_a_link_are_empty_and_lowers_are_not_followed(tree: Path, tmp_path: Path) -> None:
    lower = tmp_path / "lower"
    lower.mkdir()
    (lower / "real").symlink_to(tmp_path / "upper" / "real")  # a lower whose 'real' is a link
    assert walk_changes(tree, [lower], "/abs") == []
    assert walk_changes(tree, [lower], "/rel/sub") == []
    got = {(c.path, c.kind) for c in walk_changes(tree, [lower], "/")}
    assert ("/real/file", ChangeKind.added) in got  # the lower's link does not make it "modified"
    assert not any("secret" in p for p, _ in got)


def test_scrub_removes_through_real_directories_only(tree: Path, outside: Path) -> None:
    (tree / "tmp").symlink_to(outside)
    (tree / "var" / "tmp").mkdir(parents=True)
    (tree / "var" / "tmp" / "x").write_text("residue")
    removed = scrub(tree, ["tmp/*", "var/tmp/*", "abs/*"])
    assert removed == ["var/tmp/x"]
    assert (outside / "secret").exists() and (outside / "sub").is_dir()
