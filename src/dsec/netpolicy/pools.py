"""Which address pool a node's sandbox links take, so two nodes on one host never share one.

Every link of a node carries the pool's gateway address, its name server listens there, and
each sandbox gets a host route to a /32 of the pool: two nodes on one pool would fight over the
same routes and the same port 53. A node whose egress configuration names no pool takes a /16
of :data:`CANDIDATES`, starting at one its node name and data directory hash to, and skips
those that another node of the same network namespace has claimed or that a host route
already covers. What it took is kept in its state directory (a restart with live sandboxes
keeps their addresses) and claimed in :data:`CLAIMS` (``/run``: claims end with the boot, as
links do); both go when the node closes with no link left. A node that already had links
before pools were chosen (an edge upgraded under running sandboxes) keeps the old default.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import socket
import struct
from pathlib import Path

log = logging.getLogger("dsec.netpolicy.pools")

LEGACY_DEFAULT = ipaddress.IPv4Network("10.200.0.0/16")  # every node's before pools were chosen
# 10.192.0.0/16 .. 10.254.0.0/16, less 10.230-10.239: the test suite's and the benchmarks'
# configured pools (tests/netpolicy/mirror.py, bench/egress*.py), which they claim only while
# they run.
CANDIDATES = [ipaddress.IPv4Network(f"10.{b}.0.0/16") for b in range(192, 255) if not 230 <= b <= 239]
CLAIMS = Path("/run/dsec/link-pools")
POOL_FILE = "link-pool"  # in the node's state directory


def _netns_key() -> str:
    """Claims are per network namespace: nodes in two namespaces (the cluster tests') may
    use the same pool."""
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return "host"


def routed_networks(route_table: Path = Path("/proc/net/route")) -> list[ipaddress.IPv4Network]:
    """The destinations of this namespace's main IPv4 routing table, the default route left out."""
    out = []
    with contextlib.suppress(OSError):
        for line in route_table.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) < 8:
                continue
            dest, mask = (socket.inet_ntoa(struct.pack("<I", int(f, 16))) for f in (fields[1], fields[7]))
            net = ipaddress.IPv4Network(f"{dest}/{mask}", strict=False)
            if net.prefixlen > 0:
                out.append(net)
    return out


def _claim_path(claims: Path, pool: ipaddress.IPv4Network) -> Path:
    return claims / _netns_key() / f"{pool.network_address}-{pool.prefixlen}"


def _claimed_by_other(path: Path, state_dir: Path) -> Path | None:
    """The state directory of the node that claims this pool, if it is not ``state_dir``; a
    claim whose state directory is gone (its data directory was removed without a clean
    close) is stale."""
    try:
        owner = Path(path.read_text().strip())
    except OSError:
        return None
    return owner if owner != state_dir and owner.is_dir() else None


def _take(path: Path, state_dir: Path) -> bool:
    """Claim ``path`` for ``state_dir`` unless another live node holds it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # no writable /run: nothing to coordinate through, routes still are
        log.warning("cannot claim link pools in %s: %s", path.parent, exc)
        return True
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            if _claimed_by_other(path, state_dir) is not None:
                return False
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # stale or ours: made again below, atomically
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{state_dir}\n")
        return True
    return False


def choose(
    node: str,
    state_dir: Path,
    *,
    had_links: bool,
    claims: Path = CLAIMS,
    routes: list[ipaddress.IPv4Network] | None = None,
) -> ipaddress.IPv4Network:
    """The pool of the node whose edge state is in ``state_dir`` (see the module's docstring)."""
    state_dir = state_dir.resolve()
    kept = state_dir / POOL_FILE
    with contextlib.suppress(OSError, ValueError):
        pool = ipaddress.IPv4Network(kept.read_text().strip())
        _take(_claim_path(claims, pool), state_dir)
        return pool
    if had_links:
        pool = LEGACY_DEFAULT
    else:
        taken = routed_networks() if routes is None else routes
        start = int.from_bytes(hashlib.sha256(f"{node}\0{state_dir}".encode()).digest()[:4], "big")
        order = [CANDIDATES[(start + i) % len(CANDIDATES)] for i in range(len(CANDIDATES))]
        free = [p for p in order if not any(p.overlaps(r) for r in taken)]
        claimed = next((p for p in free if _take(_claim_path(claims, p), state_dir)), None)
        if claimed is None:
            claimed = free[0] if free else order[0]
            log.warning("every link pool is claimed by another node; taking %s", claimed)
        pool = claimed
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = kept.with_suffix(".tmp")
    tmp.write_text(f"{pool}\n")
    tmp.replace(kept)
    _take(_claim_path(claims, pool), state_dir)
    return pool


def claim_configured(pool: ipaddress.IPv4Network, state_dir: Path, *, claims: Path = CLAIMS) -> Path | None:
    """Claim the pool the operator configured (so no node choosing one takes it); the state
    directory of another live node that claims it too, if one does (the caller says so)."""
    state_dir = state_dir.resolve()
    path = _claim_path(claims, pool)
    other = _claimed_by_other(path, state_dir)
    if other is None:
        _take(path, state_dir)
    return other


def release(pool: ipaddress.IPv4Network, state_dir: Path, *, claims: Path = CLAIMS) -> None:
    """The node closed with no link left: its pool is free for any node again."""
    state_dir = state_dir.resolve()
    path = _claim_path(claims, pool)
    with contextlib.suppress(OSError):
        if Path(path.read_text().strip()) == state_dir:
            path.unlink()
    with contextlib.suppress(OSError):
        (state_dir / POOL_FILE).unlink()
