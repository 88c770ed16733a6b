"""A destroyed sandbox's cgroups serve the next create in its bucket (spares.py): the new sandbox
runs in them with its own limits, starts charged with nothing of the last one's, and the node
keeps no spare once the edge lets go."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.base import CreateContext
from dsec.backends.container import cgroups, oci, spares
from dsec.backends.container.backend import ContainerBackend
from dsec.protocol.errors import DSecError
from tests.backends.conformance import Made

from .test_enter import backend, helper, layer_dirs, made, probe, run_entered  # noqa: F401

pytestmark = pytest.mark.slow
MiB = 1 << 20


def spare_dirs(ct: ContainerBackend) -> list[Path]:
    return spares.spare_dirs(ct.cgroup_parent)


def bucket(ctx: CreateContext) -> str:
    return cgroups.rel(ctx.sandbox_id).rpartition("/")[0]


def ctx_in(m: Made, where: str, **spec: Any) -> CreateContext:
    """A sandbox whose ID falls in the bucket ``where`` (1 in 64 do)."""
    while True:
        ctx = m.ctx(**spec)
        if bucket(ctx) == where:
            return ctx


def crun_writes_quota(ctx: CreateContext) -> bool:
    config = json.loads((ctx.workdir / "bundle" / "config.json").read_text())
    return "quota" in config["linux"]["resources"]["cpu"]


def cgroup_file(controller: str, ctx: CreateContext, name: str) -> str:
    return (cgroups.sandbox_dir(controller, ctx.sandbox_id) / name).read_text().strip()


async def test_the_next_sandbox_in_a_bucket_runs_in_the_cgroups_of_a_destroyed_one(
    backend: ContainerBackend,  # noqa: F811
    made: Made,  # noqa: F811
    helper: Path,  # noqa: F811
) -> None:
    first, handle = await made.create(made.ctx(cpu_cores_limit=0.5, memory_limit_mb=128))
    assert len(backend.spares) == 0
    out, err, code = await run_entered(
        helper, first, handle, ["sh", "-c", "head -c 8000000 /dev/zero >/tmp/x"]
    )
    assert code == 0, err
    inode = os.stat(cgroups.sandbox_dir("memory", first.sandbox_id)).st_ino
    await backend.destroy(first.sandbox_id, handle, first.workdir)
    assert cgroups.sandbox_dirs(first.sandbox_id) == []
    assert len(backend.spares) == 1 and len(spare_dirs(backend)) == len(cgroups.v1_controllers())

    # The same quota: the spare's is kept, not written again.
    second, handle = await made.create(ctx_in(made, bucket(first), cpu_cores_limit=0.5, memory_limit_mb=64))
    assert len(backend.spares) == 0 and spare_dirs(backend) == []
    assert os.stat(cgroups.sandbox_dir("memory", second.sandbox_id)).st_ino == inode
    assert cgroup_file("cpu", second, "cpu.cfs_quota_us") == "50000" and not crun_writes_quota(second)
    assert cgroup_file("memory", second, "memory.limit_in_bytes") == str(64 * MiB)
    # Nothing of the first sandbox is charged to the second (its 8 MB file went with it).
    assert int(cgroup_file("memory", second, "memory.max_usage_in_bytes")) < 4 * MiB
    assert int(cgroup_file("memory", second, "memory.failcnt")) == 0
    init = str(handle.pid)
    for h in cgroups.hierarchies():  # in every hierarchy, the new init and nothing else
        assert (h / cgroups.rel(second.sandbox_id) / "cgroup.procs").read_text().split() == [init], h
    out, _, code = await run_entered(helper, second, handle, ["cat", "/proc/self/cgroup"])
    assert code == 0 and f"memory:/{cgroups.rel(second.sandbox_id)}\n" in out.decode(), out

    # Another quota: crun writes it.
    await backend.destroy(second.sandbox_id, handle, second.workdir)
    third, handle = await made.create(ctx_in(made, bucket(first), cpu_cores_limit=1.5))
    assert os.stat(cgroups.sandbox_dir("memory", third.sandbox_id)).st_ino == inode
    assert cgroup_file("cpu", third, "cpu.cfs_quota_us") == str(oci.cpu_quota(third.spec)) == "150000"
    assert crun_writes_quota(third)
    await backend.destroy(third.sandbox_id, handle, third.workdir)


async def test_a_bucket_keeps_at_most_its_share_and_the_edge_none_once_it_lets_go(
    backend: ContainerBackend,  # noqa: F811
    made: Made,  # noqa: F811
) -> None:
    first, handle = await made.create()
    made_here = [(first, handle)]
    for _ in range(backend.spares.per_bucket):
        made_here.append(await made.create(ctx_in(made, bucket(first))))
    for ctx, handle in made_here:
        await backend.destroy(ctx.sandbox_id, handle, ctx.workdir)
        assert cgroups.sandbox_dirs(ctx.sandbox_id) == []
    assert len(backend.spares) == backend.spares.per_bucket
    assert len(spare_dirs(backend)) == backend.spares.per_bucket * len(cgroups.v1_controllers())
    await backend.detach()  # the edge closes
    assert len(backend.spares) == 0 and spare_dirs(backend) == []


async def test_a_create_that_fails_in_a_spare_leaves_neither_it_nor_a_spare(
    backend: ContainerBackend,  # noqa: F811
    made: Made,  # noqa: F811
) -> None:
    first, handle = await made.create()
    await backend.destroy(first.sandbox_id, handle, first.workdir)
    bad = made.tmp / "bad-layer"  # crun fails to mount /proc over a file: after the cgroups
    bad.mkdir()
    (bad / "proc").write_text("not a directory\n")
    ctx = ctx_in(made, bucket(first))
    ctx.layer_dirs = [*ctx.layer_dirs, bad]
    with pytest.raises(DSecError):
        await made.create(ctx)
    assert cgroups.sandbox_dirs(ctx.sandbox_id) == [] and spare_dirs(backend) == []
    assert len(backend.spares) == 0


async def test_spares_an_earlier_edge_left_are_removed_when_the_node_is_prepared(
    backend: ContainerBackend,  # noqa: F811
    made: Made,  # noqa: F811
    tmp_path: Path,
) -> None:
    ctx, handle = await made.create()
    await backend.destroy(ctx.sandbox_id, handle, ctx.workdir)
    assert spare_dirs(backend) != []
    again = ContainerBackend(backend.data_dir)  # the edge restarted, after a crash
    await again.prepare_node()
    assert spare_dirs(backend) == [] and len(again.spares) == 0


async def test_a_create_takes_another_buckets_spare_and_a_restarted_edge_finds_it_there(
    backend: ContainerBackend,  # noqa: F811
    made: Made,  # noqa: F811
    helper: Path,  # noqa: F811
) -> None:
    first, handle = await made.create()
    inode = os.stat(cgroups.sandbox_dir("memory", first.sandbox_id)).st_ino
    await backend.destroy(first.sandbox_id, handle, first.workdir)
    ctx = made.ctx()
    while bucket(ctx) == bucket(first):
        ctx = made.ctx()
    elsewhere = bucket(ctx)
    second, handle = await made.create(ctx)
    assert bucket(second) == bucket(first) != elsewhere  # placed where the spare was
    assert os.stat(cgroups.sandbox_dir("memory", second.sandbox_id)).st_ino == inode
    out, _, code = await run_entered(helper, second, handle, ["cat", "/proc/self/cgroup"])
    assert code == 0 and f"memory:/{bucket(first)}/{second.sandbox_id}\n" in out.decode(), out

    cgroups.forget(second.sandbox_id)  # a new edge process knows nothing of it...
    assert bucket(second) == elsewhere
    again = ContainerBackend(backend.data_dir)
    await again.prepare_node()  # ... until it looks
    assert bucket(second) == bucket(first) and await again.alive(second.sandbox_id, handle)
    await again.destroy(second.sandbox_id, handle, second.workdir)
    assert cgroups.sandbox_dirs(second.sandbox_id) == [] and not second.workdir.exists()
    assert not [p for h in cgroups.hierarchies() for p in h.glob(f"*/*/{second.sandbox_id}")]
