"""File systems a node mounts once for all its container sandboxes.

- **The runtime directory on a tmpfs of its own** (``<data>/runtime``: dsec-init, busybox,
  the FnCall runner, resolv.conf, the empty directory behind /sys and masked directories). A
  bind's mountinfo root is its path inside the source's file system: on the data disk every
  sandbox saw ``/var/lib/dsec/.../runtime`` there; on its own file system it sees ``/`` or
  ``/empty``. One superblock per node, not per sandbox (no shrinker per sandbox).
- **LXCFS** (Debian's ``lxcfs``): a FUSE file system whose /proc/{cpuinfo,meminfo,stat,
  uptime,loadavg,...} and /sys/devices/system/cpu/online answer each reader with its own
  cgroup's limits. One daemon per node at ``<data>/run/lxcfs``, started detached (sandboxes
  outlive the edge), adopted by the next edge, stopped only once no sandbox is left.

Both are host mounts under the data directory: :meth:`NodeFs.release` (from ``detach`` with no
sandbox left, and ``release_node``) takes them away again.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from dsec import _linux
from dsec.images.mount import find_mount

log = logging.getLogger(__name__)

RUNTIME_FS = "dsec-runtime"  # the tmpfs's source name, what mountinfo shows for it
# dsec-init and busybox are ~2.8 MB; the rest is small. The cap only bounds a mistake.
RUNTIME_FS_OPTIONS = "mode=755,size=64m,nr_inodes=4096"

# What LXCFS answers per cgroup and a sandbox gets bound over its kernel's view. Not
# /proc/diskstats and /proc/swaps: without a block-I/O or swap limit they show the host's,
# and /proc/slabinfo is masked anyway.
LXCFS_PROC_FILES = ("cpuinfo", "meminfo", "stat", "uptime", "loadavg")
CPU_ONLINE = "devices/system/cpu/online"  # below /sys
# --enable-cfs: CPU counts (cpuinfo, stat, cpu/online) from the cgroup's CFS quota, rounded
# up; --enable-loadavg: a load average per cgroup (one thread walks the tasks of every cgroup
# that has read /proc/loadavg: 1.6% of a core at 1,000 such sandboxes, bench/lxcfs.py).
LXCFS_FLAGS = ("--enable-cfs", "--enable-loadavg")
_START_TIMEOUT_S = 10.0


def _mounted(path: Path, fstype: str) -> bool:
    entry = find_mount(path)
    return entry is not None and entry.fstype == fstype


def mount_runtime_fs(runtime_dir: Path) -> None:
    """``runtime_dir`` on a tmpfs of its own (kept if mounted already: an earlier edge's, which
    running sandboxes use)."""
    runtime_dir.mkdir(parents=True, exist_ok=True)
    if not _mounted(runtime_dir, "tmpfs"):
        _linux.mount(RUNTIME_FS, runtime_dir, "tmpfs", _linux.MS_NOSUID | _linux.MS_NODEV, RUNTIME_FS_OPTIONS)


def make_sys_skeleton(root: Path) -> None:
    """/sys of a sandbox on a node with LXCFS: read-only, one empty file for LXCFS's to cover."""
    online = root / CPU_ONLINE
    if online.exists():
        return
    online.parent.mkdir(parents=True, exist_ok=True)
    online.touch(mode=0o444)
    for d in (online.parent, *online.parent.relative_to(root).parents):
        (root / d).chmod(0o555)


def _detach_all(path: Path, fstype: str) -> None:
    """Detach every ``fstype`` mount stacked at ``path`` (a crashed edge may have stacked two)."""
    for _ in range(16):
        if not _mounted(path, fstype):
            return
        try:
            _linux.umount(path, lazy=True)
        except OSError as err:
            if err.errno not in (errno.EINVAL, errno.ENOENT):
                raise
    raise OSError(errno.EBUSY, f"{fstype} mounts at {path} keep coming back")


