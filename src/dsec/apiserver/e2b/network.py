"""E2B's egress settings mapped onto DSec's network permissions.

E2B filters a sandbox's egress by address and name (``allowOut``/``denyOut``, everything open
unless denied, an allow winning over a deny); DSec opens by permission names the operator
configured (``pypi``, ``github``, ``internet``...), nothing unless granted. The mapping:

- nothing denied (E2B's default, ``allow_internet_access`` true): ``internet`` when the node
  offers it, plus every name in ``allowOut``;
- ``denyOut`` of ``0.0.0.0/0`` or ``allow_internet_access`` false: only the names in
  ``allowOut`` (``0.0.0.0/0`` there is ``internet``).

What has no DSec counterpart is a 400 naming it: denying single addresses, allowing an address
or range, header transforms (``rules``), an egress proxy, DNS servers.
"""

from __future__ import annotations

import ipaddress

from dsec.apiserver.e2b.models import NetworkInfo, NetworkUpdate
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import NetworkRules

ALL_TRAFFIC = "0.0.0.0/0"  # E2B's "everything" (the SDKs' ALL_TRAFFIC)
INTERNET = "internet"  # the permission that opens every public address (DSec's catalogue)
_HOW = "DSec opens the network by the permission names its operator configured (pypi, github, internet...)"


def _is_address(entry: str) -> bool:
    try:
        ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return False
    return True


def to_rules(net: NetworkUpdate, *, internet_offered: bool) -> NetworkRules:
    """The DSec network rules an E2B egress configuration stands for (400 if none does)."""
    if net.rules:
        raise InvalidRequest(f"network rules (header transforms) are not supported: {_HOW}")
    if net.egress_proxy is not None:
        raise InvalidRequest("an egress proxy is not supported: sandboxes reach the network through the node")
    if net.dns_servers:
        raise InvalidRequest("dns_servers is not supported: sandboxes resolve through the node's name server")
    denied = net.deny_out or []
    refused = [d for d in denied if d != ALL_TRAFFIC]
    if refused:
        raise InvalidRequest(
            f"deny_out {refused[0]!r}: only {ALL_TRAFFIC} (everything) can be denied, since a sandbox"
            f" reaches nothing it was not granted; {_HOW}"
        )
    rules: NetworkRules = {}
    for entry in net.allow_out or []:
        if entry == ALL_TRAFFIC:
            rules[INTERNET] = True
        elif _is_address(entry):
            raise InvalidRequest(f"allow_out {entry!r}: an address or range; {_HOW}, name one of those")
        else:
            rules[entry] = True  # the edge refuses a name its node does not offer (400)
    closed = net.allow_internet_access is False or ALL_TRAFFIC in denied
    if not closed and internet_offered:
        rules[INTERNET] = True
    return rules


def to_info(rules: NetworkRules) -> NetworkInfo:
    """The rules as E2B's ``network`` of a sandbox's info (what :func:`to_rules` reads back)."""
    granted = sorted(name for name, on in rules.items() if on)
    allow = [n for n in granted if n != INTERNET]
    if INTERNET in granted:
        return NetworkInfo(allow_out=allow or None)
    return NetworkInfo(allow_out=allow, deny_out=[ALL_TRAFFIC])
