"""The edge's process table and directory watches: what E2B-style callers need of a sandbox.

A process started here outlives the request that started it (a dev server, a PTY): the edge
keeps its pipes or its terminal's master (:mod:`dsec.executor.held`), callers attach and
detach, send input and signals, and resize its terminal. Each start is a trajectory entry
(kind ``process``) whose result is written when the process ends. Watches are inotify from
the host on the sandbox's own directories (:mod:`dsec.executor.watch`).

Every call goes through :meth:`~dsec.edge.pausing.Pausing.use` (a paused sandbox resumes);
stopping a sandbox kills its processes (``end`` says ``error="sandbox stopped"``) and ends
its watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import posixpath
import time
from collections.abc import AsyncGenerator, Callable

from dsec.backends.base import Backend, HoldsProcesses, HostRooted, Spawned, User, sandbox_env
from dsec.backends.handle import Handle
from dsec.edge.journal import Record
from dsec.edge.pausing import Pausing
from dsec.edge.tally import LiveSandboxes, _Live
from dsec.edge.trajectory import Recorder
from dsec.edge.users import find_user
from dsec.executor import pty
from dsec.executor.file_ops import FileOps
from dsec.executor.held import HeldProcess, ProcessTable, set_size
from dsec.executor.process import SandboxProcess
from dsec.executor.watch import DirWatch
from dsec.protocol.errors import DSecError, FileNotFound, InfraFailure, InvalidRequest, SandboxNotFound
from dsec.protocol.models import FileType, SandboxState
from dsec.protocol.processes import ProcessEvent, ProcessInfo, ProcessStart, PtySize, WatchEvent

PTY_TERM = "xterm-256color"
_PASSWD_MAX = 1 << 20


class Processes:
    """The edge's process table and directory watches, per sandbox."""

    def __init__(
        self,
        recorder: Recorder,
        live: LiveSandboxes,
        backend_of: Callable[[Record], Backend],
        pausing: Pausing,
    ) -> None:
        self.recorder = recorder
        self.live = live
        self.backend_of = backend_of
        self.pausing = pausing

    async def spawn_service(self, sandbox_id: str, argv: list[str]) -> SandboxProcess:
        """A long-lived process in a sandbox whose pipes the edge holds (a FnCall runner)."""
        live = self.live.touch(sandbox_id)
        env = sandbox_env(live.record.spec, live.user, None)
        return await self.backend_of(live.record).spawn(
            sandbox_id, live.record.handle, argv, env=env, cwd="/", user=live.user
        )

    async def start_process(self, sandbox_id: str, req: ProcessStart) -> AsyncGenerator[ProcessEvent, None]:
        """Start ``req``: ``start`` (its PID), its output, ``end``. Closing this detaches."""
        live = await self.pausing.use(sandbox_id)
        live.processes.check_room()
        backend = self.backend_of(live.record)
        if req.pty is not None and not isinstance(backend, HoldsProcesses):
            raise InvalidRequest(f"pseudo-terminals are not supported on {backend.name} sandboxes")
        user = live.user if req.user is None else await self._user(live, req.user)
        cwd = await self._cwd(live, user, req.cwd)
        env = sandbox_env(live.record.spec, user, req.env)
        if req.pty is not None and "TERM" not in req.env:
            env["TERM"] = PTY_TERM
        request = {
            "argv": req.argv,
            "cwd": cwd,
            "user": user.name,
            "tag": req.tag,
            "pty": req.pty is not None,
            "timeout": req.timeout,
            "env_keys": sorted(req.env),  # values may be secrets: the log is readable by the caller
        }
        seq = self.recorder.log.begin(sandbox_id, "process", None, request)
        started = time.monotonic()
        try:
            # Never into a frozen sandbox, nor one a stop is taking apart (edge/pausing.py).
            async with self.pausing.starting(sandbox_id):
                spawned, master = await self._spawn(sandbox_id, live, backend, req, env, cwd, user)
        except BaseException as exc:
            failure = exc if isinstance(exc, DSecError) else InfraFailure(f"process start failed: {exc}")
            if isinstance(exc, InfraFailure) and live.record.state not in (
                SandboxState.running,
                SandboxState.paused,
            ):  # the sandbox went meanwhile: the caller's answer is that, not the edge's fault
                failure = SandboxNotFound(f"sandbox {sandbox_id} stopped while the process started")
            self.recorder.log.finish(sandbox_id, seq, error=failure)
            if isinstance(failure, SandboxNotFound) and failure is not exc:
                raise failure from exc
            raise

        def ended(held: HeldProcess, end: ProcessEvent) -> None:
            if live.processes.procs.get(held.pid) is held:
                del live.processes.procs[held.pid]
            result = end.model_dump(exclude={"t", "data"}) | {"duration_s": time.monotonic() - started}
            with contextlib.suppress(Exception):  # the log closed with the edge
                self.recorder.log.finish(sandbox_id, seq, result=result)

        held = HeldProcess(
            spawned,
            argv=req.argv,
            env=req.env,
            cwd=cwd,
            tag=req.tag,
            master=master,
            timeout=req.timeout,
            stdin=req.stdin,
            on_end=ended,
        )
        live.processes.procs[held.pid] = held
        events = held.follow(held.start())
        with live.working():
            try:
                async for event in events:
                    yield event
            finally:
                await events.aclose()  # detaches only: the process runs on

    async def _spawn(
        self,
        sandbox_id: str,
        live: _Live,
        backend: Backend,
        req: ProcessStart,
        env: dict[str, str],
        cwd: str,
        user: User,
    ) -> tuple[Spawned, int | None]:
        handle = live.record.handle
        if not isinstance(backend, HoldsProcesses):
            proc = await backend.spawn(sandbox_id, handle, req.argv, env=env, cwd=cwd, user=user)
            if not req.stdin and proc.stdin is not None:
                proc.stdin.close()
            # A host process (the fake backend) is signalled here; a guest's through its agent.
            host = proc.pid if isinstance(proc, asyncio.subprocess.Process) else None
            return Spawned(proc, proc.pid, host), None
        if req.pty is None:
            held = await backend.spawn_held(
                sandbox_id, handle, req.argv, env=env, cwd=cwd, user=user, tty=None, stdin=req.stdin
            )
            return held, None
        # A sandbox whose root the host reaches gets a terminal of its own devpts (named inside:
        # `tty` works); others (and gVisor's, whose devpts is the sentry's) one of the host's.
        # The master stays with the edge either way.
        host_terminals: Callable[[Handle], bool] | None = getattr(backend, "host_terminals", None)
        if isinstance(backend, HostRooted) and not (host_terminals is not None and host_terminals(handle)):
            master, slave = await asyncio.to_thread(pty.open_in_sandbox, backend.root_path(handle), user.uid)
        else:
            master, slave = os.openpty()
        try:
            set_size(master, req.pty)
            os.set_blocking(master, False)
            held = await backend.spawn_held(
                sandbox_id, handle, req.argv, env=env, cwd=cwd, user=user, tty=slave, stdin=True
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)  # the process's copies are its own: EOF on the master once they close
        return held, master

    async def _user(self, live: _Live, name: str) -> User:
        """``name`` (a user of the sandbox's /etc/passwd as it is now, or a uid)."""
        files = self.backend_of(live.record).files(live.record.handle, live.user)
        text = b""
        with contextlib.suppress(DSecError):
            async for chunk in files.read_stream("/etc/passwd"):
                text += chunk
                if len(text) > _PASSWD_MAX:
                    break
        user = find_user(text.decode(errors="replace"), name)
        if user is None:
            raise InvalidRequest(f"user {name!r} is not a user of this sandbox (not in its /etc/passwd)")
        if user.home != "/" and not await _is_dir(files, user.home):
            return dataclasses.replace(user, home="/")
        return user

    async def _cwd(self, live: _Live, user: User, cwd: str | None) -> str:
        """The working directory, checked before the start (relative: to the user's home; none:
        the sandbox's ``workdir``, else the user's home)."""
        cwd = cwd if cwd is not None else live.record.spec.workdir
        if cwd is None:
            return user.home
        full = posixpath.normpath(posixpath.join(user.home, cwd))
        files = self.backend_of(live.record).files(live.record.handle, live.user)
        if not await _is_dir(files, full):
            raise InvalidRequest(f"working directory {full} does not exist or is not a directory")
        return full

    async def connect_process(self, sandbox_id: str, pid: int) -> AsyncGenerator[ProcessEvent, None]:
        """Attach to running process ``pid``: ``start``, its output from now on, ``end``."""
        live = await self.pausing.use(sandbox_id)
        held = live.processes.get(pid)
        events = held.follow(held.attach())
        with live.working():
            try:
                async for event in events:
                    yield event
            finally:
                await events.aclose()

    def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        procs = self.live.touch(sandbox_id).processes.procs.values()
        return [held.info() for held in procs if not held.ended.is_set()]

    async def _held(self, sandbox_id: str, pid: int) -> HeldProcess:
        return (await self.pausing.use(sandbox_id)).processes.get(pid)

    async def send_process_input(self, sandbox_id: str, pid: int, data: bytes) -> None:
        await (await self._held(sandbox_id, pid)).write(data)

    async def close_process_stdin(self, sandbox_id: str, pid: int) -> None:
        await (await self._held(sandbox_id, pid)).close_stdin()

    async def signal_process(self, sandbox_id: str, pid: int, signal: int) -> None:
        (await self._held(sandbox_id, pid)).signal(signal)

    async def resize_process(self, sandbox_id: str, pid: int, size: PtySize) -> None:
        (await self._held(sandbox_id, pid)).resize(size)

    async def watch_dir(
        self, sandbox_id: str, path: str, recursive: bool
    ) -> AsyncGenerator[WatchEvent, None]:
        """``start`` once the watch is in place, then changes below ``path``; closing ends it."""
        live = await self.pausing.use(sandbox_id)
        backend = self.backend_of(live.record)
        if not isinstance(backend, HostRooted):
            raise InvalidRequest(f"watching directories is not supported on {backend.name} sandboxes")
        table: ProcessTable = live.processes
        watch = DirWatch(
            backend.root_path(live.record.handle), path, recursive, table.budget, cwd=live.user.home
        )
        await asyncio.to_thread(watch.open)
        table.closers.add(watch.stop)
        events = watch.events()
        try:
            async for event in events:
                yield event
        finally:
            table.closers.discard(watch.stop)
            await events.aclose()
            watch.close()


async def _is_dir(files: FileOps, path: str) -> bool:
    try:
        info = await files.stat(path)
    except (FileNotFound, InvalidRequest):
        return False
    if info.type is not FileType.symlink:
        return info.type is FileType.dir
    try:  # stat() describes a symlink itself; a directory it names (in the sandbox) counts
        await files.list_dir(path)
    except DSecError:
        return False
    return True
