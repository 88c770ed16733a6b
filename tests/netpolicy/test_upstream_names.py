"""Domain rules: allowed names resolved upstream and admitted per link, everything else refused.

A fake upstream on loopback answers a fixed zone; the link's answers are checked on the wire,
and what was admitted is read from the nftables updates the name server asked for.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import dns.message
import dns.rcode
import dns.rdatatype
import pytest

from dsec.netpolicy import names as names_module
from dsec.netpolicy import sniproxy
from dsec.netpolicy.catalogue import CATALOGUE
from dsec.netpolicy.config import EgressConfig, Rule, domain_matches
from dsec.netpolicy.names import Admissions, DomainGrant, LinkNames
from dsec.netpolicy.upstream import Upstream
from dsec.protocol.errors import InfraFailure, InvalidRequest
from tests.netpolicy.fake_dns import FakeDns, Zone

ZONE: Zone = {
    "pkg.example.org": [("CNAME", "edge.cdn.example.net", 120)],
    "edge.cdn.example.net": [("A", "198.51.100.7", 40), ("A", "198.51.100.8", 40)],
    "files.example.org": [("A", "198.51.100.9", 300)],
    "rebind.example.org": [("A", "127.0.0.1", 300), ("A", "198.51.100.10", 300)],
    "node.example.org": [("A", "203.0.113.77", 300)],
    "internal.example.org": [("A", "10.9.8.7", 300)],
    "tunnel.example.org": [("TXT", "exfiltrated", 300), ("A", "198.51.100.11", 300)],
    "not-granted.example.com": [("A", "198.51.100.12", 300)],
}
RULES = [
    ("pkgs", Rule(domains=["pkg.example.org", "*.example.org"], ports=[443])),
    ("corp", Rule(domains=["internal.example.org"], resolves_to=["10.9.0.0/16"], ports=[8443])),  # type: ignore[list-item]
]


class Recorder:
    """Stands for ``nft.apply``: keeps the scripts."""

    def __init__(self) -> None:
        self.scripts: list[str] = []
        self.fail_next = False

    async def __call__(self, script: str) -> None:
        if self.fail_next:
            self.fail_next = False
            raise InfraFailure("element does not exist", reason="network")
        self.scripts.append(script)

    def learned(self) -> str:
        return "".join(line for s in self.scripts for line in s.splitlines(True) if " learned " in line)


@pytest.fixture
async def upstream() -> AsyncIterator[FakeDns]:
    async with FakeDns(ZONE) as server:
        yield server


def names_for(server: FakeDns, recorder: Recorder, grace: int = 60) -> LinkNames:
    return LinkNames(
        "dvtest",
        {"static.test": ["10.231.0.2"]},
        DomainGrant(list(RULES)),
        Upstream([server.address], port=server.port, timeout=2),
        Admissions("dsec_t", recorder),
        frozenset({"203.0.113.77"}),
        grace,
    )


def query(name: str, rdtype: str = "A") -> bytes:
    return dns.message.make_query(name, dns.rdatatype.from_text(rdtype), id=4321).to_wire()


def parse(wire: bytes) -> tuple[int, list[tuple[str, str, str, int]]]:
    msg = dns.message.from_wire(wire)
    records = [
        (rr.name.to_text(omit_final_dot=True), dns.rdatatype.to_text(rr.rdtype), r.to_text(), rr.ttl)
        for rr in msg.answer
        for r in rr
    ]
    assert msg.id == 4321
    return msg.rcode(), records


async def test_an_allowed_name_is_resolved_upstream_and_admitted_before_the_answer(upstream: FakeDns) -> None:
    rec = Recorder()
    names = names_for(upstream, rec, grace=60)
    rcode, records = parse(await names.respond(query("pkg.example.org")) or b"")
    assert rcode == dns.rcode.NOERROR
    # The chain and the addresses, with what is left of the lowest TTL (40 s) along it.
    assert [(n, t, v) for n, t, v, _ in records if t == "CNAME"] == [
        ("pkg.example.org", "CNAME", "edge.cdn.example.net.")
    ]
    assert all(0 < ttl <= 40 for *_, ttl in records), records
    assert {(n, v) for n, t, v, _ in records if t == "A"} == {
        ("edge.cdn.example.net", "198.51.100.7"),
        ("edge.cdn.example.net", "198.51.100.8"),
    }
    # For the TTL plus the grace, on the rule's port, for this link only.
    timeouts = re.findall(
        r'learned \{ "dvtest" \. (198\.51\.100\.[78]) \. tcp \. 443 timeout (\d+)s', rec.learned()
    )
    assert sorted(a for a, _ in timeouts) == ["198.51.100.7", "198.51.100.8"]
    assert all(60 < int(t) <= 100 for _, t in timeouts), timeouts


async def test_other_names_do_not_exist_and_are_never_asked_upstream(upstream: FakeDns) -> None:
    names = names_for(upstream, Recorder())
    for name in ("not-granted.example.com", "example.org", "evil.example.org.attacker.test"):
        rcode, records = parse(await names.respond(query(name)) or b"")
        assert (rcode, records) == (dns.rcode.NXDOMAIN, []), name
    assert upstream.queries == []


async def test_only_addresses_come_back_no_txt_or_aaaa(upstream: FakeDns) -> None:
    rec = Recorder()
    names = names_for(upstream, rec)
    for rdtype in ("TXT", "AAAA", "MX", "ANY"):
        rcode, records = parse(await names.respond(query("tunnel.example.org", rdtype)) or b"")
        assert (rcode, records) == (dns.rcode.NOERROR, []), rdtype
    assert upstream.queries == []  # nothing but A questions goes upstream
    assert rec.learned() == ""


async def test_answers_pointing_inside_are_dropped_unless_the_rule_names_them(upstream: FakeDns) -> None:
    rec = Recorder()
    names = names_for(upstream, rec)
    _, records = parse(await names.respond(query("rebind.example.org")) or b"")
    assert [v for _, t, v, _ in records if t == "A"] == ["198.51.100.10"]  # loopback dropped
    _, records = parse(await names.respond(query("node.example.org")) or b"")
    assert records == []  # the node's own address
    _, records = parse(await names.respond(query("internal.example.org")) or b"")
    assert [v for _, t, v, _ in records if t == "A"] == ["10.9.8.7"]  # corp's resolves_to names it
    learned = rec.learned()
    assert "127.0.0.1" not in learned and "203.0.113.77" not in learned
    assert '"dvtest" . 10.9.8.7 . tcp . 8443' in learned


async def test_the_cache_answers_repeats_and_bursts_ask_once(upstream: FakeDns) -> None:
    rec = Recorder()
    names = names_for(upstream, rec)
    await asyncio.gather(*(names.respond(query("files.example.org")) for _ in range(20)))
    await names.respond(query("files.example.org"))
    assert upstream.queries == ["files.example.org/A"]
    # Admitted once: a repeat within half the timeout does not touch the kernel again.
    assert rec.learned().count("198.51.100.9") == 1


async def test_a_static_endpoint_name_still_answers_its_configured_address(upstream: FakeDns) -> None:
    rcode, records = parse(await names_for(upstream, Recorder()).respond(query("static.test")) or b"")
    assert rcode == dns.rcode.NOERROR and [r[2] for r in records] == ["10.231.0.2"]
    assert upstream.queries == []


async def test_a_revoked_permission_takes_its_addresses_back() -> None:
    rec = Recorder()
    adm = Admissions("dsec_t", rec)
    await adm.admit("dvx", "pkgs", [("dvx", "198.51.100.7", "tcp", 443)], 100)
    await adm.admit("dvx", "corp", [("dvx", "10.9.8.7", "tcp", 8443)], 100)
    rec.fail_next = True  # one element already gone from the kernel: the rest still go
    before = len(rec.scripts)
    await adm.revoke("dvx", keep=lambda perm: perm == "corp")
    after = "".join(rec.scripts[before:])
    # From both sets: a revoke cuts established connections too, not only new ones.
    assert 'delete element inet dsec_t learned { "dvx" . 198.51.100.7 . tcp . 443 }' in after
    assert 'delete element inet dsec_t holding { "dvx" . 198.51.100.7 . tcp . 443 }' in after
    assert "10.9.8.7" not in after


def test_wildcards_match_names_below_only() -> None:
    assert domain_matches("*.githubusercontent.com", "raw.githubusercontent.com")
    assert domain_matches("*.githubusercontent.com", "a.b.githubusercontent.com")
    assert not domain_matches("*.githubusercontent.com", "githubusercontent.com")
    assert not domain_matches("*.githubusercontent.com", "evilgithubusercontent.com")
    assert domain_matches("pypi.org", "pypi.org") and not domain_matches("pypi.org", "x.pypi.org")


def test_the_catalogue_ships_on_and_an_operator_file_extends_or_replaces_it(tmp_path: object) -> None:
    from pathlib import Path

    base = EgressConfig.load(None, catalogue=True)
    for name in ("pypi", "npm", "debian", "github", "huggingface", "crates", "go", "internet"):
        assert name in base.permissions, name
    assert EgressConfig.load(None).permissions == {}  # programmatic configs start empty
    f = Path(str(tmp_path)) / "egress.toml"
    f.write_text('[[permissions.pypi]]\naddress = "10.0.0.5"\nports = [3141]\nnames = ["pypi.mirror"]\n')
    mine = EgressConfig.load(f, catalogue=True)
    assert mine.permissions["pypi"] != CATALOGUE["pypi"] and "npm" in mine.permissions
    f.write_text('catalogue = false\n[[permissions.corp]]\ndomains = ["git.corp.example"]\n')
    assert set(EgressConfig.load(f, catalogue=True).permissions) == {"corp"}


@pytest.mark.parametrize(
    "rule",
    [
        {},  # names nothing
        {"domains": ["bad_name!.org"]},
        {"domains": ["*"]},
        {"domains": ["a.org"], "ports": [0]},
        {"domains": ["a.org"], "protocol": "icmp"},
        {"domains": ["a.org"], "protocol": "udp", "ports": [443]},  # QUIC: no name to check
    ],
)
def test_bad_rules_are_refused(tmp_path: object, rule: dict[str, object]) -> None:
    import json
    from pathlib import Path

    f = Path(str(tmp_path)) / "egress.json"
    f.write_text(json.dumps({"permissions": {"p": [rule]}}))
    with pytest.raises(InvalidRequest):
        EgressConfig.load(f)


def test_the_name_check_keys_match_only_their_names_and_their_sandbox() -> None:
    """HAProxy looks ``|SNI|source`` up with map_end: a key must match its name (or, for a
    wildcard, names below it) for its own source address, and nothing else."""
    keys = sniproxy.keys(["pypi.org", "*.githubusercontent.com"], "10.230.0.5")

    def allowed(sni: str, source: str) -> bool:
        return any(f"|{sni}|{source}".endswith(k) for k in keys)

    assert allowed("pypi.org", "10.230.0.5") and allowed("raw.githubusercontent.com", "10.230.0.5")
    assert not allowed("evilpypi.org", "10.230.0.5") and not allowed("x.pypi.org", "10.230.0.5")
    assert not allowed("githubusercontent.com", "10.230.0.5")
    assert not allowed("pypi.org", "10.230.0.50") and not allowed("pypi.org", "110.230.0.5")
    assert not allowed("", "10.230.0.5")  # no server name (an IP literal)


async def test_one_sandbox_cannot_fill_the_node_s_learned_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(names_module, "MAX_PER_LINK", 3)
    adm = Admissions("dsec_t", Recorder())
    for i in range(3):
        assert await adm.admit("dvx", "pkgs", [("dvx", f"198.51.100.{i}", "tcp", 443)], 100)
    assert not await adm.admit("dvx", "pkgs", [("dvx", "198.51.100.9", "tcp", 443)], 100)
    assert await adm.admit("dvy", "pkgs", [("dvy", "198.51.100.9", "tcp", 443)], 100)  # its own budget


async def test_a_full_link_lets_go_of_expired_addresses_held_for_established_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(names_module, "MAX_PER_LINK", 2)
    rec = Recorder()
    adm = Admissions("dsec_t", rec)
    for i in range(2):  # answers that expired at once: held only for established connections
        assert await adm.admit("dvx", "pkgs", [("dvx", f"198.51.100.{i}", "tcp", 8080)], 0)
    assert await adm.admit("dvx", "pkgs", [("dvx", "198.51.100.9", "tcp", 8080)], 100)
    released = "".join(rec.scripts)
    assert 'delete element inet dsec_t holding { "dvx" . 198.51.100.0 . tcp . 8080 }' in released
    assert 'delete element inet dsec_t holding { "dvx" . 198.51.100.1 . tcp . 8080 }' in released
    assert "delete element inet dsec_t learned" not in released  # those expired in the kernel
