"""The node's own file systems for container sandboxes (nodefs.py): LXCFS, whose files answer
a sandbox's /proc CPU and memory views with its limits, and the runtime directory's tmpfs.
Both outlive an edge while sandboxes use them, are adopted by the next edge, and go with the
last sandbox; a dead LXCFS fails reads at once rather than hanging them."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dsec import _linux
from dsec.backends.base import CreateContext
from dsec.backends.container.backend import ContainerBackend
from dsec.images.mount import find_mount, mounts_under
from tests.backends.conformance import Made, build_layers, run
from tests.support import eventually

pytestmark = pytest.mark.slow


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[ContainerBackend]:
    if not shutil.which("lxcfs"):
        pytest.skip("lxcfs is not installed (./setup.sh installs Debian's lxcfs)")
    ct = ContainerBackend(tmp_path / "data")
    await ct.prepare_node()
    try:
        yield ct
    finally:
        for sid in await ct.leftovers():
            await ct.destroy(sid, {}, tmp_path / "sandboxes" / sid)
        await ct.detach()
        lxcfs = ct.nodefs.lxcfs
        leaked = mounts_under(tmp_path)
        assert not leaked, f"node file systems outlived the last sandbox: {leaked}"
        assert lxcfs._daemon() is None, "LXCFS outlived the last sandbox"


@pytest.fixture
async def made(backend: ContainerBackend, tmp_path: Path) -> AsyncIterator[Made]:
    m = Made(backend, build_layers(tmp_path / "layers"), tmp_path)
    try:
        yield m
    finally:
        await m.cleanup()


async def meminfo_total_kib(made: Made, sandbox: tuple[CreateContext, dict[str, Any]]) -> tuple[int, bytes]:
    """MemTotal inside (-1 if the read failed), and cat's stderr."""
    ctx, handle = sandbox
    out, err, rc = await run(made.backend, ctx, handle, ["cat", "/proc/meminfo"])
    return (int(out.split()[1]) if rc == 0 else -1), err


async def test_lxcfs_is_adopted_by_the_next_edge_and_kept_while_sandboxes_live(
    backend: ContainerBackend, made: Made
) -> None:
    first = await made.create(made.ctx(memory_limit_mb=200))
    assert (await meminfo_total_kib(made, first))[0] == 200 * 1024
    pid = backend.nodefs.lxcfs._daemon()
    assert pid is not None
    await backend.detach()  # the edge stops; its sandbox runs on
    assert backend.nodefs.lxcfs._daemon() == pid and find_mount(backend.runtime_dir) is not None
    again = ContainerBackend(backend.data_dir)
    await again.prepare_node()  # the next edge adopts it
    assert again.nodefs.lxcfs._daemon() == pid
    second = await made.create(made.ctx(memory_limit_mb=300))
    assert (await meminfo_total_kib(made, second))[0] == 300 * 1024
    assert (await meminfo_total_kib(made, first))[0] == 200 * 1024


async def test_a_dead_lxcfs_fails_reads_at_once_and_the_next_create_starts_another(
    backend: ContainerBackend, made: Made
) -> None:
    """Its files then answer ENOTCONN (no read hangs) in the sandboxes made before; the next
    create starts another daemon and its sandbox sees its limits (a bind of the dead mount
    would fail that create)."""
    before = await made.create(made.ctx(memory_limit_mb=200))
    pid = backend.nodefs.lxcfs._daemon()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await eventually(lambda: _linux.proc_start_time(pid) is None, "lxcfs to die")
    total, err = await meminfo_total_kib(made, before)
    assert total == -1 and b"not connected" in err, err
    after = await made.create(made.ctx(memory_limit_mb=300))
    assert backend.nodefs.lxcfs._daemon() not in (None, pid)
    assert (await meminfo_total_kib(made, after))[0] == 300 * 1024
