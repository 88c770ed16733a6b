"""The seam between the edge and a sandbox runtime.

A backend turns a validated spec plus mounted layers into a running, isolated sandbox, starts
processes inside it on the edge's behalf, and tears it down. Everything a backend needs to find
its sandbox again after an edge restart goes into the ``handle`` it returns (its own model on
:class:`~dsec.backends.handle.Handle`), which the edge journals as JSON. Every implementation
passes ``tests/backends/conformance.py``.
"""

from __future__ import annotations

import math
import os
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from dsec.backends.handle import ForkSource, Handle
from dsec.executor.file_ops import FileOps
from dsec.executor.process import SandboxProcess
from dsec.protocol.egress_headers import CA_ENV
from dsec.protocol.models import ContainerSpec, InputEvent


@dataclass(frozen=True)
class User:
    """The sandbox's initial user, resolved against the image's /etc/passwd."""

    name: str
    uid: int
    gid: int
    home: str


# A key of :meth:`Backend.capabilities`: whether the processes :meth:`Backend.spawn` starts are
# processes of this host (their PID and process group are the host's), as a container's are; a
# VM's run on its own kernel (their PIDs are the guest's). Every backend reports it.
HOST_PROCESSES = "host_processes"

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def sandbox_env(spec: ContainerSpec, user: User, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every process the edge starts in a sandbox: defaults, spec, request."""
    env = {"PATH": DEFAULT_PATH, "HOME": user.home, "USER": user.name, "LANG": "C.UTF-8", "TERM": "dumb"}
    # nproc(1) counts the CPUs it may run on (sched_getaffinity), which LXCFS does not change
    # and a cpuset per sandbox would pin; it honours OMP_NUM_THREADS first (as do OpenMP,
    # OpenBLAS and numpy). Unset when the limit is the node's whole.
    cores = math.ceil(spec.cpu_cores_limit)
    if cores < (os.cpu_count() or cores + 1):
        env["OMP_NUM_THREADS"] = str(cores)
    if spec.egress_headers:  # the node's CA is in the system bundle: Node and requests too
        env.update(CA_ENV)
    env.update(spec.env)
    env.update(extra or {})
    return env


@dataclass
class GuestLink:
    """A network link the edge makes before the sandbox starts: a VM's tap device on the host,
    or a veth whose sandbox end is in a fresh network namespace ``netns`` for the runtime to
    start in (gVisor); the sandbox's address on it, and the gateway (the host end, also the
    name server)."""

    ifname: str
    address: str
    gateway: str
    netns: str | None = None  # a veth's: the path of the namespace holding its sandbox end


@dataclass
class CreateContext:
    sandbox_id: str
    spec: ContainerSpec
    layer_dirs: list[Path]  # mounted layers, base first
    user: User
    workdir: Path  # per-sandbox directory on local disk owned by the edge
    handle: Handle = field(default_factory=Handle)  # what a failed create left (the fake's)
    layer_digests: list[str] = field(default_factory=list)  # the same layers (a VM attaches their files)
    nameserver: str | None = None  # what the sandbox resolves names with (the edge's, on its link)
    # Shared volumes: sandbox path -> host directory (edge/volumes.py checked they are its project's).
    volume_mounts: dict[str, str] = field(default_factory=dict)
    link: GuestLink | None = None  # made before the start when the spec has network rules: a VM's
    # tap (Tapped backends), or a namespace with a veth (Networked ones whose link_at_start says so)


class Backend(Protocol):
    name: str

    @property
    def handle_type(self) -> type[Handle]:
        """This backend's handle model: the edge reads journaled handles back as it."""
        ...

    async def prepare_node(self) -> None:
        """Node-level set-up, idempotent; called once when the edge starts."""

    async def create(self, ctx: CreateContext) -> Handle:
        """Start the sandbox; on failure leave nothing behind and raise a DSecError."""

    async def alive(self, sandbox_id: str, handle: Handle) -> bool:
        """Whether a sandbox journaled as running still runs (used to re-adopt after restart)."""

    async def destroy(self, sandbox_id: str, handle: Handle, workdir: Path) -> None:
        """Kill every process, release every mount, cgroup and namespace. Idempotent."""

    async def spawn(
        self,
        sandbox_id: str,
        handle: Handle,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: User,
    ) -> SandboxProcess:
        """Start ``argv`` inside the sandbox with stdin/stdout/stderr pipes held by the edge.

        The process leads its own process group so a timeout can kill its whole tree.
        """

    def writable_layer(
        self, sandbox_id: str, handle: Handle, workdir: Path
    ) -> AbstractAsyncContextManager[Path]:
        """The sandbox's own writes as an overlay upper directory on the host (whiteouts and
        opaque directories included: what a pack stores and what changes are read from),
        unchanging while the context is open (the sandbox is frozen meanwhile, or the
        directory is a copy)."""

    async def freeze(self, sandbox_id: str, handle: Handle) -> None:
        """Stop every process of the sandbox in place (so a commit sees a quiet file system)."""

    async def thaw(self, sandbox_id: str, handle: Handle) -> None:
        """Undo :meth:`freeze`. Both are idempotent."""

    async def page_out(self, sandbox_id: str, handle: Handle) -> int:
        """Push a frozen sandbox's memory out of RAM; returns the bytes no longer resident."""

    async def prefetch(self, sandbox_id: str, handle: Handle) -> int:
        """Bring paged-out memory back ahead of a thaw; returns the bytes advised (best effort)."""

    def memory_bytes(self, sandbox_id: str) -> int:
        """RAM the sandbox is charged for now."""

    def files(self, handle: Handle, user: User) -> FileOps:
        """The sandbox's files, as ``user`` would create them (owner of new files)."""

    def oom_kills(self, sandbox_id: str) -> int:
        """How many processes of this sandbox the kernel has OOM-killed so far."""

    def capabilities(self) -> dict[str, Any]:
        """What this node's instance of the backend offers (reported to the watcher), among
        them :data:`HOST_PROCESSES`."""

    async def detach(self) -> None:
        """Let go of connections to running sandboxes: the edge stops, they keep running."""

    async def release_node(self) -> None:
        """Undo node-level set-up that is per edge (called when it stops with no sandboxes)."""

    async def leftovers(self) -> list[str]:
        """Sandbox IDs the runtime still knows of (the edge destroys those it has no record of)."""


