"""Compiling a helper: ``gcc -static`` once per source version, into a directory of the node's.

Every helper here is built the same way, by :meth:`Program.build`: the binary is
``bin_dir/<name>-<key>``, the key a hash of the source, the compiler flags, the libraries and
whatever else the program is built from (:attr:`Program.keyed`), so a change builds a new
binary beside the old one and a running binary is never overwritten; the previous builds are
removed afterwards (a running one keeps its inode).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsec.protocol.errors import InfraFailure, InfraReason

CC = ("gcc", "-static", "-O2", "-Wall", "-Wextra", "-Werror")
_BASE_PACKAGES = "gcc, libc6-dev"


@dataclass(frozen=True)
class Program:
    """A static C helper: ``source`` built as ``name`` and linked with ``libs``."""

    name: str
    source: Path
    libs: tuple[str, ...] = ()
    keyed: tuple[str, ...] = ()  # more inputs the binary depends on, hashed into its name
    packages: str = ""  # Debian packages the build needs beyond gcc and libc6-dev

    def key(self) -> str:
        h = hashlib.sha256(self.source.read_bytes())
        h.update("\0".join([*CC, *self.libs, *self.keyed]).encode())
        return h.hexdigest()[:16]

    def path(self, bin_dir: Path) -> Path:
        """Where :meth:`build` puts the binary of the current source."""
        return bin_dir / f"{self.name}-{self.key()}"

    def build(self, bin_dir: Path, finish: Callable[[Path, Path], None] | None = None) -> Path:
        """Compile into ``bin_dir`` unless this source's binary is already there; its path.
        Idempotent and safe against a concurrent build (a lock file: another node on the same
        data directory may build it too). ``finish(binary, out)`` runs on the new binary
        before it takes its name and may write files named ``out.name + ".<suffix>"``, which
        stay with it. Keep ``bin_dir`` out of anything a sandbox mounts: the helpers run as
        root on the host."""
        out = self.path(bin_dir)
        if out.exists():
            return out
        bin_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(bin_dir, 0o700)
        fd = os.open(bin_dir / f".{self.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if out.exists():
                return out
            needs = ", ".join(filter(None, [_BASE_PACKAGES, self.packages]))
            if shutil.which(CC[0]) is None:
                raise InfraFailure(
                    f"cannot build {self.name}: gcc missing (install {needs})", reason=InfraReason.runtime
                )
            tmp = out.with_name(f".{out.name}.tmp")
            done = subprocess.run(
                [*CC, "-o", str(tmp), str(self.source), *self.libs],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                msg = f"cannot build {self.name} (needs {needs}): {done.stderr.strip()[-1500:]}"
                raise InfraFailure(msg, reason=InfraReason.runtime)
            os.chmod(tmp, 0o700)
            if finish is not None:
                finish(tmp, out)
            tmp.replace(out)  # last: the binary's presence says that all of it is there
            for old in bin_dir.glob(f"{self.name}-*"):
                if old != out and not old.name.startswith(out.name + "."):
                    with contextlib.suppress(OSError):
                        old.unlink()
            return out
        finally:
            os.close(fd)
