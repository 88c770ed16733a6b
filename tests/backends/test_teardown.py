"""A destroyed container sandbox takes its memory cgroup with it (teardown.py): the layer pages
it was first to read are reclaimed before its cgroups go, so no memory cgroup stays behind
"dying" with the kernel's per-cgroup state until memory runs short.

The kernel's count of dying memory cgroups (/proc/cgroups) is the whole machine's, and other
suites' cgroups die while the test runs (a CI run saw 91 dying and more after a minute): what is
checked for each sandbox is its own cgroup, empty of LRU pages when it is removed (counted page by
page: memory.stat's figures lag), and its pages out of the page cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.backends.container import cgroups, teardown
from dsec.backends.container.backend import ContainerBackend
from tests.backends.conformance import Made, run
from tests.support import evict, lru_pages_charged, resident_bytes

from .test_enter import backend, helper, layer_dirs, made, probe, run_entered, sandbox  # noqa: F401

pytestmark = pytest.mark.slow
MiB = 1 << 20
COUNT = 6


def uncached_files(layer: Path) -> list[str]:
    """A file per sandbox in a layer, none of its pages in the page cache: whoever reads one
    first is charged for it."""
    names = []
    for i in range(COUNT):
        path = layer / f"data-{i}"
        path.write_bytes(os.urandom(MiB))
        evict(path)
        names.append(f"/{path.name}")
    return names


async def test_a_destroyed_sandbox_leaves_no_dying_memory_cgroup(
    backend: ContainerBackend,  # noqa: F811
    made: Made,  # noqa: F811
    helper: Path,  # noqa: F811
    layer_dirs: list[Path],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layer = layer_dirs[-1]
    files = uncached_files(layer)
    made_here = [await sandbox(made) for _ in files]
    for (ctx, handle), name in zip(made_here, files, strict=True):
        out, err, code = await run_entered(helper, ctx, handle, ["cat", name])
        assert code == 0 and len(out) == MiB, err
        # Charged to it: without the reclaim at destroy, this keeps its cgroup alive.
        assert teardown.charged_bytes(cgroups.sandbox_dir("memory", ctx.sandbox_id)) >= MiB // 2
        assert resident_bytes(layer / name.lstrip("/")) >= MiB // 2
    # The pages each memory cgroup still has on LRU lists when the teardown is done with it,
    # just before it is removed: a page there is what would keep it dying.
    left: dict[Path, int] = {}
    release = teardown.release

    async def watched(cgroup: Path) -> int:
        freed = await release(cgroup)
        left[cgroup] = lru_pages_charged(cgroup)
        return freed

    monkeypatch.setattr(teardown, "release", watched)
    for ctx, handle in made_here:
        await backend.destroy(ctx.sandbox_id, handle, ctx.workdir)
        assert cgroups.sandbox_dirs(ctx.sandbox_id) == []
    await backend.detach()  # the spares some left (spares.py) are removed, to die too
    memcgs = {cgroups.sandbox_dir("memory", ctx.sandbox_id) for ctx, _ in made_here}
    assert left == dict.fromkeys(memcgs, 0)
    # What it was charged for is no longer cached: nothing keeps its memory cgroup.
    assert [resident_bytes(layer / name.lstrip("/")) for name in files] == [0] * COUNT


async def test_a_sandbox_whose_init_is_gone_is_still_destroyed(
    backend: ContainerBackend,  # noqa: F811
    made: Made,  # noqa: F811
) -> None:
    ctx, handle = await sandbox(made)
    os.kill(handle.pid, 9)
    await backend.destroy(ctx.sandbox_id, handle, ctx.workdir)
    assert cgroups.sandbox_dirs(ctx.sandbox_id) == [] and not ctx.workdir.exists()
    assert ctx.sandbox_id not in await backend.leftovers()


@pytest.fixture
def gvisor_made(made: Made) -> Made:  # noqa: F811
    if not made.backend.gvisor.available:
        pytest.skip(f"runtime='gvisor' needs a working runsc: {made.backend.gvisor.why_not}")
    return made


async def test_a_destroyed_gvisor_sandbox_leaves_no_dying_memory_cgroup(
    backend: ContainerBackend,  # noqa: F811
    gvisor_made: Made,
    layer_dirs: list[Path],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layer = layer_dirs[-1]
    files = uncached_files(layer)
    made_here = [await gvisor_made.create(gvisor_made.ctx(runtime="gvisor")) for _ in files]
    for (ctx, handle), name in zip(made_here, files, strict=True):
        out, err, code = await run(backend, ctx, handle, ["cat", name])
        assert code == 0 and len(out) == MiB, err
        # The gofer read it for the sentry: charged to the sandbox's memory cgroup.
        assert resident_bytes(layer / name.lstrip("/")) >= MiB // 2
        assert teardown.charged_bytes(cgroups.sandbox_dir("memory", ctx.sandbox_id)) >= MiB // 2
    for ctx, handle in made_here:
        await backend.destroy(ctx.sandbox_id, handle, ctx.workdir)
        assert cgroups.sandbox_dirs(ctx.sandbox_id) == []
    assert [resident_bytes(layer / name.lstrip("/")) for name in files] == [0] * COUNT
