"""The blocking SDK, generated from the async one by ``python -m dsec.sdk._sync.codegen``.

Do not edit: change the async classes and run the command again (a test fails while this file
is stale). Each method forwards to the async method of the same name through the sync facade's
portal (:mod:`dsec.sdk._sync`); the file exists so that type checkers see real signatures.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, Literal, cast

import dsec.sdk._pty as _pty
import dsec.sdk.client as _client
from dsec.images.vm_images import VmImageInfo
from dsec.protocol.errors import DSecError
from dsec.protocol.fncall import FnResult, FnTask
from dsec.protocol.models import (
    Change,
    CommandResult,
    FileStat,
    InputEvent,
    LayerInfo,
    LeaseResult,
    NetworkRules,
    SandboxInfo,
    TrajectoryEntry,
)
from dsec.protocol.processes import ProcessEvent
from dsec.protocol.volumes import DEFAULT_SIZE_MB, VolumeEntry, VolumeInfo
from dsec.sdk._sync import SyncWrapper
from dsec.sdk._transport import Transport
from dsec.sdk.args import DSecContainerRunArgs, DSecMicroVMRunArgs, DSecVMRunArgs
from dsec.sdk.build import BuildEvent
from dsec.sdk.client import ExecChunk


class SyncPty(SyncWrapper, async_cls=_pty.Pty):
    """Blocking handle on a program on a terminal: the methods of :class:`Pty`, without ``await``."""

    def __init__(
        self, transport: Transport, sandbox_id: str, pid: int, events: Iterator[ProcessEvent]
    ) -> None:
        self._dsec_construct(transport, sandbox_id, pid, events)

    @property
    def pid(self) -> int:
        return cast("int", self._dsec_get("pid"))

    @pid.setter
    def pid(self, value: int) -> None:
        self._dsec_set("pid", value)

    @property
    def exit_code(self) -> int | None:
        return cast("int | None", self._dsec_get("exit_code"))

    @exit_code.setter
    def exit_code(self, value: int | None) -> None:
        self._dsec_set("exit_code", value)

    @property
    def error(self) -> str | None:
        return cast("str | None", self._dsec_get("error"))

    @error.setter
    def error(self, value: str | None) -> None:
        self._dsec_set("error", value)

    def output(self) -> Iterator[bytes]:
        """The terminal's bytes as they come, until the program ends (then ``exit_code`` is set)."""
        return cast("Iterator[bytes]", self._dsec_call("output"))

    def wait(self) -> int:
        """Discard the output until the program ends; its exit code."""
        return cast("int", self._dsec_call("wait"))

    def write(self, data: bytes | str) -> None:
        r"""Type ``data`` (bytes as a terminal sends them: ``b"\x03"`` is ^C, ``b"\x04"`` ^D)."""
        self._dsec_call("write", data)

    def resize(self, rows: int, cols: int) -> None:
        """Set the terminal's size; the program gets SIGWINCH."""
        self._dsec_call("resize", rows, cols)

    def signal(self, signal: int) -> None:
        """Send ``signal`` to the program and everything it started; SIGHUP also hangs its
        terminal up (what :meth:`close` sends).
        """
        self._dsec_call("signal", signal)

    def close(self) -> None:
        """Hang up, as a closing terminal does: a program still running gets SIGHUP and its
        terminal's reads end (also for one that ignores SIGHUP), then the stream is dropped.
        """
        self._dsec_call("close")

    def __enter__(self) -> SyncPty:
        return cast("SyncPty", self._dsec_call("__aenter__"))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._dsec_call("__aexit__", exc_type, exc, tb)


