"""The OCI runtime under a container sandbox: what differs between crun and runsc (gVisor).

The container backend does everything the two share (bundle, overlay root, cgroups, disk
volumes, freezing, teardown order); an :class:`OciRuntime` does the rest. One is chosen per
sandbox, from the spec at create (``ContainerSpec.runtime``) and from the handle after
(``ContainerHandle.runtime``). Implementations: :class:`.crun.Crun` and :class:`.runsc.Runsc`.

To add a runtime: a module implementing this Protocol, a value of ``ContainerSpec.runtime``,
the backend's choice of it, and a variant of ``tests/backends/test_container_conformance.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from dsec.backends.base import GuestLink, Spawned, User
from dsec.backends.container.handle import ContainerHandle
from dsec.executor.process import SandboxProcess


class OciRuntime(Protocol):
    name: str  # the binary, in messages ("crun run failed")
    # Whether LXCFS's files are bound over the sandbox's /proc (its /proc is the host kernel's;
    # runsc answers /proc from its sentry).
    lxcfs: bool
    # Whether a destroyed sandbox's cgroups may serve the next create (spares.py), and so
    # whether a create takes a spare (runsc makes and removes its own).
    reuses_cgroups: bool
    # Whether dsec-rootfs hands the init the namespace it mounted (--own-root, crun's), rather
    # than leaving the runtime to copy the root into one of its own (runsc).
    own_root: bool
    # Whether a networked sandbox must not see the host's net sysctls (runsc's root-netns test).
    hides_net_sysctls: bool
    # Whether the sandbox's terminals are the host's: the host cannot reach the sentry's devpts.
    host_terminals: bool
    # Whether the sandbox reads its network links once, at start (netstack copies them then).
    link_at_start: bool

    def require(self) -> None:
        """Raise InvalidRequest when this node cannot run sandboxes on this runtime."""

    def adapt_config(self, config: dict[str, Any], rootfs: Path, link: GuestLink | None) -> dict[str, Any]:
        """The OCI config (oci.build_config's, crun's) as this runtime takes it."""

    def run_argv(
        self, *, bundle: Path, log_file: Path, pid_file: Path, sandbox_id: str, link: GuestLink | None
    ) -> list[str]:
        """The command that starts the sandbox detached and writes its init's PID to ``pid_file``."""

    def started(self, sandbox_id: str, handle: ContainerHandle) -> None:
        """Record in ``handle`` what this runtime needs beyond the init (runsc: its gofer)."""

    def root_pid(self, handle: ContainerHandle) -> int:
        """A host PID whose ``/proc/<pid>/root`` is the sandbox's root, writing through."""

    def netns_pid(self, handle: ContainerHandle) -> int | None:
        """A host PID in the sandbox's network namespace; None if a link added later goes unseen."""

    async def end(self, handle: ContainerHandle, memcg: Path) -> bool:
        """SIGKILL what runs the sandbox and wait until it has ended; False if that could not
        be told (then :meth:`delete` forces it)."""

    async def delete(self, sandbox_id: str, *, ended: bool) -> None:
        """Remove what the runtime itself still keeps of the sandbox (its state, a leftover
        process); ``ended``: :meth:`end` succeeded."""

    def knows(self, sandbox_id: str) -> bool:
        """Whether the runtime has state for ``sandbox_id`` (an orphan's destroy asks)."""

    def known(self) -> list[str]:
        """Sandbox IDs the runtime has state for."""

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
        """``argv`` inside, its stdio pipes the edge's, in a process group (and cgroup) of its own."""

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
        """A session shell at 2 of the edge's fds (its stdout and stderr pipes)."""

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
        """A process of the edge's process table (``HoldsProcesses.spawn_held``)."""
