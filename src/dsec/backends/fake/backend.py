"""A test double of the :class:`~dsec.backends.base.Backend` seam: sandboxes without isolation.

**Never use this to run untrusted code.** It exists so that the control plane (apiserver,
placement, edge state machine, journal, reaper, SDK) can be tested in milliseconds, without
root-only runtimes, and so that ``tests/backends/conformance.py`` has a second implementation
keeping the seam honest.

What a fake sandbox is:

- its root is a plain directory ``<workdir>/root`` holding the union of the layer
  directories, copied base first (overlay whiteouts and opaque directories are honoured, so
  the union matches what an overlay mount would show);
- its "init" is a host ``sleep`` process in a session of its own, so :meth:`alive` is a real
  liveness check (pid plus start time, immune to pid reuse) and :meth:`destroy` really kills;
- :meth:`spawn` runs argv *on the host*, as the edge's own user (``user`` is ignored), with
  its working directory mapped under the fake root (the root itself when the directory does
  not exist there). Relative paths therefore land in the sandbox, absolute paths do **not**:
  ``echo x > f`` in cwd ``/tmp`` writes ``<root>/tmp/f``, ``echo x > /tmp/f`` writes the
  host's ``/tmp/f``;
- every process it starts carries ``DSEC_FAKE_SANDBOX=<id>`` in its environment: that marker
  stands in for a cgroup, and :meth:`destroy` kills every process that still carries it
  (including daemons that left the spawned process's group);
- its on-disk record is ``<state_dir>/<id>.json`` (the counterpart of crun's state directory),
  which is what :meth:`leftovers` lists and what lets a *new* ``FakeBackend`` on the same
  ``state_dir`` re-adopt or clean up sandboxes, as after an edge restart.

Failure injection (constructor arguments, or attributes to flip at any time):

- ``fail_create``: every :meth:`create` does part of its work (root, record, init process),
  undoes it and raises ``InfraFailure``; :attr:`failed_creates` records the sandbox IDs that
  failed so a test can look them up;
- ``fail_destroy``: every :meth:`destroy` raises ``InfraFailure`` before touching anything, as
  a runtime that cannot be reached would.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import signal
import stat
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from dsec import _linux
from dsec.backends.base import HOST_PROCESSES, CreateContext, User
from dsec.backends.handle import Handle
from dsec.executor.file_ops import FileOps, HostFileOps
from dsec.executor.files import SandboxFiles
from dsec.protocol.errors import DSecError, InfraFailure, InfraReason

MARKER_ENV = "DSEC_FAKE_SANDBOX"
_OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
_SLEEP_ARGV = ["sleep", "2147483647"]
_HOST_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def _pids_with_marker(sandbox_id: str) -> list[int]:
    want = f"{MARKER_ENV}={sandbox_id}".encode()
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:
            continue
        if want in environ.split(b"\0"):
            out.append(int(entry))
    return out


def _remove(path: Path) -> None:
    """Remove whatever is at ``path`` (file, symlink, special file, or directory tree)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        path.unlink()


def _is_opaque(path: str) -> bool:
    for name in _OPAQUE_XATTRS:
        try:
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
        except OSError:
            continue
    return False


def _copy_meta(src_st: os.stat_result, dst: Path) -> None:
    if os.geteuid() == 0:
        with contextlib.suppress(OSError):
            os.lchown(dst, src_st.st_uid, src_st.st_gid)
    if not stat.S_ISLNK(src_st.st_mode):
        os.chmod(dst, stat.S_IMODE(src_st.st_mode))


def _merge_layer(src: Path, dst: Path) -> None:
    """Copy layer ``src`` over ``dst`` the way overlayfs would show ``src`` on top of ``dst``."""
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        target_dir = dst if rel == "." else dst / rel
        if rel != "." and _is_opaque(dirpath):
            for child in list(target_dir.iterdir()):
                _remove(child)
        for name in [*dirnames, *filenames]:
            s, d = os.path.join(dirpath, name), target_dir / name
            st = os.lstat(s)
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                if d.is_symlink() or (d.exists() and not d.is_dir()):
                    _remove(d)
                d.mkdir(exist_ok=True)
                _copy_meta(st, d)
                continue
            _remove(d)
            if stat.S_ISCHR(mode) and st.st_rdev == 0:
                continue  # a whiteout: the name is deleted from the union
            if stat.S_ISLNK(mode):
                os.symlink(os.readlink(s), d)
            elif stat.S_ISREG(mode):
                shutil.copy2(s, d, follow_symlinks=False)
            elif stat.S_ISFIFO(mode):
                os.mkfifo(d)
            elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                try:
                    os.mknod(d, mode, st.st_rdev)
                except PermissionError:
                    continue  # unprivileged: a device node is not worth failing a test double for
            else:
                continue  # sockets are not copied, as cp -a would not either
            _copy_meta(st, d)