class SyncSandbox(SyncWrapper, async_cls=_client.Sandbox, wrap=[SyncPty]):
    """Blocking handle on one sandbox: the methods of :class:`Sandbox`, without ``await``."""

    def __init__(self, transport: Transport, info: SandboxInfo) -> None:
        self._dsec_construct(transport, info)

    @property
    def info(self) -> SandboxInfo:
        return cast("SandboxInfo", self._dsec_get("info"))

    @info.setter
    def info(self, value: SandboxInfo) -> None:
        self._dsec_set("info", value)

    @property
    def id(self) -> str:
        return cast("str", self._dsec_get("id"))

    @id.setter
    def id(self, value: str) -> None:
        self._dsec_set("id", value)

    def refresh(self) -> SandboxInfo:
        return cast("SandboxInfo", self._dsec_call("refresh"))

    def stop(self) -> SandboxInfo:
        return cast("SandboxInfo", self._dsec_call("stop"))

    def set_network_rules(
        self,
        rules: NetworkRules,
        egress_headers: dict[str, dict[str, str]] | None = None,
        egress_secrets: dict[str, str] | None = None,
    ) -> SandboxInfo:
        """Replace this sandbox's network permissions (names the node's operator configured,
        e.g. ``{"pypi": True}``); they are in force in the kernel when this returns. Given
        ``egress_headers`` (host -> headers, values may name ``egress_secrets`` as
        ``${secrets.<name>}``) replace the sandbox's; None keeps them.
        """
        return cast(
            "SandboxInfo", self._dsec_call("set_network_rules", rules, egress_headers, egress_secrets)
        )

    def run_shell(
        self,
        command: str,
        *,
        session: str = "default",
        timeout: float | None = None,
        max_output_bytes: int | None = None,
        idempotency_key: str | None = None,
    ) -> CommandResult:
        """Run ``command`` in a named shell session that keeps cwd and variables between calls.

        A command that runs past ``timeout`` is killed with its session; the result then has
        ``timed_out=True`` and the next call on that session starts a fresh shell. With an
        ``idempotency_key`` the command runs at most once in this sandbox: a repeat (a
        restarted agent loop replaying its history) gets the recorded result.
        """
        return cast(
            "CommandResult",
            self._dsec_call(
                "run_shell",
                command,
                session=session,
                timeout=timeout,
                max_output_bytes=max_output_bytes,
                idempotency_key=idempotency_key,
            ),
        )

    def exec_stream(
        self,
        argv: list[str],
        *,
        stdin: bytes | str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        max_output_bytes: int | None = None,
        idempotency_key: str | None = None,
    ) -> Iterator[ExecChunk | CommandResult]:
        """Run ``argv`` (no shell) and yield its output as it comes; the last item is the result.

        With an ``idempotency_key`` it runs at most once, to its end even if this caller goes
        away; a repeat streams the recorded output.
        """
        return cast(
            "Iterator[ExecChunk | CommandResult]",
            self._dsec_call(
                "exec_stream",
                argv,
                stdin=stdin,
                env=env,
                cwd=cwd,
                timeout=timeout,
                max_output_bytes=max_output_bytes,
                idempotency_key=idempotency_key,
            ),
        )

    def exec(
        self,
        argv: list[str],
        *,
        stdin: bytes | str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        max_output_bytes: int | None = None,
        idempotency_key: str | None = None,
    ) -> CommandResult:
        """Run ``argv`` (no shell) to its end and collect its output."""
        return cast(
            "CommandResult",
            self._dsec_call(
                "exec",
                argv,
                stdin=stdin,
                env=env,
                cwd=cwd,
                timeout=timeout,
                max_output_bytes=max_output_bytes,
                idempotency_key=idempotency_key,
            ),
        )

    def commit(self, ref: str, *, exclude: list[str] | None = None, scrub_defaults: bool = True) -> LayerInfo:
        """Pack what this sandbox changed (its writes, deletions included) into layer ``ref``.

        Caches, histories and temp files are scrubbed first (``scrub_defaults``), plus
        ``exclude`` (paths relative to /, glob per component). The sandbox keeps running.
        """
        return cast(
            "LayerInfo", self._dsec_call("commit", ref, exclude=exclude, scrub_defaults=scrub_defaults)
        )

    def read_stream(self, path: str) -> Iterator[bytes]:
        """Yield a file's content in chunks, without holding it in memory."""
        return cast("Iterator[bytes]", self._dsec_call("read_stream", path))

    def read_file(self, path: str) -> bytes:
        return cast("bytes", self._dsec_call("read_file", path))

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> FileStat:
        return cast("FileStat", self._dsec_call("write_file", path, data, mode=mode))

    def upload(self, local_path: str | os.PathLike[str], path: str, *, mode: int | None = None) -> FileStat:
        """Stream a local file into the sandbox (any size; it is never held in memory)."""
        return cast("FileStat", self._dsec_call("upload", local_path, path, mode=mode))

    def download(self, path: str, local_path: str | os.PathLike[str]) -> int:
        """Stream a sandbox file to a local path; returns the bytes written."""
        return cast("int", self._dsec_call("download", path, local_path))

    def stat(self, path: str) -> FileStat:
        return cast("FileStat", self._dsec_call("stat", path))

    def list_dir(self, path: str) -> list[FileStat]:
        return cast("list[FileStat]", self._dsec_call("list_dir", path))

    def mkdir(self, path: str, *, parents: bool = True) -> FileStat:
        return cast("FileStat", self._dsec_call("mkdir", path, parents=parents))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._dsec_call("remove", path, recursive=recursive)

    def move(self, source: str, destination: str) -> FileStat:
        """Rename a file or directory inside the sandbox (replaces a file at ``destination``)."""
        return cast("FileStat", self._dsec_call("move", source, destination))

    def pause(self) -> SandboxInfo:
        """Freeze the sandbox and push its memory out of RAM. Any later call resumes it."""
        return cast("SandboxInfo", self._dsec_call("pause"))

    def resume(self) -> SandboxInfo:
        """Resume now (memory prefetched, then thawed); calls resume by themselves anyway."""
        return cast("SandboxInfo", self._dsec_call("resume"))

    def trajectory(self, *, after: int = 0, limit: int = 1000) -> list[TrajectoryEntry]:
        """What this sandbox was asked to do and the outcomes, as its edge recorded them
        (oldest first; page with ``after`` = the last ``seq`` seen, until a page is empty: a
        page ends early once its steps hold 32 MiB).
        """
        return cast("list[TrajectoryEntry]", self._dsec_call("trajectory", after=after, limit=limit))

    def changes(self, under: str = "/") -> list[Change]:
        """Paths this sandbox added, modified or deleted relative to its layers, below ``under``
        (read on the host from its writable layer: the sandbox cannot hide a change).
        """
        return cast("list[Change]", self._dsec_call("changes", under))

    def pack_diff(
        self, name: str, *, scrub_defaults: bool = True, exclude: list[str] | None = None
    ) -> LayerInfo:
        """Pack what this sandbox changed into the next version of layer ``name`` (or into
        ``name:version`` exactly). Only the diff is stored; ``exclude`` adds scrub patterns
        (paths relative to /, glob per component) to the default build residue. Restore with
        ``run_container(DSecContainerRunArgs(layers=[*sandbox.info.layers, layer.digest]))``.
        The sandbox keeps running, untouched.
        """
        return cast(
            "LayerInfo", self._dsec_call("pack_diff", name, scrub_defaults=scrub_defaults, exclude=exclude)
        )

    def fork(
        self, n: int, *, labels: dict[str, str] | None = None, processes: bool = False, timeout: float = 120
    ) -> list[SyncSandbox]:
        """``n`` new sandboxes with this one's disk state (created all or none). Process state
        is not copied: nodes report ``fork_processes`` in their capabilities, and asking for it
        where it is missing is an ``InvalidRequest``.
        """
        return cast(
            "list[SyncSandbox]",
            self._dsec_call("fork", n, labels=labels, processes=processes, timeout=timeout),
        )

    def screenshot(self) -> bytes:
        """What the VM's display shows now, as PNG bytes (full VMs: ``run_vm``)."""
        return cast("bytes", self._dsec_call("screenshot"))

    def send_input(self, events: list[InputEvent]) -> int:
        """Keyboard and mouse events, in order (see :class:`~dsec.protocol.models.InputEvent`)."""
        return cast("int", self._dsec_call("send_input", events))

    def press(self, *keys: str) -> int:
        """Press ``keys`` together (QEMU qcodes: "ctrl", "alt", "ret", "a", "f1"...)."""
        return cast("int", self._dsec_call("press", *keys))

    def type_text(self, text: str) -> int:
        return cast("int", self._dsec_call("type_text", text))

    def click(self, button: Literal["left", "right", "middle"] = "left") -> int:
        return cast("int", self._dsec_call("click", button))

    def point(self, x: int, y: int) -> int:
        """Put the pointer on pixel (x, y) of the 1024x768 screen (the VM's tablet: absolute)."""
        return cast("int", self._dsec_call("point", x, y))

    def move_mouse(self, dx: int, dy: int) -> int:
        """Move the pointer by (dx, dy) pixels (the PS/2 mouse is relative)."""
        return cast("int", self._dsec_call("move_mouse", dx, dy))

    def open_pty(
        self,
        argv: list[str] | None = None,
        *,
        rows: int = 24,
        cols: int = 80,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
    ) -> SyncPty:
        """Start ``argv`` (default: a login shell) on a terminal of ``rows`` x ``cols``.

        ``TERM`` is ``xterm-256color`` unless ``env`` sets it; ``user`` defaults to the
        sandbox's ``init_user``, ``cwd`` to the sandbox's ``workdir``, else that user's home.
        """
        return cast(
            "SyncPty", self._dsec_call("open_pty", argv, rows=rows, cols=cols, env=env, cwd=cwd, user=user)
        )

    def __enter__(self) -> SyncSandbox:
        return cast("SyncSandbox", self._dsec_call("__aenter__"))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._dsec_call("__aexit__", exc_type, exc, tb)


