"""Per-sandbox disk quotas: one btrfs per node, one subvolume and qgroup limit per sandbox.

A sandbox created with ``disk_limit_mb`` gets its working directory (overlay upper and work
dirs, bundle, rootfs mount point, pack staging) in a btrfs subvolume of its own, on a single
file system per node: a sparse image file under the edge's data directory, loop-attached
(autoclear, direct I/O: the host's page cache does not hold a second copy) and mounted once in
the host's mount namespace. The subvolume's qgroup gets a hard limit on the bytes it
references (data and metadata: inodes are bytes in btrfs, so empty files cannot exhaust a
shared inode table either), and a write past it fails in the sandbox with EDQUOT. No mount and
no loop device per sandbox: a create costs two ioctls (subvolume create, qgroup limit), a stop
one (subvolume destroy; the kernel's cleaner drops the tree and, once empty, its qgroup).

Why not ext4 or XFS project quotas (the usual way): this kernel is built without
``CONFIG_QFMT_V2`` (ext4: "The kernel was not built with CONFIG_QUOTA and CONFIG_QFMT_V2"; an
ext4 with the quota feature does not even mount) and without ``CONFIG_XFS_QUOTA`` ("XFS: quota
support not available in this kernel"). btrfs qgroups need neither. Simple quotas (Linux >=
6.7: usage charged to the subvolume that allocated an extent, no backref walks at commit) are
used where the kernel has them, full qgroups otherwise.

Everything here is ioctls on the mounted file system (``mkfs.btrfs`` aside): no ``btrfs`` or
``losetup`` process per sandbox.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import struct
import subprocess
from pathlib import Path

from dsec import _linux
from dsec.images.mount import find_mount

log = logging.getLogger("dsec.backends.container")
# Subvolumes of shared volumes (shared_volumes.py): they outlive every sandbox, the edge and the
# mount; every other subvolume is a sandbox's.
SHARED_PREFIX = "pv-"
_HOST_FLAGS = _linux.MS_NOSUID | _linux.MS_NODEV


def _ioc(direction: int, nr: int, size: int, kind: int = 0x94) -> int:
    return (direction << 30) | (size << 16) | (kind << 8) | nr


_W, _R, _RW = 1, 2, 3
# linux/btrfs.h (magic 0x94)
_SYNC = _ioc(0, 8, 0)
_SUBVOL_CREATE = _ioc(_W, 14, 4096)  # struct btrfs_ioctl_vol_args
_SNAP_DESTROY = _ioc(_W, 15, 4096)
_INO_LOOKUP = _ioc(_RW, 18, 4096)  # struct btrfs_ioctl_ino_lookup_args
_FS_INFO = _ioc(_R, 31, 1024)  # struct btrfs_ioctl_fs_info_args
_QUOTA_CTL = _ioc(_RW, 40, 16)  # struct btrfs_ioctl_quota_ctl_args
_QGROUP_LIMIT = _ioc(_R, 43, 48)  # struct btrfs_ioctl_qgroup_limit_args
_QUOTA_ENABLE, _QUOTA_ENABLE_SIMPLE = 1, 4
_LIMIT_MAX_RFER = 1
_CLEAR = (1 << 64) - 1  # a limit of "all ones" removes it
_FIRST_FREE_OBJECTID = 256  # the root directory of every subvolume
# linux/loop.h
_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A  # struct loop_config: fd, block_size, loop_info64, 8 reserved u64
_LO_FLAGS_AUTOCLEAR, _LO_FLAGS_DIRECT_IO = 4, 16
_LOOP_CONFIG_SIZE = 4 + 4 + 232 + 64
_LO_FLAGS_OFFSET = 8 + 5 * 8 + 3 * 4
_LO_FILE_NAME_OFFSET = _LO_FLAGS_OFFSET + 4

MIN_SIZE_MB = 1024


def _dir_fd(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _vol_args(name: str) -> bytearray:
    raw = os.fsencode(name)
    if not raw or b"/" in raw or len(raw) > 4000:
        raise ValueError(f"bad subvolume name {name!r}")
    args = bytearray(4096)
    args[8 : 8 + len(raw)] = raw
    return args


def _loop_for(image: Path) -> str | None:
    """The loop device ``image`` is attached to, if any (a mount elsewhere may still hold it)."""
    want = str(image.resolve())
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            if backing.read_text().strip() == want:
                return f"/dev/{backing.parent.parent.name}"
    return None


def _attach_loop(image: Path) -> tuple[str, int]:
    """Attach ``image`` to a free loop device (autoclear: it detaches when the last user, i.e.
    the mount, lets go; direct I/O where the backing file system allows it). Returns the
    device and an open descriptor that keeps it attached until the caller mounted it."""
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(64):
            number = fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)
            dev = f"/dev/loop{number}"
            if not os.path.exists(dev):  # no devtmpfs: make the node ourselves
                with contextlib.suppress(FileExistsError):
                    os.mknod(dev, 0o600 | 0o060000, os.makedev(7, number))
            loop = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
            backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
            config = bytearray(_LOOP_CONFIG_SIZE)
            struct.pack_into("II", config, 0, backing, 4096)
            struct.pack_into("I", config, _LO_FLAGS_OFFSET, _LO_FLAGS_AUTOCLEAR | _LO_FLAGS_DIRECT_IO)
            name = os.fsencode(image)[-63:]
            config[_LO_FILE_NAME_OFFSET : _LO_FILE_NAME_OFFSET + len(name)] = name
            try:
                fcntl.ioctl(loop, _LOOP_CONFIGURE, config)
            except OSError as exc:
                os.close(loop)
                if exc.errno == errno.EBUSY:  # another process took it between the two calls
                    continue
                raise
            finally:
                os.close(backing)
            return dev, loop
    finally:
        os.close(ctl)
    raise OSError(errno.EBUSY, "no free loop device after 64 tries")


class QuotaFs:
    """The node's quota file system under ``root``: ``volumes.btrfs`` mounted at ``mnt``.

    Not thread-safe for :meth:`ensure` and :meth:`release` (the backend serialises them);
    volume calls on different names may run concurrently.
    """

    def __init__(self, root: Path, size_mb: int | None = None) -> None:
        self.root = root
        self.image = root / "volumes.btrfs"
        self.mnt = root / "mnt"
        self.size_mb = size_mb
        self._fsid: str | None = None
        self.simple = False  # simple quotas (Linux >= 6.7) rather than full qgroups

    # -- the file system ---------------------------------------------------------------------

    @staticmethod
    def unsupported() -> str | None:
        """Why this node cannot have the quota file system (None: it can)."""
        if shutil.which("mkfs.btrfs") is None:
            return "mkfs.btrfs is missing (install btrfs-progs)"
        if not Path("/dev/loop-control").exists():
            return "no /dev/loop-control (loop devices)"
        with open("/proc/filesystems") as f:
            if "\tbtrfs\n" in f.read():
                return None
        if subprocess.run(["modprobe", "btrfs"], capture_output=True, check=False).returncode == 0:
            return None
        return "the kernel has no btrfs"

    def mounted(self) -> bool:
        entry = find_mount(self.mnt)
        return entry is not None and entry.fstype == "btrfs"

    def ensure(self) -> None:
        """Make, attach and mount the file system as needed, and turn its quotas on. Idempotent:
        a file system still mounted (an edge restart) is used as it is."""
        self.root.mkdir(parents=True, exist_ok=True)
        # What tenants wrote lives below (sandboxes' upper layers, shared volumes, some world-
        # writable): no host user but root walks in, and nothing there is setuid or a device
        # to the host (inside, each sandbox's own mounts decide).
        os.chmod(self.root, 0o700)
        self.mnt.mkdir(exist_ok=True)
        if not self.mounted():
            if not self.image.exists():
                self._make()
            dev = _loop_for(self.image)
            if dev is not None:  # still attached: its file system lives on in some namespace
                _linux.mount(dev, self.mnt, "btrfs", _HOST_FLAGS, None)
            else:
                dev, fd = _attach_loop(self.image)
                try:
                    _linux.mount(dev, self.mnt, "btrfs", _HOST_FLAGS, None)
                finally:
                    os.close(fd)
        self._fsid = self._read_fsid()
        qgroups = Path("/sys/fs/btrfs", self._fsid, "qgroups")
        if not qgroups.is_dir():
            fd = _dir_fd(self.mnt)
            try:
                try:
                    fcntl.ioctl(fd, _QUOTA_CTL, struct.pack("QQ", _QUOTA_ENABLE_SIMPLE, 0))
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    fcntl.ioctl(fd, _QUOTA_CTL, struct.pack("QQ", _QUOTA_ENABLE, 0))
            finally:
                os.close(fd)
        mode = qgroups / "mode"
        self.simple = mode.exists() and mode.read_text().strip() == "squota"

    def _make(self) -> None:
        size_mb = self.size_mb or self.default_size_mb(self.root)
        tmp = self.image.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.truncate(size_mb << 20)  # sparse: the host's disk is used as sandboxes write
        # Single (not DUP) metadata: a second copy on the same file protects nothing. No discard
        # at mkfs (it would punch the whole file); the mount discards freed space later.
        done = subprocess.run(
            ["mkfs.btrfs", "-q", "-K", "-m", "single", "-d", "single", str(tmp)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise OSError(errno.EIO, f"mkfs.btrfs failed: {done.stderr.strip()[-500:]}")
        tmp.replace(self.image)
        log.info("disk quotas: made %s (%d MiB, sparse)", self.image, size_mb)

    @staticmethod
    def default_size_mb(root: Path) -> int:
        """Half the free space of the file system the image lives on (at least 1 GiB): the
        most quota'd sandboxes on this node can take from the host's disk, all together."""
        st = os.statvfs(root)
        return max(MIN_SIZE_MB, st.f_bavail * st.f_frsize // 2 >> 20)

    def _read_fsid(self) -> str:
        fd = _dir_fd(self.mnt)
        try:
            info = bytearray(1024)
            fcntl.ioctl(fd, _FS_INFO, info)
        finally:
            os.close(fd)
        raw = bytes(info[16:32]).hex()
        return f"{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"

    def size_bytes(self) -> int:
        st = os.statvfs(self.mnt)
        return st.f_blocks * st.f_frsize

    def release(self) -> bool:
        """Unmount if no volume is left (the loop device then detaches by itself) and delete
        the image, so the next start mounts nothing until a sandbox asks for a limit again.
        Returns whether it is gone now. Shared volumes keep the image (the next start mounts
        it again); a sandbox's volume keeps it mounted."""
        if self.mounted():
            names = self.volumes()
            if any(not n.startswith(SHARED_PREFIX) for n in names):
                return False
            try:
                _linux.umount(self.mnt)
            except OSError as exc:
                log.warning("disk quotas: cannot unmount %s: %s", self.mnt, exc)
                return False
            self._fsid = None
            if names:
                return True
        # Its loop device may still be detaching (autoclear runs after the last close): it
        # holds the file open, and the blocks go back to the host once it has.
        self.image.unlink(missing_ok=True)
        return True

    # -- volumes -----------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        return self.mnt / name

    def volumes(self) -> list[str]:
        if not self.mounted():
            return []
        return sorted(p.name for p in self.mnt.iterdir() if p.is_dir())

    def create_volume(self, name: str, limit_bytes: int) -> Path:
        """A new subvolume ``name`` whose qgroup may reference at most ``limit_bytes``."""
        fd = _dir_fd(self.mnt)
        try:
            fcntl.ioctl(fd, _SUBVOL_CREATE, _vol_args(name))
        finally:
            os.close(fd)
        try:
            self.set_limit(name, limit_bytes)
        except BaseException:
            self.destroy_volume(name)
            raise
        return self.path(name)

    def volume_id(self, name: str) -> int:
        fd = _dir_fd(self.path(name))
        try:
            args = bytearray(4096)
            struct.pack_into("QQ", args, 0, 0, _FIRST_FREE_OBJECTID)
            fcntl.ioctl(fd, _INO_LOOKUP, args)
            return int(struct.unpack_from("Q", args, 0)[0])
        finally:
            os.close(fd)

    def set_limit(self, name: str, limit_bytes: int | None) -> None:
        """Set (or with None, lift) the volume's limit on referenced bytes."""
        fd = _dir_fd(self.path(name))
        try:
            # qgroupid 0 = the qgroup of the subvolume the descriptor is in (level 0, its id).
            value = _CLEAR if limit_bytes is None else limit_bytes
            fcntl.ioctl(fd, _QGROUP_LIMIT, struct.pack("QQQQQQ", 0, _LIMIT_MAX_RFER, value, 0, 0, 0))
        finally:
            os.close(fd)

    def destroy_volume(self, name: str) -> bool:
        """Delete the subvolume and everything in it (at once for the caller; the kernel frees
        the blocks, then the qgroup, in the background). False if there was none."""
        path = self.path(name)
        if not path.is_dir():  # never there, or the file system is not mounted
            return False
        fd = _dir_fd(self.mnt)
        try:
            fcntl.ioctl(fd, _SNAP_DESTROY, _vol_args(name))
        except OSError as exc:
            # e.g. EBUSY, EPERM: empty it by hand; rmdir removes an empty subvolume.
            log.warning("disk quotas: subvolume destroy of %s failed (%s), removing by hand", name, exc)
            shutil.rmtree(path)
        finally:
            os.close(fd)
        return True

    def commit(self) -> None:
        """Commit the file system and wake its cleaner, which drops destroyed volumes (their
        blocks, then their qgroups) at once instead of after the next periodic commit (up to
        30 s). Flushes every volume's dirty data too: the caller rate-limits it."""
        fd = _dir_fd(self.mnt)
        try:
            fcntl.ioctl(fd, _SYNC)
        finally:
            os.close(fd)

    def qgroup_dir(self, volume_id: int) -> Path:
        """The kernel's view of a volume's qgroup (``referenced``, ``max_referenced``...);
        gone once the kernel has dropped the deleted volume."""
        if self._fsid is None:
            self._fsid = self._read_fsid()
        return Path("/sys/fs/btrfs", self._fsid, "qgroups", f"0_{volume_id}")

    def usage(self, name: str) -> int:
        """Bytes the volume references now (as of the last transaction commit)."""
        return int((self.qgroup_dir(self.volume_id(name)) / "referenced").read_text())
