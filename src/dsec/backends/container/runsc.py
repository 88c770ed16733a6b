"""runsc, gVisor's runtime (``runtime="gvisor"``), as a :class:`.runtime.OciRuntime`.

Whether runsc works on this node and how its sandboxes are configured is :mod:`.gvisor`'s;
how processes start inside is :mod:`.gvisor_exec`'s. Nothing inside is a host process, so
everything that entered crun's namespaces goes through runsc here, and the host reaches the
files through the gofer's root.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from dsec import _linux
from dsec.backends.base import GuestLink, Spawned, User
from dsec.backends.container import gvisor_exec, teardown
from dsec.backends.container.gvisor import GVisor
from dsec.backends.container.handle import ContainerHandle
from dsec.executor.process import SandboxProcess
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest


class Runsc:
    name = "runsc"
    lxcfs = False  # the sentry answers /proc itself
    reuses_cgroups = False  # runsc makes and removes its sentry's and gofer's cgroups
    own_root = False  # runsc copies the namespace dsec-rootfs mounted
    hides_net_sysctls = True  # see gvisor.py: its root-netns test
    host_terminals = True  # runsc imports a host terminal as the command's
    link_at_start = True  # netstack copies its namespace's links once, at start

    def __init__(self, gvisor: GVisor) -> None:
        self.gvisor = gvisor

    def require(self) -> None:
        self.gvisor.require()

    def adapt_config(self, config: dict[str, Any], rootfs: Path, link: GuestLink | None) -> dict[str, Any]:
        return self.gvisor.adapt_config(config, rootfs, link)

    def run_argv(
        self, *, bundle: Path, log_file: Path, pid_file: Path, sandbox_id: str, link: GuestLink | None
    ) -> list[str]:
        return self.gvisor.run_argv(
            bundle=bundle, log_file=log_file, pid_file=pid_file, sandbox_id=sandbox_id, link=link
        )

    def started(self, sandbox_id: str, handle: ContainerHandle) -> None:
        gofer = self.gvisor.gofer_pid(sandbox_id)
        if gofer <= 0:
            raise InfraFailure(f"runsc reports no gofer for {sandbox_id}", reason=InfraReason.runtime)
        handle.runtime = "gvisor"
        handle.gofer_pid = gofer
        handle.gofer_start_time = _linux.proc_start_time(gofer)

    def root_pid(self, handle: ContainerHandle) -> int:
        return handle.gofer_pid  # the gofer serves the root to the sentry, writing through

    def netns_pid(self, handle: ContainerHandle) -> int | None:
        return None  # netstack copied its links at start: one added now would go unseen

    async def end(self, handle: ContainerHandle, memcg: Path) -> bool:
        return await teardown.end_gvisor(handle, memcg)

    async def delete(self, sandbox_id: str, *, ended: bool) -> None:
        await self.gvisor.delete(sandbox_id)  # its state, whether or not its processes ended

    def knows(self, sandbox_id: str) -> bool:
        return self.gvisor.knows(sandbox_id)

    def known(self) -> list[str]:
        return self.gvisor.known()

    async def spawn(
        self,
        sandbox_id: str,
        handle: ContainerHandle,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: User,
    ) -> SandboxProcess:
        # Its processes live in the sentry: only runsc can start them.
        return await gvisor_exec.spawn(self.gvisor, sandbox_id, argv, env=env, cwd=cwd, user=user)

    async def spawn_session(
        self,
        sandbox_id: str,
        handle: ContainerHandle,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: User,
    ) -> SandboxProcess:
        # runsc exec holds the shell's stdin: 2 edge fds, as crun's
        return await gvisor_exec.spawn_session(self.gvisor, sandbox_id, argv, env=env, cwd=cwd, user=user)

    async def spawn_held(
        self,
        sandbox_id: str,
        handle: ContainerHandle,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: User,
        tty: int | None,
        stdin: bool,
    ) -> Spawned:
        proc = await gvisor_exec.spawn(
            self.gvisor,
            sandbox_id,
            argv,
            env=env,
            cwd=cwd,
            user=user,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            raise_signal=True,
            tty=tty,
        )
        if proc.inner_pid is None:  # it never ran: as a held process, a failed start
            err = await proc.communicate()
            raise InvalidRequest(f"cannot start {argv[0]!r}: {err[1].decode(errors='replace').strip()}")
        return Spawned(proc, proc.inner_pid, None)  # not a host process: signalled via runsc