class DSec(SyncWrapper, async_cls=_client.DSecClient, wrap=[SyncSandbox]):
    """Blocking DSec client: the methods of :class:`DSecClient`, without ``await``."""

    def __init__(self, url: str | None = None, api_key: str | None = None, *, timeout: float = 300) -> None:
        self._dsec_construct(url, api_key, timeout=timeout)

    def open(self) -> DSec:
        return cast("DSec", self._dsec_call("open"))

    def close(self) -> None:
        self._dsec_call("close")

    def run_container(self, args: DSecContainerRunArgs, timeout: float = 120) -> SyncSandbox:
        """Create a container sandbox and wait until it runs."""
        return cast("SyncSandbox", self._dsec_call("run_container", args, timeout))

    def run_microvm(self, args: DSecMicroVMRunArgs, timeout: float = 300) -> SyncSandbox:
        """Create a microVM sandbox (its own kernel, the same layers) and wait until it runs."""
        return cast("SyncSandbox", self._dsec_call("run_microvm", args, timeout))

    def run_vm(self, args: DSecVMRunArgs, timeout: float = 600) -> SyncSandbox:
        """Create a full VM (QEMU q35, a disk image of the layers, a display) and wait until it runs."""
        return cast("SyncSandbox", self._dsec_call("run_vm", args, timeout))

    def run_containers(
        self, args: DSecContainerRunArgs, count: int, timeout: float = 120
    ) -> builtins.list[SyncSandbox]:
        """Create ``count`` sandboxes of one kind in one request (all, or none and an error)."""
        return cast("builtins.list[SyncSandbox]", self._dsec_call("run_containers", args, count, timeout))

    def get(self, sandbox_id: str) -> SyncSandbox:
        return cast("SyncSandbox", self._dsec_call("get", sandbox_id))

    def list(self, labels: dict[str, str] | None = None) -> builtins.list[SyncSandbox]:
        return cast("builtins.list[SyncSandbox]", self._dsec_call("list", labels))

    def build_layer(
        self,
        dockerfile: str | os.PathLike[str],
        context: str | os.PathLike[str],
        ref: str,
        *,
        base: builtins.list[str] | None = None,
        exclude: builtins.list[str] | None = None,
        memory_limit_mb: int = 4096,
        cpu_cores_limit: float = 2,
        step_timeout: float = 3600,
        progress: Callable[[BuildEvent], None] | None = None,
        network_rules: NetworkRules | None = None,
    ) -> LayerInfo:
        """Build layer ``ref`` from a Dockerfile subset (FROM, RUN, COPY, ENV, WORKDIR).

        ``dockerfile`` is its text, or a path to it; COPY reads from the ``context``
        directory. Steps run in a build sandbox on the FROM layers (or ``base``); the layer is
        what they changed, with caches, histories and ``exclude`` paths scrubbed. A failing
        step raises :class:`BuildFailed` with its output. ``network_rules`` are the build
        sandbox's network permissions (as at create; ``RUN --network=none`` steps run without
        them); none by default.
        """
        return cast(
            "LayerInfo",
            self._dsec_call(
                "build_layer",
                dockerfile,
                context,
                ref,
                base=base,
                exclude=exclude,
                memory_limit_mb=memory_limit_mb,
                cpu_cores_limit=cpu_cores_limit,
                step_timeout=step_timeout,
                progress=progress,
                network_rules=network_rules,
            ),
        )

    def nodes(self) -> builtins.list[dict[str, Any]]:
        """The cluster's registered nodes with their epoch, health and load (admin keys only)."""
        return cast("builtins.list[dict[str, Any]]", self._dsec_call("nodes"))

    def create_project(
        self,
        parent: str,
        name: str,
        *,
        sandboxes: int | None = None,
        cpu_cores: float | None = None,
        memory_mib: int | None = None,
        storage_mib: int | None = None,
    ) -> dict[str, Any]:
        """Create ``parent/name`` with quotas bounding its whole subtree (``None``: only the
        parent's bounds apply; a child's quota may not exceed its parent's). ``storage_mib``
        bounds the bytes of layers the subtree owns (imports and commits past it: QuotaExceeded).
        """
        return cast(
            "dict[str, Any]",
            self._dsec_call(
                "create_project",
                parent,
                name,
                sandboxes=sandboxes,
                cpu_cores=cpu_cores,
                memory_mib=memory_mib,
                storage_mib=storage_mib,
            ),
        )

    def list_projects(self, under: str | None = None) -> builtins.list[dict[str, Any]]:
        """``under`` (default: the key's project) and its descendants, with quotas and usage."""
        return cast("builtins.list[dict[str, Any]]", self._dsec_call("list_projects", under))

    def set_quota(
        self,
        project: str,
        *,
        sandboxes: int | None = None,
        cpu_cores: float | None = None,
        memory_mib: int | None = None,
        storage_mib: int | None = None,
    ) -> dict[str, Any]:
        return cast(
            "dict[str, Any]",
            self._dsec_call(
                "set_quota",
                project,
                sandboxes=sandboxes,
                cpu_cores=cpu_cores,
                memory_mib=memory_mib,
                storage_mib=storage_mib,
            ),
        )

    def delete_project(self, project: str) -> None:
        self._dsec_call("delete_project", project)

    def project_usage(self, project: str | None = None) -> dict[str, Any]:
        return cast("dict[str, Any]", self._dsec_call("project_usage", project))

    def issue_key(
        self, project: str, *, admin: bool = False, name: str = "", format: Literal["dsec", "e2b"] = "dsec"
    ) -> str:
        """A new API key for ``project`` (shown once: only its digest is stored); ``format="e2b"``
        gives an ``e2b_<hex>`` key for E2B's SDKs (same project, quotas and visibility).
        """
        return cast("str", self._dsec_call("issue_key", project, admin=admin, name=name, format=format))

    def list_keys(self, project: str | None = None) -> builtins.list[dict[str, Any]]:
        return cast("builtins.list[dict[str, Any]]", self._dsec_call("list_keys", project))

    def revoke_key(self, key_id: str) -> bool:
        return cast("bool", self._dsec_call("revoke_key", key_id))

    def fncall(
        self, task: FnTask | dict[str, Any], *, pool: str | None = None, timeout: float = 600
    ) -> FnResult:
        """Run one call (python, bash, c or cpp) in a warm pool; see ``FnResult.status``.

        The program's own failures (compile errors, crashes, timeouts, memory) are statuses of
        the result; a ``DSecError`` means the platform could not run it.
        """
        return cast("FnResult", self._dsec_call("fncall", task, pool=pool, timeout=timeout))

    def fncall_many(
        self,
        tasks: Iterable[FnTask | dict[str, Any]],
        *,
        concurrency: int = 32,
        pool: str | None = None,
        timeout: float = 600,
    ) -> builtins.list[FnResult | DSecError]:
        """Run many calls, ``concurrency`` at a time; results in the order of ``tasks``.

        One call's platform failure is that call's entry (a ``DSecError``), never the batch's.
        """
        return cast(
            "builtins.list[FnResult | DSecError]",
            self._dsec_call("fncall_many", tasks, concurrency=concurrency, pool=pool, timeout=timeout),
        )

    def stop_all(self, labels: dict[str, str]) -> builtins.list[SandboxInfo]:
        """Stop every sandbox that carries all ``labels`` (e.g. ``{"job": job_id}``), on every node,
        in one call. Returns what was stopped; raises if any could not be stopped.
        """
        return cast("builtins.list[SandboxInfo]", self._dsec_call("stop_all", labels))

    def pause_all(self, labels: dict[str, str]) -> builtins.list[SandboxInfo]:
        """Pause every sandbox carrying all ``labels``, cluster-wide, in one call (a preempted
        job); each resumes by itself on its next request.
        """
        return cast("builtins.list[SandboxInfo]", self._dsec_call("pause_all", labels))

    def resume_all(self, labels: dict[str, str]) -> builtins.list[SandboxInfo]:
        return cast("builtins.list[SandboxInfo]", self._dsec_call("resume_all", labels))

    def renew_lease(self, job: str, lease_s: float) -> LeaseResult:
        """Keep job ``job``'s sandboxes (created with ``lease_s``) alive for ``lease_s`` more
        seconds: one call per job, not per sandbox. Raises if a node holding some did not answer.
        """
        return cast("LeaseResult", self._dsec_call("renew_lease", job, lease_s))

    def layers(self) -> builtins.list[LayerInfo]:
        return cast("builtins.list[LayerInfo]", self._dsec_call("layers"))

    def import_image(
        self,
        path: str | os.PathLike[str],
        ref: str,
        *,
        merge_below_mb: float = 0,
        image: str | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> builtins.list[LayerInfo]:
        """Import an OCI image as ``ref``: ``docker save`` output, or an OCI layout (directory
        or tarball, as skopeo writes them). Each image layer becomes an EROFS layer (layers
        shared with earlier imports are stored once); ``ref`` names their ordered list, usable
        as ``container_image``. Consecutive layers under ``merge_below_mb`` are merged.
        ``progress(stage, done, total)`` follows the server's work.
        """
        return cast(
            "builtins.list[LayerInfo]",
            self._dsec_call(
                "import_image", path, ref, merge_below_mb=merge_below_mb, image=image, progress=progress
            ),
        )

    def retag(self, ref: str, target: str | builtins.list[str]) -> builtins.list[LayerInfo]:
        """Point ``ref`` at other content (a layer, or an ordered list for an image).

        Versions are immutable everywhere else: this explicit call is the only way a tag moves.
        """
        return cast("builtins.list[LayerInfo]", self._dsec_call("retag", ref, target))

    def untag(self, ref: str) -> builtins.list[str]:
        """Remove tag ``ref``; its blobs go at the next :meth:`gc_layers` if nothing else names them."""
        return cast("builtins.list[str]", self._dsec_call("untag", ref))

    def mark_public(self, ref: str) -> builtins.list[LayerInfo]:
        """Let every project use layer or image ``ref`` (admin keys only; base layers are public).

        Otherwise a layer is seen only by the project that imported or committed it and by the
        projects above that one.
        """
        return cast("builtins.list[LayerInfo]", self._dsec_call("mark_public", ref))

    def verify_layer(self, ref: str) -> LayerInfo:
        """Re-hash a layer's stored bytes; ``InfraFailure(reason="corrupt")`` if they changed."""
        return cast("LayerInfo", self._dsec_call("verify_layer", ref))

    def gc_layers(self, *, grace_s: float | None = None) -> builtins.list[str]:
        """Delete stored layers that no tag names and no sandbox uses; returns their digests."""
        return cast("builtins.list[str]", self._dsec_call("gc_layers", grace_s=grace_s))

    def import_vm_image(self, path: str | os.PathLike[str], ref: str) -> VmImageInfo:
        """Import a bootable disk image (qcow2 or raw) as VM image ``ref`` (``name:version``),
        for ``DSecVMRunArgs(disk_image=ref)``.
        """
        return cast("VmImageInfo", self._dsec_call("import_vm_image", path, ref))

    def vm_images(self) -> builtins.list[VmImageInfo]:
        return cast("builtins.list[VmImageInfo]", self._dsec_call("vm_images"))

    def import_layer(self, path: str | os.PathLike[str], ref: str) -> LayerInfo:
        """Import a directory or tar archive as layer ``ref`` (``name:version``)."""
        return cast("LayerInfo", self._dsec_call("import_layer", path, ref))

    def create_volume(
        self, name: str, *, size_mb: int = DEFAULT_SIZE_MB, project: str | None = None
    ) -> VolumeInfo:
        """A new empty volume (``name``: 1-128 of ``A-Za-z0-9_-``, unique in its project on
        its node).
        """
        return cast("VolumeInfo", self._dsec_call("create_volume", name, size_mb=size_mb, project=project))

    def list_volumes(self) -> builtins.list[VolumeInfo]:
        """The volumes of the key's project and below, on every node, oldest first."""
        return cast("builtins.list[VolumeInfo]", self._dsec_call("list_volumes"))

    def get_volume(self, volume_id: str) -> VolumeInfo:
        return cast("VolumeInfo", self._dsec_call("get_volume", volume_id))

    def delete_volume(self, volume_id: str) -> None:
        """Delete it and everything in it (``Conflict`` while a sandbox mounts it)."""
        self._dsec_call("delete_volume", volume_id)

    def volume_list_dir(
        self, volume_id: str, path: str = "/", *, depth: int = 1
    ) -> builtins.list[VolumeEntry]:
        """Entries under ``path`` to ``depth`` (1-10), depth first in name order."""
        return cast(
            "builtins.list[VolumeEntry]", self._dsec_call("volume_list_dir", volume_id, path, depth=depth)
        )

    def volume_stat(self, volume_id: str, path: str) -> VolumeEntry:
        return cast("VolumeEntry", self._dsec_call("volume_stat", volume_id, path))

    def volume_mkdir(
        self, volume_id: str, path: str, *, parents: bool = True, mode: int = 0o755
    ) -> VolumeEntry:
        return cast(
            "VolumeEntry", self._dsec_call("volume_mkdir", volume_id, path, parents=parents, mode=mode)
        )

    def volume_remove(self, volume_id: str, path: str) -> None:
        """Remove a file, or a directory and everything below it."""
        self._dsec_call("volume_remove", volume_id, path)

    def read_volume_stream(self, volume_id: str, path: str) -> Iterator[bytes]:
        return cast("Iterator[bytes]", self._dsec_call("read_volume_stream", volume_id, path))

    def read_volume_file(self, volume_id: str, path: str) -> bytes:
        return cast("bytes", self._dsec_call("read_volume_file", volume_id, path))

    def write_volume_file(
        self, volume_id: str, path: str, data: bytes | str, *, mode: int = 0o644, uid: int = 0, gid: int = 0
    ) -> VolumeEntry:
        """Write ``path`` whole (replacing it, making missing parents), atomically."""
        return cast(
            "VolumeEntry",
            self._dsec_call("write_volume_file", volume_id, path, data, mode=mode, uid=uid, gid=gid),
        )

    def __enter__(self) -> DSec:
        return cast("DSec", self._dsec_call("__aenter__"))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._dsec_call("__aexit__", exc_type, exc, tb)


__all__ = ["DSec", "SyncPty", "SyncSandbox"]
