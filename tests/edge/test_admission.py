"""Admission by use: overcommitted limits, room made by pausing the idlest, pressure relief.

The node's memory is simulated (the edge reads it through ``total_memory`` and
``available_memory``); sandboxes are the fake backend's host processes."""

from __future__ import annotations

import pytest

from dsec.protocol.errors import CapacityExhausted
from dsec.protocol.models import ContainerSpec, SandboxState, ShellRequest
from tests.edge.conftest import EdgeEnv
from tests.unit.conftest import TINY

GiB = 1 << 30


def small_node(env: EdgeEnv, *, ratio: float = 2.0, min_idle_s: float = 0.0) -> None:
    env.edge.admission.total_memory = lambda: GiB  # type: ignore[method-assign]
    env.edge.config.memory_overcommit = ratio
    env.edge.config.pressure_min_idle_s = min_idle_s


def spec(mb: int = 512, cores: float = 1.0) -> ContainerSpec:
    return ContainerSpec(image=TINY, memory_limit_mb=mb, cpu_cores_limit=cores)


async def test_limits_are_overcommitted_up_to_the_ratio(edge_env: EdgeEnv) -> None:
    small_node(edge_env, ratio=2.0, min_idle_s=3600)  # nothing idle long enough to pause
    made = [await edge_env.edge.create(spec()) for _ in range(4)]  # 2 GiB of limits on 1 GiB
    assert all(i.state is SandboxState.running for i in made)
    with pytest.raises(CapacityExhausted, match=r"memory limits would exceed 2x the node's RAM"):
        await edge_env.edge.create(spec())
    assert len(edge_env.edge.sandbox_ids()) == 4  # the refused create left nothing


async def test_a_create_that_does_not_fit_pauses_the_idlest(edge_env: EdgeEnv) -> None:
    small_node(edge_env, ratio=1.0)
    edge = edge_env.edge
    old, recent = await edge.create(spec()), await edge.create(spec())
    await edge.commands.run_shell(recent.id, ShellRequest(command="true"))  # recent is the less idle
    new = await edge.create(spec())
    assert new.state is SandboxState.running
    assert edge.get(old.id).state is SandboxState.paused and edge.get(old.id).pause_reason == "admission"
    assert edge.get(recent.id).state is SandboxState.running
    # The paused one resumes on use (and the node is over its ratio meanwhile: use wins).
    r = await edge.commands.run_shell(old.id, ShellRequest(command="echo back"))
    assert r.stdout == "back\n" and edge.get(old.id).state is SandboxState.running


async def test_cpu_limits_are_admitted_by_their_own_ratio(edge_env: EdgeEnv) -> None:
    import os

    small_node(edge_env, ratio=100.0, min_idle_s=3600)
    edge_env.edge.config.cpu_overcommit = 1.0
    cores = os.cpu_count() or 1
    await edge_env.edge.create(spec(mb=16, cores=cores))
    with pytest.raises(CapacityExhausted, match="CPU limits would exceed 1x the node's cores"):
        await edge_env.edge.create(spec(mb=16, cores=0.5))


async def test_memory_pressure_pauses_the_idlest_until_relieved(edge_env: EdgeEnv) -> None:
    small_node(edge_env, ratio=100.0)
    edge = edge_env.edge
    a, b, c = [await edge.create(spec(mb=64)) for _ in range(3)]
    await edge.commands.run_shell(c.id, ShellRequest(command="true"))
    readings = iter([0, 0, GiB])  # short, still short after one pause, fine after two
    edge.admission.available_memory = lambda: next(readings, GiB)  # type: ignore[method-assign]
    await edge.admission.relieve_pressure()
    states = {i.id: edge.get(i.id) for i in (a, b, c)}
    assert [states[i.id].state for i in (a, b, c)] == [
        SandboxState.paused,
        SandboxState.paused,
        SandboxState.running,
    ]
    assert {states[a.id].pause_reason, states[b.id].pause_reason} == {"memory_pressure"}


async def test_a_node_short_of_memory_makes_room_or_refuses(edge_env: EdgeEnv) -> None:
    small_node(edge_env, ratio=100.0, min_idle_s=3600)
    edge = edge_env.edge
    info = await edge.create(spec(mb=64))
    edge.admission.available_memory = lambda: 0  # type: ignore[method-assign]
    with pytest.raises(CapacityExhausted, match="MiB of memory is available"):
        await edge.create(spec(mb=64))
    edge.config.pressure_min_idle_s = 0
    readings = iter([0])  # one pause is enough
    edge.admission.available_memory = lambda: next(readings, GiB)  # type: ignore[method-assign]
    assert (await edge.create(spec(mb=64))).state is SandboxState.running
    assert edge.get(info.id).pause_reason == "admission"


async def test_sandboxes_in_use_or_recently_used_are_never_paused_for_room(edge_env: EdgeEnv) -> None:
    small_node(edge_env, ratio=100.0, min_idle_s=3600)
    edge = edge_env.edge
    info = await edge.create(spec(mb=64))
    edge.admission.available_memory = lambda: 0  # type: ignore[method-assign]
    await edge.admission.relieve_pressure()
    assert edge.get(info.id).state is SandboxState.running
