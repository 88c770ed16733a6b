"""The IAM seam: projects, quotas, API keys and the usage ledger, as one async Protocol.

A project's ID is its path from the root, ``root/team/rollout-17``. Paths make the two
questions asked on every request answerable without a lookup: "may this key touch that
project?" is a prefix test (:func:`can_access`), and "which rows must a create lock?" is the
list of the path's prefixes (:func:`ancestors`), in an order that is the same for every
transaction (so lock order never deadlocks). Projects cannot be moved; that is the price.

Quotas are per project and bound the whole subtree: the usage of a project is its own
sandboxes plus every descendant's, and a create must fit the quota of every ancestor. A
quota field of ``None`` means "only the ancestors' bounds apply". A sub-project's quotas may
never exceed the bound its parent is under, so a project can hand out bounded sub-projects
(an agent harness: one per rollout) without being able to raise its own limits.

Two stores implement :class:`IamStore`: ``SqliteIamStore`` (embedded) and
``PostgresIamStore`` (cluster); both share the logic in :mod:`dsec.iam.sql` and pass one
conformance suite (tests/iam/conformance.py).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from dsec.protocol.errors import InvalidRequest

if TYPE_CHECKING:
    from dsec.iam.registry import NodeRecord

ROOT_PROJECT = "root"
KEY_PREFIX = "dsec_"
# Keys the official E2B SDKs accept (they check ``^e2b_[0-9a-f]+$``): the same keys otherwise.
E2B_KEY_PREFIX = "e2b_"
KEY_PREFIXES = {"dsec": KEY_PREFIX, "e2b": E2B_KEY_PREFIX}
KeyFormat = Literal["dsec", "e2b"]

# One path segment. No '/', and nothing a shell, URL or label value would need quoting for.
_NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9_.-]{0,62})$")
_MAX_DEPTH = 64  # deep enough for any harness; bounds the rows one create locks


@dataclass(frozen=True)
class Principal:
    """Who a request acts as: the project its API key belongs to, and whether it is an admin key.

    ``admin`` gates cluster-wide operations (layers, nodes); it does not widen the project
    scope, which is always the key's project and its sub-projects.
    """

    project: str
    admin: bool
    key_id: str = ""


@dataclass(frozen=True)
class Quota:
    """Upper bounds for a project's subtree; ``None``: only the ancestors' bounds apply."""

    sandboxes: int | None = None
    cpu_cores: float | None = None
    memory_mib: int | None = None
    # Bytes of layer blobs the subtree owns, in MiB: enforced by the layer store at import and
    # commit (dsec.images.storage_quota), not by the ledger.
    storage_mib: int | None = None

    def validate(self) -> Quota:
        for name, value in (
            ("sandboxes", self.sandboxes),
            ("cpu_cores", self.cpu_cores),
            ("memory_mib", self.memory_mib),
            ("storage_mib", self.storage_mib),
        ):
            if value is not None and value < 0:
                raise InvalidRequest(f"quota {name} must be >= 0 or unset, got {value}")
        return self


@dataclass(frozen=True)
class Usage:
    """What a project's subtree holds right now (reserved and not yet released)."""

    sandboxes: int = 0
    cpu_cores: float = 0.0
    memory_mib: int = 0
    # Bytes of layer blobs the subtree owns: the layer store knows them, the IAM store does not
    # (None from it); the apiserver's project routes fill them in.
    storage_bytes: int | None = None


@dataclass(frozen=True)
class ProjectInfo:
    id: str
    parent: str | None
    quota: Quota
    usage: Usage
    created_at: float


@dataclass(frozen=True)
class KeyInfo:
    """An API key as listed: its public ``key_id``, never the key itself."""

    key_id: str
    project: str
    admin: bool
    name: str
    created_at: float
    revoked: bool


@dataclass(frozen=True)
class Reservation:
    """One ledger row: a sandbox (or a pending create) holding part of its project's quota."""

    sandbox_id: str
    project: str
    node: str | None
    cpu_cores: float
    memory_mib: int
    since: float


# -- paths -----------------------------------------------------------------------------------


def ancestors(project: str) -> list[str]:
    """``root/a/b`` -> ``[root, root/a, root/a/b]``: the rows a create in ``project`` locks.

    Sorted as strings this is also the lock order: every prefix sorts before its extensions,
    so all transactions take overlapping rows in the same order.
    """
    parts = project.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def parent_of(project: str) -> str | None:
    head, sep, _ = project.rpartition("/")
    return head if sep else None


def validate_project(project: str) -> str:
    parts = project.split("/")
    if parts[0] != ROOT_PROJECT or len(parts) > _MAX_DEPTH or not all(_NAME_RE.fullmatch(p) for p in parts):
        raise InvalidRequest(
            f"invalid project {project!r}: a path from 'root' of up to {_MAX_DEPTH} names,"
            " each 1-63 of a-z, 0-9, '_', '.', '-' starting with a letter or digit"
        )
    return project


