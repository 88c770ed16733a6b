"""E2B front answers checked without a node: egress addresses and ranges (``allowOut``/
``denyOut``) onto DSec's permissions (taken where DSec already enforces what E2B would, a 400
naming the entry where it cannot), a directory's size as E2B's ext4 reports it."""

from __future__ import annotations

from typing import Any

import pytest

from dsec.apiserver.e2b.envd_entries import dir_size
from dsec.apiserver.e2b.models import NetworkUpdate
from dsec.apiserver.e2b.network import ALL_TRAFFIC, INTERNET, headers_info, to_headers, to_info, to_rules
from dsec.protocol.errors import InvalidRequest


def _rules(body: dict[str, Any], internet: bool = True) -> dict[str, Any]:
    return dict(to_rules(NetworkUpdate.model_validate(body), internet_offered=internet))


def test_ranges_dsec_enforces_already_add_nothing() -> None:
    # A private range: `internet` never reaches it.
    assert _rules({"denyOut": ["10.0.0.0/8", "192.168.1.7", "fd00::/8"]}) == {INTERNET: True}
    # Everything allowed holds every deny (E2B: allow over deny).
    assert _rules({"denyOut": ["8.8.8.8"], "allowOut": [ALL_TRAFFIC]}) == {INTERNET: True}
    # No internet granted: nothing public is reachable, so every range is denied already.
    assert _rules({"denyOut": ["8.8.8.8"]}, internet=False) == {}
    assert _rules({"denyOut": [ALL_TRAFFIC, "8.8.8.8"], "allowOut": ["pypi"]}) == {"pypi": True}


def test_public_addresses_are_opened_and_denied_per_sandbox() -> None:
    # Beside internet, a denied public range is taken out of it (host bits dropped, as E2B's
    # Go parser does); one an allowed range holds stays open (E2B: allow over deny).
    assert _rules({"denyOut": ["8.8.8.8", "1.2.3.4/24"]}) == {
        INTERNET: True,
        "8.8.8.8": False,
        "1.2.3.0/24": False,
    }
    assert _rules({"denyOut": ["1.1.1.1"], "allowOut": ["1.1.1.0/24"]}) == {
        INTERNET: True,
        "1.1.1.0/24": True,
    }
    # An allowed address inside a denied range: both kept, the node's firewall lets the allow win.
    assert _rules({"denyOut": ["1.0.0.0/8"], "allowOut": ["1.1.1.1"]}) == {
        INTERNET: True,
        "1.1.1.1": True,
        "1.0.0.0/8": False,
    }
    # Closed, or internet not offered: the allowed public addresses alone (the edge refuses
    # them where its node opens no public address at all).
    assert _rules({"denyOut": [ALL_TRAFFIC], "allowOut": ["1.1.1.1", "pypi"]}) == {
        "1.1.1.1": True,
        "pypi": True,
    }
    assert _rules({"allowOut": ["8.8.0.0/16"]}, internet=False) == {"8.8.0.0/16": True}


@pytest.mark.parametrize(
    "rules",
    [{INTERNET: True, "8.8.8.8": False, "1.1.1.1": True}, {"1.1.1.0/24": True, "pypi": True}, {}],
)
def test_the_info_reads_back_as_the_same_rules(rules: dict[str, Any]) -> None:
    info = to_info(rules).wire()
    assert _rules(info, internet=INTERNET in rules) == rules, info


@pytest.mark.parametrize(
    ("body", "internet", "said"),
    [
        ({"denyOut": ["example.com"]}, True, "invalid denied CIDR example.com"),
        ({"allowOut": ["10.0.0.5"]}, True, "allow_out '10.0.0.5': a sandbox opens public IPv4"),
        ({"allowOut": ["100.0.0.0/1"]}, True, "allow_out '100.0.0.0/1'"),  # holds private ranges
        ({"allowOut": ["2001:db8::1"]}, True, "allow_out '2001:db8::1'"),
        ({"egressProxy": {"address": "proxy.example.com:1080"}}, True, "an egress proxy is not supported"),
    ],
)
def test_what_dsec_cannot_enforce_is_a_400_naming_it(body: dict[str, Any], internet: bool, said: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        _rules(body, internet)
    assert said in caught.value.message


def test_rules_become_egress_headers_in_dsec_s_spelling_and_read_back_as_e2b_s() -> None:
    given = {
        "API.Example.com": [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.Open-AI}x"}}}],
        "plain.example.com": [{"transform": {"headers": {"X-A": "$notaplaceholder ${e2b.secret.x}"}}}],
        "empty.example.com": [],
    }
    headers = to_headers(NetworkUpdate.model_validate({"rules": given}))
    assert headers == {
        # A secret's name as E2B canonicalizes it (NormalizeName: lower case); text around is kept.
        "api.example.com": {"Authorization": "Bearer ${secrets.open-ai}x"},
        "plain.example.com": {"X-A": "$notaplaceholder ${e2b.secret.x}"},  # opaque: no known prefix
        "empty.example.com": {},
    }
    assert headers_info(headers)["api.example.com"] == [
        {"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.open-ai}x"}}}
    ]


@pytest.mark.parametrize(
    "value",
    [
        "${e2b.secrets.a${e2b.secrets.b}}",
        "${e2b.secrets.has space}",
        "${e2b.secrets.sec_x}",
        "${e2b.secrets.}",
    ],
)
def test_a_malformed_placeholder_is_e2b_s_400(value: str) -> None:
    with pytest.raises(InvalidRequest, match="malformed E2B placeholder"):
        to_headers(
            NetworkUpdate.model_validate({"rules": {"a.com": [{"transform": {"headers": {"A": value}}}]}})
        )


def test_a_directory_size_is_whole_ext4_blocks() -> None:
    # btrfs (a sandbox's disk-limited writable layer) says 0 for an empty directory and counts
    # name bytes otherwise; E2B's guests (ext4) say 4096 and more in whole blocks.
    assert [dir_size(n) for n in (0, 20, 4096, 4097, 9000)] == [4096, 4096, 4096, 8192, 12288]
