"""The kernel side of egress policy: one nftables table per edge.

Sandbox links are matched by interface name through sets (never a wildcard), so two edges on
one host, or a host firewall of its own, are left alone. What a sandbox may reach is a set of
``interface . address . protocol . port`` elements: granting and revoking is one atomic
element update, with no rule per sandbox to rewrite.

What a link may reach is the union of five sets: ``allowed`` (fixed endpoints), ``ranges``
(CIDR ranges, an interval set), ``learned`` (addresses the name server admitted from an
upstream answer, each element expiring with the answer's TTL plus a grace), ``opened``
(addresses and ranges a sandbox's own rules open on every port: public ones only, on a node
that opens public addresses at all) and ``public`` (links granted every public address:
anything not in ``nonpublic``), less ``denied`` (ranges a sandbox's rules take out of
``public``; the sets above win over it, as an allow wins over a deny in E2B). ``holding``
keeps each learned element :data:`HOLD_S` longer: a connection opened while the address was
learned stays up past the answer's expiry (as Cilium's toFQDNs: established flows are
accepted), while a new one is refused; a revoke deletes from both.

Base chains (``inet``: IPv4 and IPv6 alike):
- input: from a link, only DNS (UDP and TCP) to the gateway, and the package registry proxy's
  ports (:mod:`dsec.registry.proxy`) of the registries the link is granted (set ``registry``:
  ``interface . port``); the node itself is otherwise unreachable;
- forward: a link's packets must carry its own source address, then established connections
  to what it still holds, then only allowed endpoints; nothing is forwarded into a link but
  replies;
- output: the node opens nothing towards a sandbox but DNS replies;
- prerouting: connections to learned addresses on 443 and 80 go to the name-checking proxy
  (:mod:`.sniproxy`), which the input chain lets them reach only through that redirect;
- postrouting: sandbox traffic leaves with the node's address (endpoints need no route back).

Rejects answer at once (a TCP reset; ICMP ``admin-prohibited`` for the rest), so a blocked
connect fails fast rather than hanging a tool until its timeout. TCP gets resets because the
kernel rate-limits ICMP errors (about one per second per destination after a small burst).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dsec.native import spawner
from dsec.protocol.errors import InfraFailure, InfraReason

Element = tuple[str, str, str, int]  # interface, address (or a CIDR range), protocol, port


@dataclass(frozen=True)
class Reach:
    """What one link may reach, beside the addresses it learns from answers: endpoints and
    ranges of its permissions (``elements``), every public address (``public``), the registry
    proxy's ports (``registry``: interface, port), addresses or ranges its own rules open on
    every port (``opened``) or take out of ``public`` (``denied``)."""

    elements: frozenset[Element] = frozenset()
    public: bool = False
    registry: frozenset[tuple[str, int]] = frozenset()
    opened: frozenset[str] = frozenset()
    denied: frozenset[str] = frozenset()


# Never "public": this network, private, shared (CGNAT), loopback, link-local, IETF protocol
# assignments, benchmarking, multicast and reserved (224/3 holds 255.255.255.255 too). The
# node's own addresses are never forwarded to at all (the input chain answers for them).
NONPUBLIC = (
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "224.0.0.0/3",
)

# How long an established connection to a learned address outlives the address's answer.
HOLD_S = 24 * 3600

# The table's named counters, read at scrape time (:func:`read_counters`). Denials, packets:
# not_granted: from a sandbox to an endpoint its rules do not grant (each refused TCP SYN is
# one connection attempt); node: to the node itself beyond DNS and the proxies; spoofed: with
# a source address not the link's; inbound: towards a sandbox, not a reply. Granted: new
# connections (a TCP SYN, a UDP flow's first datagram) let out to a granted endpoint.
DENIALS = ("not_granted", "node", "spoofed", "inbound")
GRANTED = "granted"

_TABLE = re.compile(r"[^A-Za-z0-9_]")


def table_name(node: str, data_dir: str) -> str:
    """Per edge: the node's name, and its data directory (two edges on one host never share)."""
    return f"dsec_{_TABLE.sub('_', node)[:32]}_{hashlib.sha256(data_dir.encode()).hexdigest()[:8]}"


def _elements(items: Iterable[str]) -> str:
    return ", ".join(items)


def _link(ifname: str, address: str) -> str:
    return f'"{ifname}" . {address}'


def _allowed(e: Element) -> str:
    return f'"{e[0]}" . {e[1]} . {e[2]} . {e[3]}'


def _registry(e: tuple[str, int]) -> str:
    return f'"{e[0]}" . {e[1]}'


def _is_range(e: Element) -> bool:
    return "/" in e[1]


def _init(items: list[str]) -> str:
    return f"elements = {{ {_elements(items)} }}" if items else ""


