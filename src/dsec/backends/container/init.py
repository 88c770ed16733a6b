"""PID 1 of every container sandbox: ``dsec-init`` (``init/dsec_init.c``), one tiny static
process that reaps orphans and waits for SIGTERM.

:func:`install_init` compiles it once per source version into the node's build directory
(gcc -static, keyed by a hash of the source and the flags, as ``dsec-enter`` is) and copies it
into the runtime directory that sandboxes see read-only at ``/.dsec``, where
:data:`dsec.backends.container.oci.INIT` names it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from dsec.protocol.errors import InfraFailure

SOURCE = Path(__file__).parent / "init" / "dsec_init.c"
NAME = "dsec-init"
CC = ["gcc", "-static", "-O2", "-Wall", "-Wextra", "-Werror"]


def _key(source: Path) -> str:
    h = hashlib.sha256(source.read_bytes())
    h.update("\0".join(CC).encode())
    return h.hexdigest()[:16]


def build_init(bin_dir: Path) -> Path:
    """Compile ``dsec-init`` into ``bin_dir`` unless this source's binary is there; its path."""
    return build_static(SOURCE, NAME, bin_dir)


def build_static(source: Path, name: str, bin_dir: Path) -> Path:
    """Compile the dependency-free C program ``source`` as ``bin_dir/name-<key>`` unless it is
    there already (the key hashes the source and flags); its path. Older builds are removed."""
    out = bin_dir / f"{name}-{_key(source)}"
    if out.exists():
        return out
    bin_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(bin_dir / f".{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another node on this data directory may build it too
        if out.exists():
            return out
        if shutil.which(CC[0]) is None:
            raise InfraFailure(f"cannot build {name}: gcc missing (install gcc, libc6-dev)", reason="runtime")
        tmp = out.with_name(f".{out.name}.tmp")
        done = subprocess.run([*CC, "-o", str(tmp), str(source)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise InfraFailure(f"cannot build {name}: {done.stderr.strip()[-1500:]}", reason="runtime")
        tmp.replace(out)
        for old in bin_dir.glob(f"{name}-*"):
            if old != out:
                with contextlib.suppress(OSError):
                    old.unlink()
        return out
    finally:
        os.close(fd)


def install_init(bin_dir: Path, runtime_dir: Path) -> None:
    """Put the current ``dsec-init`` at ``runtime_dir/dsec-init`` (a rename: running sandboxes
    keep the binary they started with)."""
    built = build_init(bin_dir)
    target = runtime_dir / NAME
    if target.exists() and target.read_bytes() == built.read_bytes():
        return
    tmp = target.with_name(f".{NAME}.{os.getpid()}.tmp")
    shutil.copy2(built, tmp)
    os.chmod(tmp, 0o755)
    tmp.replace(target)
