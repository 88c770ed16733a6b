"""Every node owns its host-wide names: two nodes on one machine (a `dsec up` beside the test
suite, two suites on two data directories) never share a parent cgroup, and a node still finds
the sandboxes an edge made under the old shared parent (``dsec``)."""

from __future__ import annotations

import fcntl
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dsec.backends.container import cgroups, spares
from dsec.protocol.ids import SandboxId


def test_parent_cgroups_differ_by_node_and_by_data_directory(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    names = {
        cgroups.parent_name("local", a),
        cgroups.parent_name("local", b),  # the same node name on another data directory
        cgroups.parent_name("test", a),
        cgroups.parent_name(None, a),
        cgroups.parent_name(None, b),
    }
    assert len(names) == 5
    assert cgroups.LEGACY_PARENT not in names
    longest = cgroups.parent_name("n" * 40, a)  # node names have at most 40 characters
    assert len(longest) <= 255 and "/" not in longest
    # The same directory by another spelling is the same node.
    assert cgroups.parent_name("local", a / ".." / "a") == cgroups.parent_name("local", a)


def test_spares_and_parents_of_another_node_are_not_this_ones(tmp_path: Path) -> None:
    mine, theirs = cgroups.parent_name("x", tmp_path / "1"), cgroups.parent_name("x", tmp_path / "2")
    assert spares.SpareCgroups(mine).parent != spares.SpareCgroups(theirs).parent
    sid = str(SandboxId.new("x", 1))
    assert cgroups.hashed_bucket(sid, mine).split("/")[0] == mine
    assert cgroups.hashed_bucket(sid, mine).split("/")[1] == cgroups.hashed_bucket(sid, theirs).split("/")[1]


@contextmanager
def _legacy_parent_held() -> Iterator[None]:
    """The old parent is one name for the whole host: two suites side by side (CI's beside-node
    run) each made it when missing and removed it after, and one's rmdir met the other's
    bucket (EBUSY). They take turns."""
    fd = os.open("/run/dsec-test-legacy-parent.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def test_a_sandbox_under_the_old_shared_parent_is_adopted_by_its_node(tmp_path: Path) -> None:
    memory = cgroups.CGROUP_ROOT / "memory"
    if not (memory / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 memory hierarchy")
    with _legacy_parent_held():
        _adopt_from_the_legacy_parent(memory, tmp_path)


def _adopt_from_the_legacy_parent(memory: Path, tmp_path: Path) -> None:
    node = f"legacy{uuid.uuid4().hex[:6]}"
    sid, stranger = str(SandboxId.new(node, 1)), str(SandboxId.new(node + "x", 1))
    bucket = cgroups.hashed_bucket(sid, cgroups.LEGACY_PARENT)
    legacy = memory / cgroups.LEGACY_PARENT
    made_bucket = not (memory / bucket).exists()
    dirs = [memory / bucket / sid, memory / bucket / stranger]
    for d in dirs:
        d.mkdir(parents=True)
    parent = cgroups.parent_name(node, tmp_path)
    try:
        assert cgroups.adopt(parent, node) == 1  # its own only, not another node's
        assert cgroups.memory_dir(sid) == memory / bucket / sid
        assert cgroups.is_placed(sid) and not cgroups.is_placed(stranger)
        # Its cgroups are not kept as a spare in the shared parent (the node clears only its own).
        assert not spares.SpareCgroups(parent).give(sid)
    finally:
        cgroups.forget(sid)
        for d in dirs:
            d.rmdir()
        if made_bucket:
            (memory / bucket).rmdir()
        # Whoever made it: an old edge's sandboxes would be cgroups below it; none means it is
        # a test's, this one's or one a failed run left (a race between two suites did, before
        # they took turns).
        if legacy.exists() and not any(p.is_dir() for p in legacy.iterdir()):
            legacy.rmdir()
