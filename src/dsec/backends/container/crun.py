"""crun, the default runtime of container sandboxes (:class:`.runtime.OciRuntime`).

crun starts the sandbox and is then out of the way: the edge enters the sandbox's namespaces
and cgroups itself for every process (``dsec-enter``, native/enter.py: 2.3x faster than
``crun exec`` here, bench/exec.py, and nothing on the path scans global state), ends it by
SIGKILLing its init (teardown.py), and runs ``crun delete`` only for an init it could not end.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from dsec.backends.base import GuestLink, Spawned, User
from dsec.backends.container import teardown
from dsec.backends.container.handle import ContainerHandle
from dsec.executor.process import SandboxProcess
from dsec.native import enter, spawner

ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


class Crun:
    name = "crun"
    lxcfs = True
    reuses_cgroups = True
    own_root = True
    hides_net_sysctls = False
    host_terminals = False
    link_at_start = False

    def __init__(self, binary: str, state_dir: Path, enter_helper: Path) -> None:
        self.binary = binary
        self.state_dir = state_dir
        self.enter_helper = enter_helper  # built by the backend's prepare_node

    def cmd(self, *args: str) -> list[str]:
        return [self.binary, "--root", str(self.state_dir), *args]

    def require(self) -> None:
        pass  # prepare_node refused to start without it

    def adapt_config(self, config: dict[str, Any], rootfs: Path, link: GuestLink | None) -> dict[str, Any]:
        return config

    def run_argv(
        self, *, bundle: Path, log_file: Path, pid_file: Path, sandbox_id: str, link: GuestLink | None
    ) -> list[str]:
        return [
            *self.cmd(
                "--log",
                f"file:{log_file}",
                "run",
                "--detach",
                # The edge's session keyring, not one per sandbox: joining a named keyring
                # searches every keyring on the host by name (perf: O(sandboxes) per create),
                # and sandboxes cannot use keyrings at all (keyctl, add_key and request_key
                # fail under seccomp; dsec-enter's processes never had their own).
                "--no-new-keyring",
                # fd 3: dsec-rootfs --own-root's socket, over which the init gets its root.
                "--preserve-fds",
                "1",
                "--bundle",
                str(bundle),
            ),
            "--pid-file",
            str(pid_file),
            sandbox_id,
        ]

    def started(self, sandbox_id: str, handle: ContainerHandle) -> None:
        pass  # the init is all it needs

    def root_pid(self, handle: ContainerHandle) -> int:
        return handle.pid

    def netns_pid(self, handle: ContainerHandle) -> int | None:
        return handle.pid

    async def end(self, handle: ContainerHandle, memcg: Path) -> bool:
        return await teardown.end_processes(handle)

    async def delete(self, sandbox_id: str, *, ended: bool) -> None:
        # Ended: what `crun delete` would still do, the backend does (the cgroups no spare
        # took, crun's state directory): one process fewer per destroy. Else crun kills and
        # removes what is left.
        if ended:
            return
        proc = await spawner.create_subprocess_exec(
            *self.cmd("delete", "--force", sandbox_id),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env=ENV,
        )
        await proc.wait()

    def knows(self, sandbox_id: str) -> bool:
        return (self.state_dir / sandbox_id).is_dir()

    def known(self) -> list[str]:
        return [p.name for p in self.state_dir.iterdir() if p.is_dir()] if self.state_dir.is_dir() else []

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
        # In a cgroup of its own: a timeout ends all it started, detached or not.
        return await enter.spawn_command(
            sandbox_id, handle, argv, env=env, cwd=cwd, user=user, helper=self.enter_helper
        )

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
        return await enter.spawn_session(
            sandbox_id, handle, argv, env=env, cwd=cwd, user=user, helper=self.enter_helper, own_cgroup=True
        )

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
        return await enter.spawn_held(
            sandbox_id,
            handle,
            argv,
            env=env,
            cwd=cwd,
            user=user,
            helper=self.enter_helper,
            tty=tty,
            stdin=stdin,
        )
