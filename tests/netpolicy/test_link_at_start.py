"""gVisor sandboxes on the egress policy without starting one: netstack copies its namespace's
links once, at start, so a gVisor sandbox named network rules starts in a namespace holding
its veth, and one created without them refuses a grant (no kernel state touched)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.backends.base import GuestLink, Networked
from dsec.backends.container.backend import ContainerBackend
from dsec.backends.container.gvisor import GVisor
from dsec.protocol.errors import InfraFailure, InvalidRequest
from dsec.protocol.models import ContainerSpec
from tests.netpolicy.test_vm_links import _Edge

GVISOR = {"runtime": "gvisor", "pid": 4242, "gofer_pid": 4243}


def test_only_gvisor_sandboxes_take_their_link_at_start(tmp_path: Path) -> None:
    backend = ContainerBackend(tmp_path)
    assert isinstance(backend, Networked)
    assert backend.link_at_start(ContainerSpec(image="x:1", runtime="gvisor"))
    assert not backend.link_at_start(ContainerSpec(image="x:1"))
    assert backend.netns_pid({"pid": 4242}) == 4242, "crun: a link can be added to its init's namespace"
    assert backend.netns_pid(GVISOR) is None


async def test_a_gvisor_sandbox_created_without_rules_refuses_a_grant(tmp_path: Path) -> None:
    edge = _Edge(ContainerBackend(tmp_path), GVISOR)
    edge.record.spec = ContainerSpec(image="x:1", runtime="gvisor")
    with pytest.raises(InvalidRequest, match=r"created without network rules.*gvisor.*all False"):
        await edge.set_network_rules("sb-1", {"mirror": True})


def _gvisor(tmp_path: Path) -> GVisor:
    gv = GVisor(tmp_path)
    gv.runsc, gv.platform, gv.why_not = "/usr/bin/runsc", "ptrace", None  # as a probe would find
    return gv


def test_a_linked_gvisor_sandbox_runs_netstack_in_the_namespace_of_its_link(tmp_path: Path) -> None:
    gv = _gvisor(tmp_path)
    namespaces = [{"type": t} for t in ("pid", "network", "ipc", "uts")]  # crun's: no mount namespace
    process = {"args": ["/.dsec/dsec-init", "--new-root-on", "3"]}
    config = {"process": process, "linux": {"namespaces": namespaces, "seccomp": {}}, "mounts": []}
    args = {
        "bundle": tmp_path,
        "log_file": tmp_path / "log",
        "pid_file": tmp_path / "pid",
        "sandbox_id": "sb-1",
    }

    plain = gv.run_argv(**args, link=None)  # type: ignore[arg-type]
    assert "--network=none" in plain
    adapted = gv.adapt_config(config, tmp_path, None)
    # runsc makes its own mount namespace, and its init gets no root over fd 3 (crun's does).
    assert adapted["linux"]["namespaces"] == [*namespaces, {"type": "mount"}]
    assert adapted["process"]["args"] == ["/.dsec/dsec-init"]

    made = tmp_path / "netns"  # stands for a namespace of its own (an nsfs file elsewhere)
    made.touch()
    link = GuestLink("dsv0", "10.241.0.2", "10.241.0.1", netns=str(made))
    assert "--network=sandbox" in gv.run_argv(**args, link=link)  # type: ignore[arg-type]
    linked = gv.adapt_config(config, tmp_path, link)["linux"]["namespaces"]
    assert {"type": "network", "path": str(made)} in linked
    assert [n["type"] for n in linked] == [*(n["type"] for n in namespaces), "mount"]


def test_netstack_is_never_started_in_the_nodes_own_namespace(tmp_path: Path) -> None:
    # runsc moves the addresses of the namespace it joins into netstack: the node's would go.
    gv = _gvisor(tmp_path)
    host = GuestLink("dsv0", "10.241.0.2", "10.241.0.1", netns="/proc/self/ns/net")
    args = {
        "bundle": tmp_path,
        "log_file": tmp_path / "log",
        "pid_file": tmp_path / "pid",
        "sandbox_id": "sb-1",
    }
    with pytest.raises(InfraFailure, match="not a namespace of its own"):
        gv.run_argv(**args, link=host)  # type: ignore[arg-type]
