"""One memory layout for every runner of a pool, so KSM can merge their warm interpreters.

With ``--mergeable SEED`` the runner re-execs itself once without address randomization and
with SEED as its hash seed (``same_layout``), and marks what its preloads built mergeable
(``mark_mergeable``): the runners of a pool then hold the same pages, which KSM keeps once.
``own_layout`` tells the call processes to give what they exec its randomization back.
"""

from __future__ import annotations

import ctypes
import os
import sys

from .libc import ADDR_NO_RANDOMIZE, MADV_MERGEABLE, PER_QUERY, libc

LAYOUT_ENV = "DSEC_FNCALL_LAYOUT"  # set in the runner's re-exec with the pool's layout
own_layout = False  # this runner turned address randomization off: exec'd programs get it back


def same_layout(seed: int) -> None:
    """Become this runner again with address randomization off and ``seed`` as the hash seed:
    every runner of the pool, started alike, then builds its preloads at the same addresses
    with the same contents, which KSM keeps once (measured: 92% of a runner's anonymous pages
    merge across two, 4% with randomization). It gives up nothing between calls: all calls of
    a sandbox fork from one zygote, so they share its layout and seed already. Left alone
    under a persona the operator chose."""
    global own_layout
    if os.environ.get(LAYOUT_ENV) == str(seed):
        own_layout = True  # the re-exec'd runner
        return
    if libc.personality(PER_QUERY) != 0 or libc.personality(ADDR_NO_RANDOMIZE) == -1:
        return
    env = dict(os.environ, PYTHONHASHSEED=str(seed), **{LAYOUT_ENV: str(seed)})
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        libc.personality(0)  # serve as started, unmerged


def mark_mergeable() -> int:
    """``madvise(MADV_MERGEABLE)`` on every private writable mapping (heap, arenas, modules'
    data: what the preloads built); the zygote and its calls inherit the mark. Bytes marked.

    Called again just before the zygote forks and before the runner says it is ready: the
    heap grows by new mappings (brk past a marked one makes an unmarked one), and whether
    anything allocated after a mark crosses that line depends on sizes nothing here controls
    (paths, environment). Marking again is idempotent and cheap."""
    with open("/proc/self/maps") as maps:
        lines = maps.read().splitlines()
    marked = 0
    for line in lines:
        fields = line.split(maxsplit=5)
        name = fields[5] if len(fields) > 5 else ""
        if fields[1][1] != "w" or fields[1][3] != "p" or name in ("[vvar]", "[vdso]", "[vsyscall]"):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_MERGEABLE) == 0:
            marked += hi - lo
    return marked
