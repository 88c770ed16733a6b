"""``runtime`` in a spec: validated at the API edge, before any node sees it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import ContainerSpec, parse_spec
from dsec.sdk.args import DSecContainerRunArgs, DSecMicroVMRunArgs


def test_a_container_defaults_to_crun_and_may_ask_for_gvisor() -> None:
    assert ContainerSpec(image="base:1").runtime == "crun"
    spec = DSecContainerRunArgs(container_image="base:1", runtime="gvisor").to_spec()
    assert spec.runtime == "gvisor"
    assert spec.required_capabilities() == ["gvisor"]
    assert ContainerSpec(image="base:1").required_capabilities() == []


def test_an_unknown_runtime_is_refused() -> None:
    with pytest.raises(ValidationError):
        parse_spec({"image": "base:1", "runtime": "runc"})


def test_a_vm_refuses_a_runtime() -> None:
    with pytest.raises(ValidationError, match="own kernel"):
        parse_spec({"type": "microvm", "image": "base:1", "runtime": "gvisor"})
    with pytest.raises(InvalidRequest, match="own kernel"):
        DSecMicroVMRunArgs(container_image="base:1", runtime="gvisor").to_spec()


def test_gvisor_takes_network_rules_like_crun() -> None:
    spec = ContainerSpec(image="base:1", runtime="gvisor", network_rules={"internet": True})
    assert spec.network_rules == {"internet": True}
