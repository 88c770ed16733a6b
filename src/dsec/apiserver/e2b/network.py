"""E2B's egress settings mapped onto DSec's network permissions.

E2B filters a sandbox's egress by address and name (``allowOut``/``denyOut``, everything open
unless denied, an allow winning over a deny); DSec opens by permission names the operator
configured (``pypi``, ``github``, ``internet``...), nothing unless granted, and never private
addresses through ``internet`` (public ones only), plus public addresses a sandbox's own rules
open or take out of ``internet`` (:func:`dsec.netpolicy.config.address_of`). The mapping:

- nothing denied (E2B's default, ``allow_internet_access`` true): ``internet`` when the node
  offers it, plus every name in ``allowOut``;
- ``denyOut`` of ``0.0.0.0/0`` or ``allow_internet_access`` false: only the names in
  ``allowOut`` (``0.0.0.0/0`` there is ``internet``);
- an ``allowOut`` address or range of public IPv4 addresses: opened for the sandbox, on every
  port (the node refuses it when it opens no public address at all);
- a ``denyOut`` address or range holding public addresses beside ``internet``: taken out of it,
  unless an ``allowOut`` range holds it (E2B: allow wins; DSec's opened ranges and permissions
  win over a denied range too). One that holds no public address, or any when the sandbox has
  no ``internet``, is denied already and adds nothing.

Everything else is a 400 naming the entry: an address or range allowed that holds private,
loopback, link-local or IPv6 addresses (DSec opens those by operator permission only), header
transforms (``rules``), an egress proxy, DNS servers. A ``denyOut`` entry that is no address or
range is E2B's own 400 ("invalid denied CIDR").
"""

from __future__ import annotations

import ipaddress

from dsec.apiserver.e2b.models import NetworkInfo, NetworkUpdate
from dsec.netpolicy.config import address_of, range_text
from dsec.netpolicy.nft import NONPUBLIC
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import NetworkRules

ALL_TRAFFIC = "0.0.0.0/0"  # E2B's "everything" (the SDKs' ALL_TRAFFIC)
INTERNET = "internet"  # the permission that opens every public address (DSec's catalogue)
_HOW = "DSec opens the network by the permission names its operator configured (pypi, github, internet...)"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# What DSec's `internet` never opens: the firewall's non-public set, and IPv6 (DSec gives
# sandboxes no IPv6 route at all).
_NONPUBLIC = (*(ipaddress.ip_network(n) for n in NONPUBLIC), ipaddress.ip_network("::/0"))


def _network(entry: str) -> Network | None:
    try:
        return ipaddress.ip_network(entry.strip(), strict=False)
    except ValueError:
        return None


def _within(inner: Network, outer: Network) -> bool:
    return inner.version == outer.version and inner.subnet_of(outer)  # type: ignore[arg-type]


def _nonpublic(net: Network) -> bool:
    return any(_within(net, n) for n in _NONPUBLIC)


def _public(net: Network) -> bool:
    """Every address of ``net`` is public (no part of it overlaps a non-public range)."""
    return not any(net.version == n.version and net.overlaps(n) for n in _NONPUBLIC)


def to_rules(net: NetworkUpdate, *, internet_offered: bool) -> NetworkRules:
    """The DSec network rules an E2B egress configuration stands for (400 if none does)."""
    if net.rules:
        raise InvalidRequest(f"network rules (header transforms) are not supported: {_HOW}")
    if net.egress_proxy is not None:
        raise InvalidRequest("an egress proxy is not supported: sandboxes reach the network through the node")
    if net.dns_servers:
        raise InvalidRequest("dns_servers is not supported: sandboxes resolve through the node's name server")
    denied: list[tuple[str, Network]] = []
    for entry in net.deny_out or []:
        found = _network(entry)
        if found is None:  # E2B's validateEgressRules: deny rules take addresses only
            raise InvalidRequest(f"invalid denied CIDR {entry}")
        denied.append((entry, found))
    rules: NetworkRules = {}
    allowed: list[tuple[str, Network]] = []
    for entry in net.allow_out or []:
        if entry == ALL_TRAFFIC:
            rules[INTERNET] = True
        elif (found := _network(entry)) is not None:
            allowed.append((entry, found))
        else:
            rules[entry] = True  # the edge refuses a name its node does not offer (400)
    closed = net.allow_internet_access is False or ALL_TRAFFIC in (e for e, _ in denied)
    if not closed and internet_offered:
        rules[INTERNET] = True
    for entry, found in allowed:
        if not isinstance(found, ipaddress.IPv4Network) or not _public(found):
            raise InvalidRequest(
                f"allow_out {entry!r}: a sandbox opens public IPv4 addresses only (this holds private,"
                f" loopback, link-local, multicast or IPv6 ones); {_HOW}, name one of those"
            )
        rules[range_text(found)] = True
    if INTERNET in rules and ALL_TRAFFIC not in (net.allow_out or []):
        for _, found in denied:
            if isinstance(found, ipaddress.IPv4Network) and not _nonpublic(found):
                if not any(_within(found, a) for _, a in allowed):  # E2B: an allow wins
                    rules.setdefault(range_text(found), False)
    return rules


def to_info(rules: NetworkRules) -> NetworkInfo:
    """The rules as E2B's ``network`` of a sandbox's info (what :func:`to_rules` reads back)."""
    granted = sorted(name for name, on in rules.items() if on)
    allow = [n for n in granted if n != INTERNET]
    refused = sorted(k for k, on in rules.items() if not on and address_of(k) is not None)
    if INTERNET in granted:
        return NetworkInfo(allow_out=allow or None, deny_out=refused or None)
    return NetworkInfo(allow_out=allow, deny_out=[ALL_TRAFFIC])
