"""E2B front answers checked without a node: egress addresses and ranges (``allowOut``/
``denyOut``) onto DSec's permissions (taken where DSec already enforces what E2B would, a 400
naming the entry where it cannot), a directory's size as E2B's ext4 reports it."""

from __future__ import annotations

from typing import Any

import pytest

from dsec.apiserver.e2b.envd_entries import dir_size
from dsec.apiserver.e2b.models import NetworkUpdate
from dsec.apiserver.e2b.network import ALL_TRAFFIC, INTERNET, to_rules
from dsec.protocol.errors import InvalidRequest


def _rules(body: dict[str, Any], internet: bool = True) -> dict[str, Any]:
    return dict(to_rules(NetworkUpdate.model_validate(body), internet_offered=internet))


def test_ranges_dsec_enforces_already_are_taken() -> None:
    # A private range: `internet` never reaches it.
    assert _rules({"denyOut": ["10.0.0.0/8", "192.168.1.7", "fd00::/8"]}) == {INTERNET: True}
    # An allow holding the deny wins (E2B: allow over deny); everything allowed holds all.
    assert _rules({"denyOut": ["1.1.1.1"], "allowOut": ["1.1.1.0/24"]}) == {INTERNET: True}
    assert _rules({"denyOut": ["8.8.8.8"], "allowOut": [ALL_TRAFFIC]}) == {INTERNET: True}
    # A public range allowed while everything public is open anyway.
    assert _rules({"allowOut": ["1.1.1.1", "8.8.0.0/16", "pypi"]}) == {INTERNET: True, "pypi": True}
    # No internet granted: nothing public is reachable, so every range is denied already.
    assert _rules({"denyOut": ["8.8.8.8"]}, internet=False) == {}
    assert _rules({"denyOut": [ALL_TRAFFIC, "8.8.8.8"], "allowOut": ["pypi"]}) == {"pypi": True}


@pytest.mark.parametrize(
    ("body", "internet", "said"),
    [
        ({"denyOut": ["8.8.8.8"]}, True, "deny_out '8.8.8.8': a public address beside the internet"),
        ({"denyOut": ["0.0.0.0/1"]}, True, "deny_out '0.0.0.0/1'"),
        ({"denyOut": ["example.com"]}, True, "invalid denied CIDR example.com"),
        ({"denyOut": [ALL_TRAFFIC], "allowOut": ["1.1.1.1"]}, True, "allow_out '1.1.1.1': an address"),
        ({"allowOut": ["1.1.1.1"]}, False, "allow_out '1.1.1.1'"),
        ({"allowOut": ["10.0.0.5"]}, True, "allow_out '10.0.0.5'"),
        ({"allowOut": ["100.0.0.0/1"]}, True, "allow_out '100.0.0.0/1'"),  # holds private ranges
    ],
)
def test_what_dsec_cannot_enforce_is_a_400_naming_it(body: dict[str, Any], internet: bool, said: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        _rules(body, internet)
    assert said in caught.value.message


def test_a_directory_size_is_whole_ext4_blocks() -> None:
    # btrfs (a sandbox's disk-limited writable layer) says 0 for an empty directory and counts
    # name bytes otherwise; E2B's guests (ext4) say 4096 and more in whole blocks.
    assert [dir_size(n) for n in (0, 20, 4096, 4097, 9000)] == [4096, 4096, 4096, 8192, 12288]
