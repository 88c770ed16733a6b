"""Core scheduling for latency-sensitive sandboxes: a core-scheduling cookie per sandbox.

On an SMT core, the kernel (``CONFIG_SCHED_CORE``, Linux 5.14+) lets two hardware threads run
tasks at the same time only when the tasks carry the same cookie. An LS sandbox gets a cookie of
its own, so its tasks never share a physical core with another sandbox's (or the host's): that
closes the sibling-thread side channels (L1TF, MDS and the like) and the noisy-sibling latency
the original measured. BE sandboxes get none: they are SCHED_IDLE already, and a cookie-less
task still never runs beside an LS sandbox's (cookie 0 differs from every cookie).

Where the cookie is set (one place per kind of process, no fix-up after the fact):

- the sandbox's start: ``dsec-rootfs --new-core-cookie`` (the same prctl as :func:`new_cookie`,
  after it mounts the root and before it execs crun; native/rootfs.py), so crun
  and everything it forks, the sandbox's init first, inherit one fresh cookie (the kernel copies
  it on every fork); the handle records ``core_cookie``;
- every later process (sessions, exec, held processes): ``dsec-enter --share-core-cookie`` pulls
  the init's cookie (``PR_SCHED_CORE_SHARE_FROM``, the init's host PID) before it forks, so the
  helper's parent and the command share it too.

:func:`probe` decides once per node. Without kernel support (``PR_SCHED_CORE`` answers EINVAL)
or without SMT (the kernel answers ENODEV; or sysfs says one thread per core) nothing is set
and nothing costs anything: the backend reports ``core_scheduling: False`` and why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

PR_SCHED_CORE = 62
PR_SCHED_CORE_GET = 0
PR_SCHED_CORE_CREATE = 1
PR_SCHED_CORE_SHARE_TO = 2
PR_SCHED_CORE_SHARE_FROM = 3
# The kernel's pid types (uapi: PR_SCHED_CORE_SCOPE_*): one task, its thread group, its
# process group. SHARE_FROM takes PIDTYPE_PID only; GET likewise.
PIDTYPE_PID = 0
PIDTYPE_TGID = 1
PIDTYPE_PGID = 2

CPU_SYSFS = Path("/sys/devices/system/cpu")
log = logging.getLogger("dsec.density.coresched")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.prctl.restype = ctypes.c_int


def _prctl(option: int, arg2: int, arg3: int, arg4: int, arg5: int) -> int:
    """prctl(2); raises :class:`OSError` with its errno. Safe in a ``preexec_fn``."""
    rc: int = _libc.prctl(option, arg2, arg3, arg4, arg5)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return rc


@dataclass(frozen=True)
class Support:
    """Whether this node gives LS sandboxes a cookie, and if not, why not."""

    available: bool
    why_not: str | None = None


def smt_threads_per_core(sysfs: Path = CPU_SYSFS) -> int | None:
    """Hardware threads per core now online: from ``smt/active`` (0 = one thread per core,
    also when SMT is switched off), else the largest ``thread_siblings_list``; None if unknown."""
    try:
        if (sysfs / "smt" / "active").read_text().strip() == "0":
            return 1
    except OSError:
        pass  # older kernels, or no SMT control: count siblings instead
    most = 0
    for siblings in sysfs.glob("cpu[0-9]*/topology/thread_siblings_list"):
        try:
            most = max(most, _count_cpus(siblings.read_text()))
        except (OSError, ValueError):
            continue
    return most or None


def _count_cpus(cpu_list: str) -> int:
    """How many CPUs a sysfs list such as ``0,4`` or ``0-1`` names."""
    n = 0
    for part in cpu_list.strip().split(","):
        lo, _, hi = part.partition("-")
        n += int(hi) - int(lo) + 1 if hi else 1
    return n


def probe(sysfs: Path = CPU_SYSFS) -> Support:
    """Ask the kernel about the calling process (``PR_SCHED_CORE_GET``) and sysfs about SMT:
    both must say yes. Every reason that applies is named (here: no kernel support *and* no
    SMT), so an operator knows what would have to change."""
    why: list[str] = []
    cookie = ctypes.c_ulonglong(0)
    try:
        _prctl(PR_SCHED_CORE, PR_SCHED_CORE_GET, 0, PIDTYPE_PID, ctypes.addressof(cookie))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            why.append(
                "the kernel has no core scheduling (PR_SCHED_CORE: EINVAL; CONFIG_SCHED_CORE, Linux 5.14+)"
            )
        elif exc.errno == errno.ENODEV:
            why.append("the kernel sees no SMT (PR_SCHED_CORE: ENODEV)")
        else:
            why.append(f"PR_SCHED_CORE_GET failed: {exc.strerror}")
    threads = smt_threads_per_core(sysfs)
    if threads == 1:
        why.append("the CPU runs one thread per core (no SMT sibling to share a core with)")
    if why:
        return Support(False, "; ".join(why))
    return Support(True)


@functools.cache
def node_support() -> Support:
    """:func:`probe` once per process: kernel and CPU do not change while the edge runs."""
    support = probe()
    if support.available:
        log.info("core scheduling: on (LS sandboxes get a cookie each)")
    else:
        log.info("core scheduling: off (%s)", support.why_not)
    return support


def capabilities() -> dict[str, bool | str]:
    """The backend's capability entries: ``core_scheduling``, and ``core_scheduling_missing``
    (why not) when it is off."""
    support = node_support()
    caps: dict[str, bool | str] = {"core_scheduling": support.available}
    if support.why_not is not None:
        caps["core_scheduling_missing"] = support.why_not
    return caps


def wants_cookie(cpu_class: str, support: Support) -> bool:
    """Whether a new sandbox of ``cpu_class`` gets a cookie of its own: LS on a node that can.
    BE never (SCHED_IDLE already; and a shared cookie-0 class is what BE is)."""
    return cpu_class == "ls" and support.available


def new_cookie() -> None:
    """A fresh cookie for the calling process, inherited by everything it forks afterwards.
    The call dsec-rootfs makes in C before it execs crun (a preexec_fn would make the edge fork
    rather than vfork: slow at density); kept for tests and diagnostics."""
    _prctl(PR_SCHED_CORE, PR_SCHED_CORE_CREATE, 0, PIDTYPE_TGID, 0)


def cookie_of(pid: int) -> int:
    """The cookie of task ``pid`` (0: none). Diagnostics and tests; raises OSError without support."""
    cookie = ctypes.c_ulonglong(0)
    _prctl(PR_SCHED_CORE, PR_SCHED_CORE_GET, pid, PIDTYPE_PID, ctypes.addressof(cookie))
    return cookie.value
