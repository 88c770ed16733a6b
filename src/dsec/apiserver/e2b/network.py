"""E2B's egress settings mapped onto DSec's network permissions.

E2B filters a sandbox's egress by address and name (``allowOut``/``denyOut``, everything open
unless denied, an allow winning over a deny); DSec opens by permission names the operator
configured (``pypi``, ``github``, ``internet``...), nothing unless granted, and never private
addresses through ``internet`` (public ones only). The mapping:

- nothing denied (E2B's default, ``allow_internet_access`` true): ``internet`` when the node
  offers it, plus every name in ``allowOut``;
- ``denyOut`` of ``0.0.0.0/0`` or ``allow_internet_access`` false: only the names in
  ``allowOut`` (``0.0.0.0/0`` there is ``internet``).

Addresses and ranges are taken where what DSec enforces already is what E2B would do:

- a ``denyOut`` range E2B's allow overrides (an ``allowOut`` range holding it) or one that
  holds no public address (DSec's ``internet`` never reaches those; a permission named in
  ``allowOut`` that does is an allow, which wins over a deny in E2B too), or any ``denyOut``
  entry when the sandbox is granted no ``internet``;
- an ``allowOut`` range of public addresses while the sandbox has ``internet`` (open anyway).

Everything else is a 400 naming the entry: a public address denied beside ``internet`` (DSec
denies nothing inside a permission), an address or range allowed beyond what the sandbox's
permissions reach (DSec opens addresses per operator permission, never per sandbox), header
transforms (``rules``), an egress proxy, DNS servers. A ``denyOut`` entry that is no address or
range is E2B's own 400 ("invalid denied CIDR").
"""

from __future__ import annotations

import ipaddress

from dsec.apiserver.e2b.models import NetworkInfo, NetworkUpdate
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import NetworkRules

ALL_TRAFFIC = "0.0.0.0/0"  # E2B's "everything" (the SDKs' ALL_TRAFFIC)
INTERNET = "internet"  # the permission that opens every public address (DSec's catalogue)
_HOW = "DSec opens the network by the permission names its operator configured (pypi, github, internet...)"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# What DSec's `internet` never opens (netpolicy/names.py's non-public set, IPv6 too: DSec
# gives sandboxes no IPv6 route at all).
_NONPUBLIC = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
        "192.0.0.0/24", "192.0.2.0/24", "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24",
        "203.0.113.0/24", "224.0.0.0/3", "::/0",
    )
)  # fmt: skip


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
    internet = INTERNET in rules
    for entry, found in allowed:
        if not (internet and _public(found)):
            raise InvalidRequest(
                f"allow_out {entry!r}: an address or range beyond what the sandbox's permissions "
                f"reach; {_HOW}, name one of those (DSec opens no address per sandbox)"
            )
    everything_allowed = ALL_TRAFFIC in (net.allow_out or [])
    for entry, found in denied:
        overridden = everything_allowed or entry == ALL_TRAFFIC or any(_within(found, a) for _, a in allowed)
        if internet and not overridden and not _nonpublic(found):
            raise InvalidRequest(
                f"deny_out {entry!r}: a public address beside the internet permission; DSec denies "
                f"nothing inside a permission: deny {ALL_TRAFFIC} (everything) and allow names "
                f"instead; {_HOW}"
            )
    return rules


def to_info(rules: NetworkRules) -> NetworkInfo:
    """The rules as E2B's ``network`` of a sandbox's info (what :func:`to_rules` reads back)."""
    granted = sorted(name for name, on in rules.items() if on)
    allow = [n for n in granted if n != INTERNET]
    if INTERNET in granted:
        return NetworkInfo(allow_out=allow or None)
    return NetworkInfo(allow_out=allow, deny_out=[ALL_TRAFFIC])