class LxcFs:
    """The node's LXCFS daemon, mounted at ``<data>/run/lxcfs``."""

    def __init__(self, data_dir: Path) -> None:
        self.mountpoint = data_dir / "run" / "lxcfs"
        self.pidfile = data_dir / "run" / "lxcfs.pid"
        self.logfile = data_dir / "run" / "lxcfs.log"
        self.why_not: str | None = None  # set when the node runs without it
        self._serving: tuple[int, int | None] | None = None  # (pid, start time) once mounted
        self._lock = threading.Lock()  # creates that find it dead restart it once

    @property
    def path(self) -> str | None:
        """Where sandboxes bind its files from; None when the node runs without LXCFS."""
        return None if self.why_not else str(self.mountpoint)

    def _daemon(self) -> int | None:
        """The pid of the LXCFS serving our mount point, found by its command line."""
        try:
            pid = int(self.pidfile.read_text().strip())
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        return pid if os.fsencode(self.mountpoint) in argv else None

    def healthy(self) -> bool:
        """Serving, or off on purpose (one read of /proc/PID/stat)."""
        serving = self._serving
        if self.why_not is not None:
            return True
        return serving is not None and _linux.proc_start_time(serving[0]) == serving[1]

    def ensure(self) -> None:
        """Before a create: a dead daemon's mount would fail the sandbox's binds (ENOTCONN), so
        one that died is replaced (sandboxes made before keep failing reads of its files)."""
        serving = self._serving
        if not self.healthy():
            with self._lock:
                if self._serving == serving:
                    log.warning("lxcfs (pid %s) is gone: starting another", serving and serving[0])
                    self._start()

    def start(self) -> None:
        """Adopt the running daemon, else start one (a dead one's mount is detached first).
        Without the lxcfs binary the node runs on and sandboxes see the node's numbers."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        self._serving = None
        exe = shutil.which("lxcfs")
        if exe is None:
            self.why_not = "lxcfs is not installed (Debian's lxcfs)"
            log.warning("sandboxes will see the node's CPUs and memory: %s", self.why_not)
            return
        self.why_not = None
        pid = self._daemon()
        if pid is not None and _mounted(self.mountpoint, "fuse.lxcfs"):
            self._serving = (pid, _linux.proc_start_time(pid))
            return
        self.stop()
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with open(self.logfile, "wb") as logf:  # this start's: bounded
            # setsid -f: the daemon is nobody's child here and in no session of the edge's, so
            # it outlives the edge and its sandboxes keep their views.
            subprocess.run(
                ["setsid", "-f", exe, *LXCFS_FLAGS, "--pidfile", str(self.pidfile), str(self.mountpoint)],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                check=True,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _mounted(self.mountpoint, "fuse.lxcfs"):
            if time.monotonic() > deadline:
                tail = self.logfile.read_text(errors="replace")[-1500:]
                self.stop()
                self.why_not = f"lxcfs did not mount {self.mountpoint}: {tail.strip()}"
                log.warning("sandboxes will see the node's CPUs and memory: %s", self.why_not)
                return
            time.sleep(0.02)  # FUSE's mount comes from the daemon's side: nothing to wait on
        pid = self._daemon()
        self._serving = (pid, _linux.proc_start_time(pid)) if pid is not None else None

    def stop(self) -> None:
        self._serving = None
        pid = self._daemon()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)  # lxcfs unmounts on SIGTERM
            deadline = time.monotonic() + _START_TIMEOUT_S
            while _linux.proc_start_time(pid) is not None and time.monotonic() < deadline:
                time.sleep(0.02)  # not our child: no wait(2) for it
        _detach_all(self.mountpoint, "fuse.lxcfs")
        with contextlib.suppress(FileNotFoundError):
            self.pidfile.unlink()


class NodeFs:
    """The runtime tmpfs and LXCFS of one node."""

    def __init__(self, data_dir: Path, runtime_dir: Path) -> None:
        self.runtime_dir = runtime_dir
        self.lxcfs = LxcFs(data_dir)

    def prepare(self) -> None:
        mount_runtime_fs(self.runtime_dir)
        self.lxcfs.start()

    def release(self) -> None:
        """Only once no sandbox is left: theirs are binds of these."""
        self.lxcfs.stop()
        _detach_all(self.runtime_dir, "tmpfs")
