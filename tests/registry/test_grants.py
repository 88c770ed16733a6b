"""Which registries a node serves, and what a grant with a cutoff opens: the proxy's port only,
never the registry's upstream names (unit: the policy's bookkeeping, no kernel)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.netpolicy.config import EgressConfig, Rule
from dsec.netpolicy.grants import describe, parse
from dsec.netpolicy.policy import EgressPolicy, _Link
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import GrantOptions
from dsec.registry.config import Registry


class _NoLinks:
    def links(self) -> dict[str, int]:
        return {}

    def put_link(self, sandbox_id: str, index: int) -> None: ...

    def drop_link(self, sandbox_id: str) -> None: ...


def test_the_catalogue_s_registries_and_an_operator_s_own() -> None:
    assert sorted(EgressConfig(catalogue=True).registries) == ["debian", "npm", "pypi"]
    mirror = EgressConfig(catalogue=True, permissions={"pypi": [Rule(domains=["pypi.corp.example"])]})
    assert "pypi" not in mirror.registries  # a replaced permission keeps no proxy to pypi.org
    with pytest.raises(ValueError, match="name no permission"):
        EgressConfig(registries={"nope": Registry(kind="npm", index="https://r.example/", port=14000)})
    with pytest.raises(ValueError, match="ports must differ"):
        EgressConfig(
            permissions={"a": [Rule(domains=["a.example"])], "b": [Rule(domains=["b.example"])]},
            registries={
                "a": Registry(kind="npm", index="https://a.example/", port=14000),
                "b": Registry(kind="pypi", index="https://b.example/", port=14000),
            },
        )


def test_a_cutoff_opens_the_proxy_and_not_the_upstream_names(tmp_path: Path) -> None:
    policy = EgressPolicy(EgressConfig(catalogue=True), "n1", _NoLinks(), tmp_path)
    link = _Link(1, "dsvtest", "10.200.0.2")
    policy._grant_locally(link, {"pypi": True})
    assert [perm for perm, _ in link.domains.rules] == ["pypi"] and link.checked_names
    assert link.reach.registry == {("dsvtest", 13141)}
    policy._grant_locally(
        link, {"pypi": GrantOptions.model_validate({"before": "2025-06-01"}), "github": True}
    )
    assert [perm for perm, _ in link.domains.rules] == ["github"]
    assert not any("pypi.org" in k or "pythonhosted" in k for k in link.checked_names)
    assert link.reach.registry == {("dsvtest", 13141)}
    policy._grant_locally(link, {"pypi": False})
    assert link.reach.registry == set() and link.domains.rules == []


def test_the_command_line_s_network_option() -> None:
    rules = parse("pypi@2025-06-01, debian")
    assert rules == {"pypi": GrantOptions.model_validate({"before": "2025-06-01"}), "debian": True}
    assert describe(rules) == ["debian", "pypi@2025-06-01"]
    with pytest.raises(InvalidRequest, match="YYYY-MM-DD"):
        parse("pypi@june")
