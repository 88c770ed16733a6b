"""The conformance suite of the IAM seam: what the apiserver relies on from every IamStore.

A store's test module subclasses :class:`IamConformance` as ``Test<Name>Conformance`` and
provides three fixtures:

- ``iam``: a fresh, empty store (only the root project);
- ``reopen``: an async callable ``reopen(cache_ttl_s=5.0)`` opening another instance on the
  same data, as a second apiserver process would (the fixture closes what it opened);
- ``racer_argv``: the arguments that make ``python -m tests.iam.racer`` open the same store
  in a separate process.

The projects, quotas and keys half lives here; the ledger and concurrency half in
:mod:`tests.iam.conformance_ledger` and membership in :mod:`tests.iam.conformance_registry`,
mixed into the same class.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from dsec.iam.base import IamStore, Principal, Quota, Usage, can_access, key_id_of
from dsec.protocol.errors import Conflict, Forbidden, InvalidRequest, QuotaExceeded, Unauthorized
from tests.support import eventually

from .conformance_ledger import LedgerConformance, sid
from .conformance_registry import RegistryConformance

Reopen = Callable[..., Awaitable[IamStore]]


async def as_key(iam: IamStore, project: str, *, admin: bool = False) -> Principal:
    return await iam.authenticate(await iam.issue_key(project, admin=admin))


class IamConformance(LedgerConformance, RegistryConformance):
    # -- projects ---------------------------------------------------------------------------

    async def test_root_exists_and_is_unbounded(self, iam: IamStore) -> None:
        root = await iam.get_project("root")
        assert (root.id, root.parent, root.quota, root.usage) == ("root", None, Quota(), Usage())
        assert [p.id for p in await iam.list_projects()] == ["root"]

    async def test_projects_nest_to_any_depth(self, iam: IamStore) -> None:
        path = "root"
        for depth in range(20):
            made = await iam.create_project(path, f"d{depth}")
            assert made.parent == path
            path = made.id
        leaf = await iam.get_project(path)
        assert leaf.id.count("/") == 20 and leaf.parent == path.rsplit("/", 1)[0]
        subtree = [p.id for p in await iam.list_projects("root/d0")]
        assert len(subtree) == 20 and subtree[0] == "root/d0" and subtree[-1] == path
        assert [p.id for p in await iam.list_projects(path)] == [path]

    async def test_names_are_validated_and_unique(self, iam: IamStore) -> None:
        await iam.create_project("root", "team-a.1_x")
        with pytest.raises(Conflict):
            await iam.create_project("root", "team-a.1_x")
        for bad in ("", "Team", "a/b", "-x", "x" * 64, "é"):
            with pytest.raises(InvalidRequest):
                await iam.create_project("root", bad)
        with pytest.raises(InvalidRequest, match="no project"):
            await iam.create_project("root/missing", "x")
        with pytest.raises(InvalidRequest, match="no project"):
            await iam.get_project("root/missing")
        with pytest.raises(InvalidRequest):
            await iam.get_project("elsewhere/x")

    async def test_subtrees_do_not_mix_up_names_sharing_a_prefix(self, iam: IamStore) -> None:
        # '_' is a LIKE wildcard and '-' sorts before '/': neither may leak into root/a's subtree.
        for name in ("a", "a_b", "a-b", "ab", "a0"):
            await iam.create_project("root", name)
        await iam.create_project("root/a", "x")
        assert [p.id for p in await iam.list_projects("root/a")] == ["root/a", "root/a/x"]
        await iam.reserve("root/a_b", sid(), 1, 1)
        await iam.reserve("root/a0", sid(), 1, 1)
        await iam.reserve("root/a/x", sid(), 1, 1)
        assert (await iam.usage("root/a")).sandboxes == 1
        assert (await iam.usage("root")).sandboxes == 3
        a = await as_key(iam, "root/a")
        assert [can_access(a, p) for p in ("root/a", "root/a/x", "root/a_b", "root/ab", "root")] == [
            True,
            True,
            False,
            False,
            False,
        ]

    # -- quotas -----------------------------------------------------------------------------

    async def test_a_quota_bounds_the_whole_subtree(self, iam: IamStore) -> None:
        await iam.create_project("root", "team", Quota(sandboxes=3))
        await iam.create_project("root/team", "x")
        await iam.create_project("root/team", "y")
        await iam.create_project("root/team/y", "z")
        for project in ("root/team/x", "root/team/y/z", "root/team"):
            await iam.reserve(project, sid(), 1, 100)
        with pytest.raises(QuotaExceeded, match=r"'root/team'.*sandboxes") as info:
            await iam.reserve("root/team/y/z", sid(), 1, 100)
        assert info.value.reason == "sandboxes"
        assert (await iam.usage("root/team")).sandboxes == 3
        assert await iam.usage("root/team/y") == Usage(1, 1.0, 100)
        assert (await iam.usage("root")).sandboxes == 3
        await iam.reserve("root", sid(), 1, 100)  # root itself is unbounded

    async def test_cpu_and_memory_quotas_are_exact(self, iam: IamStore) -> None:
        await iam.create_project("root", "cpu", Quota(cpu_cores=1.0))
        for _ in range(10):
            await iam.reserve("root/cpu", sid(), 0.1, 1)
        with pytest.raises(QuotaExceeded, match=r"'root/cpu'.*cpu_cores") as info:
            await iam.reserve("root/cpu", sid(), 0.001, 1)
        assert info.value.reason == "cpu_cores"
        assert (await iam.usage("root/cpu")).cpu_cores == pytest.approx(1.0)
        await iam.create_project("root", "mem", Quota(memory_mib=1000))
        await iam.reserve("root/mem", sid(), 0, 512)
        await iam.reserve("root/mem", sid(), 0, 488)
        with pytest.raises(QuotaExceeded, match="memory_mib"):
            await iam.reserve("root/mem", sid(), 0, 1)
        await iam.create_project("root", "small", Quota(cpu_cores=2))
        with pytest.raises(QuotaExceeded, match="0 cores of 2 cores in use, this sandbox needs 3 cores"):
            await iam.reserve("root/small", sid(), 3, 1)

    async def test_the_nearest_exceeded_quota_is_named(self, iam: IamStore) -> None:
        await iam.create_project("root", "a", Quota(sandboxes=5))
        await iam.create_project("root/a", "b", Quota(sandboxes=2))
        await iam.create_project("root/a", "c")
        await iam.reserve("root/a/b", sid(), 1, 1)
        await iam.reserve("root/a/b", sid(), 1, 1)
        with pytest.raises(QuotaExceeded, match="'root/a/b'"):
            await iam.reserve("root/a/b", sid(), 1, 1)
        for _ in range(3):
            await iam.reserve("root/a/c", sid(), 1, 1)
        with pytest.raises(QuotaExceeded, match="'root/a' is at its sandboxes quota: 5 of 5"):
            await iam.reserve("root/a/c", sid(), 1, 1)

    async def test_a_refused_reserve_changes_nothing(self, iam: IamStore) -> None:
        await iam.create_project("root", "p", Quota(sandboxes=1))
        await iam.reserve("root/p", "first", 1, 1)
        with pytest.raises(QuotaExceeded):
            await iam.reserve("root/p", "second", 1, 1)
        assert [r.sandbox_id for r in await iam.reservations()] == ["first"]
        assert (await iam.usage("root")).sandboxes == 1
        await iam.release("first")
        await iam.reserve("root/p", "second", 1, 1)
        assert await iam.recount() == {}

    async def test_sub_project_quotas_are_capped_by_the_parent_bound(self, iam: IamStore) -> None:
        await iam.create_project("root", "p", Quota(sandboxes=10, cpu_cores=4, memory_mib=4096))
        with pytest.raises(InvalidRequest, match=r"sandboxes.*exceeds"):
            await iam.create_project("root/p", "big", Quota(sandboxes=11))
        with pytest.raises(InvalidRequest, match="cpu_cores"):
            await iam.create_project("root/p", "big", Quota(cpu_cores=4.5))
        await iam.create_project("root/p", "equal", Quota(sandboxes=10, cpu_cores=4, memory_mib=4096))
        await iam.create_project("root/p", "open")  # no quota of its own: p's bound applies
        with pytest.raises(InvalidRequest, match="memory_mib"):
            await iam.create_project("root/p/open", "g", Quota(memory_mib=5000))
        made = await iam.create_project("root/p/open", "g", Quota(sandboxes=3, memory_mib=100))
        assert made.quota == Quota(sandboxes=3, memory_mib=100)
        with pytest.raises(InvalidRequest):
            await iam.create_project("root", "neg", Quota(sandboxes=-1))

    async def test_storage_quota_is_kept_bounded_by_the_parent_and_reserves_nothing(
        self, iam: IamStore
    ) -> None:
        made = await iam.create_project("root", "st", Quota(storage_mib=100))
        assert made.quota == Quota(storage_mib=100)
        assert (await iam.get_project("root/st")).quota.storage_mib == 100
        with pytest.raises(InvalidRequest, match=r"storage_mib.*exceeds"):
            await iam.create_project("root/st", "big", Quota(storage_mib=101))
        await iam.create_project("root/st", "c", Quota(storage_mib=60))
        with pytest.raises(InvalidRequest, match="storage_mib"):
            await iam.set_quota("root/st", Quota(storage_mib=50))  # below its sub-project's
        updated = await iam.set_quota("root/st/c", Quota(sandboxes=2, storage_mib=10))
        assert updated.quota == Quota(sandboxes=2, storage_mib=10)
        assert [p.quota.storage_mib for p in await iam.list_projects("root/st")] == [100, 10]
        # Storage is the layer store's to count: a sandbox reserves none of it, even at 0 MiB.
        await iam.set_quota("root/st/c", Quota(storage_mib=0))
        one = sid()
        await iam.reserve("root/st/c", one, 1, 64)
        usage = await iam.usage("root/st")
        assert (usage.sandboxes, usage.storage_bytes) == (1, None)
        await iam.release(one)
        with pytest.raises(InvalidRequest, match="storage_mib"):
            await iam.set_quota("root/st/c", Quota(storage_mib=-1))

    async def test_set_quota_keeps_every_sub_project_within_its_parent(self, iam: IamStore) -> None:
        await iam.create_project("root", "p", Quota(sandboxes=10))
        await iam.create_project("root/p", "c")
        await iam.create_project("root/p/c", "g", Quota(sandboxes=8))
        with pytest.raises(InvalidRequest, match="exceeds"):
            await iam.set_quota("root/p/c", Quota(sandboxes=12))
        # The grandchild sits under a child without a quota: it is bounded by p all the same.
        with pytest.raises(InvalidRequest, match="sub-project"):
            await iam.set_quota("root/p", Quota(sandboxes=5))
        await iam.set_quota("root/p/c/g", Quota(sandboxes=2))
        for _ in range(2):
            await iam.reserve("root/p/c/g", sid(), 1, 1)
        updated = await iam.set_quota("root/p/c/g", Quota(sandboxes=1))  # below what is in use: allowed
        assert updated.quota.sandboxes == 1 and updated.usage.sandboxes == 2
        await iam.set_quota("root/p", Quota(sandboxes=1))
        with pytest.raises(QuotaExceeded, match="'root/p'"):
            await iam.reserve("root/p", sid(), 1, 1)
        assert (await iam.set_quota("root/p", Quota())).quota == Quota()
        await iam.reserve("root/p", sid(), 1, 1)

    # -- keys and scoping -------------------------------------------------------------------

    async def test_keys_authenticate_to_their_project(self, iam: IamStore) -> None:
        await iam.create_project("root", "team")
        key = await iam.issue_key("root/team", name="ci")
        assert key.startswith("dsec_") and len(key) > 40
        who = await iam.authenticate(key)
        assert who == Principal("root/team", admin=False, key_id=key_id_of(key))
        assert (await iam.authenticate(await iam.issue_key(admin=True))).admin
        assert await iam.is_valid(key) and not await iam.is_valid("dsec_" + "0" * 48)
        for bad in (None, "", "dsec_nope"):
            with pytest.raises(Unauthorized):
                await iam.authenticate(bad)
        with pytest.raises(InvalidRequest, match="no project"):
            await iam.issue_key("root/missing")
        [info] = await iam.list_keys("root/team")
        assert (info.key_id, info.project, info.name, info.revoked) == (
            key_id_of(key),
            "root/team",
            "ci",
            False,
        )
        assert key not in repr(await iam.list_keys())

    async def test_a_key_sees_and_touches_only_its_subtree(self, iam: IamStore) -> None:
        for parent, name in (("root", "a"), ("root/a", "sub"), ("root", "b")):
            await iam.create_project(parent, name)
        a = await as_key(iam, "root/a")
        await iam.get_project("root/a/sub", actor=a)
        assert [p.id for p in await iam.list_projects("root/a", actor=a)] == ["root/a", "root/a/sub"]
        await iam.reserve("root/a/sub", sid(), 1, 1, actor=a)
        assert (await iam.usage("root/a", actor=a)).sandboxes == 1
        for call in (
            iam.get_project("root/b", actor=a),
            iam.get_project("root", actor=a),
            iam.list_projects(actor=a),
            iam.usage("root/b", actor=a),
            iam.reserve("root/b", sid(), 1, 1, actor=a),
            iam.list_keys("root", actor=a),
        ):
            with pytest.raises(Forbidden):
                await call
        assert not can_access(a, "root/b") and can_access(await as_key(iam, "root"), "root/a/sub")

    async def test_a_project_creates_bounded_sub_projects_and_keys_for_them(self, iam: IamStore) -> None:
        await iam.create_project("root", "team", Quota(sandboxes=4))
        team = await as_key(iam, "root/team")
        rollout = await iam.create_project("root/team", "r1", Quota(sandboxes=1), actor=team)
        with pytest.raises(InvalidRequest, match="exceeds"):
            await iam.create_project("root/team", "r2", Quota(sandboxes=5), actor=team)
        with pytest.raises(Forbidden):
            await iam.create_project("root", "mine", actor=team)
        key = await iam.issue_key(rollout.id, actor=team)
        r1 = await iam.authenticate(key)
        assert r1.project == "root/team/r1"
        await iam.reserve("root/team/r1", sid(), 1, 1, actor=r1)
        with pytest.raises(QuotaExceeded, match="'root/team/r1'"):
            await iam.reserve("root/team/r1", sid(), 1, 1, actor=r1)
        for call in (
            iam.issue_key("root/team", actor=r1),
            iam.issue_key("root", actor=team),
            iam.issue_key("root/team", admin=True, actor=team),
            iam.set_quota("root/team/r1", Quota(sandboxes=4), actor=r1),  # raising its own limit
            iam.set_quota("root/team", Quota(sandboxes=100), actor=team),
            iam.delete_project("root/team", actor=team),
        ):
            with pytest.raises(Forbidden):
                await call
        admin = await as_key(iam, "root", admin=True)
        await iam.issue_key("root/team", admin=True, actor=admin)
        await iam.set_quota("root/team/r1", Quota(sandboxes=2), actor=team)
        await iam.set_quota("root", Quota(sandboxes=1000), actor=admin)
        with pytest.raises(Forbidden):
            await iam.set_quota("root", Quota(), actor=await as_key(iam, "root"))

    async def test_revocation(self, iam: IamStore) -> None:
        await iam.create_project("root", "a")
        await iam.create_project("root", "b")
        key, other = await iam.issue_key("root/a"), await iam.issue_key("root/b")
        assert (await iam.authenticate(key)).project == "root/a"  # now cached
        a = await iam.authenticate(other)
        with pytest.raises(Forbidden):
            await iam.revoke_key(key, actor=a)
        assert await iam.revoke_key(key)
        with pytest.raises(Unauthorized):
            await iam.authenticate(key)  # the revoking instance forgets it at once
        assert not await iam.revoke_key(key)
        assert await iam.revoke_key(key_id_of(other))
        assert not await iam.is_valid(other)
        assert [k.revoked for k in await iam.list_keys()] == [True, True]

    async def test_e2b_format_keys_are_keys_like_any_other(self, iam: IamStore) -> None:
        await iam.create_project("root", "e2b")
        key = await iam.issue_key("root/e2b", format="e2b")
        assert re.fullmatch(r"e2b_[0-9a-f]+", key), "what E2B's SDKs accept"
        assert await iam.authenticate(key) == Principal("root/e2b", admin=False, key_id=key_id_of(key))
        assert await iam.revoke_key(key)  # by the key itself
        assert not await iam.is_valid(key)
        again = await iam.issue_key("root/e2b", format="e2b")
        assert await iam.revoke_key(key_id_of(again))  # by its id
        assert not await iam.is_valid(again)

    async def test_revocation_reaches_other_instances_within_the_cache_ttl(
        self, iam: IamStore, reopen: Reopen
    ) -> None:
        key = await iam.issue_key()
        other = await reopen(cache_ttl_s=0.2)
        assert await other.is_valid(key)
        await iam.revoke_key(key)
        await eventually(lambda: _not(other.is_valid(key)), "the revocation to reach the other instance")

    async def test_authenticate_is_served_from_the_cache(self, iam: IamStore, reopen: Reopen) -> None:
        key = await iam.issue_key()
        fresh = await reopen()
        reads = _count_reads(fresh)
        await asyncio.gather(*(fresh.authenticate(key) for _ in range(20)))  # misses share one lookup
        assert reads() == 1
        for _ in range(100):
            await fresh.authenticate(key)
        assert reads() == 1

    async def test_deleting_a_project(self, iam: IamStore) -> None:
        await iam.create_project("root", "gone")
        await iam.create_project("root/gone", "child")
        key = await iam.issue_key("root/gone/child")
        assert await iam.is_valid(key)
        await iam.reserve("root/gone/child", "held", 1, 1)
        with pytest.raises(Conflict, match="reservations"):
            await iam.delete_project("root/gone")
        await iam.release("held")
        await iam.delete_project("root/gone")
        assert not await iam.is_valid(key)
        assert [p.id for p in await iam.list_projects()] == ["root"]
        with pytest.raises(InvalidRequest, match="no project"):
            await iam.reserve("root/gone/child", sid(), 1, 1)
        assert await iam.reservations() == []
        with pytest.raises(InvalidRequest):
            await iam.delete_project("root")
        await iam.create_project("root", "gone")  # the name is free again


async def _not(value: Awaitable[bool]) -> bool:
    return not await value


def _count_reads(store: IamStore) -> Callable[[], int]:
    """Count the store's database reads (both stores are SqlIamStore: one ``_db`` driver)."""
    db: Any = store._db  # type: ignore[attr-defined]
    original, calls = db.read, [0]

    async def read(fn: Any) -> Any:
        calls[0] += 1
        return await original(fn)

    db.read = read
    return lambda: calls[0]
