"""Directory watches inside a sandbox, from the host: inotify on paths resolved in its root.

The sandbox is hostile: a watch of ``/work`` where ``/work`` is a symlink to ``/etc`` must
watch the sandbox's ``/etc``, never the host's. So the directory is resolved as the file API
resolves paths (``openat2`` with ``RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`` from a directory
fd of the sandbox root) into an ``O_PATH`` fd, kernel file systems are refused, and the inotify
watch is added on ``/proc/self/fd/<fd>``: the inode that fd holds, whatever the path names
by then. A recursive watch walks subdirectories fd-relative with ``O_NOFOLLOW`` and stays on
the watched directory's file system; directories created later get a watch as they appear
(and what was made in them before the watch was in place is reported as created).

Events follow fsnotify, which E2B's envd is built on: a rename is ``rename`` for the old name
and ``create`` for the new one. ``IN_MODIFY`` and ``IN_CLOSE_WRITE`` are both ``write``;
repeats of one event within a read are reported once.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import posixpath
import stat
import struct
from collections.abc import AsyncGenerator, Callable

from dsec.executor._openat2 import KERNEL_FS_MAGIC, RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, fs_type, openat2
from dsec.executor._paths import _map_oserror, _normalize
from dsec.protocol.errors import Conflict, DSecError, InfraFailure, InfraReason, InvalidRequest
from dsec.protocol.processes import WatchEvent, WatchKind

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800
IN_UNMOUNT, IN_Q_OVERFLOW, IN_IGNORED = 0x2000, 0x4000, 0x8000
IN_ONLYDIR, IN_EXCL_UNLINK, IN_ISDIR = 0x01000000, 0x04000000, 0x40000000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
MASK = (
    IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
    | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK
)  # fmt: skip
_EVENT = struct.Struct("iIII")  # struct inotify_event without its name
_READ = 1 << 16
MAX_WATCHES = 8192  # inotify watches (directories) per sandbox, over all its watch streams
MAX_STREAMS = 16  # watch streams per sandbox: each is an inotify instance of the edge

_libc = ctypes.CDLL(None, use_errno=True)
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]


class WatchBudget:
    """What one sandbox's watches may hold of the node's inotify resources."""

    def __init__(self, watches: int = MAX_WATCHES, streams: int = MAX_STREAMS) -> None:
        self.watches, self.streams = watches, streams

    def take(self, watches: int = 0, streams: int = 0) -> None:
        if streams > self.streams:
            raise Conflict(f"too many directory watches open on this sandbox (at most {MAX_STREAMS})")
        if watches > self.watches:
            raise InvalidRequest(
                f"too many directories watched in this sandbox (at most {MAX_WATCHES}): watch a smaller tree"
            )
        self.watches -= watches
        self.streams -= streams

    def give(self, watches: int = 0, streams: int = 0) -> None:
        self.watches += watches
        self.streams += streams


class DirWatch:
    """One watch stream of directory ``path`` in the sandbox whose root the host sees at ``root``."""

    def __init__(self, root: str, path: str, recursive: bool, budget: WatchBudget, *, cwd: str = "/") -> None:
        self.root = root
        self.path = _normalize(path, cwd)
        self.recursive = recursive
        self.budget = budget
        self.fd = -1
        self.root_fd = -1
        self.dev = 0
        self.dirs: dict[int, str] = {}  # watch descriptor -> directory, relative to the watched one
        self.stopped: DSecError | None = None
        self._wake: asyncio.Future[None] | None = None
        self._stream = False

    # -- set-up (blocking: run in a thread) ------------------------------------------------------

    def open(self) -> None:
        self.budget.take(streams=1)
        self._stream = True
        try:
            self.root_fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            self.close()
            msg = f"sandbox root {self.root} is not accessible: {exc.strerror}"
            raise InfraFailure(msg, reason=InfraReason.runtime) from exc
        try:
            top = self._resolve(self.path)
            try:
                self.dev = os.fstat(top).st_dev
                fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
                if fd < 0:
                    err = ctypes.get_errno()
                    msg = f"cannot watch {self.path}: inotify: {os.strerror(err)}"
                    raise InfraFailure(msg + " (fs.inotify.max_user_instances?)", reason=InfraReason.runtime)
                self.fd = fd
                self._add(top, "")
            finally:
                os.close(top)
            if self.recursive:
                self._walk_from("", report=False)
        except BaseException:
            self.close()
            raise

    def _resolve(self, full: str) -> int:
        """An ``O_PATH`` fd of directory ``full``, resolved inside the root; data file systems only."""
        try:
            fd = openat2(self.root_fd, full, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE)
        except OSError as exc:
            raise _map_oserror(exc, full) from exc
        kernel_fs = KERNEL_FS_MAGIC.get(fs_type(fd))
        if kernel_fs is not None:
            os.close(fd)
            raise InvalidRequest(f"{full} is on {kernel_fs}: only data directories can be watched")
        return fd

    def _add(self, fd: int, rel: str) -> None:
        self.budget.take(watches=1)
        wd = _libc.inotify_add_watch(self.fd, f"/proc/self/fd/{fd}".encode(), MASK)
        if wd < 0:
            self.budget.give(watches=1)
            err = ctypes.get_errno()
            if err == errno.ENOSPC:
                raise Conflict("the node's inotify watches are used up (fs.inotify.max_user_watches)")
            raise _map_oserror(OSError(err, os.strerror(err)), self._full(rel))
        if wd in self.dirs:
            self.budget.give(watches=1)  # the same directory again (a rename inside the tree)
        self.dirs[wd] = rel

    def _full(self, rel: str) -> str:
        return posixpath.join(self.path, rel) if rel else self.path

    def _walk_from(self, rel: str, *, report: bool) -> list[str]:
        """Watch every directory below ``rel`` (on the same file system), fd-relative and never
        through a symlink; returns what it found (``report``), relative to the watched one."""
        found: list[str] = []
        try:
            top = openat2(
                self.root_fd, self._full(rel), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE
            )
        except OSError:
            return found  # gone again, or not a directory any more
        stack = [(top, rel)]
        try:
            while stack:
                dir_fd, here = stack.pop()
                try:
                    names = os.listdir(dir_fd)
                except OSError:
                    os.close(dir_fd)
                    continue
                for name in names:
                    sub = posixpath.join(here, name) if here else name
                    if report:
                        found.append(sub)
                    try:
                        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    except OSError:
                        continue
                    if not stat.S_ISDIR(info.st_mode) or info.st_dev != self.dev:
                        continue
                    try:
                        child = os.open(
                            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
                        )
                    except OSError:
                        continue
                    try:
                        self._add(child, sub)
                    except BaseException:
                        os.close(child)
                        raise
                    stack.append((child, sub))
                os.close(dir_fd)
        finally:
            for dir_fd, _ in stack:
                os.close(dir_fd)
        return found

    # -- events -----------------------------------------------------------------------------------

    def stop(self, why: DSecError) -> None:
        """End the stream from outside (the sandbox stops): its reader gets ``why``."""
        self.stopped = why
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1
        self.budget.give(watches=len(self.dirs), streams=1 if self._stream else 0)
        self.dirs.clear()
        self._stream = False

    async def events(self) -> AsyncGenerator[WatchEvent, None]:
        """``start``, then changes; the caller closes it (and :meth:`close`)."""
        loop = asyncio.get_running_loop()
        yield WatchEvent(t="start")
        while True:
            if self.stopped is not None:
                raise self.stopped
            try:
                raw = os.read(self.fd, _READ)
            except BlockingIOError:
                self._wake = wake = loop.create_future()
                fd = self.fd
                loop.add_reader(fd, _wake, wake)
                try:
                    await wake
                finally:
                    loop.remove_reader(fd)
                continue
            out, ended = self._parse(raw)
            for event in out:
                yield event
            if ended:
                return

    def _parse(self, raw: bytes) -> tuple[list[WatchEvent], bool]:
        out: list[WatchEvent] = []
        moved: dict[int, str] = {}  # cookie -> directory moved away (to be re-homed or dropped)
        ended = False

        def emit(kind: WatchKind, name: str) -> None:
            event = WatchEvent(t=kind, name=name)
            if not out or out[-1] != event:
                out.append(event)

        pos = 0
        while pos + _EVENT.size <= len(raw):
            wd, mask, cookie, length = _EVENT.unpack_from(raw, pos)
            name = raw[pos + _EVENT.size : pos + _EVENT.size + length].rstrip(b"\0")
            pos += _EVENT.size + length
            if mask & IN_Q_OVERFLOW:
                raise Conflict(f"the watch of {self.path} fell behind and lost events: watch it again")
            base = self.dirs.get(wd)
            if base is None:
                continue
            rel = posixpath.join(base, os.fsdecode(name)) if base else os.fsdecode(name)
            if mask & IN_IGNORED:
                self.dirs.pop(wd, None)
                self.budget.give(watches=1)
                ended = ended or wd_is_top(base)
                continue
            if not name:  # about the directory itself
                if mask & (IN_DELETE_SELF | IN_MOVE_SELF) and not base:
                    emit("remove" if mask & IN_DELETE_SELF else "rename", "")
                continue
            is_dir = bool(mask & IN_ISDIR)
            if mask & IN_CREATE:
                emit("create", rel)
                if is_dir and self.recursive:
                    self._watch_new(rel, emit)
            elif mask & IN_MOVED_TO:
                emit("create", rel)
                if is_dir and self.recursive:
                    if cookie in moved:
                        self._rehome(moved.pop(cookie), rel)
                    else:
                        self._watch_new(rel, emit)
            elif mask & IN_MOVED_FROM:
                emit("rename", rel)
                if is_dir:
                    moved[cookie] = rel
            elif mask & IN_DELETE:
                emit("remove", rel)
            elif mask & (IN_MODIFY | IN_CLOSE_WRITE):
                emit("write", rel)
            elif mask & IN_ATTRIB:
                emit("chmod", rel)
        for gone in moved.values():  # moved out of the watched tree: no longer ours to watch
            self._drop(gone)
        return out, ended

    def _watch_new(self, rel: str, emit: Callable[[WatchKind, str], None]) -> None:
        try:
            fd = self._resolve(self._full(rel))
        except DSecError:
            return  # gone already, or not ours to watch (another file system)
        try:
            if os.fstat(fd).st_dev != self.dev:
                return
            self._add(fd, rel)
        finally:
            os.close(fd)
        # What was made in it before its watch was in place would go unseen otherwise.
        for sub in self._walk_from(rel, report=True):
            emit("create", sub)

    def _rehome(self, old: str, new: str) -> None:
        for wd, rel in list(self.dirs.items()):
            if rel == old or rel.startswith(old + "/"):
                self.dirs[wd] = new + rel[len(old) :]

    def _drop(self, gone: str) -> None:
        for wd, rel in list(self.dirs.items()):
            if rel == gone or rel.startswith(gone + "/"):
                _libc.inotify_rm_watch(self.fd, wd)  # its IN_IGNORED gives the budget back


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def wd_is_top(rel: str) -> bool:
    return rel == ""


_RESOLVE = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
