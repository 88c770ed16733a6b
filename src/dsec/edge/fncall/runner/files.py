"""A call's files: its dir and input files before it runs, its fetch_files after, and the
absolute paths it may write (opened to it for this call only, and closed again after).

Everything here runs in the runner as root, on paths a call may have had its hands on: files
are opened with O_NOFOLLOW and O_EXCL, and read back only once no process of the call is
alive (so no check here can race with it).
"""

from __future__ import annotations

import base64
import os
import stat

from .cleanup import remove
from .wire import MAX_FETCH_BYTES, SOURCE, Task, TaskError


def fetch(cdir: str, paths: list[str], uid: int) -> tuple[dict[str, str], dict[str, str]]:
    """Read the fetch_files back; no process of the call is alive, so the checks cannot race.
    An absolute path comes back only if the call uid owns it: the call brings back what it
    wrote or was given, never a file of the pool sandbox's own."""
    root, files, errors, total = os.path.realpath(cdir), {}, {}, 0
    for rel in paths:
        full = os.path.join(root, rel)
        if rel.startswith("/"):
            if os.path.realpath(os.path.dirname(rel)) != os.path.dirname(rel):
                errors[rel] = "a link on the way"
                continue
        elif os.path.commonpath([os.path.realpath(full), root]) != root:
            errors[rel] = "escapes the call directory"
            continue
        try:
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            errors[rel] = "missing" if isinstance(exc, FileNotFoundError) else f"cannot open: {exc.strerror}"
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                errors[rel] = "not a regular file"
            elif rel.startswith("/") and st.st_uid != uid:
                errors[rel] = "not the call's: an absolute path comes back only if the call made it"
            elif total + st.st_size > MAX_FETCH_BYTES:
                errors[rel] = f"too large: all fetched files together are capped at {MAX_FETCH_BYTES} bytes"
            else:
                chunks, left = [], st.st_size
                while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                    chunks.append(chunk)
                    left -= len(chunk)
                total += st.st_size - left
                files[rel] = base64.b64encode(b"".join(chunks)).decode()
        finally:
            os.close(fd)
    return files, errors


class CallFiles:
    """The files of the call under way: its dir, and what it was let write at absolute paths."""

    def __init__(self, workdir: str, root: bool, uid: int, gid: int) -> None:
        self.workdir, self.root, self.uid, self.gid = workdir, root, uid, gid
        # This call's absolute paths: directories made for it, ones opened to it (with their
        # modes before), and every directory holding such a path (scanned for the uid's entries).
        self.made_dirs: list[str] = []
        self.opened_dirs: list[tuple[str, int]] = []
        self.abs_parents: set[str] = set()

    def uid_entries(self, d: str) -> list[str]:
        try:
            with os.scandir(d) as it:
                return [e.path for e in it if e.stat(follow_symlinks=False).st_uid == self.uid]
        except OSError:
            return []

    def open_absolute(self, t: Task) -> None:
        """Let the call write its absolute paths, for this call only (``close_absolute`` undoes it):
        missing directories are made and given to the call uid; an existing one it cannot write
        is opened to it, sticky, so what was there stays out of its reach."""
        for path in [p for p in [*t.files, *t.fetch_files] if p.startswith("/")]:
            if (path + "/").startswith(self.workdir + "/"):
                raise TaskError(f"bad path {path!r}: the runner's own directory")
            parent, missing = os.path.dirname(path), []
            while not os.path.lexists(parent):
                missing.append(parent)
                parent = os.path.dirname(parent)
            st = os.lstat(parent)
            if not stat.S_ISDIR(st.st_mode) or os.path.realpath(parent) != parent:
                raise TaskError(f"bad path {path!r}: {parent} is not a directory (or is a link)")
            self.abs_parents.add(parent)
            if missing:
                self.made_dirs.append(missing[-1])
                for d in reversed(missing):
                    os.mkdir(d, 0o755)
                    if self.root:
                        os.lchown(d, self.uid, self.gid)
            elif self.root and st.st_uid != self.uid and not st.st_mode & stat.S_IWOTH:
                if parent not in (d for d, _ in self.opened_dirs):
                    self.opened_dirs.append((parent, stat.S_IMODE(st.st_mode)))
                    os.chmod(parent, stat.S_IMODE(st.st_mode) | stat.S_ISVTX | stat.S_IWOTH | stat.S_IXOTH)
        for path, data in t.files.items():
            if path.startswith("/"):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                with open(fd, "wb") as f:
                    f.write(data)
                if self.root:
                    os.lchown(path, self.uid, self.gid)

    def close_absolute(self) -> bool:
        """Remove what the call made at its absolute paths; True when that is proven done."""
        for d in self.made_dirs:
            remove(d)
        for d in self.abs_parents:
            for path in self.uid_entries(d):
                remove(path)
        for d, mode in self.opened_dirs:
            os.chmod(d, mode)
        undone = not any(os.path.lexists(d) for d in self.made_dirs)
        undone = undone and all(stat.S_IMODE(os.lstat(d).st_mode) == m for d, m in self.opened_dirs)
        undone = undone and not any(self.uid_entries(d) for d in self.abs_parents)
        self.made_dirs, self.opened_dirs, self.abs_parents = [], [], set()
        return undone

    def prepare(self, cdir: str, t: Task) -> None:
        """Make the call dir (0700, the call uid's) with the program and the relative input files."""
        os.mkdir(cdir, 0o700)
        relative = [(p, d) for p, d in t.files.items() if not p.startswith("/")]
        for rel, data in [*relative, (SOURCE[t.language], t.code.encode())]:
            path = os.path.join(cdir, rel)
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb") as f:
                f.write(data)
        if self.root:
            for d, _, names in os.walk(cdir):
                for p in [d, *(os.path.join(d, n) for n in names)]:
                    os.lchown(p, self.uid, self.gid)
