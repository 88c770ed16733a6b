"""Per-sandbox disk quotas (``disk_limit_mb``) through the SDK, on the real runtime.

A quota'd sandbox's writable layer lives in a btrfs subvolume with a qgroup limit, on one quota
file system per node (``dsec.backends.container.diskquota``); a write past the limit fails in
the sandbox with EDQUOT and touches nothing else.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from dsec import Conflict, DSecClient, DSecContainerRunArgs, InvalidRequest, Sandbox
from dsec.backends.container.backend import ContainerBackend
from dsec.images.mount import find_mount
from dsec.node.embedded import EmbeddedNode
from tests.conftest import BASE, Sandboxes, node_config
from tests.support import RestartedNode, eventually

MiB = 1 << 20
LIMIT = 64
EDQUOT_TEXT = "Disk quota exceeded"


@pytest.fixture
def backend(node: EmbeddedNode) -> ContainerBackend:
    ct = node.backend
    assert isinstance(ct, ContainerBackend)
    if not ct.capabilities()["disk_quota"]:
        pytest.skip("this node cannot enforce disk quotas (needs btrfs and loop devices)")
    return ct


def _dd(path: str, mib: int) -> str:
    return f"dd if=/dev/zero of={path} bs=1M count={mib} conv=fsync status=none"


async def _fill(sb: Sandbox, path: str = "/root/big") -> None:
    r = await sb.run_shell(_dd(path, LIMIT * 2))
    assert r.exit_code != 0 and EDQUOT_TEXT in r.stderr, r


async def test_writes_past_the_limit_fail_inside_and_below_it_are_fine(
    backend: ContainerBackend, make_sandbox: Sandboxes
) -> None:
    sb = await make_sandbox(disk_limit_mb=LIMIT)
    r = await sb.run_shell(_dd("/root/small", 16) + " && sha256sum /root/small | cut -c1-16")
    assert r.exit_code == 0, r
    r = await sb.run_shell(_dd("/root/big", LIMIT * 2))
    assert r.exit_code == 1 and f"dd: error writing '/root/big': {EDQUOT_TEXT}" in r.stderr, r
    # Python sees the errno itself.
    code = (
        "import errno\n"
        "try:\n"
        "    open('/root/py', 'wb').write(b'x' * (32 << 20))\n"
        "except OSError as e:\n"
        "    print(errno.errorcode[e.errno])\n"
    )
    r = await sb.exec(["python3", "-c", code])
    assert r.stdout.strip() == errno.errorcode[errno.EDQUOT], r
    # The file below the limit is intact, and the sandbox still works (reads, small writes
    # elsewhere fail too: the limit is the sandbox's whole writable layer).
    assert (await sb.run_shell("wc -c < /root/small")).stdout.strip() == str(16 * MiB)
    r = await sb.run_shell("echo hi > /tmp/x")
    assert r.exit_code != 0 and EDQUOT_TEXT in r.stderr
    # Deleting frees the quota.
    assert (await sb.run_shell("rm -f /root/big /root/py /root/small && sync")).exit_code == 0
    r = await sb.run_shell(_dd("/root/again", LIMIT - 16))
    assert r.exit_code == 0, r
    # A write through the file API (from the host, into the sandbox) is held to it as well.
    with pytest.raises(Conflict, match="no space left") as exc:
        await sb.write_file("/root/upload", b"u" * (32 * MiB))
    assert exc.value.reason == "no_space"
    assert (await sb.run_shell("rm /root/again && echo ok > /root/ok && cat /root/ok")).stdout == "ok\n"


async def test_neighbours_and_the_host_are_unaffected(
    backend: ContainerBackend, make_sandbox: Sandboxes, tmp_path: Path
) -> None:
    full = await make_sandbox(disk_limit_mb=LIMIT)
    quota_neighbour = await make_sandbox(disk_limit_mb=LIMIT)
    plain = await make_sandbox()
    image = backend.disk_quota.image
    before = image.stat().st_blocks * 512
    await _fill(full)
    # The host gave the full sandbox no more than its limit (the image is sparse and grows only
    # with what is written; some slack for metadata and what other tests left to discard).
    grown = image.stat().st_blocks * 512 - before
    assert grown <= (LIMIT + 16) * MiB, grown
    r = await quota_neighbour.run_shell(_dd("/root/f", LIMIT // 2))
    assert r.exit_code == 0, r
    r = await plain.run_shell(_dd("/root/f", LIMIT * 2))  # no limit of its own, as before
    assert r.exit_code == 0, r
    host_file = tmp_path / "host-write"
    with open(host_file, "wb") as f:
        f.write(b"h" * (8 * MiB))
        os.fsync(f.fileno())
    assert host_file.stat().st_size == 8 * MiB
    # A sandbox without a limit is laid out exactly as before: a plain directory, no volume.
    assert plain.id not in backend.disk_quota.volumes()
    assert {full.id, quota_neighbour.id} <= set(backend.disk_quota.volumes())


async def test_one_node_mount_whatever_the_number_of_quota_d_sandboxes(
    backend: ContainerBackend, make_sandbox: Sandboxes
) -> None:
    first = await make_sandbox(disk_limit_mb=LIMIT)  # the first may mount the quota fs
    assert find_mount(backend.disk_quota.mnt) is not None
    mounts = len(Path("/proc/self/mounts").read_text().splitlines())
    more = [await make_sandbox(disk_limit_mb=LIMIT) for _ in range(3)]
    assert len(Path("/proc/self/mounts").read_text().splitlines()) == mounts
    for sb in (first, *more):
        assert (await sb.run_shell("echo ok")).stdout == "ok\n"


async def test_stop_leaves_no_volume_qgroup_or_workdir(
    backend: ContainerBackend, node: EmbeddedNode, make_sandbox: Sandboxes
) -> None:
    sb = await make_sandbox(disk_limit_mb=LIMIT)
    assert (await sb.run_shell(_dd("/root/f", 8))).exit_code == 0
    workdir = node.config.data_dir / "sandboxes" / sb.id
    assert workdir.is_symlink() and workdir.resolve() == backend.disk_quota.path(sb.id)
    qgroup = backend.disk_quota.qgroup_dir(backend.disk_quota.volume_id(sb.id))
    assert (qgroup / "max_referenced").read_text().strip() == str(LIMIT * MiB)
    await sb.stop()
    assert not workdir.exists() and not workdir.is_symlink()
    assert sb.id not in backend.disk_quota.volumes()
    # The kernel drops the subvolume's blocks, then its qgroup, once the edge's commit ran.
    await eventually(lambda: not qgroup.exists(), "the stopped sandbox's qgroup to go", timeout=30)


async def test_pause_resume_keeps_the_limit(backend: ContainerBackend, make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox(disk_limit_mb=LIMIT)
    await sb.pause()
    r = await sb.run_shell(_dd("/root/big", LIMIT * 2))  # resumes by itself
    assert r.exit_code != 0 and EDQUOT_TEXT in r.stderr, r


async def test_changes_pack_diff_and_fork_work_on_a_full_sandbox(
    client: DSecClient, backend: ContainerBackend, make_sandbox: Sandboxes
) -> None:
    sb = await make_sandbox(disk_limit_mb=LIMIT)
    assert (await sb.run_shell("mkdir -p /work && seq 1 1000 > /work/seq && rm /etc/issue")).exit_code == 0
    await _fill(sb, "/work/big")
    changes = {c.path for c in await sb.changes()}
    assert {"/work/seq", "/work/big", "/etc/issue"} <= changes
    layer = await sb.pack_diff("test/quota-pack")  # copies the full upper as links: needs room
    # The limit is back once the pack is done.
    r = await sb.run_shell(_dd("/work/more", 8))
    assert r.exit_code != 0 and EDQUOT_TEXT in r.stderr, r
    layers = [*sb.info.layers, layer.digest]
    restored = await make_sandbox(container_image=None, layers=layers, disk_limit_mb=LIMIT)
    r = await restored.run_shell("tail -1 /work/seq; test -e /etc/issue || echo gone")
    assert r.stdout == "1000\ngone\n", r
    # What came in a layer is not the new sandbox's writing: it has its whole limit.
    assert (await restored.run_shell(_dd("/work/new", LIMIT // 2))).exit_code == 0
    forks = await sb.fork(2)
    try:
        for f in forks:
            assert (await f.run_shell("tail -1 /work/seq")).stdout == "1000\n"
            assert f.id in backend.disk_quota.volumes()  # a fork keeps the spec, limit included
            r = await f.run_shell(_dd("/work/big2", LIMIT * 2))
            assert r.exit_code != 0 and EDQUOT_TEXT in r.stderr, r
    finally:
        for f in forks:
            await f.stop()


async def test_an_edge_restart_reuses_the_quota_fs_and_keeps_the_limit(
    backend: ContainerBackend, base_layer: str, tmp_path: Path
) -> None:
    cfg = node_config(tmp_path, data_dir=tmp_path / "node")
    cfg.microvm = cfg.vm = False
    async with RestartedNode(cfg) as nodes:
        async with DSecClient(nodes.node.url, nodes.node.api_key) as c:
            sb = await c.run_container(DSecContainerRunArgs(container_image=base_layer, disk_limit_mb=LIMIT))
            assert (await sb.run_shell(_dd("/root/kept", 8))).exit_code == 0
        quota_fs = nodes.node.backend.disk_quota
        mounted = find_mount(quota_fs.mnt)
        assert mounted is not None
        # Tenants' files live there: no setuid program or device node of theirs works on the
        # host, and no host user but root walks in.
        assert {"nosuid", "nodev"} <= set(mounted.options.split(","))
        assert quota_fs.root.stat().st_mode & 0o777 == 0o700
        second = await nodes.restart()  # the sandbox keeps running meanwhile
        assert find_mount(quota_fs.mnt) == mounted, "re-used as it is, not mounted again"
        async with DSecClient(second.url, second.api_key) as c:
            again = await c.get(sb.id)
            assert (await again.run_shell("wc -c < /root/kept")).stdout.strip() == str(8 * MiB)
            await _fill(again)
            await again.stop()
    # The last sandbox gone and the node stopped: no mount, no image left behind.
    assert find_mount(quota_fs.mnt) is None and not quota_fs.image.exists()


@pytest.mark.parametrize("bad", [0, 15, -1, 1024 * 1024 + 1, "lots", 64.5])
async def test_bad_limits_are_refused(client: DSecClient, base_layer: str, bad: object) -> None:
    if isinstance(bad, int):
        with pytest.raises(InvalidRequest, match="disk_limit_mb"):
            await client.run_container(DSecContainerRunArgs(container_image=base_layer, disk_limit_mb=bad))
    # The server refuses it too, whatever client sent it.
    body = {"spec": {"type": "container", "image": BASE, "disk_limit_mb": bad}, "timeout": 30}
    with pytest.raises(InvalidRequest, match="disk_limit_mb"):
        await client._t.request("POST", "/v1/sandboxes", json_body=body)
