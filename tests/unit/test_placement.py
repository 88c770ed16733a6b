"""Placement: filter the nodes that can take a sandbox, then the less loaded of k random picks."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from dsec.placement.placement import Placement, Watcher
from dsec.protocol.errors import CapacityExhausted, InvalidRequest
from dsec.protocol.models import Hardware
from tests.support import eventually


class FakeNode:
    def __init__(
        self,
        running: int = 0,
        capacity: int = 10,
        creating: int = 0,
        backends: tuple[str, ...] = ("container",),
        hardware: dict[str, Any] | None = None,
        capabilities: dict[str, Any] | None = None,
    ):
        self.running = running
        self.capacity = capacity
        self.creating = creating
        self.backends = list(backends)
        self.hardware = hardware or {"arch": "x86_64", "gpus": 0, "labels": {}}
        self.capabilities = capabilities or {}
        self.down = False
        self.polls = 0

    async def stats(self) -> dict[str, Any]:
        self.polls += 1
        if self.down:
            raise ConnectionError("edge unreachable")
        return {
            "running": self.running,
            "creating": self.creating,
            "capacity": self.capacity,
            "backends": self.backends,
            "hardware": self.hardware,
            "capabilities": self.capabilities,
        }


async def placement(nodes: dict[str, FakeNode], k: int = 2) -> Placement:
    watcher = Watcher(dict(nodes))
    await watcher.poll()
    return Placement(watcher, k=k)


async def test_power_of_two_picks_the_less_loaded_of_two_nodes() -> None:
    p = await placement({"busy": FakeNode(running=8), "idle": FakeNode(running=1)})
    assert {await p.choose("container") for _ in range(50)} == {"idle"}


async def test_load_is_relative_to_capacity() -> None:
    # 5 of 100 is less loaded than 2 of 4.
    p = await placement({"big": FakeNode(running=5, capacity=100), "small": FakeNode(running=2, capacity=4)})
    assert {await p.choose("container") for _ in range(50)} == {"big"}


async def test_the_most_loaded_node_is_never_picked_with_k_2() -> None:
    nodes = {f"n{i}": FakeNode(running=i) for i in range(5)}
    p = await placement(nodes)
    picks = Counter([await p.choose("container") for _ in range(400)])
    assert "n4" not in picks
    assert picks["n0"] > picks["n3"], "lighter nodes win more often"
    assert len(picks) >= 3, "the random sample spreads load rather than herding on one node"


async def test_creates_placed_since_the_last_poll_count_against_a_node() -> None:
    p = await placement({"a": FakeNode(running=1), "b": FakeNode(running=2)})
    with p.reserve("a"), p.reserve("a"):
        assert await p.choose("container") == "b"  # a: 1 running + 2 placed
    assert await p.choose("container") == "b", "an answered create is in no snapshot until a poll"
    await p.watcher.poll()  # the poll counts what the edge runs (here, as if both failed later)
    assert await p.choose("container") == "a"


async def test_creates_in_progress_count_as_load() -> None:
    # Another apiserver's burst is visible only as "creating" in the watcher's snapshot.
    p = await placement({"bursting": FakeNode(running=1, creating=5), "steady": FakeNode(running=2)})
    assert {await p.choose("container") for _ in range(20)} == {"steady"}


async def test_a_reservation_is_released_when_the_create_fails() -> None:
    p = await placement({"a": FakeNode()})
    with pytest.raises(RuntimeError), p.reserve("a"):
        raise RuntimeError("edge rejected")
    assert p.in_flight["a"] == 0


async def test_full_unhealthy_excluded_and_wrong_backend_nodes_are_filtered() -> None:
    nodes = {
        "full": FakeNode(running=3, capacity=3),
        "almost": FakeNode(running=2, creating=1, capacity=3),
        "down": FakeNode(),
        "vm-only": FakeNode(backends=("vm",)),
        "tried": FakeNode(),
        "ok": FakeNode(running=9, capacity=10),
    }
    nodes["down"].down = True
    p = await placement(nodes)
    assert p.watcher.snapshot["down"]["healthy"] is False
    assert p.candidates("container", {"tried"}) == ["ok"]
    assert {await p.choose("container", {"tried"}) for _ in range(20)} == {"ok"}
    assert p.candidates("vm", set()) == ["vm-only"]


async def test_only_nodes_with_the_hardware_asked_for_are_chosen() -> None:
    nodes = {
        "plain": FakeNode(),
        "gpu": FakeNode(running=9, hardware={"arch": "x86_64", "gpus": 4, "labels": {"zone": "a"}}),
        "arm": FakeNode(hardware={"arch": "aarch64", "gpus": 0, "labels": {"zone": "a"}}),
    }
    p = await placement(nodes)
    assert {await p.choose("container", need=Hardware(gpus=1)) for _ in range(20)} == {"gpu"}
    assert {await p.choose("container", need=Hardware(arch="aarch64")) for _ in range(20)} == {"arm"}
    zone_a = {await p.choose("container", need=Hardware(node_labels={"zone": "a"})) for _ in range(40)}
    assert zone_a == {"arm"}, "the less loaded of the two zone-a nodes"
    with pytest.raises(CapacityExhausted, match="gpus"):
        await p.choose("container", need=Hardware(gpus=8))
    assert {await p.choose("container") for _ in range(40)} == {"plain", "arm"}, "no need: any node"


async def test_a_choice_looks_at_k_nodes_not_the_whole_cluster() -> None:
    nodes = {f"n{i}": FakeNode(capacity=1000) for i in range(200)}
    p = await placement(nodes, k=2)
    looked: list[str] = []
    room = p._has_room
    p._has_room = lambda name: looked.append(name) or room(name)  # type: ignore[method-assign]
    await p.choose("container")
    assert len(looked) == 2


async def test_no_eligible_node_is_capacity_exhausted() -> None:
    p = await placement({"full": FakeNode(running=1, capacity=1)})
    with pytest.raises(CapacityExhausted):
        await p.choose("container")
    p = await placement({"a": FakeNode()})
    with pytest.raises(CapacityExhausted):
        await p.choose("container", {"a"})
    with pytest.raises(CapacityExhausted):
        await (await placement({})).choose("container")


async def test_placed_creates_fill_a_node_until_the_edge_reports_them() -> None:
    node = FakeNode(running=0, capacity=2)
    p = await placement({"a": node})
    with p.reserve("a"), p.reserve("a"):
        assert p.candidates("container", set()) == [], "full by this apiserver's own placements"
        node.creating = 2  # what the edge reports once the creates reach it
        with pytest.raises(CapacityExhausted):
            await p.choose("container")  # the fresh poll agrees


async def test_the_watcher_polls_at_start_and_then_periodically() -> None:
    node = FakeNode(running=1)
    watcher = Watcher({"a": node}, interval_s=0.01)
    await watcher.start()
    try:
        assert watcher.snapshot["a"]["running"] == 1, "start() polls before returning"
        node.running = 7
        await eventually(lambda: watcher.snapshot["a"]["running"] == 7, "the watcher to see the new load")
        node.down = True
        await eventually(lambda: not watcher.snapshot["a"]["healthy"], "the watcher to mark the node down")
    finally:
        await watcher.close()
    polls = node.polls
    await asyncio.sleep(0.05)  # five intervals: a negative can only be checked over time
    assert node.polls == polls, "close() stops polling"


async def test_a_capability_asked_for_picks_only_nodes_that_report_it() -> None:
    plain = FakeNode(capabilities={"container": {"gvisor": False}})
    gv = FakeNode(running=5, capabilities={"container": {"gvisor": True}})
    p = await placement({"plain": plain, "gvisor": gv})
    assert {await p.choose("container", features=("gvisor",)) for _ in range(20)} == {"gvisor"}
    assert await p.choose("container") == "plain", "without the feature, load decides"


async def test_a_capability_no_node_has_is_an_invalid_request_not_a_full_cluster() -> None:
    p = await placement({"a": FakeNode(), "b": FakeNode()})
    with pytest.raises(InvalidRequest, match="gvisor"):
        await p.choose("container", features=("gvisor",))
