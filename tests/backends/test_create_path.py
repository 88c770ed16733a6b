"""What a container create does to the host, trimmed of work that grows with the node's
sandboxes (docs/decisions.md, "A create's cost at density"): dsec-rootfs mounts the root after a
vfork, the cpuset parent clones its CPUs to children, no keyring per sandbox, no period write,
the runtime's detached processes reaped by the spawner."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from pathlib import Path

import pytest

from dsec import _linux
from dsec.backends.base import User
from dsec.backends.container import cgroups, nodefs, oci
from dsec.backends.container.backend import ContainerBackend
from dsec.native import rootfs, spawner
from dsec.protocol.errors import InfraFailure
from dsec.protocol.models import ContainerSpec
from tests.backends.conformance import Made
from tests.support import eventually

from .test_enter import backend, helper, layer_dirs, made, probe, sandbox  # noqa: F401

pytestmark = pytest.mark.slow
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


@pytest.fixture(scope="module")
def rootfs_helper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rootfs.build_helper(tmp_path_factory.mktemp("bin"))


def overlay(tmp: Path) -> tuple[str, Path]:
    lower, upper, work, root = (tmp / d for d in ("lower", "upper", "work", "root"))
    for d in (lower, upper, work, root):
        d.mkdir()
    (lower / "from-lower").write_text("x")
    return f"lowerdir={lower},upperdir={upper},workdir={work}", root


async def test_the_program_runs_on_the_mounted_root_which_the_host_never_sees(
    rootfs_helper: Path, tmp_path: Path
) -> None:
    options, root = overlay(tmp_path)
    seen = tmp_path / "seen"
    script = f"test -e {root}/from-lower && grep -q ' {root} ' /proc/self/mountinfo && touch {seen}"
    assert await rootfs.run(rootfs_helper, options, root, ["sh", "-c", script], ENV) == 0
    assert seen.exists()
    assert not (root / "from-lower").exists()  # the mount died with the namespace
    assert f" {root} " not in Path("/proc/self/mountinfo").read_text()


async def test_its_exit_status_is_the_programs(rootfs_helper: Path, tmp_path: Path) -> None:
    options, root = overlay(tmp_path)
    assert await rootfs.run(rootfs_helper, options, root, ["sh", "-c", "exit 7"], ENV) == 7


async def test_a_networked_runsc_finds_no_net_sysctls_in_any_namespace_the_host_keeps_them(
    rootfs_helper: Path, tmp_path: Path
) -> None:
    # runsc 20221219 takes a namespace where net.core.rmem_default exists for the host's and
    # refuses netstack there (gvisor.py); since Linux 6.x every namespace has it.
    options, root = overlay(tmp_path)
    seen = tmp_path / "seen"
    script = f"unshare -n test ! -e /proc/sys/net/core/rmem_default && touch {seen}"
    argv = ["sh", "-c", script]
    assert await rootfs.run(rootfs_helper, options, root, argv, ENV, hide_net_sysctls=True) == 0
    assert seen.exists()
    assert Path("/proc/sys/net/core/rmem_default").exists()


async def test_a_mount_that_fails_is_a_storage_failure_that_says_why(
    rootfs_helper: Path, tmp_path: Path
) -> None:
    _, root = overlay(tmp_path)
    bad = f"lowerdir={tmp_path}/missing,upperdir={tmp_path}/upper,workdir={tmp_path}/work"
    with pytest.raises(InfraFailure, match=r"cannot mount the sandbox root.*No such file") as exc:
        await rootfs.run(rootfs_helper, bad, root, ["true"], ENV)
    assert exc.value.reason == "storage"


async def test_a_program_that_cannot_start_is_a_runtime_failure(rootfs_helper: Path, tmp_path: Path) -> None:
    options, root = overlay(tmp_path)
    with pytest.raises(InfraFailure, match="cannot start /nonexistent") as exc:
        await rootfs.run(rootfs_helper, options, root, ["/nonexistent"], ENV)
    assert exc.value.reason == "runtime"


def test_new_sandbox_cpusets_get_their_parents_cpus_from_the_kernel(tmp_path: Path) -> None:
    name = cgroups.parent_name("cpuset-test", tmp_path)
    if not cgroups.prepare_cpuset_parent(name):
        pytest.skip("no cgroup v1 cpuset hierarchy")
    parent = cgroups.CGROUP_ROOT / "cpuset" / name
    try:
        assert (parent / "cgroup.clone_children").read_text().strip() == "1"
        child = parent / f"test-{uuid.uuid4().hex[:8]}"
        child.mkdir()
        try:  # crun's later write of the same values returns early in the kernel
            assert (child / "cpuset.cpus").read_text() == (parent / "cpuset.cpus").read_text() != "\n"
            assert (child / "cpuset.mems").read_text() == (parent / "cpuset.mems").read_text() != "\n"
        finally:
            child.rmdir()
    finally:
        parent.rmdir()


def test_only_the_cpu_quota_is_written_the_period_is_the_kernels_default() -> None:
    spec = ContainerSpec(image="x", cpu_cores_limit=0.5)
    config = oci.build_config(
        sandbox_id="s", spec=spec, user=User("root", 0, 0, "/root"), rootfs="/r",
        runtime_dir="/d", cgroup_path="/dsec/s",
    )  # fmt: skip
    assert config["linux"]["resources"]["cpu"]["quota"] == 50_000
    assert "period" not in config["linux"]["resources"]["cpu"]


async def test_a_sandbox_gets_no_session_keyring_of_its_own(made: Made) -> None:  # noqa: F811
    ctx, h = await sandbox(made)
    keys = await asyncio.to_thread(Path("/proc/keys").read_text)
    assert ctx.sandbox_id not in keys
    assert Path(f"/proc/{h.pid}/cmdline").exists()


async def test_a_sandboxs_cgroups_sit_in_a_bucket_of_the_parent_in_every_hierarchy(
    backend: ContainerBackend,  # noqa: F811
    made: Made,  # noqa: F811
) -> None:
    # Siblings are walked by each new cpuset: the node spreads sandboxes over 64 buckets.
    ctx, h = await sandbox(made)
    dirs = cgroups.sandbox_dirs(ctx.sandbox_id)
    bucket = cgroups.rel(ctx.sandbox_id).split("/")[1]
    assert len(dirs) == len(cgroups.hierarchies())
    assert {(d.parent.parent.name, d.parent.name) for d in dirs} == {(backend.cgroup_parent, bucket)}
    assert str(h.pid) in (cgroups.memory_dir(ctx.sandbox_id) / "cgroup.procs").read_text().split()
    spread = [cgroups.hashed_bucket(f"sb-{i}", "p").split("/")[1] for i in range(6400)]
    assert len(set(spread)) == cgroups.BUCKETS and max(map(spread.count, set(spread))) < 3 * 100


def test_a_sandbox_made_before_buckets_keeps_its_cgroup() -> None:
    # Still running after an edge upgrade: found where it was made (dsec/<id>), not re-bucketed.
    parent = cgroups.CGROUP_ROOT / "memory" / cgroups.LEGACY_PARENT
    made_parent = not parent.exists()
    old = parent / f"sb-old-{uuid.uuid4().hex[:8]}"
    old.mkdir(parents=True)
    try:
        assert cgroups.rel(old.name) == f"{cgroups.LEGACY_PARENT}/{old.name}"
        assert cgroups.memory_dir(old.name) == old
        assert old in cgroups.sandbox_dirs(old.name)
    finally:
        old.rmdir()
        if made_parent:
            parent.rmdir()
    assert cgroups.rel(old.name) != f"{cgroups.LEGACY_PARENT}/{old.name}"


async def test_an_init_that_never_answers_fails_the_start_and_says_so(
    rootfs_helper: Path, tmp_path: Path
) -> None:
    # --own-root: the program succeeded, but nothing at fd 3 said it runs (crun's init would).
    options, root = overlay(tmp_path)
    with pytest.raises(InfraFailure, match="own mount namespace: the sandbox's init did not start") as exc:
        await rootfs.run(rootfs_helper, options, root, ["sh", "-c", "exec 3>&-"], ENV, own_root=True)
    assert exc.value.reason == "runtime"
    assert await rootfs.run(rootfs_helper, options, root, ["sh", "-c", "exit 3"], ENV, own_root=True) == 3


async def test_a_crun_sandboxs_mount_namespace_holds_its_own_mounts_only(made: Made) -> None:  # noqa: F811
    # crun chroots in dsec-rootfs's namespace rather than pivot_root (whose walk over every task
    # on the host grew each create with the node); the host's tree must then leave it.
    _, h = await sandbox(made)
    init = h.pid
    script = "cat /proc/self/mountinfo; stat -c '%d %i' /; readlink /proc/1/exe; readlink /proc/1/fd/0"
    entered = await asyncio.to_thread(
        subprocess.run,
        ["nsenter", f"--mount=/proc/{init}/ns/mnt", f"--pid=/proc/{init}/ns/pid", "--", "sh", "-c", script],
        capture_output=True,
        text=True,
        check=False,
    )
    assert entered.returncode == 0, entered.stderr
    *mounts, root_id, exe, stdin = entered.stdout.splitlines()
    points = {line.split()[4] for line in mounts}
    kinds = {line.split()[4]: line.split(" - ")[1].split()[0] for line in mounts}
    assert kinds["/"] == "overlay", mounts
    expected = {"/", "/proc", "/dev", "/dev/pts", "/sys", "/.dsec"}
    assert expected <= points, mounts
    # Nothing of the host: every other mount masks or binds something in the sandbox's tree.
    masks = {"/etc/resolv.conf", *oci.MASKED_DIRS, *oci.MASKED_PATHS, *oci.READONLY_PATHS}
    lxcfs = {*(f"/proc/{name}" for name in nodefs.LXCFS_PROC_FILES), f"/sys/{nodefs.CPU_ONLINE}"}
    extra = points - expected - masks - lxcfs
    assert not extra, mounts
    host_root = Path("/").stat()
    assert root_id != f"{host_root.st_dev} {host_root.st_ino}"
    # The init moved to the root every entering process gets: its binary and stdio are there.
    inits_root = Path(f"/proc/{init}/root").stat()
    assert root_id == f"{inits_root.st_dev} {inits_root.st_ino}"
    assert (exe, stdin) == ("/.dsec/dsec-init", "/dev/null")


async def test_the_runtimes_detached_processes_are_the_spawners_and_it_reaps_them(made: Made) -> None:  # noqa: F811
    # Not the host's init's: what crun run --detach leaves (the init, crun's intermediate) is
    # reparented to the spawner, whose cost per child is known; the host's init on this
    # machine spent half a CPU on 2,000 such children (docs/decisions.md).
    ctx, h = await sandbox(made)
    spawner_pid = spawner._spawner._proc.pid  # type: ignore[union-attr]
    init = h.pid
    assert _linux.stat_fields(init)[1] == str(spawner_pid)  # type: ignore[index]
    left = Path(f"/proc/{spawner_pid}/task/{spawner_pid}/children").read_text().split()
    assert [p for p in left if (_linux.stat_fields(p) or ["gone"])[0] == "Z"] == []
    await made.backend.destroy(ctx.sandbox_id, h, ctx.workdir)
    await eventually(lambda: not Path(f"/proc/{init}").exists(), "the ended init reaped, no zombie")
