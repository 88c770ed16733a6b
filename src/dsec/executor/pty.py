"""Pseudo-terminals inside a sandbox's own devpts, opened from the host.

A terminal from the host's devpts works (``isatty``, job control) but has no name inside the
sandbox: ``tty`` says "not a tty" and anything calling ``ttyname`` (``ssh``, ``sudo``,
``script``) fails. A container mounts a devpts instance of its own, so the edge opens that
instance's ``ptmx`` through the sandbox's root and asks the kernel for the peer
(``TIOCGPTPEER``): the slave is ``/dev/pts/N`` inside, the master stays with the edge.

The path is the sandbox's to shape, so nothing is opened on trust: it is resolved inside the
root without following any symlink, as ``O_PATH`` first, and only a character device 5:2 on a
devpts file system is then reopened for reading and writing. A sandbox cannot mount over
``/dev/pts`` (no mount calls, no ``CAP_SYS_ADMIN``), so this is its own instance.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct

from dsec.executor._openat2 import RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, fs_type, openat2
from dsec.protocol.errors import InfraFailure, InfraReason

RESOLVE_NO_SYMLINKS = 0x04
DEVPTS_SUPER_MAGIC = 0x1CD1
_PTMX = os.makedev(5, 2)
_TIOCSPTLCK = 0x40045431  # _IOW('T', 0x31, int): unlock the slave
_TIOCGPTPEER = 0x5441  # _IO('T', 0x41): open the slave through the master (Linux 4.13)
_TTY_GID = 5  # devpts' convention (Debian's "tty" group), as the sandbox mounts it (gid=5)


def open_in_sandbox(root: str, uid: int) -> tuple[int, int]:
    """A (master, slave) pair from the devpts mounted at ``/dev/pts`` under ``root``; the slave
    belongs to ``uid``, as a terminal a user opened would."""
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        found = openat2(
            root_fd,
            "/dev/pts/ptmx",
            os.O_PATH | os.O_CLOEXEC,
            0,
            RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
        )
    except OSError as exc:
        raise InfraFailure(
            f"the sandbox has no terminal multiplexer (/dev/pts/ptmx): {exc}", reason=InfraReason.pty
        ) from exc
    finally:
        os.close(root_fd)
    try:
        info = os.fstat(found)
        if not stat.S_ISCHR(info.st_mode) or info.st_rdev != _PTMX or fs_type(found) != DEVPTS_SUPER_MAGIC:
            raise InfraFailure(
                "the sandbox's /dev/pts/ptmx is not a devpts multiplexer", reason=InfraReason.pty
            )
        master = os.open(f"/proc/self/fd/{found}", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(found)
    try:
        fcntl.ioctl(master, _TIOCSPTLCK, struct.pack("i", 0))
        slave = fcntl.ioctl(master, _TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        try:
            os.fchown(slave, uid, _TTY_GID)
            os.fchmod(slave, 0o620)
        except BaseException:
            os.close(slave)
            raise
    except BaseException:
        os.close(master)
        raise
    return master, slave
