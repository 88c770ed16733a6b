"""The :class:`IamStore` over SQL, written once; SQLite and PostgreSQL only supply a ``Driver``.

Authorization lives here too, so both stores refuse exactly the same things: a key acts on
its own project and below; it may create sub-projects and keys there, set the quotas of its
strict sub-projects only (never its own: that would let it raise its own limit), and issue
admin keys only if it is an admin key itself.

``authenticate`` is answered from an in-process cache of principals (iam/key_cache.py);
``cache_ttl_s`` bounds how long a revocation made through another process takes to reach
this one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Mapping
from typing import Self

from dsec.iam import ledger, registry
from dsec.iam.base import (
    ROOT_PROJECT,
    KeyFormat,
    KeyInfo,
    Principal,
    ProjectInfo,
    Quota,
    Reservation,
    Usage,
    ancestors,
    can_access,
    child_path,
    in_subtree,
    is_key,
    key_digest,
    key_id_of,
    new_key,
    subtree_range,
    to_millicores,
    validate_project,
)
from dsec.iam.group_commit import ReservationQueue, Want
from dsec.iam.key_cache import KeyCache
from dsec.iam.ledger import PROJECT_COLS, QUOTA_COLS, Driver, ProjectRow, Tx, lock_chain, quota_limits
from dsec.iam.registry import NodeRecord
from dsec.protocol.errors import Conflict, Forbidden, InvalidRequest, Unauthorized
from dsec.protocol.ids import SandboxId


def _require(actor: Principal | None, project: str, what: str) -> None:
    if actor is not None and not can_access(actor, project):
        raise Forbidden(f"a key of project {actor.project!r} may not {what} project {project!r}")


def _require_above(actor: Principal | None, project: str, what: str) -> None:
    """Only a strict ancestor's key may change a project's limits or delete it."""
    if actor is not None and (project == actor.project or not can_access(actor, project)):
        raise Forbidden(
            f"a key of project {actor.project!r} may not {what} project {project!r}:"
            " only a key of a project above it may"
        )


def _node_of(sandbox_id: str) -> str | None:
    try:
        return SandboxId.parse(sandbox_id).node
    except InvalidRequest:
        return None  # not a sandbox ID yet: a pending reservation, see ``bind``


def _info(row: ProjectRow) -> ProjectInfo:
    return ProjectInfo(row.id, row.parent, row.quota, row.usage, row.created_at)


class SqlIamStore:
    def __init__(self, db: Driver, *, cache_ttl_s: float = 5.0) -> None:
        self._db = db
        self._reservations = ReservationQueue(db, self._reserve_one, self.release)  # iam/group_commit.py
        self._keys = KeyCache(self._lookup, cache_ttl_s)

    async def close(self) -> None:
        self._keys.clear()
        await self._db.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- projects ---------------------------------------------------------------------------

    async def create_project(
        self, parent: str, name: str, quota: Quota | None = None, *, actor: Principal | None = None
    ) -> ProjectInfo:
        path = child_path(parent, name)
        quota = ledger.normalized((quota or Quota()).validate())
        _require(actor, parent, "create sub-projects in")
        now = time.time()

        async def tx(tx: Tx) -> ProjectInfo:
            ledger.check_within(quota, await lock_chain(tx, ancestors(parent)), path)
            made = await tx.fetch(
                f"INSERT INTO projects (id, parent, created_at, {', '.join(QUOTA_COLS)})"
                " VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (id) DO NOTHING RETURNING id",
                path,
                parent,
                now,
                *quota_limits(quota),
            )
            if not made:
                raise Conflict(f"project {path!r} already exists")
            return ProjectInfo(path, parent, quota, Usage(), now)

        return await self._db.write(tx)

    async def get_project(self, project: str, *, actor: Principal | None = None) -> ProjectInfo:
        validate_project(project)
        _require(actor, project, "see")

        async def tx(tx: Tx) -> ProjectInfo:
            rows = await tx.fetch(f"SELECT {PROJECT_COLS} FROM projects WHERE id = $1", project)
            if not rows:
                raise InvalidRequest(f"no project {project!r}")
            return _info(ProjectRow.of(rows[0]))

        return await self._db.read(tx)

    async def list_projects(
        self, under: str = ROOT_PROJECT, *, actor: Principal | None = None
    ) -> list[ProjectInfo]:
        validate_project(under)
        _require(actor, under, "list")
        lo, hi = subtree_range(under)

        async def tx(tx: Tx) -> list[ProjectInfo]:
            rows = await tx.fetch(
                f"SELECT {PROJECT_COLS} FROM projects WHERE id = $1 OR (id >= $2 AND id < $3) ORDER BY id",
                under,
                lo,
                hi,
            )
            return [_info(ProjectRow.of(r)) for r in rows]

        return await self._db.read(tx)

    async def set_quota(self, project: str, quota: Quota, *, actor: Principal | None = None) -> ProjectInfo:
        validate_project(project)
        quota = ledger.normalized(quota.validate())
        if not (actor is not None and project == actor.project == ROOT_PROJECT and actor.admin):
            _require_above(actor, project, "set the quota of")
        lo, hi = subtree_range(project)

        async def tx(tx: Tx) -> ProjectInfo:
            chain = await lock_chain(tx, ancestors(project))
            if len(chain) > 1:
                ledger.check_within(quota, chain[:-1], project)
            # Keep "no sub-project exceeds its parent's bound" true below this project too. Each
            # descendant's own quota already fits the ones between it and here, so checking them
            # all against this project's new bound is enough. (Creating or re-quoting one of them
            # locks this row, so none can slip in meanwhile.)
            new_bound = ledger.bound([*chain[:-1], _with_quota(chain[-1], quota)])
            top = await tx.fetch(
                f"SELECT {', '.join(f'max({c})' for c in QUOTA_COLS)} FROM projects"
                " WHERE id >= $1 AND id < $2",
                lo,
                hi,
            )
            for i, (highest, cap) in enumerate(zip(top[0], new_bound, strict=True)):
                if highest is not None and cap is not None and highest > cap:
                    name = ("sandboxes", "cpu_cores", "memory_mib", "storage_mib")[i]
                    raise InvalidRequest(
                        f"a sub-project of {project!r} has a {name} quota above the new bound:"
                        " lower the sub-projects' quotas first"
                    )
            await tx.execute(
                "UPDATE projects SET max_sandboxes = $1, max_cpu_m = $2, max_memory_mib = $3,"
                " max_storage_mib = $4 WHERE id = $5",
                *quota_limits(quota),
                project,
            )
            row = chain[-1]
            return ProjectInfo(project, row.parent, quota, row.usage, row.created_at)

        return await self._db.write(tx)

    async def delete_project(self, project: str, *, actor: Principal | None = None) -> None:
        validate_project(project)
        if project == ROOT_PROJECT:
            raise InvalidRequest("the root project cannot be deleted")
        _require_above(actor, project, "delete")
        lo, hi = subtree_range(project)

        async def tx(tx: Tx) -> None:
            chain = ancestors(project)
            # Lock the ancestors and the whole subtree in one id-ordered statement: a create
            # anywhere below waits, then finds its project gone.
            rows = await tx.fetch(
                f"SELECT {PROJECT_COLS} FROM projects WHERE id IN ({ledger.params(len(chain))})"
                f" OR (id >= ${len(chain) + 1} AND id < ${len(chain) + 2}) ORDER BY id{tx.lock_delete}",
                *chain,
                lo,
                hi,
            )
            mine = [ProjectRow.of(r) for r in rows if r[0] == project]
            if not mine:
                raise InvalidRequest(f"no project {project!r}")
            if mine[0].used_sandboxes:
                raise Conflict(
                    f"project {project!r} still holds {mine[0].used_sandboxes} sandbox reservations:"
                    " stop its sandboxes first"
                )
            where = "WHERE project = $1 OR (project >= $2 AND project < $3)"
            await tx.execute(f"DELETE FROM api_keys {where}", project, lo, hi)
            await tx.execute("DELETE FROM projects WHERE id = $1 OR (id >= $2 AND id < $3)", project, lo, hi)

        await self._db.write(tx)
        self._keys.evict(lambda p: in_subtree(p.project, project))

    # -- keys -------------------------------------------------------------------------------

    async def issue_key(
        self,
        project: str = ROOT_PROJECT,
        *,
        admin: bool = False,
        name: str = "",
        format: KeyFormat = "dsec",
        actor: Principal | None = None,
    ) -> str:
        validate_project(project)
        _require(actor, project, "issue keys for")
        if admin and actor is not None and not actor.admin:
            raise Forbidden("only an admin key may issue admin keys")
        key = new_key(format)

        async def tx(tx: Tx) -> None:
            # The share lock keeps the project from being deleted under the new key.
            if not await tx.fetch(f"SELECT id FROM projects WHERE id = $1{tx.lock_share}", project):
                raise InvalidRequest(f"no project {project!r}")
            await tx.execute(
                "INSERT INTO api_keys (digest, key_id, project, admin, name, created_at)"
                " VALUES ($1, $2, $3, $4, $5, $6)",
                key_digest(key),
                key_id_of(key),
                project,
                int(admin),
                name,
                time.time(),
            )

        await self._db.write(tx)
        return key

    async def authenticate(self, key: str | None) -> Principal:
        if not key:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        return await self._keys.get(key_digest(key))

    async def _lookup(self, digest: str) -> Principal:
        async def tx(tx: Tx) -> list[ledger.Row]:
            return await tx.fetch(
                "SELECT project, admin, key_id FROM api_keys WHERE digest = $1 AND revoked_at IS NULL", digest
            )

        rows = await self._db.read(tx)
        if not rows:
            raise Unauthorized("unknown API key (never issued, revoked, or its project deleted)")
        return Principal(project=rows[0][0], admin=bool(rows[0][1]), key_id=rows[0][2])

    async def is_valid(self, key: str) -> bool:
        try:
            await self.authenticate(key)
        except Unauthorized:
            return False
        return True

    async def revoke_key(self, key_or_id: str, *, actor: Principal | None = None) -> bool:
        """Revoke by the key itself or by its public ``key_id``; False if there was none live."""
        key_id = key_id_of(key_or_id) if is_key(key_or_id) else key_or_id

        async def tx(tx: Tx) -> bool:
            rows = await tx.fetch(
                f"SELECT project FROM api_keys WHERE key_id = $1 AND revoked_at IS NULL{tx.lock_update}",
                key_id,
            )
            if not rows:
                return False
            _require(actor, rows[0][0], "revoke keys of")
            await tx.execute("UPDATE api_keys SET revoked_at = $1 WHERE key_id = $2", time.time(), key_id)
            return True

        revoked = await self._db.write(tx)
        self._keys.evict(lambda p: p.key_id == key_id)
        return revoked

    async def list_keys(
        self, project: str = ROOT_PROJECT, *, actor: Principal | None = None
    ) -> list[KeyInfo]:
        """The keys of ``project`` and its sub-projects, revoked ones included."""
        validate_project(project)
        _require(actor, project, "list keys of")
        lo, hi = subtree_range(project)

        async def tx(tx: Tx) -> list[ledger.Row]:
            return await tx.fetch(
                "SELECT key_id, project, admin, name, created_at, revoked_at FROM api_keys"
                " WHERE project = $1 OR (project >= $2 AND project < $3) ORDER BY project, created_at",
                project,
                lo,
                hi,
            )

        return [
            KeyInfo(r[0], r[1], bool(r[2]), r[3], r[4], r[5] is not None) for r in await self._db.read(tx)
        ]

    # -- the usage ledger -------------------------------------------------------------------

    async def reserve(
        self,
        project: str,
        sandbox_id: str,
        cpu_cores: float,
        memory_mib: int,
        *,
        node: str | None = None,
        actor: Principal | None = None,
    ) -> Reservation:
        """Hold quota for one sandbox in every ancestor at once, or raise ``QuotaExceeded``.

        ``sandbox_id`` is the ledger key: the sandbox's ID, or any unique token for a create
        whose ID is not known yet (then ``bind`` it to the ID once the edge made it). ``node``
        defaults to the one the ID encodes; a token has none, so ``reconcile`` leaves it alone
        and ``expire_pending`` collects it if the apiserver died before binding it. Reserving
        the same ID again with the same amounts is a no-op (a retried request).
        """
        validate_project(project)
        _require(actor, project, "create sandboxes in")
        if not sandbox_id or len(sandbox_id) > 200:
            raise InvalidRequest("a reservation needs a sandbox ID (or token) of 1-200 characters")
        if cpu_cores < 0 or memory_mib < 0:
            raise InvalidRequest("a reservation's CPU and memory must be >= 0")
        node = node if node is not None else _node_of(sandbox_id)
        want = Want(project, sandbox_id, node, to_millicores(cpu_cores), memory_mib)
        return await self._reservations.reserve(want)

    async def _reserve_one(self, w: Want) -> Reservation:
        async def tx(tx: Tx) -> Reservation:
            return await ledger.reserve(tx, w.project, w.sandbox_id, w.node, w.cpu_m, w.memory_mib)

        return await self._db.write(tx)

    async def bind(self, reservation_id: str, sandbox_id: str, *, node: str | None = None) -> Reservation:
        """Move a pending reservation onto the sandbox the edge made (``SandboxNotFound`` if gone)."""
        node = node if node is not None else _node_of(sandbox_id)

        async def tx(tx: Tx) -> Reservation:
            return await ledger.bind(tx, reservation_id, sandbox_id, node)

        return await self._db.write(tx)

    async def release(self, sandbox_id: str) -> bool:
        """Give a sandbox's quota back; False if it held none (already released)."""
        return bool(await self.release_many([sandbox_id]))

    async def release_many(self, sandbox_ids: Collection[str]) -> list[str]:
        """Give many sandboxes' quota back in one transaction; returns those that held some."""
        ids = list(sandbox_ids)

        async def tx(tx: Tx) -> list[str]:
            return await ledger.release_many(tx, ids)

        return await self._db.write(tx)

    async def reconcile(self, live_ids: Collection[str], node: str, *, grace_s: float = 30.0) -> list[str]:
        """Release the rows of ``node`` whose sandbox is not in ``live_ids`` (what the edge reports).

        Rows reserved or bound less than ``grace_s`` ago are kept: the report may predate a
        create that has just finished. Returns the released IDs.
        """
        return await self.reconcile_nodes({node: live_ids}, grace_s=grace_s)

    async def reconcile_nodes(
        self, live: Mapping[str, Collection[str]], *, grace_s: float = 30.0
    ) -> list[str]:
        """:meth:`reconcile` for many nodes at once: one read and one write, not one per node."""
        if not live:
            return []
        cutoff = time.time() - grace_s
        nodes = list(live)

        async def find(tx: Tx) -> list[ledger.Row]:
            rows: list[ledger.Row] = []
            for at in range(0, len(nodes), 500):
                chunk = nodes[at : at + 500]
                among = ledger.params(len(chunk), 2)
                rows += await tx.fetch(
                    f"SELECT sandbox_id, node FROM ledger WHERE since < $1 AND node IN ({among})",
                    cutoff,
                    *chunk,
                )
            return rows

        keep = {node: set(ids) for node, ids in live.items()}
        stale = [r[0] for r in await self._db.read(find) if r[0] not in keep[r[1]]]
        if not stale:
            return []

        async def tx(tx: Tx) -> list[str]:
            # The condition again: a row bound or re-reserved since the read is not stale.
            return await ledger.release_many(tx, stale, " AND since < $1", cutoff)

        return await self._db.write(tx)

    async def expire_pending(self, older_than_s: float) -> list[str]:
        """Release reservations never bound to a sandbox (their apiserver died mid-create)."""
        return await self._release_where("node IS NULL AND since < $1", time.time() - older_than_s)

    async def _release_where(self, where: str, *args: object, keep: set[str] | None = None) -> list[str]:
        async def find(tx: Tx) -> list[ledger.Row]:
            return await tx.fetch(f"SELECT sandbox_id FROM ledger WHERE {where}", *args)

        stale = [r[0] for r in await self._db.read(find) if keep is None or r[0] not in keep]
        if not stale:
            return []

        async def tx(tx: Tx) -> list[str]:
            # The condition again: a row bound or re-reserved since the read is not stale.
            return await ledger.release_many(tx, stale, f" AND {where}", *args)

        return await self._db.write(tx)

    async def usage(self, project: str, *, actor: Principal | None = None) -> Usage:
        """What ``project`` and all its sub-projects hold now."""
        return (await self.get_project(project, actor=actor)).usage

    async def reservations(self, *, project: str | None = None, node: str | None = None) -> list[Reservation]:
        """Ledger rows, optionally of one project's subtree and/or one node (for operators)."""
        where, args = ["1 = 1"], list[str]()
        if project is not None:
            lo, hi = subtree_range(validate_project(project))
            where.append("(project = $1 OR (project >= $2 AND project < $3))")
            args += [project, lo, hi]
        if node is not None:
            where.append(f"node = ${len(args) + 1}")
            args.append(node)

        async def tx(tx: Tx) -> list[ledger.Row]:
            return await tx.fetch(
                "SELECT sandbox_id, project, node, cpu_m, memory_mib, since FROM ledger"
                f" WHERE {' AND '.join(where)} ORDER BY since, sandbox_id",
                *args,
            )

        return [ledger.reservation(r) for r in await self._db.read(tx)]

    async def recount(self) -> dict[str, tuple[Usage, Usage]]:
        """Rebuild the subtree counters from the ledger; returns what had drifted (nothing, normally)."""
        return await self._db.write(ledger.recount)

    # -- cluster membership -----------------------------------------------------------------

    async def register_node(
        self, node: str, url: str, claimed_epoch: int | None, *, heartbeat: bool = False
    ) -> NodeRecord:
        """Record an edge's registration or heartbeat; returns the epoch it must use."""
        registry.validate_registration(node, url, claimed_epoch)

        async def tx(tx: Tx) -> NodeRecord:
            return await registry.register(tx, node, url, claimed_epoch, heartbeat=heartbeat)

        return await self._db.write(tx)

    async def list_nodes(self) -> list[NodeRecord]:
        return await self._db.read(registry.list_nodes)

    async def forget_node(self, node: str) -> bool:
        """Drop a node that is gone for good (it registers anew, with a new epoch, if it returns)."""

        async def tx(tx: Tx) -> bool:
            return await registry.forget(tx, node)

        return await self._db.write(tx)


def _with_quota(row: ProjectRow, quota: Quota) -> ProjectRow:
    s, c, m, d = quota_limits(quota)
    return dataclasses.replace(row, max_sandboxes=s, max_cpu_m=c, max_memory_mib=m, max_storage_mib=d)
