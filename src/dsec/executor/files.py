"""Confined file operations inside a sandbox, done from the host without entering it.

The edge runs on the host as root and reaches a container's filesystem through
``/proc/<init-pid>/root``. The container is hostile: it can plant symlinks (absolute, or full of
``..``), swap files for symlinks between two system calls, create FIFOs that block an ``open`` and
device nodes that reach host hardware. :class:`SandboxFiles` therefore:

* resolves every path with ``openat2(2)`` and ``RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`` relative
  to a directory fd of the sandbox root, so absolute symlinks and ``..`` are clamped to that root
  and ``/proc/*/root``-style magic links are refused;
* does everything after resolution relative to file descriptors, with single path components
  (``*at`` calls, ``O_NOFOLLOW``), so nothing is resolved a second time by name;
* opens files for reading as ``O_PATH`` first, checks they are regular files, and only then
  reopens them through ``/proc/self/fd`` -- a FIFO or a device node is never ``open``-ed;
* writes into a fresh temporary file (``O_CREAT | O_EXCL``) in the target's directory and renames
  it into place on commit, so a failed upload leaves nothing half-written;
* removes trees with its own fd-relative walk (``O_DIRECTORY | O_NOFOLLOW``), never following a
  symlink,
* refuses every path on a kernel file system (procfs, devpts, mqueue...: ``KERNEL_FS_MAGIC``),
  judged on the opened fd: it serves the sandbox's files, not the kernel's views, and
* maps every :class:`OSError` to the DSec error tree.

Paths are sandbox paths: absolute ones (``/tmp/x``) are inside the sandbox, relative ones are
joined to ``cwd`` (default ``/``). They are normalised lexically first (``/a/../b`` is ``/b``); the
root fd is opened afresh for each call so the object never pins the container's filesystem.
All methods are synchronous; run them with :func:`asyncio.to_thread`.

The handles it returns (:class:`AtomicWriter`, the reader) live in :mod:`dsec.executor._handles`;
path checks, normalisation and the OSError mapping in :mod:`dsec.executor._paths`.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import posixpath
import secrets
import stat as st
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from dsec.executor._handles import AtomicWriter, _Reader
from dsec.executor._openat2 import RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, openat2
from dsec.executor._paths import (
    PATH_MAX,
    _close,
    _map_oserror,
    _normalize,
    _refuse_kernel_fs,
    _rmtree_at,
    _to_stat,
)
from dsec.protocol.errors import Conflict, FileNotFound, InfraFailure, InfraReason, InvalidRequest
from dsec.protocol.models import FileStat

__all__ = ["PATH_MAX", "AtomicWriter", "SandboxFiles"]

_RESOLVE = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
_READ_CHUNK = 1 << 20
_TMP_ATTEMPTS = 16
_XATTRS_MAX = 256  # extended attributes of one prefix read back
_XATTR_VALUE_MAX = 64 << 10


def _check_xattrs(prefix: str, attrs: dict[str, str]) -> None:
    """Only the ``user.`` namespace (never ``trusted.``/``security.``, which the host's root
    could set), names the kernel takes (255 bytes, no NUL), a bounded total."""
    if not prefix.startswith("user.") or len(prefix) > 64 or "\0" in prefix:
        raise InvalidRequest("an extended attribute prefix is user.<something>, at most 64 characters")
    if len(attrs) > _XATTRS_MAX:
        raise InvalidRequest(f"at most {_XATTRS_MAX} extended attributes")
    total = 0
    for key, value in attrs.items():
        name = (prefix + key).encode()
        if not key or len(name) > 255 or b"\0" in name:
            raise InvalidRequest(
                f"extended attribute name {key[:64]!r}: 1 to 255 bytes with the prefix, no NUL"
            )
        total += len(name) + len(value.encode())
    if total > _XATTR_VALUE_MAX:
        raise InvalidRequest(f"extended attributes larger than {_XATTR_VALUE_MAX} bytes in all")


# --------------------------------------------------------------------------------------------- files


class SandboxFiles:
    """File operations confined to the directory tree at ``root``.

    ``root`` is a directory such as ``/proc/<init-pid>/root``; ``uid``/``gid`` own every file and
    directory this object creates (the sandbox's initial user).
    """

    def __init__(self, root: str | Path, uid: int = 0, gid: int = 0) -> None:
        self.root = str(root)
        self.uid = uid
        self.gid = gid

    def __repr__(self) -> str:
        return f"SandboxFiles(root={self.root!r}, uid={self.uid}, gid={self.gid})"

    # -- plumbing

    @contextmanager
    def _root_fd(self) -> Iterator[int]:
        try:
            fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise InfraFailure(
                f"sandbox root {self.root} is not accessible: {e.strerror}", reason=InfraReason.runtime
            ) from e
        try:
            yield fd
        finally:
            _close(fd)

    @staticmethod
    def _resolve(root_fd: int, path: str, flags: int, shown: str | None = None) -> int:
        """Open ``path`` (a normalised sandbox path) confined to the root, on a data file system
        (not /proc, /sys...: :func:`_refuse_kernel_fs`); map errors."""
        try:
            fd = openat2(root_fd, path, flags | os.O_CLOEXEC, 0, _RESOLVE)
        except OSError as e:
            raise _map_oserror(e, shown or path) from e
        try:
            _refuse_kernel_fs(fd, shown or path)
        except BaseException:
            _close(fd)
            raise
        return fd

    def _open_parent(self, root_fd: int, full: str) -> tuple[int, str]:
        """Return an ``O_PATH`` fd of the directory holding ``full`` and its last component."""
        parent, name = posixpath.split(full)
        try:
            fd = openat2(root_fd, parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE)
        except OSError as e:
            if e.errno == errno.ENOENT:
                raise FileNotFound(f"no such file or directory: {full}") from e
            if e.errno == errno.ENOTDIR:
                raise InvalidRequest(f"not a directory: the parent of {full} is not a directory") from e
            raise _map_oserror(e, full) from e
        try:
            _refuse_kernel_fs(fd, full)
        except BaseException:
            _close(fd)
            raise
        return fd, name

    @staticmethod
    def _lstat_raw(root_fd: int, full: str) -> os.stat_result:
        """lstat ``full`` inside the root; raises the raw OSError (InvalidRequest on a kernel
        file system: the entry is opened ``O_PATH | O_NOFOLLOW``, which opens no device or
        FIFO and lands past a mount point, so ``/proc`` itself counts as procfs)."""
        if full == "/":
            return os.fstat(root_fd)
        parent, name = posixpath.split(full)
        dir_fd = openat2(root_fd, parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE)
        try:
            _refuse_kernel_fs(dir_fd, full)
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        finally:
            _close(dir_fd)
        try:
            _refuse_kernel_fs(fd, full)
            return os.fstat(fd)
        finally:
            _close(fd)

    def _open_regular(self, root_fd: int, full: str, flags: int) -> int:
        """Open a regular file (following symlinks inside the root) without ever ``open``-ing
        anything else: resolve it as ``O_PATH``, check the type, reopen through /proc/self/fd."""
        path_fd = self._resolve(root_fd, full, os.O_PATH)
        try:
            try:
                before = os.fstat(path_fd)
            except OSError as e:
                raise _map_oserror(e, full) from e
            if st.S_ISDIR(before.st_mode):
                raise InvalidRequest(f"is a directory: {full}")
            if not st.S_ISREG(before.st_mode):
                raise InvalidRequest(f"not a regular file: {full}")
            try:
                fd = os.open(f"/proc/self/fd/{path_fd}", flags | os.O_CLOEXEC | os.O_NOCTTY)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ENOTDIR):
                    raise InfraFailure(
                        "cannot reopen a file through /proc/self/fd", reason=InfraReason.runtime
                    ) from e
                raise _map_oserror(e, full) from e
        finally:
            _close(path_fd)
        try:
            after = os.fstat(fd)
        except OSError as e:
            _close(fd)
            raise _map_oserror(e, full) from e
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):  # pragma: no cover
            _close(fd)
            raise InfraFailure(f"file changed identity while opening {full}", reason=InfraReason.storage)
        return fd

    def _mkdir_at(self, dir_fd: int, name: str, full: str, mode: int, exist_ok: bool) -> None:
        """Create directory ``name`` in ``dir_fd`` owned by uid/gid with exactly ``mode``."""
        try:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        except FileExistsError as e:
            try:
                cur = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError as e2:
                raise _map_oserror(e2, full) from e2
            if st.S_ISDIR(cur.st_mode):
                if exist_ok:
                    return
                raise Conflict(f"already exists: {full}") from e
            if st.S_ISLNK(cur.st_mode):
                raise InvalidRequest(f"cannot create directory {full}: it is a dangling symbolic link") from e
            raise InvalidRequest(f"cannot create directory {full}: a file of that name exists") from e
        except OSError as e:
            raise _map_oserror(e, full) from e
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as e:
            raise _map_oserror(e, full) from e
        try:
            os.fchown(fd, self.uid, self.gid)
            os.fchmod(fd, mode)
        except OSError as e:
            raise _map_oserror(e, full) from e
        finally:
            _close(fd)

    def _makedirs(self, root_fd: int, full: str, mode: int) -> None:
        """``mkdir -p`` confined to the root; each missing component is created in the fd of the
        directory resolved for its parent, so symlinked components stay inside the root."""
        try:
            _close(self._resolve(root_fd, full, os.O_PATH | os.O_DIRECTORY))
            return
        except (FileNotFound, InvalidRequest) as e:
            if not isinstance(e.__cause__, OSError) or e.__cause__.errno not in (errno.ENOENT, errno.ENOTDIR):
                raise
        prefix = ""
        for comp in full.strip("/").split("/"):
            parent, prefix = prefix or "/", f"{prefix}/{comp}"
            try:
                _close(self._resolve(root_fd, prefix, os.O_PATH | os.O_DIRECTORY))
                continue
            except FileNotFound:
                pass
            except InvalidRequest as e:
                if isinstance(e.__cause__, OSError) and e.__cause__.errno == errno.ENOTDIR:
                    msg = f"cannot create directory {full}: {prefix} is not a directory"
                    raise InvalidRequest(msg) from e.__cause__
                raise
            dir_fd = self._resolve(root_fd, parent, os.O_PATH | os.O_DIRECTORY)
            try:
                self._mkdir_at(dir_fd, comp, prefix, mode, exist_ok=True)
            finally:
                _close(dir_fd)

    # -- public API

    def stat(self, path: str, *, cwd: str = "/") -> FileStat:
        """Stat ``path``; a final symlink is described itself, not followed (lstat)."""
        full = _normalize(path, cwd)
        with self._root_fd() as root_fd:
            try:
                return _to_stat(full, self._lstat_raw(root_fd, full))
            except OSError as e:
                raise _map_oserror(e, full) from e

    def lstat(self, path: str, *, cwd: str = "/") -> os.stat_result:
        """The whole lstat of ``path`` (times, links): what :meth:`stat` summarises."""
        full = _normalize(path, cwd)
        with self._root_fd() as root_fd:
            try:
                return self._lstat_raw(root_fd, full)
            except OSError as e:
                raise _map_oserror(e, full) from e

    def readlink(self, path: str, *, cwd: str = "/") -> str:
        """A symlink's target as stored (read, never followed)."""
        full = _normalize(path, cwd)
        with self._root_fd() as root_fd:
            dir_fd, name = self._open_parent(root_fd, full)
        try:
            return os.readlink(name, dir_fd=dir_fd)
        except OSError as e:
            raise _map_oserror(e, full) from e
        finally:
            _close(dir_fd)

    def chattr(
        self, path: str, uid: int | None, gid: int | None, mode: int | None, *, cwd: str = "/"
    ) -> None:
        """chown/chmod what ``path`` leads to inside the root (a symlink is followed there, as
        chmod(1) does); ``None`` leaves that attribute as it is."""
        full = _normalize(path, cwd)
        with self._root_fd() as root_fd:
            fd = self._resolve(root_fd, full, os.O_PATH)
        try:
            # An O_PATH descriptor takes no fchmod: its /proc/self/fd link names the same inode.
            target = f"/proc/self/fd/{fd}"
            if mode is not None:
                os.chmod(target, mode & 0o7777)
            if uid is not None or gid is not None:
                os.chown(target, -1 if uid is None else uid, -1 if gid is None else gid)
        except OSError as e:
            raise _map_oserror(e, full) from e
        finally:
            _close(fd)

    def set_xattrs(self, path: str, prefix: str, attrs: dict[str, str]) -> None:
        """Make ``attrs`` (names without ``prefix``) the regular file's ``prefix`` extended
        attributes, dropping others of that prefix. The file is opened through its confined
        resolution (a link is followed only inside the root), never by a host path."""
        _check_xattrs(prefix, attrs)
        full = _normalize(path, "/")
        with self._root_fd() as root_fd:
            fd = self._open_regular(root_fd, full, os.O_RDONLY)
        try:
            for name in os.listxattr(fd):
                if name.startswith(prefix) and name[len(prefix) :] not in attrs:
                    os.removexattr(fd, name)
            for key, value in attrs.items():
                os.setxattr(fd, prefix + key, value.encode())
        except OSError as e:
            if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise InvalidRequest(f"the file system of {full} keeps no extended attributes") from e
            raise _map_oserror(e, full) from e
        finally:
            _close(fd)

    def xattrs(self, path: str, prefix: str) -> dict[str, str]:
        """The regular file's ``prefix`` extended attributes (names without it; {} for anything
        else, or a file system without them)."""
        _check_xattrs(prefix, {})
        full = _normalize(path, "/")
        with self._root_fd() as root_fd:
            try:
                fd = self._open_regular(root_fd, full, os.O_RDONLY)
            except InvalidRequest:
                return {}
        try:
            out: dict[str, str] = {}
            for name in os.listxattr(fd):
                if name.startswith(prefix) and len(out) < _XATTRS_MAX:
                    with contextlib.suppress(OSError, UnicodeDecodeError):
                        out[name[len(prefix) :]] = os.getxattr(fd, name)[:_XATTR_VALUE_MAX].decode()
            return out
        except OSError as e:
            if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                return {}
            raise _map_oserror(e, full) from e
        finally:
            _close(fd)

    def exists(self, path: str, *, cwd: str = "/") -> bool:
        """Whether ``path`` names an entry (lstat semantics: a dangling symlink exists)."""
        full = _normalize(path, cwd)
        with self._root_fd() as root_fd:
            try:
                self._lstat_raw(root_fd, full)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ENOTDIR):
                    return False
                raise _map_oserror(e, full) from e
        return True

    def list_dir(self, path: str, *, cwd: str = "/", max_entries: int | None = None) -> list[FileStat]:
        """The entries of directory ``path`` (a symlink to a directory is followed), sorted by
        name. With ``max_entries``, a larger directory is refused rather than listed."""
        full = _normalize(path, cwd)
        with self._root_fd() as root_fd:
            # O_DIRECTORY fails with ENOTDIR before the kernel opens anything that is not a dir.
            dir_fd = self._resolve(root_fd, full, os.O_RDONLY | os.O_DIRECTORY)
        try:
            try:
                names = os.listdir(dir_fd)
            except OSError as e:
                raise _map_oserror(e, full) from e
            if max_entries is not None and len(names) > max_entries:
                raise InvalidRequest(f"{full} has {len(names)} entries, more than the limit of {max_entries}")
            out: list[FileStat] = []
            for name in sorted(names):
                try:
                    info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    raise _map_oserror(e, posixpath.join(full, name)) from e
                out.append(_to_stat(posixpath.join(full, name), info))
            return out
        finally:
            _close(dir_fd)

    def mkdir(self, path: str, parents: bool = True, mode: int = 0o755, *, cwd: str = "/") -> None:
        """Create a directory owned by uid/gid. ``parents=True`` is ``mkdir -p`` (missing parents are
        created, an existing directory is fine); ``parents=False`` needs the parent to exist and
        raises :class:`Conflict` if the path exists."""
        full = _normalize(path, cwd)
        mode &= 0o7777
        with self._root_fd() as root_fd:
            if parents:
                self._makedirs(root_fd, full, mode)
                return
            if full == "/":
                raise Conflict("already exists: /")
            dir_fd, name = self._open_parent(root_fd, full)
            try:
                self._mkdir_at(dir_fd, name, full, mode, exist_ok=False)
            finally:
                _close(dir_fd)

    def remove(self, path: str, recursive: bool = False, *, cwd: str = "/") -> None:
        """Remove a file, symlink (not its target) or empty directory; with ``recursive=True`` a
        whole tree, without following any symlink inside it."""
        full = _normalize(path, cwd)
        if full == "/":
            raise InvalidRequest("refusing to remove the sandbox root")
        with self._root_fd() as root_fd:
            dir_fd, name = self._open_parent(root_fd, full)
        try:
            try:
                info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if not st.S_ISDIR(info.st_mode):
                    os.unlink(name, dir_fd=dir_fd)
                    return
                if not recursive:
                    os.rmdir(name, dir_fd=dir_fd)
                    return
            except OSError as e:
                raise _map_oserror(e, full) from e
            _rmtree_at(dir_fd, name, full)
        finally:
            _close(dir_fd)

    def move(self, source: str, destination: str, *, cwd: str = "/") -> None:
        """Rename ``source`` to ``destination`` (rename(2): replaces a file, never crosses the
        root; both parents resolved inside the root, neither final symlink followed)."""
        src, dst = _normalize(source, cwd), _normalize(destination, cwd)
        if "/" in (src, dst):
            raise InvalidRequest("refusing to move the sandbox root")
        with self._root_fd() as root_fd:
            src_fd, src_name = self._open_parent(root_fd, src)
            try:
                dst_fd, dst_name = self._open_parent(root_fd, dst)
            except BaseException:
                _close(src_fd)
                raise
        try:
            os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        except OSError as e:
            raise _map_oserror(e, src if e.errno == errno.ENOENT else dst) from e
        finally:
            _close(src_fd)
            _close(dst_fd)

    def read_bytes(self, path: str, max_bytes: int, *, cwd: str = "/") -> bytes:
        """The whole content of a regular file; :class:`InvalidRequest` if it is over ``max_bytes``."""
        if max_bytes < 0:
            raise InvalidRequest("max_bytes must be >= 0")
        full = _normalize(path, cwd)
        with self._root_fd() as root_fd:
            fd = self._open_regular(root_fd, full, os.O_RDONLY)
        try:
            try:
                size = os.fstat(fd).st_size
                if size > max_bytes:
                    raise InvalidRequest(f"{full} is {size} bytes, more than the limit of {max_bytes}")
                chunks: list[bytes] = []
                got = 0
                while got <= max_bytes:  # the file may grow while we read: never take more
                    chunk = os.read(fd, min(_READ_CHUNK, max_bytes + 1 - got))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    got += len(chunk)
            except OSError as e:
                raise _map_oserror(e, full) from e
            if got > max_bytes:
                raise InvalidRequest(f"{full} is more than the limit of {max_bytes} bytes")
            return b"".join(chunks)
        finally:
            _close(fd)

    def open_read(self, path: str, *, cwd: str = "/") -> BinaryIO:
        """A buffered binary file object over the opened file, for streaming it out in chunks;
        the caller closes it. Read errors on it are DSec errors too."""
        full = _normalize(path, cwd)
        with self._root_fd() as root_fd:
            fd = self._open_regular(root_fd, full, os.O_RDONLY)
        try:
            raw = _Reader(fd, full)
        except BaseException:
            _close(fd)
            raise
        return io.BufferedReader(raw, buffer_size=_READ_CHUNK)

    def open_write(
        self, path: str, mode: int = 0o644, append: bool = False, *, cwd: str = "/"
    ) -> AtomicWriter:
        """Start writing ``path``; missing parent directories are created (owned by uid/gid).

        Without ``append`` the data goes to a temporary file owned by uid/gid in the same directory
        and replaces ``path`` atomically on commit (a symlink at ``path`` is replaced, not
        followed). With ``append`` an existing regular file is extended in place (keeping its owner
        and mode) and :meth:`AtomicWriter.abort` truncates it back; a missing file is created as
        without ``append``.
        """
        full = _normalize(path, cwd)
        mode &= 0o7777
        if full == "/":
            raise InvalidRequest("cannot write /: it is a directory")
        with self._root_fd() as root_fd:
            parent = posixpath.dirname(full)
            if parent != "/":
                self._makedirs(root_fd, parent, 0o755)
            if append:
                writer = self._open_append(root_fd, full, mode)
                if writer is not None:
                    return writer
            dir_fd, name = self._open_parent(root_fd, full)
        try:
            return self._open_replace(dir_fd, name, full, mode)
        except BaseException:
            _close(dir_fd)
            raise

    def _open_append(self, root_fd: int, full: str, mode: int) -> AtomicWriter | None:
        try:
            fd = self._open_regular(root_fd, full, os.O_WRONLY | os.O_APPEND)
        except FileNotFound:
            return None
        try:
            size = os.fstat(fd).st_size
        except OSError as e:
            _close(fd)
            raise _map_oserror(e, full) from e
        return AtomicWriter(path=full, dir_fd=None, name="", fd=fd, tmp_name=None, mode=mode, orig_size=size)

    def _open_replace(self, dir_fd: int, name: str, full: str, mode: int) -> AtomicWriter:
        try:
            cur = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if st.S_ISDIR(cur.st_mode):
                raise InvalidRequest(f"cannot write {full}: it is a directory")
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _map_oserror(e, full) from e
        prefix = f".{name[:32]}.dsec-"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(_TMP_ATTEMPTS):
            tmp_name = prefix + secrets.token_hex(8)
            try:
                fd = os.open(tmp_name, flags, 0o600, dir_fd=dir_fd)
                break
            except FileExistsError:
                continue
            except OSError as e:
                raise _map_oserror(e, full) from e
        else:
            raise InfraFailure(
                f"could not create a temporary file next to {full}", reason=InfraReason.storage
            )
        try:
            os.fchown(fd, self.uid, self.gid)
        except OSError as e:
            _close(fd)
            try:
                os.unlink(tmp_name, dir_fd=dir_fd)
            except OSError:
                pass
            raise _map_oserror(e, full) from e
        return AtomicWriter(path=full, dir_fd=dir_fd, name=name, fd=fd, tmp_name=tmp_name, mode=mode)

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644, *, cwd: str = "/") -> None:
        """Write ``data`` to ``path`` atomically (see :meth:`open_write`)."""
        with self.open_write(path, mode, cwd=cwd) as w:
            w.write(data)
