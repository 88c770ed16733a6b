"""Helpers every test folder shares: polling with a deadline, and what the real path needs."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import inspect
import mmap
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

DEADLINE_S = 10.0


async def eventually(
    predicate: Callable[[], Any | Awaitable[Any]], what: str, timeout: float = DEADLINE_S
) -> Any:
    """Poll ``predicate`` (sync or async) until it returns something truthy, and return that.

    This is how tests wait for background work (reaper, watcher): never a bare sleep.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def erofs_usable() -> bool:
    """Root, mkfs.erofs and a kernel with EROFS: what every layer on the real path needs."""
    if os.geteuid() != 0 or shutil.which("mkfs.erofs") is None:
        return False
    with open("/proc/filesystems") as f:
        if "erofs" in f.read():
            return True
    # Not listed until the module is loaded; modprobe is what mount(2) would trigger anyway.
    return subprocess.run(["modprobe", "erofs"], capture_output=True, check=False).returncode == 0


DSEC = str(Path(sys.executable).with_name("dsec"))


def dsec_env(config: Path) -> dict[str, str]:
    env = {**os.environ, "DSEC_CONFIG": str(config)}
    env.pop("DSEC_URL", None)
    env.pop("DSEC_API_KEY", None)
    return env


def start_dsec_up(
    data_dir: Path, layer_dir: Path, config: Path, node: str, *options: str
) -> subprocess.Popen[bytes]:
    """`dsec up` as a user runs it, on a free port; returns once it wrote its config file."""
    config.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            DSEC,
            "up",
            "--data-dir",
            str(data_dir),
            "--layer-dir",
            str(layer_dir),
            "--port",
            "0",
            "--no-base",
            "--node",
            node,
            "--swap",
            "host",
            "--no-microvm",
            "--no-vm",
            *options,
        ],
        env=dsec_env(config),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while not config.exists():
        if proc.poll() is not None:
            raise AssertionError(f"dsec up exited early with {proc.returncode}: {proc.stdout.read()!r}")  # type: ignore[union-attr]
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("dsec up did not write its config file within 60 s")
        time.sleep(0.05)
    return proc


def flip_byte(path: Path, offset: int) -> None:
    """Corrupt one byte of a file in place, even a read-only (stored) blob; keeps its mode."""
    mode = path.stat().st_mode & 0o7777
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    os.chmod(path, mode)


class RestartedNode:
    """An embedded node a test stops and starts again (its sandboxes keep running between).

    ``async with RestartedNode(cfg) as n``: ``n.node`` is the running incarnation, ``await
    n.restart()`` closes it without stopping sandboxes and starts the next. Whatever happens, the
    last incarnation (started anew if the test failed between two) stops every sandbox.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.node: Any = None
        self._running = False

    async def _start(self) -> Any:
        from dsec.node.embedded import EmbeddedNode

        self.node = EmbeddedNode(self.config)
        await self.node.start()
        self._running = True
        return self.node

    async def __aenter__(self) -> RestartedNode:
        await self._start()
        return self

    async def restart(self) -> Any:
        await self.node.close()
        self._running = False
        return await self._start()

    async def __aexit__(self, *exc: object) -> None:
        if not self._running:
            await self._start()
        await self.node.close(stop_sandboxes=True)


# ---------------------------------------------------------------- page-cache residency
# mincore(2) on a mapping that is never touched: unlike a read (even RWF_NOWAIT, which starts
# readahead on a miss), looking does not bring the pages in.

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache."""
    size = path.stat().st_size
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = ctypes.create_string_buffer((size + page - 1) // page)
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(b & 1 for b in vec.raw) * page
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache (written back first: dirty ones stay)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_KPF_LRU = 1 << 5  # include/uapi/linux/kernel-page-flags.h


def lru_pages_charged(memcg: Path) -> int:
    """Pages on an LRU list that the kernel charges to the (online) memory cgroup, counted page
    by page from /proc/kpagecgroup and /proc/kpageflags: exact, where memory.stat's figures are
    flushed lazily (up to 2 s, or 64 page updates a CPU, late). About half a second."""
    needle = os.stat(memcg).st_ino.to_bytes(8, sys.byteorder)
    pfns = []
    with open("/proc/kpagecgroup", "rb", buffering=0) as fh:
        base = 0
        while True:
            try:
                chunk = fh.read(1 << 20)
            except OSError:  # EINVAL past the last page frame of a hole-ended memory map
                break
            if not chunk:
                break
            at = chunk.find(needle)
            while at >= 0:
                if at % 8 == 0:
                    pfns.append(base + at // 8)
                at = chunk.find(needle, at + 1)
            base += len(chunk) // 8
    with open("/proc/kpageflags", "rb", buffering=0) as fh:
        flags = [int.from_bytes(os.pread(fh.fileno(), 8, pfn * 8), sys.byteorder) for pfn in pfns]
    return sum(1 for f in flags if f & _KPF_LRU)


def mapping_flags(pid: int, pick: Callable[[str], bool]) -> set[str]:
    """The VmFlags of the last of ``pid``'s mappings whose first smaps line (its range,
    permissions... and name) ``pick`` accepts."""
    flags: set[str] | None = None
    picked = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if not line[:1].isupper():  # a mapping's first line; its fields start with capitals
            picked = pick(line)
        elif picked and line.startswith("VmFlags:"):
            flags = set(line.split()[1:])
    assert flags is not None, f"process {pid} has no such mapping"
    return flags