def ruleset(
    table: str,
    gateway: str,
    pool: str,
    links: dict[str, str],
    reach: Mapping[str, Reach] | None = None,
    checked: dict[int, int] | None = None,
) -> str:
    """The whole table (replacing any earlier one atomically): ``links`` maps interface ->
    sandbox address, ``reach`` interface -> what it may reach; ``checked`` maps a port to the
    name-checking proxy's port on the gateway (:mod:`.sniproxy`), for connections to learned
    addresses."""
    reach = reach or {}
    checked = checked or {}
    learned = "iifname @ifaces iifname . ip daddr . meta l4proto . th dport @learned"
    redirects = "\n    ".join(
        f"{learned} tcp dport {port} redirect to :{to}" for port, to in sorted(checked.items())
    )
    proxy_ports = ", ".join(str(to) for to in sorted(checked.values()))
    proxy_in = (
        f"iifname @ifaces ip daddr {gateway} tcp dport {{ {proxy_ports} }} ct status dnat accept"
        if checked
        else ""
    )
    allowed = [e for r in reach.values() for e in r.elements]
    ifaces = _init([f'"{i}"' for i in links])
    pairs = _init([_link(i, a) for i, a in links.items()])
    grants = _init([_allowed(e) for e in allowed if not _is_range(e)])
    ranges = _init([_allowed(e) for e in allowed if _is_range(e)])
    opened = _init([_link(i, a) for i, r in reach.items() for a in sorted(r.opened)])
    denied = _init([_link(i, a) for i, r in reach.items() for a in sorted(r.denied)])
    publics = _init([f'"{i}"' for i, r in reach.items() if r.public])
    registries = _init([_registry(e) for r in reach.values() for e in sorted(r.registry)])
    counters = "\n  ".join(f"counter {name} {{ }}" for name in (*DENIALS, GRANTED))
    # New connections only (``ct state new`` first: a packet of an established flow stops
    # there), counted where they are let through; the plain rules below accept the rest.
    # ``denied`` comes after every set that names an endpoint (an allow wins) and before
    # ``public``, whose established flows it cuts too.
    to = "iifname . ip daddr . meta l4proto . th dport"
    granted = "\n    ".join(
        [
            f"iifname @ifaces ct state new {to} @{s} counter name {GRANTED} accept"
            for s in ("allowed", "ranges", "learned")
        ]
        + [f"iifname @ifaces ct state new iifname . ip daddr @opened counter name {GRANTED} accept"]
    )
    return f"""table inet {table}
delete table inet {table}
table inet {table} {{
  set ifaces {{
    type ifname
    {ifaces}
  }}
  set links {{
    type ifname . ipv4_addr
    {pairs}
  }}
  set allowed {{
    type ifname . ipv4_addr . inet_proto . inet_service
    {grants}
  }}
  set ranges {{
    type ifname . ipv4_addr . inet_proto . inet_service
    flags interval
    {ranges}
  }}
  set learned {{
    type ifname . ipv4_addr . inet_proto . inet_service
    flags timeout
  }}
  set holding {{
    type ifname . ipv4_addr . inet_proto . inet_service
    flags timeout
  }}
  set opened {{
    type ifname . ipv4_addr
    flags interval
    {opened}
  }}
  set denied {{
    type ifname . ipv4_addr
    flags interval
    {denied}
  }}
  set public {{
    type ifname
    {publics}
  }}
  set registry {{
    type ifname . inet_service
    {registries}
  }}
  set nonpublic {{
    type ipv4_addr
    flags interval
    elements = {{ {_elements(NONPUBLIC)} }}
  }}
  {counters}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname @ifaces iifname . ip saddr != @links counter name spoofed drop
    iifname @ifaces ip daddr {gateway} meta l4proto {{ tcp, udp }} th dport 53 accept
    {proxy_in}
    iifname @ifaces ip daddr {gateway} meta l4proto tcp iifname . th dport @registry accept
    iifname @ifaces meta l4proto tcp counter name node reject with tcp reset
    iifname @ifaces counter name node reject with icmpx admin-prohibited
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    oifname @ifaces ct state established,related accept
    oifname @ifaces counter name inbound drop
    iifname @ifaces iifname . ip saddr != @links counter name spoofed drop
    iifname @ifaces ct state established iifname . ip daddr . meta l4proto . th dport @holding accept
    {granted}
    iifname @ifaces iifname . ip daddr . meta l4proto . th dport @allowed accept
    iifname @ifaces iifname . ip daddr . meta l4proto . th dport @ranges accept
    iifname @ifaces iifname . ip daddr . meta l4proto . th dport @learned accept
    iifname @ifaces iifname . ip daddr @opened accept
    iifname @public iifname . ip daddr @denied meta l4proto tcp counter name not_granted reject with tcp reset
    iifname @public iifname . ip daddr @denied counter name not_granted reject with icmpx admin-prohibited
    iifname @public ct state new ip daddr != @nonpublic counter name {GRANTED} accept
    iifname @public ip daddr != @nonpublic accept
    iifname @ifaces meta l4proto tcp counter name not_granted reject with tcp reset
    iifname @ifaces counter name not_granted reject with icmpx admin-prohibited
  }}
  chain output {{
    type filter hook output priority filter; policy accept;
    oifname @ifaces ct state established,related accept
    oifname @ifaces counter name inbound drop
  }}
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname @ifaces iifname . ip daddr . meta l4proto . th dport @allowed return
    iifname @ifaces iifname . ip daddr @opened return
    {redirects}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {pool} oifname != @ifaces masquerade
  }}
}}
"""


