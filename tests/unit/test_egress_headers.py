"""Egress headers as data: what a spec may hold, how placeholders are filled, and the proxy map
entries a sandbox's headers become (secrets on TLS-ended connections only)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dsec.netpolicy import intercept
from dsec.netpolicy.config import EgressConfig, Rule, own_domain
from dsec.protocol.egress_headers import filled, placeholders, used
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import ContainerSpec, NetworkRulesRequest

HEADERS = {"api.example.com": {"Authorization": "Bearer ${secrets.k}", "X-Team": "rl"}}


def spec(**kw: object) -> ContainerSpec:
    return ContainerSpec.model_validate({"image": "debian:bookworm", **kw})


def test_placeholders_are_filled_from_the_secrets_and_counted() -> None:
    assert placeholders("a ${secrets.k} b ${secrets.j}") == ["k", "j"]
    assert used(HEADERS) == {"k"}
    assert filled(HEADERS, {"k": "s3"}) == {"api.example.com": {"Authorization": "Bearer s3", "X-Team": "rl"}}
    with pytest.raises(ValueError, match="'k' is not in egress_secrets"):
        filled(HEADERS, {})


@pytest.mark.parametrize(
    ("headers", "secrets", "why"),
    [
        ({"Not A Host": {}}, {}, "is no host name"),
        ({"a.example.com": {"Host": "b"}}, {}, "frames the request"),
        ({"a.example.com": {"Transfer-Encoding": "chunked"}}, {}, "frames the request"),
        ({"a.example.com": {"A B": "x"}}, {}, "HTTP token characters"),
        ({"a.example.com": {"A": "x\r\nB: y"}}, {}, "control characters"),
        ({"a.example.com": {"A": "x" * 2049}}, {}, "at most 2048"),
        ({"a.example.com": {"A": "${secrets.k"}}, {}, "malformed"),
        (HEADERS, {"k": "line\nbreak"}, "control characters"),
        (HEADERS, {"k": "x" * 2050}, "at most 2048"),
        (HEADERS, {}, "not in egress_secrets"),
        ({f"h{i}.example.com": {} for i in range(11)}, {}, "at most 10 hosts"),
        ({"a.example.com": {f"H{i}": "x" for i in range(21)}}, {}, "at most 20 headers"),
    ],
)
def test_a_spec_refuses_headers_that_could_not_be_sent_as_given(
    headers: dict[str, dict[str, str]], secrets: dict[str, str], why: str
) -> None:
    with pytest.raises(ValidationError, match=why):
        spec(egress_headers=headers, egress_secrets=secrets)


def test_a_filled_value_past_the_bound_is_refused() -> None:
    with pytest.raises(ValidationError, match="longer than 2048 filled"):
        spec(
            egress_headers={"a.example.com": {"A": "x" * 2000 + "${secrets.k}"}},
            egress_secrets={"k": "y" * 100},
        )


def test_all_of_a_sandbox_s_headers_are_bounded_together() -> None:
    many = {f"h{i}.example.com": {f"H{j}": "x" * 1000 for j in range(2)} for i in range(9)}
    with pytest.raises(ValidationError, match="at most 16384 in all"):
        spec(egress_headers=many)
    spec(egress_headers=dict(list(many.items())[:8]))  # 8 x 2 x 1002 bytes: within


def test_network_rules_requests_keep_or_replace_headers() -> None:
    kept = NetworkRulesRequest(network_rules={})
    assert kept.egress_headers is None  # None keeps the sandbox's; {} clears them
    with pytest.raises(ValidationError, match="come with the egress_headers"):
        NetworkRulesRequest(network_rules={}, egress_secrets={"k": "v"})


def test_map_entries_give_plain_http_only_the_headers_without_a_secret() -> None:
    got = intercept.entries(HEADERS, {"k": "s3"}, "10.0.0.2")
    pair = {k: bytes.fromhex(v).split(b"\0") for k, v in got.items()}
    assert pair == {
        "|api.example.com|10.0.0.2#0": [b"Authorization", b"Bearer s3"],
        "|api.example.com|10.0.0.2#1": [b"X-Team", b"rl"],
        "|api.example.com|10.0.0.2#p0": [b"X-Team", b"rl"],
    }
    assert {intercept.host_of(k) for k in got} == {"api.example.com"}
    # Every entry is one word on the admin socket's line: no spaces, no line breaks.
    assert all(v.isalnum() for v in got.values())


def test_a_sandbox_s_own_domains_need_a_node_that_opens_public_addresses() -> None:
    named = {"web": [{"domains": ["*.example.org"], "ports": [443]}]}
    closed = EgressConfig.model_validate({"permissions": named})
    open_ = EgressConfig.model_validate({"permissions": {**named, "internet": [{"public": True}]}})
    rules = {"api.example.com": True, "*.cdn.example.net": True}
    with pytest.raises(InvalidRequest, match="opens no public addresses"):
        closed.check(rules)
    open_.check(rules)
    assert [r.domains for r in open_.endpoints(rules) if isinstance(r, Rule)] == [
        ["*.cdn.example.net"],
        ["api.example.com"],
    ]
    assert open_.reaches_by_name(rules, "api.example.com")
    assert not open_.reaches_by_name(rules, "cdn.example.net")  # a wildcard: below it only
    assert not open_.reaches_by_name({"internet": True}, "api.example.com")  # addresses: unread
    assert own_domain("pypi") is None and own_domain("10.0.0.1") is None
    with pytest.raises(InvalidRequest, match="at most 64 domains"):
        open_.check({f"h{i}.example.com": True for i in range(65)})
