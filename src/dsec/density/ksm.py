"""KSM the edge runs: identical anonymous pages of sandboxes that mark their memory mergeable
are kept once.

What is marked (``madvise(MADV_MERGEABLE)``): QEMU's guest RAM (its default), and FnCall
runners' warm interpreters (``fncall/runner/layout.py``, ``--mergeable``: every runner of a pool lays out
its memory alike, so most of what its preloads built is the same page in every sandbox of the
pool). Container sandboxes are not marked, and ksmd scans nothing else: a node of containers
costs it nothing.

ksmd is one for the whole host, and several nodes may run on it (a `dsec up` beside the test
suite). Each edge that uses it claims it (a file named after its data directory under
:data:`CLAIMS`). An edge that finds it stopped starts it (``run`` 0 -> 1) and marks it started by
DSec (:data:`STARTED`, host-wide, so an edge restarted on any data directory knows it is DSec's).
An edge that closes with no sandbox left drops its claim, and stops ksmd again (``run`` 1 -> 0:
merged pages stay merged until their processes end) only when DSec started it and no other live
node claims it, as swap is released; a ksmd the operator started, or one set to unmerge
everything (``run`` 2), is left as it is. Scan rate: the kernel's settings, untouched.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path
from typing import Protocol

log = logging.getLogger("dsec.density.ksm")

KSM = Path("/sys/kernel/mm/ksm")
_OWNED = "ksm_started"  # journal meta of edges before claims: "1" while their ksmd ran
CLAIMS = Path("/run/dsec/ksm")  # /run: ksmd and the claims on it both end with the boot
STARTED = "started-by-dsec"  # in the claims directory, while a DSec edge's start stands


class Meta(Protocol):
    """Where the edge keeps small facts across restarts (the journal's meta table)."""

    def meta(self, key: str, default: str | None = None) -> str | None: ...

    def set_meta(self, key: str, value: str) -> None: ...


class Ksm:
    def __init__(
        self,
        enabled: bool,
        meta: Meta,
        root: Path = KSM,
        *,
        owner: Path | None = None,
        claims: Path | None = None,
    ) -> None:
        """``owner``: the node's data directory (its claim's name and content); ``claims``:
        :data:`CLAIMS` for the kernel's ksmd, beside ``root`` for any other (a test's)."""
        self.enabled = enabled
        self._meta = meta
        self._root = root
        self._claims = claims or (CLAIMS if root == KSM else root.parent / "ksm-claims")
        self._owner = str(owner.resolve()) if owner is not None else ""
        self._claim = self._claims / "users" / (hashlib.sha256(self._owner.encode()).hexdigest()[:16])
        self.running = False  # ksmd runs, whoever started it: worth marking memory mergeable

    def ensure(self) -> None:
        if not self.enabled:
            return
        started = self._claims / STARTED
        try:
            run = (self._root / "run").read_text().strip()
            self._claim.parent.mkdir(parents=True, exist_ok=True)
            self._claim.write_text(self._owner + "\n")
            if run == "0":
                started.write_text(self._owner + "\n")  # first: a crash right after still owns it
                (self._root / "run").write_text("1")
                log.info("ksmd started")
                run = "1"
            elif run != "1":
                started.unlink(missing_ok=True)  # the operator changed it since: theirs now
            elif self._meta.meta(_OWNED) == "1":  # started by this node's edge before claims
                started.write_text(self._owner + "\n")
            self._meta.set_meta(_OWNED, "")
        except OSError as exc:  # a kernel without CONFIG_KSM, or a read-only /sys
            log.warning("KSM not available: %s", exc)
            return
        self.running = run == "1"

    def release(self) -> None:
        """Drop this node's claim; stop ksmd if DSec started it and no other node still claims
        it. Call only with no sandbox left on the node."""
        if not self.enabled:
            return
        self._claim.unlink(missing_ok=True)
        started = self._claims / STARTED
        if not started.exists() or self.other_users():
            return
        try:
            if (self._root / "run").read_text().strip() == "1":
                (self._root / "run").write_text("0")
                log.info("ksmd stopped")
        except OSError as exc:
            log.warning("could not stop ksmd: %s", exc)
            return
        started.unlink(missing_ok=True)
        self.running = False

    def other_users(self) -> list[str]:
        """The data directories of the other live nodes that claim ksmd."""
        return users(self._claims, but=self._claim)

    def stats(self) -> dict[str, int | bool]:
        """What the node's report says: whether ksmd runs, and the memory it saves now."""
        sharing = _counter(self._root / "pages_sharing")
        return {"running": self.running, "saved_bytes": sharing * os.sysconf("SC_PAGE_SIZE")}


def users(claims: Path = CLAIMS, *, but: Path | None = None) -> list[str]:
    """The data directories of the live nodes that claim ksmd (a claim whose data directory is
    gone is stale: removed)."""
    out = []
    with contextlib.suppress(OSError):
        for claim in sorted((claims / "users").iterdir()):
            if claim == but:
                continue
            with contextlib.suppress(OSError):
                owner = claim.read_text().strip()
                if owner and not Path(owner).is_dir():
                    claim.unlink()
                    continue
                out.append(owner)
    return out


def _counter(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0