@runtime_checkable
class Display(Protocol):
    """A backend whose sandboxes have a screen and input devices (full VMs)."""

    async def screenshot(self, sandbox_id: str, handle: Handle) -> bytes:
        """The screen now, as a PNG."""
        ...

    async def send_input(self, sandbox_id: str, handle: Handle, events: list[InputEvent]) -> int:
        """Keyboard and mouse events, in order; returns how many low-level events were sent."""
        ...


@runtime_checkable
class Forkable(Protocol):
    """A backend that copies a running sandbox whole, processes and memory included (VMs)."""

    async def fork_source(self, sandbox_id: str, handle: Handle) -> ForkSource:
        """Save the sandbox as it is now (memory, devices, disk) for copies to start from; the
        sandbox itself carries on."""
        ...

    async def create_fork(self, ctx: CreateContext, source: ForkSource) -> Handle:
        """Start a copy from ``source``; like :meth:`Backend.create`, it leaves nothing on failure."""
        ...

    async def release_fork_source(self, source: ForkSource) -> None:
        """The copies are made: the source goes once no copy needs it any more."""
        ...


@dataclass
class Spawned:
    """A process the edge keeps in its process table (see :class:`HoldsProcesses`)."""

    proc: SandboxProcess  # returncode -N for a death by signal N (never 128+N)
    pid: int  # its PID as the sandbox sees it
    host_pid: int | None  # the process itself on this host (None: gone before it was seen)


@runtime_checkable
class HoldsSessions(Protocol):
    """A backend that starts session shells its own way, holding fewer of the edge's fds per
    idle session than :meth:`Backend.spawn` (containers: 2 rather than 4)."""

    async def spawn_session(
        self,
        sandbox_id: str,
        handle: Handle,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: User,
    ) -> SandboxProcess: ...


@runtime_checkable
class HoldsProcesses(Protocol):
    """A backend that starts the long-lived processes of the edge's process table itself:
    with their PID as the sandbox sees it, and optionally on a pseudo-terminal (containers).
    Others are driven through :meth:`Backend.spawn`, with pipes only."""

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
        """``tty``: the slave of a pseudo-terminal the edge holds the master of, to be the
        process's stdio and controlling terminal; else pipes (``stdin=False``: /dev/null)."""
        ...


@runtime_checkable
class HostRooted(Protocol):
    """A backend whose sandbox root the edge reaches as a host path (directory watches)."""

    def root_path(self, handle: Handle) -> str: ...


@runtime_checkable
class CollectsUnused(Protocol):
    """A backend keeping node-local files of its own that outlive sandboxes (a full VM's base
    images): the layer gc's round through the edges lets it remove the ones nobody uses."""

    def collect_unused(self) -> list[str]:
        """Remove what no sandbox of this node uses any more; returns what went."""
        ...


@runtime_checkable
class Tapped(Protocol):
    """A backend whose sandboxes (VMs) reach the network through a tap device: the edge makes
    it before the VM starts (``CreateContext.link``) when the spec names network rules, since
    QEMU attaches it at start; a VM created without rules has no network card to grant to."""

    def has_link(self, handle: Handle) -> bool:
        """Whether this sandbox was started with a network card on a tap."""
        ...


@runtime_checkable
class Networked(Protocol):
    """A backend whose sandboxes sit in a Linux network namespace the edge can enter, so
    network permissions can give them a link (containers; VMs would need a tap device)."""

    def link_at_start(self, spec: ContainerSpec) -> bool:
        """Whether a sandbox of ``spec`` reads its network links once, when it starts (gVisor's
        netstack copies its namespace's interfaces then): given network rules, it is started
        in a namespace that has its link already (``CreateContext.link``), and without them it
        can never get one."""
        ...

    def netns_pid(self, handle: Handle) -> int | None:
        """A PID whose network namespace is the sandbox's, to add a link to while it runs;
        None when a link added then would not be seen (see :meth:`link_at_start`)."""
