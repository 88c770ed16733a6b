"""Reading the files of an image archive safely: an unpacked directory or a tar, read in place.

Names are resolved lexically inside the archive (no absolute paths, no ``..`` out of it,
symlinks followed only within it); a compressed archive is unpacked once to a plain tar.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.images.oci.compression import _CHUNK, _decompressed, _sniff
from dsec.images.oci.validation import _bad, _safe_parts
from dsec.protocol.errors import InvalidRequest

MAX_JSON_BYTES = 8 << 20  # manifests, indexes and configs; real ones are kilobytes
MAX_SYMLINK_HOPS = 40


# ---- where the archive's files come from ---------------------------------------------------


class _Section(io.RawIOBase):
    """A read-only window ``[offset, offset + size)`` of an open file."""

    def __init__(self, fd: int, offset: int, size: int, what: str) -> None:
        self._fd, self._offset, self._size, self._what = fd, offset, size, what
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._size - self._pos)
        if n <= 0:
            return 0
        data = os.pread(self._fd, n, self._offset + self._pos)
        if not data:
            raise _bad(self._what, "is truncated")
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


class _Source:
    """The files of an image archive, addressed by relative names."""

    def open(self, name: str, what: str) -> tuple[io.BufferedReader, int]:
        raise NotImplementedError

    def real_path(self, name: str, what: str) -> Path | None:
        """A path on disk holding exactly this file's bytes, if there is one."""
        return None

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def read_small(self, name: str, what: str, limit: int = MAX_JSON_BYTES) -> bytes:
        reader, size = self.open(name, what)
        with reader:
            if size > limit:
                raise _bad(what, f"is {size} bytes, more than the {limit} allowed")
            data = reader.read(size + 1)
        if len(data) != size:
            raise _bad(what, "changed size while being read")
        return data


class _DirSource(_Source):
    """An unpacked layout; symlinks inside it are followed as long as they stay inside."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root)

    def _path(self, name: str, what: str) -> str:
        parts = _safe_parts(name, what)
        real = os.path.realpath(os.path.join(self.root, *parts))
        if not real.startswith(self.root.rstrip("/") + "/"):
            raise _bad(what, f"{name!r} leads outside the image directory")
        return real

    def exists(self, name: str) -> bool:
        try:
            return os.path.isfile(self._path(name, name))
        except InvalidRequest:
            return False

    def real_path(self, name: str, what: str) -> Path | None:
        return Path(self._path(name, what))

    def open(self, name: str, what: str) -> tuple[io.BufferedReader, int]:
        path = self._path(name, what)
        try:
            f = open(path, "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise _bad(what, f"{name!r} is missing from the image directory") from None
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            f.close()
            raise _bad(what, f"{name!r} is not a regular file")
        return f, st.st_size


@dataclass(frozen=True)
class _Member:
    kind: str  # "file", "dir", "symlink", "hardlink"
    offset: int = 0
    size: int = 0
    target: str = ""


class _TarSource(_Source):
    """An uncompressed tar, read in place: blobs are windows of the file, nothing is unpacked."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.members: dict[str, _Member] = {}
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            raise InvalidRequest(f"cannot read {path}: {err.strerror}") from err
        try:
            self._index()
        except BaseException:
            os.close(self._fd)
            raise

    def _index(self) -> None:
        try:
            with tarfile.open(self.path, mode="r:") as tf:
                for m in tf:
                    what = f"archive member {m.name[:200]!r}"
                    if all(p in ("", ".") for p in m.name.split("/")):
                        continue  # "./" itself
                    key = "/".join(_safe_parts(m.name, what))
                    if m.issparse():
                        raise _bad(what, "is a sparse file")
                    if m.isreg():
                        self.members[key] = _Member("file", m.offset_data, m.size)
                    elif m.isdir():
                        self.members[key] = _Member("dir")
                    elif m.issym():
                        self.members[key] = _Member("symlink", target=m.linkname)
                    elif m.islnk():
                        self.members[key] = _Member("hardlink", target=m.linkname)
                    # devices, fifos: nothing an image archive uses; never looked at
        except (tarfile.TarError, EOFError) as err:
            raise InvalidRequest(f"cannot read {self.path} as a tar archive: {err}") from err
        size = os.fstat(self._fd).st_size
        for key, member in self.members.items():
            if member.kind == "file" and member.offset + member.size > size:
                raise _bad(f"archive member {key!r}", "is truncated")

    def _resolve(self, name: str, what: str) -> _Member:
        todo = _safe_parts(name, what)
        done: list[str] = []
        hops = 0
        while todo:
            part = todo.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                if not done:
                    raise _bad(what, f"{name!r} resolves outside the archive")
                done.pop()
                continue
            member = self.members.get("/".join([*done, part]))
            if member is not None and member.kind in ("symlink", "hardlink"):
                hops += 1
                if hops > MAX_SYMLINK_HOPS:
                    raise _bad(what, f"{name!r}: too many levels of links")
                if member.target.startswith("/") or "\0" in member.target:
                    raise _bad(what, f"{name!r}: link to {member.target[:200]!r} leaves the archive")
                if member.kind == "hardlink":  # tar names hard-link targets from the root
                    done = []
                todo = member.target.split("/") + todo
                continue
            done.append(part)
        member = self.members.get("/".join(done))
        if member is None:
            raise _bad(what, f"{name!r} is missing from the archive")
        if member.kind != "file":
            raise _bad(what, f"{name!r} is not a regular file")
        return member

    def exists(self, name: str) -> bool:
        try:
            self._resolve(name, name)
        except InvalidRequest:
            return False
        return True

    def open(self, name: str, what: str) -> tuple[io.BufferedReader, int]:
        member = self._resolve(name, what)
        return io.BufferedReader(_Section(self._fd, member.offset, member.size, what), _CHUNK), member.size

    def close(self) -> None:
        os.close(self._fd)


def _decompress_file(path: Path, kind: str, out: Path) -> None:
    with open(path, "rb") as raw, open(out, "xb") as dst:
        for chunk in _decompressed(io.BufferedReader(raw, _CHUNK), kind, str(path)):
            dst.write(chunk)


@contextmanager
def _open_source(path: Path, work: Path) -> Iterator[_Source]:
    if path.is_dir():
        yield _DirSource(path)
        return
    if not path.is_file():
        raise InvalidRequest(f"cannot import {path}: no such file or directory")
    try:
        with open(path, "rb") as f:
            kind = _sniff(f.read(8))
    except OSError as err:
        raise InvalidRequest(f"cannot read {path}: {err.strerror}") from err
    if kind != "tar":  # a compressed archive: unpack the outer layer once, then read in place
        plain = work / "archive.tar"
        _decompress_file(path, kind, plain)
        path = plain
    source = _TarSource(path)
    try:
        yield source
    finally:
        source.close()