def _map_cwd(sandbox_id: str, root: Path, cwd: str) -> Path:
    """``cwd`` under the fake root; the root itself if it is missing there or escapes it."""
    if not root.is_dir():
        raise InfraFailure(f"fake sandbox {sandbox_id} has no root {root}", reason=InfraReason.runtime)
    host_cwd = root / cwd.lstrip("/")
    if not host_cwd.is_dir() or not host_cwd.resolve().is_relative_to(root.resolve()):
        return root
    return host_cwd


class FakeHandle(Handle):
    """pid/start_time: its init (a ``sleep``); its copied root and working directory."""

    root: str = ""
    workdir: str = ""


class FakeBackend:
    """A :class:`~dsec.backends.base.Backend` for tests: host processes, copied roots, no isolation.

    ``name`` defaults to ``"container"`` because placement matches a spec's ``type`` against the
    names of the backends an edge reports; the fake stands in for the container backend.
    """

    handle_type = FakeHandle

    def __init__(
        self,
        state_dir: Path,
        *,
        fail_create: bool = False,
        fail_destroy: bool = False,
        name: str = "container",
    ) -> None:
        self.state_dir = state_dir
        self.fail_create = fail_create
        self.fail_destroy = fail_destroy
        self.name = name
        self.failed_creates: list[str] = []
        self._inits: dict[str, asyncio.subprocess.Process] = {}

    # -- helpers ------------------------------------------------------------------------------

    def _state_file(self, sandbox_id: str) -> Path:
        return self.state_dir / f"{sandbox_id}.json"

    def _read_state(self, sandbox_id: str) -> dict[str, Any]:
        try:
            data = json.loads(self._state_file(sandbox_id).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_state(self, sandbox_id: str, state: dict[str, Any]) -> None:
        path = self._state_file(sandbox_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(path)

    async def _kill_init(self, sandbox_id: str, pid: int, start_time: int | None) -> None:
        proc = self._inits.pop(sandbox_id, None)
        if pid > 0 and start_time is not None and _linux.proc_start_time(pid) == start_time:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc is not None:
            await proc.wait()

    async def _kill_marked(self, sandbox_id: str) -> None:
        """SIGKILL every process carrying the sandbox's marker until none is left."""
        deadline = time.monotonic() + 10.0
        while True:
            pids = await asyncio.to_thread(_pids_with_marker, sandbox_id)
            live = [p for p in pids if _linux.proc_start_time(p) is not None]
            if not live:
                return
            if time.monotonic() > deadline:
                raise InfraFailure(
                    f"fake sandbox {sandbox_id}: processes {live} survive SIGKILL", reason=InfraReason.runtime
                )
            for pid in live:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.005)  # the kernel needs a moment to tear killed processes down

    # -- the Backend protocol -----------------------------------------------------------------

    async def prepare_node(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)

    async def create(self, ctx: CreateContext) -> FakeHandle:
        sid = ctx.sandbox_id
        root = ctx.workdir / "root"
        state: dict[str, Any] = {"root": str(root), "workdir": str(ctx.workdir)}
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._write_state(sid, state)
            root.mkdir(parents=True)
            for layer in ctx.layer_dirs:
                if not layer.is_dir():
                    raise InfraFailure(
                        f"fake create: layer directory {layer} is missing", reason=InfraReason.runtime
                    )
                await asyncio.to_thread(_merge_layer, layer, root)
            proc = await asyncio.create_subprocess_exec(
                *_SLEEP_ARGV,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                env={**_HOST_ENV, MARKER_ENV: sid},
                cwd=str(root),
                start_new_session=True,
            )
            self._inits[sid] = proc
            state.update(pid=proc.pid, start_time=_linux.proc_start_time(proc.pid))
            self._write_state(sid, state)
            ctx.handle = FakeHandle.model_validate(state)  # what the failure below leaves
            if self.fail_create:
                raise InfraFailure(
                    f"fake create of {sid} failed on purpose (fail_create=True)", reason=InfraReason.runtime
                )
            return FakeHandle.model_validate(state)
        except BaseException as exc:
            self.failed_creates.append(sid)
            await asyncio.shield(self._destroy(sid, state, ctx.workdir))
            if isinstance(exc, DSecError) or not isinstance(exc, Exception):
                raise
            raise InfraFailure(f"fake create of {sid} failed: {exc}", reason=InfraReason.runtime) from exc

    async def alive(self, sandbox_id: str, handle: Handle) -> bool:
        h = FakeHandle.of(handle)
        return h.pid > 0 and _linux.proc_start_time(h.pid) == h.start_time

    async def destroy(self, sandbox_id: str, handle: Handle, workdir: Path) -> None:
        if self.fail_destroy:
            raise InfraFailure(
                f"fake destroy of {sandbox_id} failed on purpose (fail_destroy=True)",
                reason=InfraReason.runtime,
            )
        await self._destroy(sandbox_id, FakeHandle.of(handle).dump(), workdir)

    async def _destroy(self, sandbox_id: str, handle: dict[str, Any], workdir: Path) -> None:
        state = {**self._read_state(sandbox_id), **handle}
        await self._kill_init(sandbox_id, int(state.get("pid", 0)), state.get("start_time"))
        await self._kill_marked(sandbox_id)
        for path in {Path(p) for p in (workdir, state.get("workdir")) if p}:
            await asyncio.to_thread(shutil.rmtree, path, ignore_errors=True)
        self._state_file(sandbox_id).unlink(missing_ok=True)

    async def spawn(
        self,
        sandbox_id: str,
        handle: Handle,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: User,
    ) -> asyncio.subprocess.Process:
        host_cwd = _map_cwd(sandbox_id, Path(self.root_path(handle)), cwd)
        full_env = {**env, MARKER_ENV: sandbox_id}
        kwargs: dict[str, Any] = {
            "stdin": asyncio.subprocess.PIPE,
            "stdout": asyncio.subprocess.PIPE,
            "stderr": asyncio.subprocess.PIPE,
            "env": full_env,
            "cwd": str(host_cwd),
            "start_new_session": True,
        }
        try:
            return await asyncio.create_subprocess_exec(*argv, **kwargs)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EACCES, errno.ENOEXEC):
                raise
            # Like a runtime's exec: a missing program is the command's failure (exit 127/126),
            # not the platform's.
            code = 127 if exc.errno == errno.ENOENT else 126
            msg = f"{argv[0]}: {os.strerror(exc.errno)}"
            return await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", 'printf "%s\\n" "$1" >&2; exit "$2"', "sh", msg, str(code), **kwargs
            )

    @asynccontextmanager
    async def writable_layer(self, sandbox_id: str, handle: Handle, workdir: Path) -> AsyncIterator[Path]:
        yield workdir / "root"  # no overlay here: a commit packs the whole copied tree

    async def freeze(self, sandbox_id: str, handle: Handle) -> None:
        return None

    async def thaw(self, sandbox_id: str, handle: Handle) -> None:
        return None

    async def page_out(self, sandbox_id: str, handle: Handle) -> int:
        return 0  # plain processes: nothing to push out

    async def prefetch(self, sandbox_id: str, handle: Handle) -> int:
        return 0

    def memory_bytes(self, sandbox_id: str) -> int:
        return 0

    def root_path(self, handle: Handle) -> str:
        return FakeHandle.of(handle).root

    def files(self, handle: Handle, user: User) -> FileOps:
        return HostFileOps(SandboxFiles(self.root_path(handle), uid=user.uid, gid=user.gid))

    def oom_kills(self, sandbox_id: str) -> int:
        return 0

    def capabilities(self) -> dict[str, Any]:
        # no working checkpoint/restore here; its processes are the host's own
        return {"pause": True, "fork_processes": False, HOST_PROCESSES: True}

    async def detach(self) -> None:
        return None  # the edge holds no connection to a container: its pipes are the sessions'

    async def release_node(self) -> None:
        return None

    async def leftovers(self) -> list[str]:
        if not self.state_dir.is_dir():
            return []
        return sorted(p.stem for p in self.state_dir.glob("*.json"))


__all__ = ["MARKER_ENV", "FakeBackend"]
