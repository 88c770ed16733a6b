"""Cluster membership: which edges exist, where they listen, and each one's registration epoch.

It lives in the IAM database because that is the one store every apiserver already shares;
apiservers hold no membership of their own and rebuild it by reading this table.

The epoch is what makes a sandbox ID safe to route: ``sb-<node>-<epoch>-<tag>``. An edge that
restarts with its journal intact claims the epoch it had and keeps it (its sandboxes are
re-adopted and their IDs stay good). An edge that comes back without its state claims
nothing, or an older epoch, and receives a new one: every ID from before names a sandbox
that cannot exist any more, and any apiserver can say so without asking the edge.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dsec.iam.ledger import Row, Tx
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.ids import validate_node_name

_MAX_EPOCH = 9_999_999_999  # IDs carry at most ten digits (protocol/ids.py)


@dataclass(frozen=True)
class NodeRecord:
    node: str
    url: str
    epoch: int
    registered_at: float  # when this epoch began
    last_seen: float  # the edge's latest registration or heartbeat


def granted_epoch(stored: int | None, claimed: int | None) -> int:
    """The epoch an edge receives: its claim when that is current, else a new one.

    A claim newer than the record is honoured too: the edge's journal is the truth about the
    sandboxes it runs, and the record may come from a restored or rebuilt database.
    """
    if claimed is not None and (stored is None or claimed >= stored):
        return claimed
    return (stored or 0) + 1


def validate_registration(node: str, url: str, claimed: int | None) -> None:
    validate_node_name(node)
    if not url or len(url) > 500 or not url.startswith(("http://", "https://", "local:")):
        raise InvalidRequest(f"edge {node!r}: its URL must be http(s)://host:port, got {url!r}")
    if claimed is not None and not 0 < claimed <= _MAX_EPOCH:
        raise InvalidRequest(f"edge {node!r}: an epoch is 1..{_MAX_EPOCH}, got {claimed}")


async def register(
    tx: Tx, node: str, url: str, claimed: int | None, *, heartbeat: bool = False
) -> NodeRecord:
    """Grant an epoch (see :func:`granted_epoch`); a ``heartbeat`` never changes one.

    A heartbeat whose epoch is not the current one comes from an edge that was replaced
    under its name: it gets the current record back (and fences itself) and changes
    nothing, so a stale edge cannot take its name back from the one that replaced it.
    """
    now = time.time()
    # Insert-or-nothing first, so two edges racing to register one new name both find a row to lock.
    await tx.execute(
        "INSERT INTO nodes (node, url, epoch, registered_at, last_seen) VALUES ($1, $2, 0, $3, $3)"
        " ON CONFLICT (node) DO NOTHING",
        node,
        url,
        now,
    )
    rows = await tx.fetch(f"SELECT epoch, registered_at FROM nodes WHERE node = $1{tx.lock_update}", node)
    stored = int(rows[0][0]) or None
    if heartbeat and stored is not None and claimed != stored:
        (current,) = await tx.fetch(
            "SELECT node, url, epoch, registered_at, last_seen FROM nodes WHERE node = $1", node
        )
        return _record(current)
    epoch = granted_epoch(stored, claimed)
    since = float(rows[0][1]) if epoch == stored else now
    await tx.execute(
        "UPDATE nodes SET url = $2, epoch = $3, registered_at = $4, last_seen = $5 WHERE node = $1",
        node,
        url,
        epoch,
        since,
        now,
    )
    return NodeRecord(node, url, epoch, since, now)


async def list_nodes(tx: Tx) -> list[NodeRecord]:
    rows = await tx.fetch(
        "SELECT node, url, epoch, registered_at, last_seen FROM nodes WHERE epoch > 0 ORDER BY node"
    )
    return [_record(r) for r in rows]


async def forget(tx: Tx, node: str) -> bool:
    rows = await tx.fetch(f"SELECT node FROM nodes WHERE node = $1{tx.lock_delete}", node)
    await tx.execute("DELETE FROM nodes WHERE node = $1", node)
    return bool(rows)


def _record(r: Row) -> NodeRecord:
    return NodeRecord(str(r[0]), str(r[1]), int(r[2]), float(r[3]), float(r[4]))
