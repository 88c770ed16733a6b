"""The operator's permission file: validated at load, and the edge refuses unknown names."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dsec.netpolicy import nft
from dsec.netpolicy.config import EgressConfig
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import GrantOptions

TOML = """
pool = "10.250.0.0/24"
[[permissions.pypi]]
address = "10.0.0.5"
ports = [3141, 443, 443]
names = ["PyPI.Mirror.Internal."]
[[permissions.dns-upstream]]
address = "10.0.0.53"
ports = [53]
protocol = "udp"
"""


def test_a_toml_file_loads_and_normalises(tmp_path: Path) -> None:
    path = tmp_path / "egress.toml"
    path.write_text(TOML)
    cfg = EgressConfig.load(path)
    (ep,) = cfg.permissions["pypi"]
    assert ep.ports == [443, 3141] and ep.names == ["pypi.mirror.internal"]
    assert cfg.gateway == "10.250.0.1" and cfg.sandbox_address(1) == "10.250.0.2"
    assert cfg.capacity == 253
    assert [e.protocol for e in cfg.endpoints({"pypi": True, "dns-upstream": True})] == ["udp", "tcp"]
    assert cfg.endpoints({"pypi": False}) == []


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"permissions": {"x": [{"address": "10.0.0.1", "ports": [0]}]}}', "ports must be 1-65535"),
        ('{"permissions": {"x": [{"address": "nope", "ports": [80]}]}}', "IPv4"),
        ('{"permissions": {"x": [{"address": "10.0.0.1", "ports": []}]}}', "at least 1"),
        ('{"permissions": {"bad name": []}}', "permission names"),
        ('{"permissions": {"x": [{"address": "10.0.0.1", "ports": [80], "names": ["a..b"]}]}}', "DNS"),
        ('{"pool": "10.0.0.0/30"}', "at least 16"),
        ('{"permisions": {}}', "Extra inputs"),
        ("{", "egress configuration"),
    ],
)
def test_bad_files_are_refused_with_the_reason(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "egress.json"
    path.write_text(text)
    with pytest.raises(InvalidRequest, match=why):
        EgressConfig.load(path)


def test_unknown_permission_names_are_refused() -> None:
    cfg = EgressConfig.model_validate({"permissions": {"pypi": [{"address": "10.0.0.5", "ports": [80]}]}})
    cfg.check({"pypi": True})
    with pytest.raises(InvalidRequest, match=r"\['pipy'\].*offers: pypi"):
        cfg.check({"pipy": True})
    with pytest.raises(InvalidRequest, match="offers: none"):
        EgressConfig().check({"pypi": False})


def test_the_ruleset_and_grants_are_valid_nftables() -> None:
    """``nft -c`` checks a script against the kernel without applying it."""
    links = {"dsvaaaaaaaaaaaa": "10.250.0.2"}
    elems = {("dsvaaaaaaaaaaaa", "10.0.0.5", "tcp", 443), ("dsvaaaaaaaaaaaa", "10.0.0.53", "udp", 53)}
    ranges = {("dsvaaaaaaaaaaaa", "10.9.0.0/16", "tcp", 443)}
    every = nft.Reach(
        elements=frozenset(elems | ranges),
        public=True,
        registry=frozenset({("dsvaaaaaaaaaaaa", 13141)}),
        opened=frozenset({"198.51.100.7", "203.0.113.0/24"}),
        denied=frozenset({"8.8.8.8", "1.0.0.0/8"}),
    )
    for script in (
        nft.ruleset(
            "dsec_check",
            "10.250.0.1",
            "10.250.0.0/24",
            links,
            {"dsvaaaaaaaaaaaa": nft.Reach(frozenset(elems))},
        ),
        nft.ruleset("dsec_check", "10.250.0.1", "10.250.0.0/24", {}),
        nft.ruleset(
            "dsec_check",
            "10.250.0.1",
            "10.250.0.0/24",
            links,
            {"dsvaaaaaaaaaaaa": every},
            {443: 16443, 80: 16080},
        ),
    ):
        subprocess.run(["nft", "-c", "-f", "-"], input=script.encode(), check=True, capture_output=True)


def test_learned_addresses_and_grants_apply_to_a_real_table(tmp_path: Path) -> None:
    """In a network namespace of the test's own: the table, a grant with a range and the
    public set, an address learned for a while, re-learned with a new timeout, forgotten."""
    ns = f"dsec-nftcheck-{os.getpid()}"
    link = ("dsvx", "10.250.0.2")
    learned = ("dsvx", "198.51.100.7", "tcp", 443)
    reach = nft.Reach(
        elements=frozenset({("dsvx", "10.9.0.0/16", "tcp", 443)}),
        public=True,
        opened=frozenset({"198.51.100.9", "203.0.113.0/24"}),
        denied=frozenset({"8.8.8.8", "1.0.0.0/8"}),
    )

    def run(script: str) -> None:
        subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script.encode(), check=True)

    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        run(nft.ruleset("t", "10.250.0.1", "10.250.0.0/24", {}, {}, {443: 16443}))
        run(nft.grant("t", *link, nft.Reach(), reach))
        run(nft.learn("t", [(learned, 300)]))
        run(nft.learn("t", [(learned, 600)], refresh=[learned], rehold=[learned]))
        out = subprocess.run(
            ["ip", "netns", "exec", ns, "nft", "list", "table", "inet", "t"], capture_output=True, text=True
        ).stdout
        assert '"dsvx" . 198.51.100.7 . tcp . 443 timeout 10m' in out, out
        # Held for established connections a day longer than it is open to new ones.
        assert '"dsvx" . 198.51.100.7 . tcp . 443 timeout 1d10m' in out, out
        assert '"dsvx" . 10.9.0.0/16 . tcp . 443' in out and 'elements = { "dsvx" }' in out
        assert '"dsvx" . 198.51.100.9' in out and '"dsvx" . 203.0.113.0/24' in out, out
        assert '"dsvx" . 8.8.8.8' in out and '"dsvx" . 1.0.0.0/8' in out, out
        # A change touches only what changed: one range reopened, one deny lifted.
        changed = nft.Reach(
            elements=reach.elements,
            public=True,
            opened=frozenset({"198.51.100.9"}),
            denied=frozenset({"8.8.8.8"}),
        )
        script = nft.grant("t", *link, reach, changed)
        assert "198.51.100.9" not in script and "8.8.8.8" not in script
        run(script)
        run(nft.unlearn("t", [learned], [learned]))
        run(nft.forget("t", *link, changed))
        out = subprocess.run(
            ["ip", "netns", "exec", ns, "nft", "list", "table", "inet", "t"], capture_output=True, text=True
        ).stdout
        assert "198.51.100" not in out and "10.9.0.0" not in out and "dsvx" not in out, out
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=True)


def test_a_grant_update_only_touches_what_changed() -> None:
    old = {("dsvx", "10.0.0.5", "tcp", 80), ("dsvx", "10.0.0.5", "tcp", 443)}
    new = {("dsvx", "10.0.0.5", "tcp", 443), ("dsvx", "10.0.0.6", "tcp", 22)}
    script = nft.grant("t", "dsvx", "10.250.0.2", nft.Reach(frozenset(old)), nft.Reach(frozenset(new)))
    assert 'delete element inet t allowed { "dsvx" . 10.0.0.5 . tcp . 80 }' in script
    assert 'add element inet t allowed { "dsvx" . 10.0.0.6 . tcp . 22 }' in script
    assert "443" not in script


_PUBLIC = EgressConfig.model_validate(
    {
        "permissions": {
            "internet": [{"public": True, "ports": [443]}],
            "pypi": [{"address": "10.0.0.5", "ports": [80]}],
        }
    }
)


def test_a_sandbox_s_rules_open_and_deny_public_addresses() -> None:
    rules = {
        "internet": True,
        "203.0.113.7": True,
        "198.51.100.0/24": True,
        "8.8.8.8": False,
        "10.0.0.0/8": False,
    }
    _PUBLIC.check(rules)
    assert sorted((str(n), on) for n, on in _PUBLIC.address_rules(rules)) == [
        ("10.0.0.0/8", False),
        ("198.51.100.0/24", True),
        ("203.0.113.7/32", True),
        ("8.8.8.8/32", False),
    ]
    assert _PUBLIC.endpoints(rules) == _PUBLIC.permissions["internet"]  # names only
    # A deny of something the node never opens is no error, wherever it is asked.
    EgressConfig().check({"8.8.8.8": False})


@pytest.mark.parametrize(
    ("config", "rules", "why"),
    [
        (_PUBLIC, {"10.0.0.5": True}, "not public"),
        (_PUBLIC, {"0.0.0.0/1": True}, "not public"),  # holds private ranges
        (_PUBLIC, {"127.0.0.1": True}, "not public"),
        (_PUBLIC, {"2001:db8::1": True}, "no IPv6 route"),
        (_PUBLIC, {"203.0.113.7/24": True}, "has host bits set"),
        (_PUBLIC, {"300.1.1.1": True}, "no IPv4 address"),
        (_PUBLIC, {"8.8.8.8": {"before": "2025-01-01"}}, "options apply to package registries"),
        (_PUBLIC, {f"8.8.{i}.0/24": True for i in range(65)}, "at most 64"),
        (
            EgressConfig.model_validate({"permissions": {"pypi": [{"address": "10.0.0.5", "ports": [80]}]}}),
            {"8.8.8.8": True},
            "opens no public addresses",
        ),
    ],
)
def test_addresses_a_sandbox_may_not_open_are_refused(
    config: EgressConfig, rules: dict[str, Any], why: str
) -> None:
    parsed = {k: GrantOptions.model_validate(v) if isinstance(v, dict) else v for k, v in rules.items()}
    with pytest.raises(InvalidRequest, match=why):
        config.check(parsed)


def test_no_permission_is_named_like_an_address() -> None:
    with pytest.raises(ValueError, match="must not read as addresses"):
        EgressConfig.model_validate({"permissions": {"10.0.0.5": [{"address": "10.0.0.5", "ports": [80]}]}})