def _element_updates(table: str, verb: str, elements: Iterable[Element]) -> list[str]:
    lines = []
    for name, chosen in (
        ("allowed", sorted(e for e in elements if not _is_range(e))),
        ("ranges", sorted(e for e in elements if _is_range(e))),
    ):
        if chosen:
            lines.append(f"{verb} element inet {table} {name} {{ {_elements(map(_allowed, chosen))} }}")
    return lines


def _updates(table: str, ifname: str, old: Reach, new: Reach) -> list[str]:
    """The element updates that turn ``old`` into ``new`` (deletions first)."""
    lines = _element_updates(table, "delete", old.elements - new.elements)
    lines += _element_updates(table, "add", new.elements - old.elements)
    if old.public != new.public:
        lines.append(f'{"add" if new.public else "delete"} element inet {table} public {{ "{ifname}" }}')
    for verb, before, after in (("delete", new, old), ("add", old, new)):
        ports = sorted(after.registry - before.registry)
        if ports:
            lines.append(f"{verb} element inet {table} registry {{ {_elements(map(_registry, ports))} }}")
        for name in ("opened", "denied"):
            chosen = sorted(getattr(after, name) - getattr(before, name))
            if chosen:
                items = _elements(_link(ifname, a) for a in chosen)
                lines.append(f"{verb} element inet {table} {name} {{ {items} }}")
    return lines


def grant(table: str, ifname: str, address: str, old: Reach, new: Reach) -> str:
    """One atomic update: the link's interface known, what it reaches changed from ``old``
    to ``new``."""
    lines = [
        f'add element inet {table} ifaces {{ "{ifname}" }}',
        f"add element inet {table} links {{ {_link(ifname, address)} }}",
        *_updates(table, ifname, old, new),
    ]
    return "\n".join(lines) + "\n"


def forget(table: str, ifname: str, address: str, old: Reach) -> str:
    lines = [
        *_updates(table, ifname, old, Reach()),
        f'delete element inet {table} ifaces {{ "{ifname}" }}',
        f"delete element inet {table} links {{ {_link(ifname, address)} }}",
    ]
    return "\n".join(lines) + "\n"


def learn(
    table: str,
    elements: Iterable[tuple[Element, int]],
    refresh: Iterable[Element] = (),
    rehold: Iterable[Element] = (),
) -> str:
    """Admit addresses an upstream answer gave, each for ``seconds`` (the kernel drops the
    element then) and held for established connections :data:`HOLD_S` longer. An element still
    in a set (``refresh``: in ``learned``, ``rehold``: in ``holding``) is deleted and added
    again: ``add`` alone would keep its old timeout."""
    lines = [f"delete element inet {table} learned {{ {_allowed(e)} }}" for e in refresh]
    lines += [f"delete element inet {table} holding {{ {_allowed(e)} }}" for e in rehold]
    for e, seconds in elements:
        lines.append(f"add element inet {table} learned {{ {_allowed(e)} timeout {max(1, seconds)}s }}")
        lines.append(
            f"add element inet {table} holding {{ {_allowed(e)} timeout {max(1, seconds) + HOLD_S}s }}"
        )
    return "\n".join(lines) + "\n"


def unlearn(table: str, elements: Iterable[Element], held: Iterable[Element] = ()) -> str:
    """Take admitted addresses back (a revoked grant or a stopped sandbox): ``elements`` from
    ``learned``, ``held`` from ``holding`` (which cuts established connections to them)."""
    return "".join(
        [f"delete element inet {table} learned {{ {_allowed(e)} }}\n" for e in elements]
        + [f"delete element inet {table} holding {{ {_allowed(e)} }}\n" for e in held]
    )


def drop_table(table: str) -> str:
    return f"table inet {table}\ndelete table inet {table}\n"


async def read_counters(table: str) -> dict[str, int]:
    """The table's named counters (:data:`DENIALS`, :data:`GRANTED`): packets each, as the kernel
    counts them now; empty if the table is not there (one ``nft -j`` run, ~ms)."""
    try:
        proc = await spawner.create_subprocess_exec(
            "nft",
            "-j",
            "list",
            "counters",
            "table",
            "inet",
            table,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except FileNotFoundError:
        return {}
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        return {}
    try:
        items = json.loads(out)["nftables"]
        counters = [item["counter"] for item in items if isinstance(item, dict) and "counter" in item]
        return {str(c["name"]): int(c["packets"]) for c in counters if c.get("table") == table}
    except (ValueError, KeyError, TypeError):
        return {}


async def apply(script: str) -> None:
    """Run an nft script as one transaction (all of it or none)."""
    try:
        proc = await spawner.create_subprocess_exec(
            "nft",
            "-f",
            "-",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError as exc:
        raise InfraFailure("nft (Debian's nftables) is not installed", reason=InfraReason.network) from exc
    _, err = await proc.communicate(script.encode())
    if proc.returncode != 0:
        why = err.decode(errors="replace")[-800:]
        raise InfraFailure(f"nftables refused the update: {why}", reason=InfraReason.network)
