"""``dsec-init``, PID 1 of every container sandbox: one process, and it reaps orphans."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.backends.container import cgroups
from tests.support import DEADLINE_S, eventually

from .conformance import Made
from .test_enter import _dead, backend, helper, layer_dirs, made, probe, run_entered, sandbox  # noqa: F401

pytestmark = pytest.mark.slow


def children(pid: int) -> list[int]:
    """Children, zombies included (a zombie stays its parent's child until reaped)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def test_an_idle_sandbox_is_one_process(made: Made) -> None:  # noqa: F811
    ctx, h = await sandbox(made)
    init = h.pid
    # crun exits once the init is set up, maybe a moment before the init's own execve.
    await eventually(lambda: Path(f"/proc/{init}/cmdline").read_bytes() == b"/.dsec/dsec-init\0", "exec")
    assert [p for p in cgroups.pids(ctx.sandbox_id) if not _dead(p)] == [init]
    assert children(init) == []


async def test_orphans_are_reaped_by_the_init(helper: Path, made: Made) -> None:  # noqa: F811
    ctx, h = await sandbox(made)
    init = h.pid
    # Each subshell exits at once: its `true` is orphaned to the init, and exits too.
    _, _, code = await run_entered(
        helper, ctx, h, ["sh", "-c", "for i in 1 2 3 4 5 6 7 8; do (true &); done"]
    )
    assert code == 0
    await eventually(lambda: children(init) == [], "the orphaned zombies reaped", DEADLINE_S)
    assert [p for p in cgroups.pids(ctx.sandbox_id) if not _dead(p)] == [init]
