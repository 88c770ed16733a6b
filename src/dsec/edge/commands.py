"""Work inside a sandbox: shell commands, execs, files, and packing what it changed.

Every request goes through the trajectory recorder (:mod:`dsec.edge.trajectory`), and through
:meth:`~dsec.edge.pausing.Pausing.use`, which resumes a paused sandbox first. Packing never
changes the sandbox: its upper directory is copied as hard links (the sandbox frozen, so the
copy is one moment) and residue is scrubbed from the copy, not from the sandbox.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import subprocess
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

from dsec.backends.base import Backend, Display, HoldsSessions, sandbox_env
from dsec.edge.changes import NODE_TOOLS, check_under, walk_changes
from dsec.edge.config import EdgeConfig
from dsec.edge.journal import Record
from dsec.edge.networking import Networking
from dsec.edge.pausing import Pausing
from dsec.edge.tally import LiveSandboxes, _Live
from dsec.edge.trajectory import Recorder
from dsec.executor.file_ops import FileOps
from dsec.executor.process import DEFAULT_MAX_OUTPUT, SandboxProcess, run_streaming
from dsec.executor.session import DRIVER, Session
from dsec.iam.base import in_subtree
from dsec.images.commit import DEFAULT_SCRUB, scrub
from dsec.images.mounts import LayerMounts
from dsec.images.refs import parse_tag
from dsec.images.store import LayerStore
from dsec.observe.edge_metrics import EdgeMetrics, command_outcome
from dsec.protocol.errors import (
    DSecError,
    InfraFailure,
    InfraReason,
    InvalidRequest,
    SandboxNotFound,
    SandboxStopped,
)
from dsec.protocol.models import (
    DEFAULT_PROJECT,
    PROJECT_LABEL,
    Change,
    CommandResult,
    CommitRequest,
    ContainerSpec,
    ExecEvent,
    InputEvent,
    LayerInfo,
    SandboxInfo,
    SandboxState,
    ShellRequest,
    TrajectoryEntry,
)

log = logging.getLogger("dsec.edge")
_VERSION_RETRIES = 20


_KEPT_OUTPUT = 64 << 10  # of each stream, in the record of an unkeyed command


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    """An unkeyed command's record: its output capped (the caller got all of it)."""
    out = dict(result)
    for name in ("stdout", "stderr"):
        text = out.get(name) or ""
        if len(text) > _KEPT_OUTPUT:
            out[name] = text[:_KEPT_OUTPUT]
            out["record_truncated"] = True
    return out


