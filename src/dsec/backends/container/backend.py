"""Container sandboxes: crun over an overlay of EROFS layers, mounted out of the host's sight.

The overlay root is mounted in a mount namespace of its own made by ``dsec-rootfs`` before it
runs ``crun run``; crun mounts the sandbox's filesystems there and chroots, and the helper
then takes the host's tree out of it, so the namespace becomes the container's (runsc copies
it instead). The host's mount table therefore never grows with sandboxes (a long table slows
every later create and exec), and a sandbox's mounts vanish with its last process: nothing
to unmount, nothing to leak if the edge crashes.

A sandbox with ``disk_limit_mb`` keeps its working directory in a btrfs subvolume with a
qgroup limit, on one quota file system per node (:mod:`.diskquota`, used through
:mod:`.volumes`); the edge's path for it is then a symlink there. Everything else about such
a sandbox is the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from dsec import _linux
from dsec.backends.base import HOST_PROCESSES, CreateContext, Spawned, User
from dsec.backends.container import cgroups, diskquota, gvisor, nodefs, oci, spares, teardown, volumes
from dsec.backends.container.crun import Crun
from dsec.backends.container.handle import ContainerHandle
from dsec.backends.container.runsc import Runsc
from dsec.backends.container.runtime import OciRuntime
from dsec.backends.handle import Handle
from dsec.density import coresched, memory
from dsec.edge.fncall import runner_zip
from dsec.executor.file_ops import FileOps, HostFileOps
from dsec.executor.files import SandboxFiles
from dsec.executor.process import SandboxProcess
from dsec.native import enter, init, rootfs, spawner
from dsec.protocol.errors import InfraFailure, InfraReason
from dsec.protocol.models import ContainerSpec

_CRUN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def _raise_nofile_limit() -> None:
    # The edge holds three pipes per live process and sandboxes want many files: the default
    # hard limit (1024-20000) is too small. Without CAP_SYS_RESOURCE this stays a best effort.
    ceiling = int(Path("/proc/sys/fs/nr_open").read_text())
    want = min(ceiling, 1 << 20)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < want or soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
        except (ValueError, OSError):
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# Each held sandbox is 2 processes (init, a session shell) and more while commands run: the
# kernel's default pid_max (32,768) would cap a node near 10,000 sandboxes. 4M is the maximum.
_PID_MAX = Path("/proc/sys/kernel/pid_max")
PID_MAX_WANTED = 1 << 22


def _raise_pid_max() -> None:
    with contextlib.suppress(OSError, ValueError):
        if int(_PID_MAX.read_text()) < PID_MAX_WANTED:
            _PID_MAX.write_text(f"{PID_MAX_WANTED}\n")


# A sandbox's network namespace gets socket hash tables of its own (Linux 6.1+ for TCP, 6.2+
# for UDP) instead of sharing the host's: reading /proc/net/tcp (ss, netstat, any port probe)
# walks the whole table, 262,144 buckets on this 24 GiB node, 4.7 ms of kernel time per read
# against 50 us with 1,024 (docs/decisions.md, "Socket tables of their own"). 1,024 TCP
# buckets: 8 KiB a sandbox, and room for 512 TIME_WAIT sockets (the kernel allows half);
# 128 is the smallest UDP table. Applies to namespaces made after it is set, by anyone.
CHILD_SOCKET_TABLES = {
    Path("/proc/sys/net/ipv4/tcp_child_ehash_entries"): 1024,
    Path("/proc/sys/net/ipv4/udp_child_hash_entries"): 128,
}


def _own_socket_tables() -> None:
    for knob, entries in CHILD_SOCKET_TABLES.items():
        with contextlib.suppress(OSError, ValueError):  # an older kernel: sandboxes share the host's
            if int(knob.read_text()) == 0:  # 0: shared; an operator's own size stands
                knob.write_text(f"{entries}\n")


def _remove_workdir(workdir: Path) -> None:
    if workdir.is_symlink():  # a quota'd sandbox's: its volume goes whole (destroy_volume)
        workdir.unlink()
    else:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(workdir)


class ContainerBackend:
    name = "container"
    handle_type = ContainerHandle

    def __init__(
        self,
        data_dir: Path,
        *,
        runtime: str = "crun",
        disk_quota_mb: int | None = None,
        spare_cgroups: int = spares.PER_BUCKET,
        node: str | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.node = node
        # The node's own parent cgroup (two nodes on one host never share one: cgroups.py).
        self.cgroup_parent = cgroups.parent_name(node, data_dir)
        self.runtime = shutil.which(runtime) or runtime
        self.state_dir = data_dir / "run" / runtime
        self.runtime_dir = data_dir / "runtime"  # read-only tools bind-mounted at /.dsec
        # The exec helper runs as root on the host: kept out of runtime_dir, which sandboxes mount.
        self.crun = Crun(self.runtime, self.state_dir, enter.helper_path(data_dir / "bin"))
        self.rootfs_helper = data_dir / "bin" / rootfs.NAME  # built by prepare_node
        self.spawn_helper = data_dir / "bin" / spawner.NAME  # built by prepare_node
        self.volumes = volumes.DiskVolumes(data_dir / "disk-quota", size_mb=disk_quota_mb)
        # runtime="gvisor" sandboxes (gvisor.py): runsc, when the node has a working one.
        self.gvisor = gvisor.GVisor(data_dir)
        self.runsc = Runsc(self.gvisor)
        # Chosen once per sandbox: from its spec at create, from its handle after.
        self.runtimes: dict[str, OciRuntime] = {"crun": self.crun, "gvisor": self.runsc}
        # Destroyed sandboxes' cgroups, kept for the next creates (spares.py); 0: none kept.
        self.spares = spares.SpareCgroups(self.cgroup_parent, spare_cgroups)
        # The runtime directory's own tmpfs and the node's LXCFS (nodefs.py).
        self.nodefs = nodefs.NodeFs(data_dir, self.runtime_dir)

    @property
    def enter_helper(self) -> Path:
        """dsec-enter, through which every process enters a crun sandbox (native/enter.py)."""
        return self.crun.enter_helper

    @enter_helper.setter
    def enter_helper(self, path: Path) -> None:
        self.crun.enter_helper = path

    def _runtime(self, handle: ContainerHandle) -> OciRuntime:
        """The runtime a sandbox was started on, which its handle names (crun's say nothing)."""
        return self.runtimes[handle.runtime or "crun"]

    async def prepare_node(self) -> None:
        await asyncio.to_thread(self._prepare_node)
        spawner.start(self.spawn_helper)  # from the loop's thread, before the edge holds fds
        await self.gvisor.probe(self.runtime_dir)  # once per runsc binary (cached on disk)

    def _prepare_node(self) -> None:
        if not Path(self.runtime).exists():
            raise InfraFailure(
                f"OCI runtime {self.runtime!r} not found: install crun", reason=InfraReason.runtime
            )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.nodefs.prepare()  # before anything is written into the runtime directory
        (self.runtime_dir / oci.EMPTY_DIR).mkdir(mode=0o555, exist_ok=True)
        nodefs.make_sys_skeleton(self.runtime_dir / oci.SYS_SKELETON)
        busybox = Path("/bin/busybox")
        target = self.runtime_dir / "busybox"
        if not busybox.exists():
            raise InfraFailure("/bin/busybox missing: install busybox-static", reason=InfraReason.runtime)
        if not target.exists() or target.stat().st_size != busybox.stat().st_size:
            shutil.copy2(busybox, target.with_suffix(".tmp"))
            target.with_suffix(".tmp").replace(target)
        # The FnCall runner runs in pool sandboxes from here (read-only, like busybox).
        runner = runner_zip()
        target = self.runtime_dir / "fncall-runner.py"
        if not target.exists() or target.read_bytes() != runner:
            target.with_suffix(".tmp").write_bytes(runner)
            target.with_suffix(".tmp").replace(target)
        cgroups.fix_hybrid_layout()
        cgroups.register_parent(self.node, self.cgroup_parent)
        cgroups.prepare_cpuset_parent(self.cgroup_parent)
        cgroups.prepare_buckets(self.cgroup_parent)
        self.spares.clear()  # an earlier edge's: a cache, never adopted
        cgroups.adopt(self.cgroup_parent, self.node)  # where its running sandboxes are
        _raise_nofile_limit()
        _raise_pid_max()
        _own_socket_tables()
        self.enter_helper = enter.build_helper(self.data_dir / "bin")  # gcc once per source version
        init.install_init(self.data_dir / "bin", self.runtime_dir)  # PID 1 of every sandbox
        self.rootfs_helper = rootfs.build_helper(self.data_dir / "bin")
        self.spawn_helper = spawner.build_helper(self.data_dir / "bin")
        self.volumes.remount()

    @property
    def disk_quota(self) -> diskquota.QuotaFs:
        """The node's quota file system (disk_limit_mb), made on first use."""
        return self.volumes.fs

    async def create(self, ctx: CreateContext) -> ContainerHandle:
        try:
            return await self._start(ctx)
        except BaseException:
            await asyncio.shield(self.destroy(ctx.sandbox_id, ContainerHandle(), ctx.workdir))
            raise

    async def _start(self, ctx: CreateContext) -> ContainerHandle:
        rt = self.runtimes[ctx.spec.runtime]
        rt.require()
        missing = [str(p) for p in ctx.layer_dirs if not p.is_dir()]
        if missing:
            raise InfraFailure(
                f"layer mounts missing on this node: {', '.join(missing)}", reason=InfraReason.storage
            )
        wd = ctx.workdir
        limit_mb = ctx.spec.disk_limit_mb
        if limit_mb is not None:
            wd = await self.volumes.create(ctx.sandbox_id, ctx.workdir, limit_mb)
        upper, work, root, bundle = wd / "upper", wd / "work", wd / "rootfs", wd / "bundle"
        for d in (upper, work, root, bundle):
            d.mkdir(parents=True, exist_ok=True)
        # A destroyed sandbox's cgroups, if the node keeps some (spares.py): crun then makes none.
        kept_quota = self.spares.take(ctx.sandbox_id) if rt.reuses_cgroups else None
        if rt.lxcfs and not self.nodefs.lxcfs.healthy():  # its files are bound below
            await asyncio.to_thread(self.nodefs.lxcfs.ensure)
        if not cgroups.is_placed(ctx.sandbox_id):  # no spare: crun makes them in its ID's bucket
            cgroups.place(ctx.sandbox_id, cgroups.hashed_bucket(ctx.sandbox_id, self.cgroup_parent))
        config = oci.build_config(
            sandbox_id=ctx.sandbox_id,
            spec=ctx.spec,
            user=ctx.user,
            rootfs=str(root),
            runtime_dir=str(self.runtime_dir),
            cgroup_path=f"/{cgroups.rel(ctx.sandbox_id)}",
            nofile=min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
            resolv_conf=self._resolv_conf(ctx.nameserver),
            cpu_quota_set=kept_quota == oci.cpu_quota(ctx.spec),
            lxcfs=self.nodefs.lxcfs.path if rt.lxcfs else None,
            volume_mounts=ctx.volume_mounts,
        )
        config = rt.adapt_config(config, root, ctx.link)
        (bundle / "config.json").write_text(json.dumps(config))
        # overlayfs lists lowerdirs top-most first; the spec lists base first.
        lower = ":".join(str(p) for p in reversed(ctx.layer_dirs))
        # Not volatile, although its unmount (the init's exit) then syncs the upper's whole host
        # file system: that sync is what lets the sandbox's memory cgroup die at destroy
        # (docs/decisions.md: "The root overlay stays not `volatile`").
        options = f"lowerdir={lower},upperdir={upper},workdir={work}"

        # LS on an SMT node with core scheduling: a fresh cookie before crun execs, so crun and
        # all it forks (the init first) share it, with no window and no fix-up afterwards.
        cookie = coresched.wants_cookie(ctx.spec.cpu_class, coresched.node_support())
        log = bundle / "crun.log"
        pid_file = bundle / "init.pid"
        run = rt.run_argv(
            bundle=bundle, log_file=log, pid_file=pid_file, sandbox_id=ctx.sandbox_id, link=ctx.link
        )
        if ctx.spec.cpu_class == "be":
            # Best effort: SCHED_IDLE for the runtime and so for everything it starts (children inherit).
            run = ["chrt", "--idle", "0", *run]
        # Mounted by dsec-rootfs after a vfork+exec (native/rootfs.py): a preexec_fn would fork the
        # whole edge, whose page tables grow with the sandboxes it holds.
        rc = await rootfs.run(
            self.rootfs_helper,
            options,
            root,
            run,
            _CRUN_ENV,
            new_core_cookie=cookie,
            hide_net_sysctls=rt.hides_net_sysctls and ctx.link is not None,
            own_root=rt.own_root,
        )
        if rc != 0:
            detail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise InfraFailure(
                f"{rt.name} run failed (exit {rc}): {detail.strip()}", reason=InfraReason.runtime
            )
        pid = int(pid_file.read_text())  # gVisor: the sentry, whose death is the sandbox's
        handle = ContainerHandle(
            pid=pid, start_time=_linux.proc_start_time(pid), cpu_class=ctx.spec.cpu_class
        )
        if cookie:
            handle.core_cookie = True  # dsec-enter makes every later process share the init's
        if ctx.spec.allow_setuid:
            handle.allow_setuid = True  # dsec-enter leaves no_new_privs off: sudo works
        rt.started(ctx.sandbox_id, handle)
        if limit_mb is not None:
            handle.disk_limit_mb = limit_mb
        return handle

    async def alive(self, sandbox_id: str, handle: Handle) -> bool:
        h = ContainerHandle.of(handle)
        return h.pid > 0 and _linux.proc_start_time(h.pid) == h.start_time

    async def destroy(self, sandbox_id: str, handle: Handle, workdir: Path) -> None:
        h = ContainerHandle.of(handle)
        memcg = cgroups.sandbox_dir("memory", sandbox_id)
        # An empty handle (no record of the sandbox): runsc's state says whether it was gVisor's.
        rt = self.runsc if self.runsc.knows(sandbox_id) else self._runtime(h)
        ended = await rt.end(h, memcg)
        if ended:
            # Nothing runs in it any more: its written pages go with its files, and what it
            # still has charged is reclaimed, so its memory cgroup dies with it (teardown.py);
            # on gVisor before runsc removes the cgroups (else they stay dying).
            await self._remove_writable_layer(sandbox_id, workdir)
            await teardown.release(memcg)
            if rt.reuses_cgroups:
                self.spares.give(sandbox_id)
        await rt.delete(sandbox_id, ended=ended)
        # The cgroups no spare took (`crun delete` removes its own, unless it crashed or was
        # never told about them).
        for _ in range(100):
            if not cgroups.sandbox_dirs(sandbox_id):
                break
            cgroups.remove(sandbox_id)
            await asyncio.sleep(0.01)
        if not ended:
            await self._remove_writable_layer(sandbox_id, workdir)
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.state_dir / sandbox_id)
        cgroups.forget(sandbox_id)

    async def _remove_writable_layer(self, sandbox_id: str, workdir: Path) -> None:
        """Its work directory and, with a disk limit, its volume; nothing if already gone."""
        await asyncio.to_thread(_remove_workdir, workdir)
        await self.volumes.destroy(sandbox_id)

    async def spawn(
        self, sandbox_id: str, handle: Handle, argv: list[str], *, env: dict[str, str], cwd: str, user: User
    ) -> SandboxProcess:
        h = ContainerHandle.of(handle)
        return await self._runtime(h).spawn(sandbox_id, h, argv, env=env, cwd=cwd, user=user)

    async def spawn_session(
        self, sandbox_id: str, handle: Handle, argv: list[str], *, env: dict[str, str], cwd: str, user: User
    ) -> SandboxProcess:
        h = ContainerHandle.of(handle)
        return await self._runtime(h).spawn_session(sandbox_id, h, argv, env=env, cwd=cwd, user=user)

    async def spawn_held(
        self,
        sandbox_id: str,
        handle: Handle,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: User,
        tty: int | None,
        stdin: bool,
    ) -> Spawned:
        h = ContainerHandle.of(handle)
        rt = self._runtime(h)
        return await rt.spawn_held(sandbox_id, h, argv, env=env, cwd=cwd, user=user, tty=tty, stdin=stdin)

    @asynccontextmanager
    async def writable_layer(self, sandbox_id: str, handle: Handle, workdir: Path) -> AsyncIterator[Path]:
        await self.freeze(sandbox_id, handle)
        try:
            if ContainerHandle.of(handle).disk_limit_mb:
                # A pack copies the directories of a possibly full volume into the same volume
                # (hard links cannot cross volumes): lifted while frozen, restored by thaw.
                await self.volumes.set_limit(sandbox_id, None)
            yield workdir / "upper"
        finally:
            await self.thaw(sandbox_id, handle)

    async def freeze(self, sandbox_id: str, handle: Handle) -> None:
        await cgroups.set_frozen(sandbox_id, True)  # the cgroup freezer: well under a millisecond

    async def thaw(self, sandbox_id: str, handle: Handle) -> None:
        limit_mb = ContainerHandle.of(handle).disk_limit_mb
        if limit_mb:
            # Always (re)applied before the sandbox runs again: also after an edge that died
            # in the middle of a pack, whose restart thaws every running sandbox.
            await self.volumes.set_limit(sandbox_id, limit_mb << 20)
        await cgroups.set_frozen(sandbox_id, False)

    async def page_out(self, sandbox_id: str, handle: Handle) -> int:
        return await asyncio.to_thread(memory.page_out, cgroups.memory_dir(sandbox_id))

    async def prefetch(self, sandbox_id: str, handle: Handle) -> int:
        return await asyncio.to_thread(memory.prefetch, cgroups.pids(sandbox_id))

    def memory_bytes(self, sandbox_id: str) -> int:
        return memory.usage_bytes(cgroups.memory_dir(sandbox_id))

    def _resolv_conf(self, nameserver: str | None) -> str | None:
        """The node's resolv.conf for sandboxes (read-only inside): the edge's name server."""
        if nameserver is None:
            return None
        path = self.runtime_dir / f"resolv.conf.{nameserver}"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_text(f"nameserver {nameserver}\noptions timeout:1 attempts:1\n")
            tmp.rename(path)
        return str(path)

    def host_terminals(self, handle: Handle) -> bool:
        """Whether this sandbox's terminals are the host's (gVisor: the host cannot reach the
        sentry's devpts; runsc imports a host terminal) rather than its own devpts'."""
        return self._runtime(ContainerHandle.of(handle)).host_terminals

    def link_at_start(self, spec: ContainerSpec) -> bool:
        return self.runtimes[spec.runtime].link_at_start

    def netns_pid(self, handle: Handle) -> int | None:
        h = ContainerHandle.of(handle)
        return self._runtime(h).netns_pid(h)

    def root_path(self, handle: Handle) -> str:
        h = ContainerHandle.of(handle)
        return f"/proc/{self._runtime(h).root_pid(h)}/root"

    def files(self, handle: Handle, user: User) -> FileOps:
        return HostFileOps(SandboxFiles(self.root_path(handle), uid=user.uid, gid=user.gid))

    def oom_kills(self, sandbox_id: str) -> int:
        return cgroups.oom_kills(sandbox_id)

    def capabilities(self) -> dict[str, Any]:
        # no working checkpoint/restore here
        caps: dict[str, Any] = {
            "pause": True,
            "fork_processes": False,
            # What spawn starts is a host process, on crun and gVisor alike (runsc exec is one)
            HOST_PROCESSES: True,
            "disk_quota": self.volumes.why_not is None,
            "disk_quota_mb": self.volumes.capacity_mb() if self.volumes.why_not is None else 0,
            "gvisor": self.gvisor.available,  # runtime="gvisor": placement asks for this
            # crun: each process the edge starts has a Landlock domain (native/enter.py)
            "isolated_entrances": enter.entrances_isolated(),
            **coresched.capabilities(),  # core_scheduling (LS: an SMT core of its own) or why not
        }
        if not self.gvisor.available:
            caps["gvisor_missing"] = self.gvisor.why_not
        return caps

    async def detach(self) -> None:
        # The edge holds no connection to a container (its pipes are the sessions'); spare
        # cgroups are a cache of this edge's. Its empty buckets go too (no create is in flight
        # now; the next start makes them again): a node that ran no sandbox leaves no parent.
        await asyncio.to_thread(self.spares.clear)
        await asyncio.to_thread(cgroups.remove_parents, self.cgroup_parent)
        if not await self.leftovers():  # no sandbox binds the node's file systems any more
            await asyncio.to_thread(self.nodefs.release)

    async def release_node(self) -> None:
        await asyncio.to_thread(self.spares.clear)
        if not await self.leftovers():
            await asyncio.to_thread(self.nodefs.release)
        cgroups.remove_parents(self.cgroup_parent)
        await self.volumes.release()

    async def leftovers(self) -> list[str]:
        known = set(await self.volumes.volumes())
        known.update(self.crun.known(), self.runsc.known())
        return sorted(known)
