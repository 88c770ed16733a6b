"""Ending a crun sandbox so that its memory cgroup dies with it.

A memory cgroup that is removed while page cache is still charged to it does not go away: the
kernel keeps it, "dying", until memory pressure reclaims those pages, and with it every
per-cgroup structure (per-cpu statistics, and the per-shrinker state that grows with every
filesystem instance on the node: ~0.7 MiB each here at 1,000 sandboxes). A sandbox is charged
for the pages it was first to read (of layer files, of the host file system's blocks), and
almost every one still had one or two when it ended: 1,000 created and destroyed kept ~1,000
dying memory cgroups and ~1 GiB of MemAvailable, which admission reads, until the kernel ran
short (``echo 3 > /proc/sys/vm/drop_caches`` freed them all at once).

So the edge ends a sandbox in this order: SIGKILL its init (the kernel kills the rest of its
pid namespace, and the sandbox's mount namespace, with its overlay, goes with the last of
them), remove its writable layer (its written pages are then freed, never written back),
reclaim what is still charged (layer pages it read first: :func:`release_memory`), and only
then remove its cgroups or keep them as spares (spares.py; crun runs only for a sandbox whose
init could not be ended). On gVisor: SIGKILL its sentry and gofer, wait until its cgroup has
no process, the same, then runsc delete. The reclaim may evict a layer page that
other sandboxes map too; they fault it back in from the page cache of the layer's image, or
from disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dsec import _linux
from dsec.backends.container.handle import ContainerHandle
from dsec.density import memory
from dsec.executor.fdwait import fd_ready

INIT_EXIT_TIMEOUT_S = 5.0  # its pid namespace waits for zombies whose parents are outside
# force_empty mostly waits (for kernel workers on every CPU): its own threads, so that a mass
# destroy does not hold the event loop's default ones, which file operations use.
EXECUTOR = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dsec-teardown")


async def end_processes(handle: ContainerHandle) -> bool:
    """SIGKILL the sandbox's init, found by PID *and* start time, and wait until it has exited
    (then every process of its pid namespace has). False if it could not be told to have ended
    (no init in the handle, or it outlived the timeout); True if it is gone."""
    return await _end(handle.pid, handle.start_time)


async def end_gvisor(handle: ContainerHandle, cgroup: Path) -> bool:
    """:func:`end_processes` for a gVisor sandbox: its sentry (the handle's init) and its gofer,
    then wait until the memory cgroup has no process left (the sentry's stubs end with it).
    True once so; False if that could not be told within the timeout."""
    ended = await asyncio.gather(
        _end(handle.pid, handle.start_time),
        _end(handle.gofer_pid, handle.gofer_start_time),
    )
    if not all(ended):
        return False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + INIT_EXIT_TIMEOUT_S
    for delay in itertools.chain(itertools.repeat(0.001, 10), itertools.repeat(0.02)):
        try:
            if not (cgroup / "cgroup.procs").read_text().strip():
                return True
        except OSError:
            return False
        if loop.time() > deadline:
            return False
        await asyncio.sleep(delay)  # no event says a cgroup emptied (v1): a short poll
    return False  # pragma: no cover - the delays never end


async def _end(pid: int, start_time: int | None) -> bool:
    if pid <= 0:
        return False
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        # Through the pidfd, the PID cannot be reused behind our back: check it is the process.
        if _linux.proc_start_time(pid) != start_time:
            return True  # it ended long ago; this PID is another process now
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return await _exited(pidfd)
    finally:
        os.close(pidfd)


async def _exited(pidfd: int) -> bool:
    try:
        async with asyncio.timeout(INIT_EXIT_TIMEOUT_S):
            await fd_ready(pidfd)  # a pidfd is readable once its process has exited
        return True
    except TimeoutError:
        return False


_RELEASE_TRIES = 3


def charged_bytes(cgroup: Path) -> int:
    """Bytes of user memory (page cache, anonymous pages) charged to the memory cgroup, what
    keeps it from dying once removed, or a little more (pages a CPU holds pre-charged for it,
    which force_empty hands back); 0 when it is gone. Kernel objects do not count: the kernel
    hands them to the parent at removal.

    From the page counters, exact, not from memory.stat: the kernel flushes those figures
    lazily (2 s, or 64 updates a CPU, late), and a dead sandbox's cgroup with no page left on
    any list still showed one there in about 1 test run of 3."""
    try:
        usage = int((cgroup / "memory.usage_in_bytes").read_text())
        kmem = int((cgroup / "memory.kmem.usage_in_bytes").read_text())
    except OSError:
        return 0
    return max(0, usage - kmem)


async def release(cgroup: Path) -> int:
    """:func:`release_memory` in the teardown's own threads."""
    return await asyncio.get_running_loop().run_in_executor(EXECUTOR, release_memory, cgroup)


def release_memory(cgroup: Path) -> int:
    """Reclaim what the dead sandbox's memory cgroup still holds on its LRU lists, so that it
    dies once removed; the bytes it no longer charges (0, and no reclaim, if it had none).
    Blocking: run it in :data:`EXECUTOR`.

    ``memory.force_empty``, though it costs more than the page or two it usually finds: it
    drains every CPU's page batches, then, kernel objects still charged, retries a full reclaim
    16 times. A limit of 0, which reclaims until nothing more goes, left that last page in 98
    of 100 dead sandboxes (after a drain too). 1,000 concurrent destroys here: 143-162/s
    without it, 96-111/s with it; CPU 11-13 s without, 17-19 s with (~5.5 ms per destroy)."""
    freed = 0
    # A page busy at that moment (isolated by another reclaimer, under I/O) is skipped by
    # force_empty; the retries cost nothing when the first pass emptied the cgroup.
    for _ in range(_RELEASE_TRIES):
        if not charged_bytes(cgroup):
            break
        freed += memory.page_out(cgroup)
    return freed
