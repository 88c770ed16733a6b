"""Sandbox path checks and normalisation, and the OSError handling shared by the file code.

Used by :mod:`dsec.executor.files` (and the handles in :mod:`dsec.executor._handles`): a caller's
path is checked and normalised lexically into an absolute sandbox path, every :class:`OSError`
raised while working on it is mapped onto the DSec error tree, ``os.stat`` results become
:class:`~dsec.protocol.models.FileStat`; also the refusal of kernel file systems and the
fd-relative tree removal.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat as st

from dsec.executor._openat2 import KERNEL_FS_MAGIC, fs_type
from dsec.protocol.errors import (
    Conflict,
    ConflictReason,
    DSecError,
    FileNotFound,
    InfraFailure,
    InfraReason,
    InvalidReason,
    InvalidRequest,
)
from dsec.protocol.models import FileStat, FileType

__all__ = ["PATH_MAX"]

PATH_MAX = 4096
"""Longest path (in bytes, UTF-8/surrogateescape encoded) accepted from a caller."""

_MAX_TREE_DEPTH = 1024  # directories held open at once by a recursive remove


# --------------------------------------------------------------------------------------------- errors


def _map_oserror(exc: OSError, path: str) -> DSecError:
    """Translate an OSError raised while working on sandbox path ``path`` into a DSec error."""
    code = exc.errno
    why = exc.strerror or str(exc)
    if code == errno.ENOENT:
        return FileNotFound(f"no such file or directory: {path}")
    if code in (errno.ELOOP, errno.EXDEV):
        return InvalidRequest(
            f"path escapes the sandbox (or loops through symbolic links): {path}",
            reason=InvalidReason.path_escape,
        )
    if code == errno.ENOTDIR:
        return InvalidRequest(f"not a directory: a component of {path} is not a directory")
    if code == errno.EISDIR:
        return InvalidRequest(f"is a directory: {path}")
    if code == errno.EEXIST:
        return Conflict(f"already exists: {path}")
    if code == errno.ENOTEMPTY:
        return InvalidRequest(f"directory not empty: {path} (pass recursive=True to remove a tree)")
    if code in (errno.EACCES, errno.EPERM):
        return InvalidRequest(f"permission denied: {path}")
    if code == errno.EROFS:
        return InvalidRequest(f"read-only file system: {path}")
    if code == errno.ENAMETOOLONG:
        return InvalidRequest(f"file name too long: {path}")
    if code == errno.EFBIG:
        return InvalidRequest(f"file too large: {path}")
    if code == errno.EINVAL:
        return InvalidRequest(f"invalid argument for {path}: {why}")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return Conflict(f"no space left on the sandbox file system: {path}", reason=ConflictReason.no_space)
    if code in (errno.EBUSY, errno.ETXTBSY):
        return Conflict(f"busy: {path} ({why})")
    if code == errno.EMEDIUMTYPE:  # a microVM's guest agent: the path is on a kernel file system
        return InvalidRequest(
            f"{path} is on a kernel file system: the file API serves the sandbox's files, not kernel views",
            reason=InvalidReason.kernel_fs,
        )
    if code == errno.ENOSYS:
        return InfraFailure(
            "openat2(2) is not available on this kernel (Linux >= 5.6)", reason=InfraReason.runtime
        )
    return InfraFailure(f"file operation on {path} failed: {why}", reason=InfraReason.storage)


def _refuse_kernel_fs(fd: int, path: str) -> None:
    """Raise InvalidRequest if ``fd`` (of sandbox path ``path``) is on a kernel file system.

    The file API serves the sandbox's files, not its kernel's views of processes and devices:
    it works with the edge's host privileges, so a listing of ``/proc/1/fd`` or a stat under
    ``/proc`` would show what the sandbox's own user may not see. Checked on the opened fd, so
    a symlink or a mount that leads there is refused as the plain path is."""
    try:
        kind = KERNEL_FS_MAGIC.get(fs_type(fd))
    except OSError as e:
        raise _map_oserror(e, path) from e
    if kind is not None:
        raise InvalidRequest(
            f"{path} is a {kind} file: the file API serves the sandbox's files, not kernel views",
            reason=InvalidReason.kernel_fs,
        )


def _check_path(value: str, what: str) -> None:
    if not isinstance(value, str):
        raise InvalidRequest(f"{what} must be a string")
    if not value:
        raise InvalidRequest(f"{what} is empty")
    if "\0" in value:
        raise InvalidRequest(f"{what} contains a NUL byte")
    if len(os.fsencode(value)) > PATH_MAX:
        raise InvalidRequest(f"{what} is longer than {PATH_MAX} bytes")


def _normalize(path: str, cwd: str) -> str:
    """Join ``path`` to ``cwd`` and normalise lexically; the result is ``/`` or ``/a/b``."""
    _check_path(path, "path")
    _check_path(cwd, "cwd")
    if not cwd.startswith("/"):
        raise InvalidRequest(f"cwd must be an absolute path: {cwd!r}")
    full = posixpath.normpath(posixpath.join(cwd, path))
    full = "/" + full.lstrip("/")  # normpath keeps a leading "//"
    if len(os.fsencode(full)) > PATH_MAX:
        raise InvalidRequest(f"path is longer than {PATH_MAX} bytes")
    return full


def _file_type(mode: int) -> FileType:
    if st.S_ISREG(mode):
        return FileType.file
    if st.S_ISDIR(mode):
        return FileType.dir
    if st.S_ISLNK(mode):
        return FileType.symlink
    return FileType.other


def _to_stat(path: str, s: os.stat_result) -> FileStat:
    return FileStat(
        path=path,
        name=posixpath.basename(path) or "/",
        type=_file_type(s.st_mode),
        size=s.st_size,
        mode=st.S_IMODE(s.st_mode),
        mtime=s.st_mtime,
        uid=s.st_uid,
        gid=s.st_gid,
    )


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _rmtree_at(dir_fd: int, name: str, full: str) -> None:
    """Remove directory ``name`` of ``dir_fd`` and everything below it, fd-relative.

    Directories are entered with ``O_DIRECTORY | O_NOFOLLOW`` one component at a time, so a
    symlink (planted beforehand or swapped in mid-walk) is unlinked, never followed.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    stack: list[tuple[int, list[str], str, str]] = []  # (fd, names left, name in parent, path)
    cur_path = full
    try:
        try:
            top = os.open(name, flags, dir_fd=dir_fd)
            stack.append((top, [], name, full))
            _refuse_kernel_fs(top, full)  # e.g. /dev, whose devpts the walk must not enter
            stack[-1][1].extend(os.listdir(top))
        except OSError as e:
            raise _map_oserror(e, cur_path) from e
        while stack:
            fd, names, _, here = stack[-1]
            descended = False
            while names:
                entry = names.pop()
                cur_path = posixpath.join(here, entry)
                try:
                    info = os.stat(entry, dir_fd=fd, follow_symlinks=False)
                    if not st.S_ISDIR(info.st_mode):
                        os.unlink(entry, dir_fd=fd)
                        continue
                    if len(stack) >= _MAX_TREE_DEPTH:
                        raise InvalidRequest(
                            f"directory tree under {full} is deeper than {_MAX_TREE_DEPTH} levels"
                        )
                    child = os.open(entry, flags, dir_fd=fd)
                    stack.append((child, [], entry, cur_path))
                    _refuse_kernel_fs(child, cur_path)
                    stack[-1][1].extend(os.listdir(child))
                except FileNotFoundError:
                    continue  # vanished meanwhile: fine, we are removing it anyway
                except OSError as e:
                    raise _map_oserror(e, cur_path) from e
                descended = True
                break
            if descended:
                continue
            fd, _, entry, here = stack.pop()
            _close(fd)
            cur_path = here
            try:
                os.rmdir(entry, dir_fd=stack[-1][0] if stack else dir_fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise _map_oserror(e, here) from e
    finally:
        for fd, *_ in stack:
            _close(fd)
