"""Extract a layer tarball into a directory, exactly and safely, as root.

We read with :mod:`tarfile` but create the files ourselves, because this Python's extractor
(3.11.2, before PEP 706 filters) follows symlinks that earlier members planted, maps owners by
name through the host's /etc/passwd, drops xattrs, and leaves symlink mtimes at "now" (which
would make the layer digest depend on when it was imported). Here:

* absolute names and ``..`` components are refused, and so is any member or hard-link target
  whose parent path runs through a symlink, so nothing lands outside ``dest``;
* owners are numeric, modes (setuid included), fifos, hard links, and ``SCHILY.xattr.*`` pax
  xattrs are kept; pax mtimes keep their nanoseconds;
* device nodes (but overlay whiteouts, char 0/0) and ``security.capability`` xattrs are
  dropped (:mod:`dsec.images.sanitize` says why);
* with ``max_bytes``, extraction stops with :class:`TooLarge` as soon as the members' sizes
  (plus a header block each) pass it: a small compressed archive can expand a thousandfold;
* directories the archive does not describe (implicit parents, the root without a ``./``
  member) get fixed attributes (0755, root, mtime 0) so the result is reproducible.

Symlink *targets* are not checked: they are data inside the image and resolve inside the
sandbox's root, never on the host, since we never open a path through them here.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import IO

from dsec.images.sanitize import CAPABILITY_XATTR, is_whiteout
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest, TooLarge

log = logging.getLogger(__name__)
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_XATTR_PREFIX = "SCHILY.xattr."
_DEFAULT_DIR_MODE = 0o755
_HEADER = 512  # what an empty member costs on disk at least (an inode, a dirent): counted too


def _reject(name: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"unsafe tar member {name!r}: {why}")


def _member_parts(name: str) -> list[str]:
    """The path components of a member name, relative to the extraction root."""
    if "\0" in name:
        raise _reject(name, "NUL in name")
    if name.startswith("/"):
        raise _reject(name, "absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _reject(name, "'..' component")
    return parts


def _mtime_ns(member: tarfile.TarInfo) -> int:
    raw = member.pax_headers.get("mtime")
    if raw is not None:
        try:
            return int(Decimal(raw) * 1_000_000_000)
        except InvalidOperation:
            pass
    return int(member.mtime) * 1_000_000_000


class _Extractor:
    def __init__(self, dest: Path, max_bytes: int | None = None) -> None:
        self.dest = dest
        self.max_bytes = max_bytes
        self.expanded = 0
        self.stripped: list[str] = []
        # Every directory we created or described, with the member describing it (None: implicit).
        self.dirs: dict[Path, tarfile.TarInfo | None] = {dest: None}

    def _real_dir(self, parts: list[str], name: str, create: bool) -> Path:
        """Walk ``parts`` below dest, refusing symlinks and non-directories on the way."""
        path = self.dest
        for part in parts:
            path = path / part
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                if not create:
                    raise _reject(name, f"parent {part!r} does not exist") from None
                os.mkdir(path, 0o700)
                self.dirs[path] = None
                continue
            if stat.S_ISLNK(st.st_mode):
                raise _reject(name, f"path runs through the symlink {part!r}")
            if not stat.S_ISDIR(st.st_mode):
                raise _reject(name, f"parent {part!r} is not a directory")
        return path

    def _clear(self, target: Path, keep_dir: bool) -> bool:
        """Remove what is at ``target`` so the member replaces it, as tar does; True if kept."""
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            if keep_dir:
                return True
            shutil.rmtree(target)
            for d in [d for d in self.dirs if d == target or target in d.parents]:
                del self.dirs[d]
        else:
            os.unlink(target)
        return False

    def _count(self, member: tarfile.TarInfo) -> None:
        self.expanded += _HEADER + (member.size if member.isreg() else 0)
        if self.max_bytes is not None and self.expanded > self.max_bytes:
            raise TooLarge(
                f"the archive expands to more than {self.max_bytes} bytes (the import cap); "
                f"stopped at member {member.name!r}"
            )

    def add(self, tf: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        self._count(member)
        parts = _member_parts(member.name)
        if not parts:
            if not member.isdir():
                raise _reject(member.name, "the archive root is not a directory")
            self.dirs[self.dest] = member
            return
        parent = self._real_dir(parts[:-1], member.name, create=True)
        target = parent / parts[-1]
        if member.islnk():
            self._hard_link(member, target)
            return  # a hard link shares the inode, whose attributes its first member set
        if member.ischr() or member.isblk():
            kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
            if not is_whiteout(kind, os.makedev(member.devmajor, member.devminor)):
                self.stripped.append(member.name)  # as if absent: it replaces nothing either
                return
        kept = self._clear(target, keep_dir=member.isdir())
        if member.isdir():
            if not kept:
                os.mkdir(target, 0o700)
            self.dirs[target] = member
            return  # attributes at the end, once nothing more is created inside
        if member.isreg():
            src = tf.extractfile(member)
            if src is None:
                raise _reject(member.name, "unreadable file data")
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        elif member.issym():
            os.symlink(member.linkname, target)
        elif member.ischr() or member.isblk():  # an overlay whiteout (0/0): the only kind kept
            kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
            os.mknod(target, kind | 0o600, os.makedev(member.devmajor, member.devminor))
        elif member.isfifo():
            os.mkfifo(target, 0o600)
        else:
            raise _reject(member.name, f"unsupported member type {member.type!r}")
        self._set_attrs(target, member)

    def _hard_link(self, member: tarfile.TarInfo, target: Path) -> None:
        link_parts = _member_parts(member.linkname)
        not_a_file = _reject(member.name, f"hard link target {member.linkname!r} is not an earlier file")
        if not link_parts:
            raise not_a_file
        source = self._real_dir(link_parts[:-1], member.name, create=False) / link_parts[-1]
        try:
            if stat.S_ISDIR(os.lstat(source).st_mode):
                raise not_a_file
        except FileNotFoundError:
            raise not_a_file from None
        if source == target:
            return
        self._clear(target, keep_dir=False)
        os.link(source, target, follow_symlinks=False)

    def _set_attrs(self, path: Path, member: tarfile.TarInfo | None) -> None:
        if member is None:
            uid = gid = 0
            mode, mtime_ns, xattrs = _DEFAULT_DIR_MODE, 0, {}
        else:
            uid, gid, mode, mtime_ns = member.uid, member.gid, member.mode & 0o7777, _mtime_ns(member)
            xattrs = {
                k.removeprefix(_XATTR_PREFIX): v
                for k, v in member.pax_headers.items()
                if k.startswith(_XATTR_PREFIX)
            }
            if xattrs.pop(CAPABILITY_XATTR, None) is not None:
                self.stripped.append(member.name)
        is_link = member is not None and member.issym()
        os.chown(path, uid, gid, follow_symlinks=False)
        if not is_link:
            os.chmod(path, mode)  # after chown, which clears setuid/setgid bits
        for key, value in xattrs.items():
            try:
                # tarfile decoded the value with surrogateescape; this gives back the raw bytes.
                os.setxattr(path, key, value.encode("utf-8", "surrogateescape"), follow_symlinks=False)
            except OSError as err:
                raise InvalidRequest(
                    f"cannot set xattr {key!r} on {member.name if member else path}: {err}"
                ) from err
        os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)

    def finish(self) -> None:
        for path, member in self.dirs.items():
            self._set_attrs(path, member)


@contextmanager
def _open_archive(archive: Path) -> Iterator[tarfile.TarFile]:
    with open(archive, "rb") as f:
        magic = f.read(4)
    if magic != _ZSTD_MAGIC:
        # Stream mode ("r|*") handles plain, gzip, bzip2 and xz without seeking.
        with tarfile.open(archive, mode="r|*") as tf:
            yield tf
        return
    # This Python has no zstd module; the zstd tool streams just as well.
    zstd = shutil.which("zstd")
    if zstd is None:
        raise InvalidRequest(f"{archive} is zstd-compressed but the zstd tool is not installed")
    proc = subprocess.Popen(
        [zstd, "-dcq", "--", os.fspath(archive)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    stdout: IO[bytes] | None = proc.stdout
    assert stdout is not None
    try:
        with tarfile.open(fileobj=stdout, mode="r|") as tf:
            yield tf
        while stdout.read(1 << 20):  # drain padding after the end-of-archive blocks: no SIGPIPE
            pass
    finally:
        stdout.close()  # on an error, makes zstd exit instead of blocking on a full pipe
        rc = proc.wait()
    if rc != 0:
        raise InvalidRequest(f"zstd could not decompress {archive} (exit {rc})")


def extract_tar(archive: Path, dest: Path, *, max_bytes: int | None = None) -> list[str]:
    """Extract ``archive`` (plain, gzip, bzip2, xz or zstd tar) into the empty directory ``dest``.

    Returns the members stripped (device nodes, file capabilities). ``TooLarge`` once the
    content passes ``max_bytes``; what was extracted stays in ``dest`` for the caller to remove.
    """
    if not archive.is_file():
        raise InvalidRequest(f"cannot import {archive}: not a file or directory")
    extractor = _Extractor(dest, max_bytes)
    try:
        with _open_archive(archive) as tf:
            for member in tf:
                extractor.add(tf, member)
    except (tarfile.TarError, EOFError, ValueError) as err:
        raise InvalidRequest(f"cannot read {archive} as a tar archive: {err}") from err
    except OSError as err:
        if isinstance(err, (FileNotFoundError, PermissionError)) and err.filename == os.fspath(archive):
            raise InvalidRequest(f"cannot read {archive}: {err}") from err
        raise InfraFailure(f"extracting {archive} failed: {err}", reason=InfraReason.storage) from err
    extractor.finish()
    if extractor.stripped:
        log.warning("%s: stripped device nodes or file capabilities of %s", archive, extractor.stripped[:20])
    return extractor.stripped
