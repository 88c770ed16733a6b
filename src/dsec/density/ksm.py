"""KSM the edge runs: identical anonymous pages of sandboxes that mark their memory mergeable
are kept once.

What is marked (``madvise(MADV_MERGEABLE)``): QEMU's guest RAM (its default), and FnCall
runners' warm interpreters (``fncall/runner.py --mergeable``: every runner of a pool lays out
its memory alike, so most of what its preloads built is the same page in every sandbox of the
pool). Container sandboxes are not marked, and ksmd scans nothing else: a node of containers
costs it nothing.

The edge starts ksmd (``run`` 0 -> 1) where it found it stopped, and says so in its journal, so
that an edge restarted on the same data directory knows the ksmd it finds running is its own.
It stops it again (``run`` 1 -> 0: merged pages stay merged until their processes end) only when
it closes with no sandbox left, as swap is released; a ksmd the operator started, or one set to
unmerge everything (``run`` 2), is left as it is. Scan rate: the kernel's settings, untouched.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

log = logging.getLogger("dsec.density.ksm")

KSM = Path("/sys/kernel/mm/ksm")
_OWNED = "ksm_started"  # journal meta: "1" while this edge's data directory started ksmd


class Meta(Protocol):
    """Where the edge keeps small facts across restarts (the journal's meta table)."""

    def meta(self, key: str, default: str | None = None) -> str | None: ...

    def set_meta(self, key: str, value: str) -> None: ...


class Ksm:
    def __init__(self, enabled: bool, meta: Meta, root: Path = KSM) -> None:
        self.enabled = enabled
        self._meta = meta
        self._root = root
        self.running = False  # ksmd runs, whoever started it: worth marking memory mergeable

    def ensure(self) -> None:
        if not self.enabled:
            return
        try:
            run = (self._root / "run").read_text().strip()
            if run == "0":
                self._meta.set_meta(_OWNED, "1")  # first: a crash right after still owns it
                (self._root / "run").write_text("1")
                log.info("ksmd started")
                run = "1"
            elif self._meta.meta(_OWNED) == "1" and run != "1":
                self._meta.set_meta(_OWNED, "")  # the operator changed it since: theirs now
        except OSError as exc:  # a kernel without CONFIG_KSM, or a read-only /sys
            log.warning("KSM not available: %s", exc)
            return
        self.running = run == "1"

    def release(self) -> None:
        """Stop ksmd if this edge (or an earlier one on its data directory) started it; call only
        with no sandbox left on the node."""
        if self._meta.meta(_OWNED) != "1":
            return
        try:
            if (self._root / "run").read_text().strip() == "1":
                (self._root / "run").write_text("0")
                log.info("ksmd stopped")
        except OSError as exc:
            log.warning("could not stop ksmd: %s", exc)
            return
        self._meta.set_meta(_OWNED, "")
        self.running = False

    def stats(self) -> dict[str, int | bool]:
        """What the node's report says: whether ksmd runs, and the memory it saves now."""
        sharing = _counter(self._root / "pages_sharing")
        return {"running": self.running, "saved_bytes": sharing * os.sysconf("SC_PAGE_SIZE")}


def _counter(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0
