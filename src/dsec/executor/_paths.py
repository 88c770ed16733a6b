"""Sandbox path checks and normalisation, and the OSError handling shared by the file code.

Used by :mod:`dsec.executor.files` (and the handles in :mod:`dsec.executor._handles`): a caller's
path is checked and normalised lexically into an absolute sandbox path, every :class:`OSError`
raised while working on it is mapped onto the DSec error tree, and ``os.stat`` results become
:class:`~dsec.protocol.models.FileStat`.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat as st

from dsec.protocol.errors import Conflict, DSecError, FileNotFound, InfraFailure, InvalidRequest
from dsec.protocol.models import FileStat, FileType

__all__ = ["PATH_MAX"]

PATH_MAX = 4096
"""Longest path (in bytes, UTF-8/surrogateescape encoded) accepted from a caller."""


# --------------------------------------------------------------------------------------------- errors


def _map_oserror(exc: OSError, path: str) -> DSecError:
    """Translate an OSError raised while working on sandbox path ``path`` into a DSec error."""
    code = exc.errno
    why = exc.strerror or str(exc)
    if code == errno.ENOENT:
        return FileNotFound(f"no such file or directory: {path}")
    if code in (errno.ELOOP, errno.EXDEV):
        return InvalidRequest(
            f"path escapes the sandbox (or loops through symbolic links): {path}", reason="path_escape"
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
        return Conflict(f"no space left on the sandbox file system: {path}", reason="no_space")
    if code in (errno.EBUSY, errno.ETXTBSY):
        return Conflict(f"busy: {path} ({why})")
    if code == errno.ENOSYS:
        return InfraFailure("openat2(2) is not available on this kernel (Linux >= 5.6)", reason="runtime")
    return InfraFailure(f"file operation on {path} failed: {why}", reason="storage")


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
