"""A benchmark that fails leaves nothing of its node on the host. ``bench/create.py`` asked for
an image its layer store does not have used to start its node first and fail after: the node's
LXCFS, runtime tmpfs, cgroup parent and scratch directory stayed behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dsec.backends.container import cgroups
from dsec.images.mount import mounts_under
from tests.cluster.hostscan import end_leftovers, processes_mentioning

REPO = Path(__file__).resolve().parents[2]


def _scratch_parents(below: Path) -> set[str]:
    """The cgroup parents of the bench nodes whose scratch data directory is under ``below``
    (what it names them: ``cgroups.parent_name``), if they are on the host."""
    named = {cgroups.parent_name("bench", d) for d in below.glob("dsec-bench-*")}
    return named & set(cgroups.parents())


def test_a_benchmark_refusing_a_missing_image_leaves_nothing_behind(tmp_path: Path) -> None:
    layers = str(tmp_path / "layers")
    argv = [sys.executable, "bench/create.py", "--layers", layers, "--image", "nothing:here"]
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # its scratch data directory goes here
    try:
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode != 0 and "no layer 'nothing:here'" in done.stderr, done.stderr[-3000:]
        assert mounts_under(tmp_path) == [], "LXCFS or the runtime tmpfs stayed mounted"
        assert processes_mentioning(tmp_path) == [], "its LXCFS still runs"
        assert _scratch_parents(tmp_path) == set(), "its cgroup parent stayed"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["layers"], "its scratch directory stayed"
    finally:
        end_leftovers(tmp_path, _scratch_parents(tmp_path))
