"""Container sandboxes: crun over an overlay of EROFS layers, mounted out of the host's sight.

The overlay root is mounted in a throw-away mount namespace created between fork and exec of
``crun run``; crun copies that namespace for the container, then the throw-away one dies. The
host's mount table therefore never grows with sandboxes (a long table slows every later
create and exec), and a sandbox's mounts vanish with its last process: nothing to unmount,
nothing to leak if the edge crashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from dsec import _linux
from dsec.backends.base import CreateContext, User
from dsec.backends.container import cgroups, oci
from dsec.backends.fncall import RUNNER_PATH as FNCALL_RUNNER
from dsec.density import memory
from dsec.executor.file_ops import FileOps, HostFileOps
from dsec.executor.files import SandboxFiles
from dsec.protocol.errors import InfraFailure

_CRUN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def _raise_nofile_limit() -> None:
    # The edge holds three pipes per live process and sandboxes want many files: the default
    # hard limit (1024-20000) is too small. Without CAP_SYS_RESOURCE this stays a best effort.
    ceiling = int(Path("/proc/sys/fs/nr_open").read_text())
    want = min(ceiling, 1 << 20)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < want or soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))


class ContainerBackend:
    name = "container"

    def __init__(self, data_dir: Path, *, runtime: str = "crun") -> None:
        self.data_dir = data_dir
        self.runtime = shutil.which(runtime) or runtime
        self.state_dir = data_dir / "run" / runtime
        self.runtime_dir = data_dir / "runtime"  # read-only tools bind-mounted at /.dsec

    def _cmd(self, *args: str, cpu_class: str = "ls") -> list[str]:
        # Best effort: SCHED_IDLE for crun and so for everything it starts (children inherit).
        idle = ["chrt", "--idle", "0"] if cpu_class == "be" else []
        return [*idle, self.runtime, "--root", str(self.state_dir), *args]

    async def prepare_node(self) -> None:
        await asyncio.to_thread(self._prepare_node)

    def _prepare_node(self) -> None:
        if not Path(self.runtime).exists():
            raise InfraFailure(f"OCI runtime {self.runtime!r} not found: install crun", reason="runtime")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        busybox = Path("/bin/busybox")
        target = self.runtime_dir / "busybox"
        if not busybox.exists():
            raise InfraFailure("/bin/busybox missing: install busybox-static", reason="runtime")
        if not target.exists() or target.stat().st_size != busybox.stat().st_size:
            shutil.copy2(busybox, target.with_suffix(".tmp"))
            target.with_suffix(".tmp").replace(target)
        # The FnCall runner runs in pool sandboxes from here (read-only, like busybox).
        runner = FNCALL_RUNNER.read_bytes()
        target = self.runtime_dir / "fncall-runner.py"
        if not target.exists() or target.read_bytes() != runner:
            target.with_suffix(".tmp").write_bytes(runner)
            target.with_suffix(".tmp").replace(target)
        cgroups.fix_hybrid_layout()
        _raise_nofile_limit()

    async def create(self, ctx: CreateContext) -> dict[str, Any]:
        try:
            return await self._start(ctx)
        except BaseException:
            await asyncio.shield(self.destroy(ctx.sandbox_id, {}, ctx.workdir))
            raise

    async def _start(self, ctx: CreateContext) -> dict[str, Any]:
        missing = [str(p) for p in ctx.layer_dirs if not p.is_dir()]
        if missing:
            raise InfraFailure(f"layer mounts missing on this node: {', '.join(missing)}", reason="storage")
        wd = ctx.workdir
        upper, work, rootfs, bundle = wd / "upper", wd / "work", wd / "rootfs", wd / "bundle"
        for d in (upper, work, rootfs, bundle):
            d.mkdir(parents=True, exist_ok=True)
        config = oci.build_config(
            sandbox_id=ctx.sandbox_id,
            spec=ctx.spec,
            user=ctx.user,
            rootfs=str(rootfs),
            runtime_dir=str(self.runtime_dir),
            cgroup_path=f"/{cgroups.PARENT}/{ctx.sandbox_id}",
            nofile=min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
        )
        (bundle / "config.json").write_text(json.dumps(config))
        # overlayfs lists lowerdirs top-most first; the spec lists base first.
        lower = ":".join(str(p) for p in reversed(ctx.layer_dirs))
        options = f"lowerdir={lower},upperdir={upper},workdir={work}"

        def enter_private_rootfs() -> None:
            _linux.private_mount_namespace()
            _linux.mount("overlay", str(rootfs), "overlay", 0, options)

        log = bundle / "crun.log"
        pid_file = bundle / "init.pid"
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._cmd(
                    "--log",
                    f"file:{log}",
                    "run",
                    "--detach",
                    "--bundle",
                    str(bundle),
                    cpu_class=ctx.spec.cpu_class,
                ),
                "--pid-file",
                str(pid_file),
                ctx.sandbox_id,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                env=_CRUN_ENV,
                preexec_fn=enter_private_rootfs,
            )
        except subprocess.SubprocessError as exc:
            # Raised when the overlay mount in the child failed; the child cannot say why.
            msg = f"cannot mount the sandbox root (overlay over {lower}): {exc}"
            raise InfraFailure(msg, reason="storage") from exc
        rc = await proc.wait()
        if rc != 0:
            detail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise InfraFailure(f"crun run failed (exit {rc}): {detail.strip()}", reason="runtime")
        pid = int(pid_file.read_text())
        return {"pid": pid, "start_time": _linux.proc_start_time(pid), "cpu_class": ctx.spec.cpu_class}

    async def alive(self, sandbox_id: str, handle: dict[str, Any]) -> bool:
        pid = int(handle.get("pid", 0))
        return pid > 0 and _linux.proc_start_time(pid) == handle.get("start_time")

    async def destroy(self, sandbox_id: str, handle: dict[str, Any], workdir: Path) -> None:
        proc = await asyncio.create_subprocess_exec(
            *self._cmd("delete", "--force", sandbox_id),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env=_CRUN_ENV,
        )
        await proc.wait()
        # crun removes the cgroups it made, unless it crashed or was never told about them.
        for _ in range(100):
            if not cgroups.sandbox_dirs(sandbox_id):
                break
            cgroups.remove(sandbox_id)
            await asyncio.sleep(0.01)
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(shutil.rmtree, workdir)
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.state_dir / sandbox_id)

    async def spawn(
        self,
        sandbox_id: str,
        handle: dict[str, Any],
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: User,
    ) -> asyncio.subprocess.Process:
        env_args: list[str] = []
        for key, value in env.items():
            env_args += ["--env", f"{key}={value}"]
        return await asyncio.create_subprocess_exec(
            *self._cmd(
                "exec",
                "--no-new-privs",
                "--user",
                f"{user.uid}:{user.gid}",
                "--cwd",
                cwd,
                *env_args,
                sandbox_id,
                cpu_class=handle.get("cpu_class", "ls"),
            ),
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=_CRUN_ENV,
            start_new_session=True,
        )

    @asynccontextmanager
    async def writable_layer(
        self, sandbox_id: str, handle: dict[str, Any], workdir: Path
    ) -> AsyncIterator[Path]:
        await self.freeze(sandbox_id, handle)
        try:
            yield workdir / "upper"
        finally:
            await self.thaw(sandbox_id, handle)

    async def freeze(self, sandbox_id: str, handle: dict[str, Any]) -> None:
        await cgroups.set_frozen(sandbox_id, True)  # the cgroup freezer: well under a millisecond

    async def thaw(self, sandbox_id: str, handle: dict[str, Any]) -> None:
        await cgroups.set_frozen(sandbox_id, False)

    async def page_out(self, sandbox_id: str, handle: dict[str, Any]) -> int:
        return await asyncio.to_thread(memory.page_out, cgroups.memory_dir(sandbox_id))

    async def prefetch(self, sandbox_id: str, handle: dict[str, Any]) -> int:
        return await asyncio.to_thread(memory.prefetch, cgroups.pids(sandbox_id))

    def memory_bytes(self, sandbox_id: str) -> int:
        return memory.usage_bytes(cgroups.memory_dir(sandbox_id))

    def root_path(self, handle: dict[str, Any]) -> str:
        return f"/proc/{int(handle['pid'])}/root"

    def files(self, handle: dict[str, Any], user: User) -> FileOps:
        return HostFileOps(SandboxFiles(self.root_path(handle), uid=user.uid, gid=user.gid))

    def oom_kills(self, sandbox_id: str) -> int:
        return cgroups.oom_kills(sandbox_id)

    def capabilities(self) -> dict[str, Any]:
        return {"pause": True, "fork_processes": False}  # no working checkpoint/restore here

    async def detach(self) -> None:
        return None  # the edge holds no connection to a container: its pipes are the sessions'

    async def release_node(self) -> None:
        cgroups.remove_parents()

    async def leftovers(self) -> list[str]:
        if not self.state_dir.is_dir():
            return []
        return sorted(p.name for p in self.state_dir.iterdir() if p.is_dir())
