"""The file handles :class:`~dsec.executor.files.SandboxFiles` gives out.

:class:`AtomicWriter` (from ``open_write``) writes to a temporary file and renames it over the
target on commit, so a failed upload leaves nothing half-written; ``_Reader`` (under the buffered
reader from ``open_read``) reports read errors as DSec errors. Both work on file descriptors
already opened, confined, by :class:`~dsec.executor.files.SandboxFiles`.
"""

from __future__ import annotations

import errno
import io
import os
import stat as st
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING

from dsec.executor._paths import _close, _map_oserror
from dsec.protocol.errors import InvalidRequest

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["AtomicWriter"]

# --------------------------------------------------------------------------------------------- reader


class _Reader(io.FileIO):
    """A FileIO over an already-opened fd whose read errors come out as DSec errors."""

    def __init__(self, fd: int, path: str) -> None:
        super().__init__(fd, "rb", closefd=True)
        self.sandbox_path = path

    def readinto(self, buffer: WriteableBuffer, /) -> int:
        try:
            return super().readinto(buffer)
        except OSError as e:
            raise _map_oserror(e, self.sandbox_path) from e

    def readall(self) -> bytes:
        try:
            return super().readall()
        except OSError as e:
            raise _map_oserror(e, self.sandbox_path) from e


# --------------------------------------------------------------------------------------------- writer


class AtomicWriter:
    """A write handle returned by :meth:`SandboxFiles.open_write`.

    Data goes to a temporary file next to the target; :meth:`commit` (or :meth:`close`, or leaving a
    ``with`` block normally) renames it over the target atomically, :meth:`abort` (or leaving the
    ``with`` block by an exception, or dropping the object unclosed) deletes it. In append mode the
    existing file is written in place and :meth:`abort` truncates it back to its original size.

    Writes are unbuffered (one ``write(2)`` per call): stream in sizeable chunks.
    """

    def __init__(
        self,
        *,
        path: str,
        dir_fd: int | None,
        name: str,
        fd: int,
        tmp_name: str | None,
        mode: int,
        orig_size: int = 0,
    ) -> None:
        self.path = path
        self.mode = mode
        self._dir_fd = dir_fd
        self._name = name
        self._fd = fd
        self._tmp_name = tmp_name
        self._orig_size = orig_size
        self._written = 0
        self._state = "open"  # -> "committed" | "aborted"

    # -- file-like surface

    @property
    def closed(self) -> bool:
        return self._state != "open"

    @property
    def committed(self) -> bool:
        return self._state == "committed"

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        """Bytes written through this handle so far."""
        return self._written

    def flush(self) -> None:
        """Writes are unbuffered; nothing to do."""

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._state != "open":
            raise InvalidRequest(f"upload of {self.path} is already {self._state}")
        view = memoryview(data).cast("B")
        total = len(view)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as e:
            raise _map_oserror(e, self.path) from e
        self._written += total
        return total

    def writelines(self, lines: Iterable[bytes]) -> None:
        for line in lines:
            self.write(line)

    # -- completion

    def commit(self) -> None:
        """Make the written data visible at the target path (idempotent once committed)."""
        if self._state == "committed":
            return
        if self._state == "aborted":
            raise InvalidRequest(f"upload of {self.path} was aborted")
        try:
            if self._tmp_name is None:  # append mode: the data is already in place
                _close(self._fd)
            else:
                self._finish_replace(self._tmp_name)
        except BaseException:
            self._state = "aborted"
            raise
        finally:
            self._close_dir()
        self._state = "committed"

    def _close_dir(self) -> None:
        if self._dir_fd is not None:
            _close(self._dir_fd)
            self._dir_fd = None

    def _finish_replace(self, tmp_name: str) -> None:
        assert self._dir_fd is not None
        try:
            # After the fchown done at creation: chown clears set-id bits, chmod sets the exact mode.
            os.fchmod(self._fd, self.mode)
            os.close(self._fd)
        except OSError as e:
            _close(self._fd)
            self._unlink_tmp(tmp_name)
            raise _map_oserror(e, self.path) from e
        try:
            cur = os.stat(self._name, dir_fd=self._dir_fd, follow_symlinks=False)
            if st.S_ISDIR(cur.st_mode):
                self._unlink_tmp(tmp_name)
                raise InvalidRequest(f"cannot write {self.path}: it is a directory")
        except FileNotFoundError:
            pass
        except OSError as e:
            self._unlink_tmp(tmp_name)
            raise _map_oserror(e, self.path) from e
        try:
            os.rename(tmp_name, self._name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except OSError as e:
            self._unlink_tmp(tmp_name)
            if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                raise InvalidRequest(f"cannot write {self.path}: it is a directory") from e
            raise _map_oserror(e, self.path) from e

    def _unlink_tmp(self, tmp_name: str) -> None:
        if self._dir_fd is None:
            return
        try:
            os.unlink(tmp_name, dir_fd=self._dir_fd)
        except OSError:
            pass

    def abort(self) -> None:
        """Throw the written data away; the target is left as it was. Idempotent."""
        if self._state != "open":
            return
        self._state = "aborted"
        try:
            if self._tmp_name is None:
                try:
                    os.ftruncate(self._fd, self._orig_size)
                except OSError:
                    pass
                _close(self._fd)
            else:
                _close(self._fd)
                self._unlink_tmp(self._tmp_name)
        finally:
            self._close_dir()

    def close(self) -> None:
        """Commit if still open (file-object protocol: a clean close means success)."""
        if self._state == "open":
            self.commit()

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def __del__(self) -> None:
        # Dropped without commit/abort (e.g. the upload's task was cancelled): never publish.
        if getattr(self, "_state", None) == "open":
            try:
                self.abort()
            except Exception:
                pass
