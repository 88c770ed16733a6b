"""The kernel side of egress policy: one nftables table per edge.

Sandbox links are matched by interface name through sets (never a wildcard), so two edges on
one host, or a host firewall of its own, are left alone. What a sandbox may reach is a set of
``interface . address . protocol . port`` elements: granting and revoking is one atomic
element update, with no rule per sandbox to rewrite.

Base chains (``inet``: IPv4 and IPv6 alike):
- input: from a link, only DNS to the gateway; the node itself is otherwise unreachable;
- forward: a link's packets must carry its own source address, then only allowed endpoints;
  nothing is forwarded into a link but replies;
- output: the node opens nothing towards a sandbox but DNS replies;
- postrouting: sandbox traffic leaves with the node's address (endpoints need no route back).

Rejects answer at once (a TCP reset; ICMP ``admin-prohibited`` for the rest), so a blocked
connect fails fast rather than hanging a tool until its timeout. TCP gets resets because the
kernel rate-limits ICMP errors (about one per second per destination after a small burst).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Iterable

from dsec.executor import spawner
from dsec.protocol.errors import InfraFailure

Element = tuple[str, str, str, int]  # interface, address, protocol, port

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


def ruleset(table: str, gateway: str, pool: str, links: dict[str, str], allowed: Iterable[Element]) -> str:
    """The whole table (replacing any earlier one atomically): ``links`` maps interface ->
    sandbox address."""
    allowed = list(allowed)
    names = _elements(f'"{i}"' for i in links)
    ifaces = f"elements = {{ {names} }}" if links else ""
    pairs = f"elements = {{ {_elements(_link(i, a) for i, a in links.items())} }}" if links else ""
    grants = f"elements = {{ {_elements(_allowed(e) for e in allowed)} }}" if allowed else ""
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
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname @ifaces iifname . ip saddr != @links drop
    iifname @ifaces ip daddr {gateway} udp dport 53 accept
    iifname @ifaces meta l4proto tcp reject with tcp reset
    iifname @ifaces reject with icmpx admin-prohibited
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    oifname @ifaces ct state established,related accept
    oifname @ifaces drop
    iifname @ifaces iifname . ip saddr != @links drop
    iifname @ifaces iifname . ip daddr . meta l4proto . th dport @allowed accept
    iifname @ifaces meta l4proto tcp reject with tcp reset
    iifname @ifaces reject with icmpx admin-prohibited
  }}
  chain output {{
    type filter hook output priority filter; policy accept;
    oifname @ifaces ct state established,related accept
    oifname @ifaces drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {pool} oifname != @ifaces masquerade
  }}
}}
"""


def grant(table: str, ifname: str, address: str, old: Iterable[Element], new: Iterable[Element]) -> str:
    """One atomic update: the link's interface known, its old grants replaced by ``new``."""
    lines = [
        f'add element inet {table} ifaces {{ "{ifname}" }}',
        f"add element inet {table} links {{ {_link(ifname, address)} }}",
    ]
    old, new = set(old), set(new)
    for verb, elements in (("delete", sorted(old - new)), ("add", sorted(new - old))):
        if elements:
            lines.append(f"{verb} element inet {table} allowed {{ {_elements(map(_allowed, elements))} }}")
    return "\n".join(lines) + "\n"


def forget(table: str, ifname: str, address: str, old: Iterable[Element]) -> str:
    old = sorted(set(old))
    lines = [
        f'delete element inet {table} ifaces {{ "{ifname}" }}',
        f"delete element inet {table} links {{ {_link(ifname, address)} }}",
    ]
    if old:
        lines.append(f"delete element inet {table} allowed {{ {_elements(map(_allowed, old))} }}")
    return "\n".join(lines) + "\n"


def drop_table(table: str) -> str:
    return f"table inet {table}\ndelete table inet {table}\n"


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
        raise InfraFailure("nft (Debian's nftables) is not installed", reason="network") from exc
    _, err = await proc.communicate(script.encode())
    if proc.returncode != 0:
        why = err.decode(errors="replace")[-800:]
        raise InfraFailure(f"nftables refused the update: {why}", reason="network")