def _summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the log keeps of an unkeyed exec: its result and how much output it made."""
    out = sum(len(e.get("d") or "") for e in events if e.get("t") == "out") * 3 // 4
    err = sum(len(e.get("d") or "") for e in events if e.get("t") == "err") * 3 // 4
    end = next((e.get("result") for e in events if e.get("t") == "exit"), None)
    return {"result": end, "stdout_bytes": out, "stderr_bytes": err}


class Commands:
    """Work inside the edge's sandboxes: commands, files, displays, packing, the trajectory."""

    def __init__(
        self,
        config: EdgeConfig,
        store: LayerStore,
        mounts: LayerMounts,
        recorder: Recorder,
        prom: EdgeMetrics,
        live: LiveSandboxes,
        backend_of: Callable[[Record], Backend],
        pausing: Pausing,
        networking: Networking,
        *,
        get: Callable[[str], SandboxInfo],
    ) -> None:
        """``get``: any sandbox the journal still holds, running or not (the edge's ``get``)."""
        self.config = config
        self.store = store
        self.mounts = mounts
        self.recorder = recorder
        self.prom = prom
        self.live = live
        self.backend_of = backend_of
        self.pausing = pausing
        self.networking = networking
        self.get = get

    async def run_shell(self, sandbox_id: str, req: ShellRequest) -> CommandResult:
        request = {"command": req.command, "session": req.session, "timeout": req.timeout}

        async def run() -> dict[str, Any]:
            return (await self._run_shell(sandbox_id, req)).model_dump()

        out = await self.recorder.call(sandbox_id, "shell", req.idempotency_key, request, run, brief=_brief)
        return CommandResult.model_validate(out)

    async def _spawn_session_shell(self, sandbox_id: str, live: _Live) -> SandboxProcess:
        rec = live.record
        shell = "/bin/bash" if await self._exists(live, "/bin/bash") else "/bin/sh"
        backend = self.backend_of(rec)
        start = backend.spawn_session if isinstance(backend, HoldsSessions) else backend.spawn
        async with self.pausing.starting(sandbox_id):
            try:
                return await start(
                    sandbox_id,
                    rec.handle,
                    [shell, "-c", DRIVER],
                    env=sandbox_env(rec.spec, live.user),
                    cwd=rec.spec.workdir or live.user.home,
                    user=live.user,
                )
            except InfraFailure as exc:
                raise _gone_or(live, exc) from exc

    async def _run_shell(self, sandbox_id: str, req: ShellRequest) -> CommandResult:
        started = time.perf_counter()
        async with self.pausing.working(sandbox_id) as live:
            session = live.sessions.get(req.session)
            if session is None:
                # A partial, not a closure: one object per session, thousands held (decisions.md).
                spawn = functools.partial(self._spawn_session_shell, sandbox_id, live)
                session = live.sessions[req.session] = Session(req.session, spawn)
            timeout = req.timeout or self.config.default_shell_timeout_s
            cap = DEFAULT_MAX_OUTPUT if req.max_output_bytes is None else req.max_output_bytes
            result = await session.run(
                req.command,
                timeout=timeout,
                max_output=cap,
                oom_kills=lambda: self.backend_of(live.record).oom_kills(sandbox_id),
            )
            self.prom.command(sandbox_id, "run_shell", started, *_outcome(result))
            cut = _cut_short(live, result)
            if cut is not None:
                raise cut
            return result

    async def exec_stream(
        self,
        sandbox_id: str,
        argv: list[str],
        *,
        stdin: bytes | None,
        env: dict[str, str],
        cwd: str | None,
        timeout: float | None,
        max_output: int | None,
        idempotency_key: str | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        self.live.touch(sandbox_id)  # a missing sandbox fails before anything is recorded
        request = {
            "argv": argv,
            "cwd": cwd,
            "timeout": timeout,
            "env_keys": sorted(env),  # values may be secrets: the log is readable by the caller
            "stdin_bytes": len(stdin or b""),
        }

        async def events() -> AsyncGenerator[dict[str, Any], None]:
            gen = self._exec(sandbox_id, argv, stdin, env, cwd, timeout, max_output)
            try:
                async for ev in gen:
                    yield ev.model_dump()
            finally:
                await gen.aclose()

        stream = self.recorder.stream(sandbox_id, "exec", idempotency_key, request, events, _summary)
        try:
            async for raw in stream:
                yield ExecEvent.model_validate(raw)
        finally:
            await stream.aclose()

    async def _exec(
        self,
        sandbox_id: str,
        argv: list[str],
        stdin: bytes | None,
        env: dict[str, str],
        cwd: str | None,
        timeout: float | None,
        max_output: int | None,
    ) -> AsyncGenerator[ExecEvent, None]:
        started = time.perf_counter()
        async with self.pausing.working(sandbox_id) as live:
            backend = self.backend_of(live.record)
            async with self.pausing.starting(sandbox_id):
                try:
                    proc = await backend.spawn(
                        sandbox_id,
                        live.record.handle,
                        argv,
                        env=sandbox_env(live.record.spec, live.user, env),
                        cwd=cwd or live.record.spec.workdir or live.user.home,
                        user=live.user,
                    )
                except InfraFailure as exc:
                    raise _gone_or(live, exc) from exc
            events = run_streaming(
                proc,
                stdin=stdin,
                timeout=timeout or self.config.default_shell_timeout_s,
                max_output=DEFAULT_MAX_OUTPUT if max_output is None else max_output,
                oom_kills=lambda: backend.oom_kills(sandbox_id),
            )
            try:
                async for event in events:
                    if event.result is not None:
                        self.prom.command(sandbox_id, "exec", started, *_outcome(event.result))
                    cut = _cut_short(live, event.result) if event.result is not None else None
                    if cut is not None:
                        raise cut
                    yield event
            finally:
                # A caller that goes away mid-stream (disconnect) must not leave the tree running.
                await events.aclose()

    def trajectory(self, sandbox_id: str, after: int = 0, limit: int = 1000) -> list[TrajectoryEntry]:
        """What the sandbox was asked to do and what came of it, oldest first, after ``after``."""
        self.get(sandbox_id)  # the log outlives the sandbox, as long as its journal record
        return self.recorder.log.entries(sandbox_id, after=after, limit=limit)

    # -- packing ----------------------------------------------------------------------------

    async def commit(self, sandbox_id: str, req: CommitRequest) -> LayerInfo:
        """Pack what the sandbox changed into layer ``req.ref`` (a bare name: the next version),
        residue scrubbed from the packed copy. The sandbox keeps running, untouched."""
        patterns = [NODE_TOOLS, *(DEFAULT_SCRUB if req.scrub_defaults else ()), *req.exclude]
        patterns += self.networking.node_files(sandbox_id)  # the node's, pointing at this node

        async def run() -> dict[str, Any]:
            return (await self._pack(sandbox_id, req.ref, patterns)).model_dump()

        out = await self.recorder.call(sandbox_id, "pack", None, req.model_dump(), run)
        return LayerInfo.model_validate(out)

    async def fork_spec(self, sandbox_id: str, ref: str) -> tuple[ContainerSpec, LayerInfo]:
        """Pack the sandbox's whole state (nothing scrubbed) as ``ref`` and return the spec of
        a sandbox that starts from it: the same spec over the same layers plus the packed one."""
        info = await self.commit(sandbox_id, CommitRequest(ref=ref, scrub_defaults=False))
        rec = self.live.touch(sandbox_id).record
        return rec.spec.model_copy(update={"image": None, "layers": [*rec.layers, info.digest]}), info

    async def _pack(self, sandbox_id: str, ref: str, patterns: list[str]) -> LayerInfo:
        work = self.config.workdir(sandbox_id)
        staging = work / "pack"
        if ":" not in ref:
            parse_tag(f"{ref}:1")  # a bad name fails before the sandbox is frozen
        async with self.pausing.held_still(sandbox_id) as live:
            backend = self.backend_of(live.record)
            async with backend.writable_layer(sandbox_id, live.record.handle, work) as upper:
                try:
                    await asyncio.to_thread(_link_copy, upper, staging)
                    removed = await asyncio.to_thread(scrub, staging, patterns)
                    log.info("pack %s: scrubbed %d entries", sandbox_id, len(removed))
                    # Still inside: the copy may share inodes with the sandbox, which must not
                    # write into them before mkfs has read them.
                    owner = live.record.spec.labels.get(PROJECT_LABEL, DEFAULT_PROJECT)
                    network = self.networking.network_held(sandbox_id, live.record.spec.network_rules)
                    return await asyncio.to_thread(self._import_versioned, staging, ref, owner, network)
                finally:
                    await asyncio.to_thread(shutil.rmtree, staging, True)

    def _import_versioned(self, path: Path, ref: str, owner: str, network: list[str]) -> LayerInfo:
        """Import the packed changes as ``ref`` (a bare name: its next version), owned by the
        sandbox's project, under a name that project's subtree owns (Conflict otherwise)."""
        viewer = functools.partial(in_subtree, top=owner)  # what the sandbox's project may see
        if ":" in ref:
            return self.store.import_path(path, ref, owner=owner, viewer=viewer, network=network)
        for _ in range(_VERSION_RETRIES):
            taken = [int(v) for v in self.store.catalogue.versions(ref) if v.isdigit()]
            version = max(taken, default=0) + 1
            try:
                return self.store.import_path(
                    path, f"{ref}:{version}", owner=owner, viewer=viewer, network=network
                )
            except InvalidRequest:
                # Another pack took this version between our listing and our tag: next one.
                if str(version) not in self.store.catalogue.versions(ref):
                    raise
        raise InfraFailure(
            f"no free version of {ref} after {_VERSION_RETRIES} tries", reason=InfraReason.storage
        )

    async def changes(self, sandbox_id: str, under: str = "/") -> list[Change]:
        """What the sandbox changed relative to its layers, read from its upper directory on
        the host (nothing inside the sandbox can hide a change from this), below ``under``."""
        under = check_under(under)
        async with self.pausing.held_still(sandbox_id) as live:
            lowers = [self.mounts.path_for(d) for d in reversed(live.record.layers)]
            backend = self.backend_of(live.record)
            async with backend.writable_layer(
                sandbox_id, live.record.handle, self.config.workdir(sandbox_id)
            ) as upper:
                return await asyncio.to_thread(walk_changes, upper, lowers, under)

    async def files_ready(self, sandbox_id: str) -> FileOps:
        """File access to a sandbox (as its user), resumed first if it was paused."""
        live = await self.pausing.use(sandbox_id)
        return self.backend_of(live.record).files(live.record.handle, live.user)

    async def _display(self, sandbox_id: str) -> tuple[Display, _Live]:
        live = await self.pausing.use(sandbox_id)
        backend = self.backend_of(live.record)
        if not isinstance(backend, Display):
            raise InvalidRequest(
                f"sandbox {sandbox_id} ({live.record.backend}) has no display: full VMs (run_vm) have one"
            )
        return backend, live

    async def screenshot(self, sandbox_id: str) -> bytes:
        """The sandbox's screen as a PNG (full VMs)."""
        backend, live = await self._display(sandbox_id)
        with live.working():
            return await backend.screenshot(sandbox_id, live.record.handle)

    async def send_input(self, sandbox_id: str, events: list[InputEvent]) -> int:
        """Keyboard and mouse events for the sandbox's screen, in order (full VMs)."""
        backend, live = await self._display(sandbox_id)

        async def run() -> dict[str, Any]:
            with live.working():
                return {"sent": await backend.send_input(sandbox_id, live.record.handle, events)}

        request = {"events": [e.model_dump(exclude_none=True) for e in events]}
        return int((await self.recorder.call(sandbox_id, "input", None, request, run))["sent"])

    async def _exists(self, live: _Live, path: str) -> bool:
        return await self.backend_of(live.record).files(live.record.handle, live.user).exists(path)


# Stop reasons of the reaper (reclaim.py): the platform reclaimed the sandbox.
_RECLAIMED = frozenset({"idle_ttl", "max_lifetime", "lease_expired"})


def _outcome(result: CommandResult) -> tuple[str, bool]:
    """(outcome label, OOM-killed) of a finished command, for the edge's metrics."""
    return command_outcome(result.exit_code, result.timed_out, result.oom_killed), result.oom_killed


def _cut_short(live: _Live, result: CommandResult) -> SandboxStopped | None:
    """A command that ended unsuccessfully because its sandbox was stopped under it (another
    request, a reclaim, the edge shutting down) did not fail by the agent's doing: an
    ``InfraFailure`` (``stopped`` or ``reclaimed``), not the exit status the kill left."""
    if result.exit_code == 0 or not (live.stop_wanted or live.record.state is SandboxState.stopping):
        return None
    why = live.record.stop_reason or "stopped"
    kind = InfraReason.reclaimed if why in _RECLAIMED else InfraReason.stopped
    return SandboxStopped(
        f"the sandbox was {kind.value} ({why}) while the command ran: its outcome is not the command's",
        reason=kind,
    )


def _gone_or(live: _Live, exc: InfraFailure) -> DSecError:
    """A start that failed because the sandbox went (a stop, its init's death) meanwhile is a
    missing sandbox for the caller, not the platform's failure."""
    if live.record.state in (SandboxState.running, SandboxState.paused):
        return exc
    return SandboxNotFound(f"sandbox {live.record.id} stopped while a command started in it")


def _link_copy(upper: Path, staging: Path) -> None:
    """A copy of ``upper`` made of hard links (directories and their overlay xattrs copied):
    instant, and scrubbing it cannot touch the sandbox."""
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    done = subprocess.run(
        ["cp", "-a", "--link", f"{upper}/.", f"{staging}/"], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise InfraFailure(
            f"copying the sandbox's changes failed: {done.stderr.strip()}", reason=InfraReason.storage
        )
