"""VM networking without a VM: the card QEMU is given, the handle a snapshot resume rebuilds it
from, and what the edge accepts or refuses for VM backends (no kernel state touched)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dsec.backends.base import Tapped
from dsec.backends.microvm import qemu
from dsec.backends.microvm.backend import MicroVMBackend
from dsec.backends.microvm.handle import RecordedVm
from dsec.edge.networking import Networking
from dsec.netpolicy.policy import EgressPolicy
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import ContainerSpec
from tests.netpolicy.mirror import egress_config


def config(tmp: Path, machine: str = "microvm", **kw: Any) -> qemu.MicroVMConfig:
    paths = {k: tmp / k for k in ("kernel", "initramfs", "agent_socket", "qmp_socket", "serial_log")}
    return qemu.MicroVMConfig(**paths, layers=[], rw_disk=None, machine=machine, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("machine", "device"), [("microvm", "virtio-net-device"), ("q35", "virtio-net-pci")])
def test_a_vm_with_a_tap_gets_a_card_on_it_and_its_address_on_the_command_line(
    tmp_path: Path, machine: str, device: str
) -> None:
    plain = qemu.microvm_argv(config(tmp_path, machine))
    assert not any("netdev" in a for a in plain) and "dsec.net" not in " ".join(plain)
    c = config(tmp_path, machine, tap="dsv0123456789ab", guest_net="10.247.0.5,10.247.0.1")
    argv = qemu.microvm_argv(c)
    assert argv[argv.index("-netdev") + 1] == "tap,id=net0,ifname=dsv0123456789ab,script=no,downscript=no"
    assert argv[argv.index("-netdev") + 3].startswith(f"{device},netdev=net0")
    assert "dsec.net=10.247.0.5,10.247.0.1" in argv[argv.index("-append") + 1].split()
    # A snapshot resume starts the same machine again from the handle's record of it.
    recorded = {k: str(v) if isinstance(v, Path) else v for k, v in vars(c).items()}
    assert qemu.microvm_argv(RecordedVm.model_validate(recorded).config()) == argv


class _Edge(Networking):
    def __init__(self, backend: object, handle: dict[str, Any]) -> None:
        egress = EgressPolicy(egress_config(), "t", SimpleNamespace(), Path("/nonexistent"))  # type: ignore[arg-type]
        self.record = SimpleNamespace(id="sb-1", handle=handle, backend="microvm")
        live = SimpleNamespace(touch=lambda sandbox_id: SimpleNamespace(record=self.record))
        super().__init__(egress, None, None, live, lambda rec: backend, "t")  # type: ignore[arg-type]


async def test_vms_accept_rules_at_create_and_refuse_a_grant_without_a_card(tmp_path: Path) -> None:
    backend = MicroVMBackend(tmp_path)
    assert isinstance(backend, Tapped)
    edge = _Edge(backend, {"vm": {"tap": None}})
    edge.check(ContainerSpec(image="x:1", network_rules={"mirror": True}), backend)
    with pytest.raises(InvalidRequest, match="created without network rules"):
        await edge.set_network_rules("sb-1", {"mirror": True})
    assert backend.has_link({"vm": {"tap": "dsvx"}}) and not backend.has_link({})