def child_path(parent: str, name: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise InvalidRequest(f"invalid project name {name!r}: 1-63 of a-z, 0-9, '_', '.', '-'")
    return validate_project(f"{validate_project(parent)}/{name}")


def in_subtree(project: str, top: str) -> bool:
    """Whether ``project`` is ``top`` or below it (``root/ab`` is not below ``root/a``)."""
    return project == top or project.startswith(top + "/")


def can_access(principal: Principal, project: str) -> bool:
    """Whether a key may see and touch ``project`` (its own project, or one below it)."""
    return in_subtree(project, principal.project)


def subtree_range(top: str) -> tuple[str, str]:
    """Bounds ``(lo, hi)`` with ``lo <= id < hi`` exactly for the strict descendants of ``top``.

    '0' is the character after '/' in byte order: a range the primary-key index answers,
    where ``LIKE 'top/%'`` would treat the '_' allowed in names as a wildcard. (PostgreSQL
    columns are declared ``COLLATE "C"`` so that its order is byte order too.)
    """
    return top + "/", top + "0"


# -- keys ------------------------------------------------------------------------------------


def new_key(format: KeyFormat = "dsec") -> str:
    return KEY_PREFIXES[format] + secrets.token_hex(24)


def is_key(key_or_id: str) -> bool:
    """A key itself rather than its public ``key_id`` (16 hex digits, no prefix)."""
    return key_or_id.startswith(tuple(KEY_PREFIXES.values()))


def key_digest(key: str) -> str:
    """What is stored: a leaked database does not leak usable keys."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key: str) -> str:
    """A key's public name (a digest prefix): what listings show and revocation takes."""
    return key_digest(key)[:16]


# -- units -----------------------------------------------------------------------------------


def to_millicores(cpu_cores: float) -> int:
    """CPU is summed as integer millicores: 10 x 0.1 cores must fit a 1.0 quota exactly."""
    return round(cpu_cores * 1000)


def to_cores(millicores: int) -> float:
    return millicores / 1000


# -- the seam --------------------------------------------------------------------------------


@runtime_checkable
class IamStore(Protocol):
    """Projects, quotas, keys and the usage ledger.

    Methods taking ``actor`` authorize the call as that principal (``Forbidden`` otherwise);
    ``actor=None`` is a trusted internal call (bootstrap, the apiserver's own bookkeeping).
    The ledger methods without ``actor`` are for the apiserver only, after it has checked the
    caller may touch the sandbox (:func:`can_access` on the sandbox's project).
    """

    # projects
    async def create_project(
        self, parent: str, name: str, quota: Quota | None = None, *, actor: Principal | None = None
    ) -> ProjectInfo: ...

    async def get_project(self, project: str, *, actor: Principal | None = None) -> ProjectInfo: ...

    async def list_projects(
        self, under: str = ROOT_PROJECT, *, actor: Principal | None = None
    ) -> list[ProjectInfo]:
        """``under`` and all its descendants, parents before children."""
        ...

    async def set_quota(
        self, project: str, quota: Quota, *, actor: Principal | None = None
    ) -> ProjectInfo: ...

    async def delete_project(self, project: str, *, actor: Principal | None = None) -> None:
        """Delete a project, its sub-projects and their keys; refused while anything is reserved."""
        ...

    # keys
    async def issue_key(
        self,
        project: str = ROOT_PROJECT,
        *,
        admin: bool = False,
        name: str = "",
        format: KeyFormat = "dsec",
        actor: Principal | None = None,
    ) -> str:
        """``format``: ``dsec`` (``dsec_<hex>``) or ``e2b`` (``e2b_<hex>``, for E2B's SDKs)."""
        ...

    async def authenticate(self, key: str | None) -> Principal:
        """The key's principal, from an in-process cache when it is fresh (no database trip)."""
        ...

    async def is_valid(self, key: str) -> bool: ...

    async def revoke_key(self, key_or_id: str, *, actor: Principal | None = None) -> bool: ...

    async def list_keys(
        self, project: str = ROOT_PROJECT, *, actor: Principal | None = None
    ) -> list[KeyInfo]: ...

    # the usage ledger
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
        """Hold quota for one sandbox in every ancestor at once, or raise ``QuotaExceeded``."""
        ...

    async def bind(self, reservation_id: str, sandbox_id: str, *, node: str | None = None) -> Reservation: ...

    async def release(self, sandbox_id: str) -> bool: ...

    async def release_many(self, sandbox_ids: Collection[str]) -> list[str]: ...

    async def reconcile(
        self, live_ids: Collection[str], node: str, *, grace_s: float = 30.0
    ) -> list[str]: ...

    async def expire_pending(self, older_than_s: float) -> list[str]: ...

    async def usage(self, project: str, *, actor: Principal | None = None) -> Usage: ...

    async def reservations(
        self, *, project: str | None = None, node: str | None = None
    ) -> list[Reservation]: ...

    async def reconcile_nodes(
        self, live: Mapping[str, Collection[str]], *, grace_s: float = 30.0
    ) -> list[str]: ...

    async def recount(self) -> dict[str, tuple[Usage, Usage]]: ...

    # -- cluster membership (iam/registry.py): kept here because every apiserver shares it --

    async def register_node(
        self, node: str, url: str, claimed_epoch: int | None, *, heartbeat: bool = False
    ) -> NodeRecord: ...

    async def list_nodes(self) -> list[NodeRecord]: ...

    async def forget_node(self, node: str) -> bool: ...

    async def close(self) -> None: ...
