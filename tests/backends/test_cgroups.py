"""Removing cgroups (backends/container/cgroups.py): a cpuset's CPUs are emptied before it goes,
never while a process still runs in it."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.backends.container import cgroups

CPUSET = cgroups.CGROUP_ROOT / "cpuset"
pytestmark = pytest.mark.skipif(not (CPUSET / "cpuset.cpus").exists(), reason="no cgroup v1 cpuset hierarchy")


@pytest.fixture
def parent() -> Iterator[Path]:
    """A cpuset whose children start with its CPUs (as the sandboxes' buckets do)."""
    d = CPUSET / f"dsec-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    try:
        for name in ("cpuset.cpus", "cpuset.mems"):
            (d / name).write_text((CPUSET / name).read_text())
        (d / "cgroup.clone_children").write_text("1")
        yield d
    finally:
        for child in d.iterdir():
            if child.is_dir():
                child.rmdir()
        d.rmdir()


def test_a_cpuset_with_a_process_in_it_keeps_its_cpus(parent: Path) -> None:
    child = parent / "sandbox"
    child.mkdir()
    cpus = (child / "cpuset.cpus").read_text()
    assert cpus.strip(), "the kernel did not copy the parent's CPUs"
    proc = subprocess.Popen(["sleep", "60"])
    try:
        (child / "cgroup.procs").write_text(str(proc.pid))
        with pytest.raises(OSError):
            cgroups.rmdir(child)
        assert (child / "cpuset.cpus").read_text() == cpus
        assert os.sched_getaffinity(proc.pid), "its process lost its CPUs"
    finally:
        proc.kill()
        proc.wait()
    cgroups.rmdir(child)
    assert not child.exists()
