"""The scale-out policy (apiserver/scaling.py) driven step by step: a fake provider whose
nodes are fake edges, a fake clock, the real watcher and placement. No sleeps: each
``tick`` is one decision at the clock's time."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
from pydantic import ValidationError

from dsec.apiserver.scaling import FencingWatcher, Scaler, ScalingConfig, build_provider
from dsec.edge.link import EdgeLink
from dsec.node.libvirt_provider import LibvirtProvider
from dsec.node.provider import LocalNetnsProvider, NodeRequest, ProvidedNode
from dsec.placement.placement import Placement
from dsec.protocol.errors import CapacityExhausted, InfraFailure, InvalidRequest


@dataclass
class FakeEdge:
    capacity: int = 10
    running: int = 0
    paused: int = 0
    ids: list[str] = field(default_factory=list)
    fenced: bool = False  # POST /edge/v1/fence: it refuses creates, whoever places them
    reachable: bool = True
    answers: bool = True  # False: not registered or down (the watcher sees it unhealthy)

    async def stats(self) -> dict[str, Any]:
        if not self.answers:
            raise InfraFailure("edge unreachable")
        # As the edge reports it: ``running`` counts paused sandboxes too.
        return {"capacity": 0 if self.fenced else self.capacity, "running": self.running + self.paused,
                "paused": self.paused, "creating": 0, "backends": ["container"], "hardware": {},
                "fenced": self.fenced}  # fmt: skip

    async def fence(self, fenced: bool, reason: str = "") -> bool:
        if not self.reachable:
            raise InfraFailure("edge unreachable")
        self.fenced = fenced
        return fenced

    async def sandbox_ids(self) -> list[str]:
        return list(self.ids)


class FakeProvider:
    def __init__(self, links: dict[str, FakeEdge], fail: bool = False) -> None:
        self.links = links
        self.fail = fail
        self.started: list[NodeRequest] = []
        self.stopped: list[str] = []

    async def start(self, request: NodeRequest) -> ProvidedNode:
        assert request.name is not None
        self.started.append(request)
        if self.fail:
            raise InfraFailure("no capacity in the cloud today")
        self.links[request.name] = FakeEdge()
        return ProvidedNode(request.name, request.labels, "running")

    async def stop(self, name: str) -> ProvidedNode:
        self.stopped.append(name)
        del self.links[name]
        return ProvidedNode(name, {}, "stopped")

    async def list(self) -> list[ProvidedNode]:
        return [ProvidedNode(n, {}, "running") for n in self.links if n != "home"]

    async def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    links: dict[str, FakeEdge]
    provider: FakeProvider
    watcher: FencingWatcher
    placement: Placement
    scaler: Scaler
    clock: Clock

    async def at(self, t: float) -> None:
        """The watcher polls, then the scaler decides, at ``t`` seconds into the test."""
        self.clock.now = 1000.0 + t
        await self.watcher.poll()
        await self.scaler.tick()
        await asyncio.gather(*self.scaler.pending)  # a start the provider answers at once

    def load(self, name: str, running: int, paused: int = 0) -> None:
        edge = self.links[name]
        edge.running, edge.paused = running, paused
        edge.ids = [f"sb-{name}-1-{i:020d}" for i in range(running + paused)]


CONFIG = ScalingConfig(
    threshold=0.8, sustain_s=30, idle_s=60, drain_s=5, max_nodes=2, labels={"pool": "burst"}, cpus=2
)


def rig(config: ScalingConfig = CONFIG, fail: bool = False) -> Rig:
    links: dict[str, FakeEdge] = {"home": FakeEdge()}
    provider = FakeProvider(links, fail)
    watcher = FencingWatcher(links)
    placement = Placement(watcher)
    clock = Clock()
    scaler = Scaler(config, provider, watcher, placement, cast(dict[str, EdgeLink], links), clock=clock)
    return Rig(links, provider, watcher, placement, scaler, clock)


async def test_a_node_starts_after_sustained_load_not_on_a_blip() -> None:
    r = rig()
    r.load("home", 9)  # 90%
    await r.at(0)
    await r.at(29)
    r.load("home", 5)  # a dip below the threshold: the clock starts again
    await r.at(29.5)
    r.load("home", 9)
    await r.at(30)
    await r.at(59)
    assert r.provider.started == [], "load for 29 s at a time is a blip"
    await r.at(60)
    assert [q.name for q in r.provider.started] == ["burst-1"]
    assert r.provider.started[0].labels == {"pool": "burst"} and r.provider.started[0].cpus == 2
    assert r.scaler.nodes["burst-1"].state == "running"


async def test_no_node_answering_is_no_load() -> None:
    # An apiserver just started, its edges not registered yet (or all down): utilisation
    # reads 1.0 then, which must not start a node (seen in a cluster test: every start did).
    r = rig()
    r.links["home"].answers = False
    for t in range(0, 300, 10):
        await r.at(t)
    assert r.provider.started == []
    r.links["home"].answers = True
    r.load("home", 9)
    await r.at(300)
    await r.at(330)
    assert [q.name for q in r.provider.started] == ["burst-1"]  # measured load still counts


async def test_the_max_is_respected_and_each_node_needs_its_own_sustained_load() -> None:
    r = rig()
    r.load("home", 10)
    await r.at(0)
    await r.at(30)
    assert len(r.provider.started) == 1
    r.load("burst-1", 10)
    await r.at(45)  # still loaded, but the first node has not had sustain_s to help
    assert len(r.provider.started) == 1
    await r.at(60)
    r.load("burst-2", 10)
    for t in range(90, 600, 30):
        await r.at(t)
    assert [q.name for q in r.provider.started] == ["burst-1", "burst-2"], "max_nodes = 2"


async def test_a_node_that_fails_to_start_is_not_counted_and_is_retried_under_load() -> None:
    r = rig(fail=True)
    r.load("home", 10)
    await r.at(0)
    await r.at(30)
    assert r.scaler.nodes == {} and len(r.provider.started) == 1
    await r.at(60)
    assert len(r.provider.started) == 2


async def _one_provider_node(r: Rig) -> None:
    r.load("home", 10)
    await r.at(0)
    await r.at(30)
    assert "burst-1" in r.links
    r.load("home", 2)


async def test_only_idle_nodes_are_fenced_drained_and_stopped() -> None:
    r = rig()
    await _one_provider_node(r)
    r.load("burst-1", 1)
    for t in range(31, 300, 10):
        await r.at(t)
    assert r.provider.stopped == [], "a node with a running sandbox is kept"
    r.load("burst-1", 0)
    await r.at(300)
    await r.at(359)
    assert not r.watcher.fenced
    await r.at(360)  # idle for idle_s: fenced from placement, not stopped yet
    assert r.watcher.fenced == {"burst-1"}
    assert r.watcher.snapshot["burst-1"]["capacity"] == 0
    with pytest.raises(CapacityExhausted):  # home is full; the fenced node takes nothing
        r.load("home", 10)
        await r.watcher.poll()
        await r.placement.choose("container")
    r.load("home", 2)
    await r.at(364)
    assert r.provider.stopped == []
    await r.at(365)  # drain_s later the edge says it holds nothing: stopped
    assert r.provider.stopped == ["burst-1"]
    assert r.scaler.nodes == {} and not r.watcher.fenced
    assert r.links.keys() == {"home"}, "the home node is never the scaler's to stop"


async def test_a_node_with_a_paused_sandbox_is_never_stopped() -> None:
    r = rig()
    await _one_provider_node(r)
    r.load("burst-1", 0, paused=1)
    for t in range(31, 2000, 10):
        await r.at(t)
    assert r.provider.stopped == [] and not r.watcher.fenced


async def test_a_sandbox_that_lands_during_the_drain_keeps_the_node() -> None:
    r = rig()
    await _one_provider_node(r)
    await r.at(31)
    await r.at(91)
    assert r.watcher.fenced == {"burst-1"}
    # A create placed (by this or another apiserver) before the fence reached the edge.
    r.links["burst-1"].ids = ["sb-burst-1-1-" + "a" * 20]
    await r.at(96)
    assert r.provider.stopped == [] and not r.watcher.fenced
    assert r.scaler.nodes["burst-1"].state == "running"
    assert not r.links["burst-1"].fenced, "the edge was told to take creates again"
    await r.watcher.poll()
    assert r.watcher.snapshot["burst-1"]["capacity"] == 10, "unfenced: placement may use it again"


async def test_no_node_is_fenced_while_the_cluster_is_loaded() -> None:
    r = rig()
    await _one_provider_node(r)
    r.links["home"].capacity = 40
    r.load("home", 40)  # 40 of 50: a node idle because of labels nobody asks for, under load: kept
    for t in range(31, 300, 1):
        r.clock.now = 1000.0 + t
        await r.watcher.poll()
        r.scaler.above_since = None  # only the scale-in half of the policy is under test here
        await r.scaler.tick()
    assert not r.watcher.fenced and r.provider.stopped == []


def test_the_config_is_validated_at_its_edge(tmp_path: Path) -> None:
    path = tmp_path / "scaling.toml"
    path.write_text('sustain_s = 30\nmax_nodes = 0\n[labels]\npool = "burst"\n')
    with pytest.raises(ValueError, match="max_nodes"):
        ScalingConfig.load(path)
    path.write_text('sustain_s = 30\nmax_nodes = 3\n[labels]\npool = "burst"\n')
    assert ScalingConfig.load(path).labels == {"pool": "burst"}
    with pytest.raises(ValidationError, match="provider"):
        ScalingConfig(provider="ec2")
    with pytest.raises(ValidationError, match="node label"):
        ScalingConfig(labels={"a=b": "c"})
    with pytest.raises(ValidationError, match="max_nodes"):
        ScalingConfig(max_nodes=0)
    with pytest.raises(ValidationError, match="extra"):
        ScalingConfig.model_validate({"sustain": 3})
    assert ScalingConfig(memory_mib=4096).request("burst-1").memory_mib == 4096


async def test_the_cluster_apiserver_runs_the_scaler_over_its_provider(tmp_path: Path) -> None:
    from dsec.iam import open_iam_store
    from dsec.images.store import LayerStore
    from dsec.node.cluster import ApiServerConfig, ClusterApiServer

    iam = await open_iam_store(str(tmp_path / "iam.sqlite"))
    await iam.close()
    provider = FakeProvider({})
    cfg = ApiServerConfig(
        "s3cret-for-this-test-only",
        LayerStore(tmp_path / "layers"),
        str(tmp_path / "iam.sqlite"),
        port=0,
        scaling=CONFIG,
        node_provider=provider,
    )
    api = ClusterApiServer(cfg)
    await api.start()
    try:
        assert api.scaler is not None and api.scaler.provider is provider
        assert api.scaler.watcher is api.watcher and api.scaler.links is api.links
        assert isinstance(api.watcher, FencingWatcher)
    finally:
        await api.close()
    assert api.scaler._task is not None and api.scaler._task.done()


async def test_nodes_the_provider_already_runs_are_adopted_counted_and_stopped_when_idle() -> None:
    r = rig()
    r.links["burst-7"] = FakeEdge()  # started before this apiserver (re)started
    await r.scaler.start()
    await r.scaler.close()  # its loop is not under test: the ticks below are
    assert r.scaler.nodes["burst-7"].state == "running"
    r.load("home", 10)
    r.load("burst-7", 10)
    await r.at(0)
    await r.at(30)
    r.load("burst-1", 10)
    for t in range(60, 300, 30):
        await r.at(t)
    assert [q.name for q in r.provider.started] == ["burst-1"], "the adopted node counts to max_nodes"
    for name in ("home", "burst-1", "burst-7"):
        r.load(name, 0)
    for t in range(300, 400, 5):
        await r.at(t)
    assert sorted(r.provider.stopped) == ["burst-1", "burst-7"]


async def test_the_edge_itself_is_fenced_so_every_apiservers_placement_skips_it() -> None:
    r = rig()
    await _one_provider_node(r)
    await r.at(31)
    await r.at(91)  # idle for idle_s
    assert r.links["burst-1"].fenced, "the edge was told to refuse creates"
    other = FencingWatcher(r.links)  # another apiserver of the cluster, with no scaler of its own
    await other.poll()
    assert other.snapshot["burst-1"]["fenced"] is True
    r.load("home", 10)
    await other.poll()
    with pytest.raises(CapacityExhausted):  # home is full, and the fenced node takes nothing
        await Placement(other).choose("container")
    r.load("home", 2)
    await r.at(96)
    assert r.provider.stopped == ["burst-1"]


async def test_a_node_whose_edge_cannot_be_fenced_is_not_drained() -> None:
    r = rig()
    await _one_provider_node(r)
    r.links["burst-1"].reachable = False
    for t in range(31, 200, 5):
        await r.at(t)
    assert r.provider.stopped == [] and not r.watcher.fenced, "another apiserver could still place there"
    r.links["burst-1"].reachable = True
    for t in range(200, 300, 5):
        await r.at(t)
    assert r.provider.stopped == ["burst-1"]


async def test_an_edge_unfenced_meanwhile_is_kept() -> None:
    r = rig()
    await _one_provider_node(r)
    await r.at(31)
    await r.at(91)
    r.links["burst-1"].fenced = False  # lifted by someone else (an operator): it takes creates
    await r.at(96)
    assert r.provider.stopped == [] and r.scaler.nodes["burst-1"].state == "running"


async def test_a_fence_left_by_a_scaler_that_went_away_is_lifted_by_the_next() -> None:
    # The edge journals its fence: a node fenced by an apiserver that then died stays fenced.
    r = rig()
    r.links["burst-7"] = FakeEdge(fenced=True)
    await r.scaler.start()  # this apiserver's scaler adopts it, as any node the provider runs
    await r.scaler.close()
    await r.at(0)
    assert not r.links["burst-7"].fenced, "adopted as running: it takes creates again"
    await r.at(1)
    assert r.watcher.snapshot["burst-7"]["capacity"] == 10 and r.provider.stopped == []


async def test_an_unfence_that_did_not_reach_the_edge_is_sent_again() -> None:
    r = rig()
    await _one_provider_node(r)
    await r.at(31)
    await r.at(91)
    edge = r.links["burst-1"]
    edge.ids, edge.reachable = ["sb-burst-1-1-" + "a" * 20], False  # a sandbox landed; then a blip
    await r.at(96)
    assert edge.fenced and r.scaler.nodes["burst-1"].state == "running"
    edge.reachable = True
    await r.at(97)
    assert not edge.fenced, "a kept node takes creates again"


def test_provider_settings_load_with_the_file_and_field_in_errors(tmp_path: Path) -> None:
    path = tmp_path / "scaling.toml"
    path.write_text(
        'provider = "libvirt"\nmax_nodes = 2\n[libvirt]\napiservers = ["http://10.0.0.1:8642"]\n'
        'uri = "qemu+ssh://host/system"\ndisk_gib = 20\ndomain_type = "qemu"\n'
    )
    config = ScalingConfig.load(path)
    assert config.libvirt is not None and config.libvirt.settings.uri == "qemu+ssh://host/system"
    assert config.libvirt.settings.disk_gib == 20 and config.libvirt.apiservers == ["http://10.0.0.1:8642"]
    assert config.libvirt.settings.domain_type == "qemu"
    bad = {
        'provider = "libvirt"\n': "libvirt table",
        'provider = "libvirt"\n[libvirt]\nuri = "qemu:///system"\n': "apiservers",
        'provider = "libvirt"\n[libvirt]\napiservers = ["h:1"]\n': "http",
        'provider = "libvirt"\n[libvirt]\napiservers = ["http://a:1"]\ndisk_gib = 0\n': "disk_gib",
        'provider = "libvirt"\n[libvirt]\napiservers = ["http://a:1"]\nurl = "x"\n': "url",
        'provider = "libvirt"\n[libvirt]\napiservers = ["http://a:1"]\ndomain_type = "xen"\n': "domain_type",
        "[local_netns]\napiserver_ports = [0]\n": "apiserver_ports",
        '[local_netns]\nedge_arg = ["--no-vm"]\n': "edge_arg",
    }
    for text, field_named in bad.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=field_named) as err:
            ScalingConfig.load(path)
        assert str(path) in str(err.value)


def test_the_provider_named_is_built_for_this_apiserver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "secret"
    where = dict(port=8642, secret="s" * 24, secret_file=secret, scratch=tmp_path / "scratch")
    built = build_provider(ScalingConfig(), shared_layers=tmp_path / "layers", **where)  # type: ignore[arg-type]
    assert isinstance(built, LocalNetnsProvider)
    assert built.apiserver_ports == [8642] and built.data_root == tmp_path / "scratch" / "nodes"
    options = {"apiserver_ports": [1, 2], "edge_args": ["--no-vm"], "data_root": str(tmp_path / "n")}
    built = build_provider(
        ScalingConfig.model_validate({"local_netns": options}),
        shared_layers=tmp_path,
        **where,  # type: ignore[arg-type]
    )
    assert isinstance(built, LocalNetnsProvider)
    assert (
        built.apiserver_ports == [1, 2]
        and built.edge_args == ["--no-vm"]
        and built.data_root == tmp_path / "n"
    )
    with pytest.raises(InvalidRequest, match="--secret-file"):
        build_provider(ScalingConfig(), shared_layers=tmp_path, **{**where, "secret_file": None})  # type: ignore[arg-type]
    virt = ScalingConfig.model_validate({"provider": "libvirt", "libvirt": {"apiservers": ["http://a:1"]}})
    monkeypatch.setitem(sys.modules, "libvirt", None)  # a host without the binding
    with pytest.raises(InfraFailure, match="libvirt-python"):
        build_provider(virt, shared_layers=tmp_path, **where)  # type: ignore[arg-type]
    monkeypatch.delitem(sys.modules, "libvirt")  # the binding the test extra installs: imported again
    made = build_provider(virt, shared_layers=tmp_path, **where)  # type: ignore[arg-type]
    assert isinstance(made, LibvirtProvider)
    assert made.apiservers == ["http://a:1"] and made.secret == "s" * 24


def test_the_cli_refuses_a_bad_scaling_file_naming_file_and_field(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from dsec.cli.main import app

    path = tmp_path / "scaling.json"
    path.write_text(json.dumps({"provider": "local-netns", "sustain_s": -1}))
    argv = ["apiserver", "--iam", str(tmp_path / "iam.sqlite"), "--shared-layers", str(tmp_path)]
    done = CliRunner().invoke(app, [*argv, "--scaling", str(path)])
    assert done.exit_code == 2
    assert str(path) in done.output and "sustain_s" in done.output
    path.write_text("{}")  # valid, but local-netns needs the secret as a file
    done = CliRunner().invoke(app, [*argv, "--scaling", str(path)], env={"DSEC_CLUSTER_SECRET": "x" * 24})
    assert done.exit_code == 2 and "--secret-file" in done.output and str(path) in done.output
    done = CliRunner().invoke(app, [*argv, "--scaling", str(tmp_path / "missing.toml")])
    assert done.exit_code == 2 and "missing.toml" in done.output
