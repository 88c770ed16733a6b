"""Fixtures: one real runner per test (see ``client.py``), always ended and checked."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fncall.client import Runner, kill_leftovers


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path / "fncall"


@pytest.fixture
def runner(workdir: Path) -> Iterator[Runner]:
    r = Runner(workdir)
    try:
        yield r
    finally:
        rc = r.close()
        leftovers = kill_leftovers(r.uid)
        shutil.rmtree(workdir, ignore_errors=True)
    assert rc == 0, f"the runner exited with {rc}"
    assert leftovers == [], f"processes of the call uid outlived the runner: {leftovers}"
