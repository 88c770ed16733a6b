"""Conformance for cluster membership (iam/registry.py), mixed into :class:`IamConformance`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from dsec.iam.base import IamStore
from dsec.iam.registry import granted_epoch
from dsec.protocol.errors import InvalidRequest

Reopen = Callable[..., Awaitable[IamStore]]


class RegistryConformance:
    def test_the_epoch_rule(self) -> None:
        assert granted_epoch(None, None) == 1, "a new node starts at 1"
        assert granted_epoch(None, 7) == 7, "a node with state and no record keeps its epoch"
        assert granted_epoch(7, 7) == 7, "a restart with its journal keeps its epoch"
        assert granted_epoch(7, None) == 8, "a node that lost its state gets a new epoch"
        assert granted_epoch(7, 3) == 8, "an old journal does not resurrect an old epoch"
        assert granted_epoch(7, 9) == 9, "the journal wins over an older record"

    async def test_a_node_keeps_its_epoch_while_its_state_lives(self, iam: IamStore) -> None:
        first = await iam.register_node("n1", "http://10.0.0.1:8643", None)
        again = await iam.register_node("n1", "http://10.0.0.9:8643", first.epoch)  # moved address
        assert again.epoch == first.epoch and again.registered_at == first.registered_at
        assert again.last_seen >= first.last_seen
        (listed,) = await iam.list_nodes()
        assert (listed.node, listed.url, listed.epoch) == ("n1", "http://10.0.0.9:8643", first.epoch)

    async def test_a_node_without_its_state_gets_a_new_epoch(self, iam: IamStore) -> None:
        first = await iam.register_node("n1", "http://h:1", None)
        fresh = await iam.register_node("n1", "http://h:1", None)
        assert fresh.epoch > first.epoch
        stale = await iam.register_node("n1", "http://h:1", first.epoch)
        assert stale.epoch > fresh.epoch, "an epoch once replaced never comes back"

    async def test_every_apiserver_sees_the_same_members(self, iam: IamStore, reopen: Reopen) -> None:
        other = await reopen()
        await iam.register_node("b", "http://h:2", None)
        await other.register_node("a", "http://h:1", None)
        assert [n.node for n in await other.list_nodes()] == ["a", "b"]
        assert [n.node for n in await iam.list_nodes()] == ["a", "b"]
        assert await other.forget_node("a") and not await iam.forget_node("a")
        assert [n.node for n in await iam.list_nodes()] == ["b"]

    async def test_racing_registrations_of_a_new_node_agree(self, iam: IamStore, reopen: Reopen) -> None:
        other = await reopen()
        got = await asyncio.gather(*(s.register_node("n", "http://h:1", 5) for s in (iam, other, iam, other)))
        assert {r.epoch for r in got} == {5}
        assert len(await iam.list_nodes()) == 1

    @pytest.mark.parametrize(
        ("node", "url", "epoch"),
        [("Bad_Name", "http://h:1", None), ("n", "ftp://h", None), ("n", "", None), ("n", "http://h:1", 0)],
    )
    async def test_registrations_are_validated(
        self, iam: IamStore, node: str, url: str, epoch: int | None
    ) -> None:
        with pytest.raises(InvalidRequest):
            await iam.register_node(node, url, epoch)
        assert await iam.list_nodes() == []

    async def test_a_replaced_edge_cannot_take_its_name_back(self, iam: IamStore) -> None:
        old = await iam.register_node("n", "http://old:1", None)
        new = await iam.register_node("n", "http://new:1", None)  # same name, no state: replaces it
        beat = await iam.register_node("n", "http://old:1", old.epoch, heartbeat=True)
        assert beat.epoch == new.epoch and beat.url == "http://new:1", "the old edge learns it was replaced"
        (listed,) = await iam.list_nodes()
        assert (listed.epoch, listed.url) == (new.epoch, "http://new:1"), "and changes nothing"
        ok = await iam.register_node("n", "http://new:1", new.epoch, heartbeat=True)
        assert ok.epoch == new.epoch and ok.last_seen >= new.last_seen
