"""What one link's queries are answered with, and which addresses an answer admits.

A name of a fixed endpoint (:class:`~dsec.netpolicy.config.Endpoint`) answers with the
configured address, as it always did. A name that a granted domain rule matches is resolved
upstream (:mod:`.upstream`); from the answer the addresses that point inside (private,
loopback, link-local, multicast, or the node's own: DNS rebinding) are dropped unless the rule
names them itself, the rest are admitted for this link on the rule's ports for the answer's
TTL plus a grace (``grace_s``: a client that resolved just before expiry still connects;
:class:`Admissions`), and only then does the sandbox get its answer,
so its connect never races its own grant. Only A questions go upstream; AAAA and every other
type of an allowed name has no data (sandboxes have no IPv6; TXT and the like would be a
channel out); every other name does not exist, and is never asked upstream.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import dns.rcode

from dsec.netpolicy import nft
from dsec.netpolicy.config import Rule
from dsec.netpolicy.dns import QTYPE_A, answer, forwarded, question
from dsec.netpolicy.upstream import Upstream
from dsec.protocol.errors import InfraFailure

log = logging.getLogger(__name__)

MAX_PER_LINK = 4096  # live addresses one sandbox may hold from answers at once

_NONPUBLIC = [ipaddress.IPv4Network(n) for n in nft.NONPUBLIC]


@dataclass
class DomainGrant:
    """The domain rules a link holds, by permission name."""

    rules: list[tuple[str, Rule]] = field(default_factory=list)

    def matching(self, name: str) -> list[tuple[str, Rule]]:
        return [(perm, rule) for perm, rule in self.rules if rule.matches(name)]


def inside(address: str, node_addresses: frozenset[str]) -> bool:
    """An address a public name has no business pointing at (DNS rebinding)."""
    ip = ipaddress.IPv4Address(address)
    return address in node_addresses or any(ip in net for net in _NONPUBLIC)


@dataclass
class _Held:
    until: float  # monotonic: the kernel's ``learned`` element expires then (new connections)
    hold_until: float  # ... and its ``holding`` one (established connections)
    permission: str


class Admissions:
    """Addresses learned from answers, per link: what the kernel's ``learned`` and ``holding``
    sets hold and until when, and which permission admitted each (a revoked permission takes
    its addresses back at once, established connections included)."""

    def __init__(self, table: str, apply: Callable[[str], Awaitable[None]]) -> None:
        self.table = table
        self._apply = apply
        self._held: dict[str, dict[nft.Element, _Held]] = {}

    async def admit(
        self, ifname: str, permission: str, elements: Iterable[nft.Element], seconds: int
    ) -> bool:
        """Admit ``elements`` for ``seconds``; False when the link holds :data:`MAX_PER_LINK`
        live addresses already (a sandbox resolving endless names under a wildcard must not
        fill the node's set: its answer then comes back without addresses)."""
        now = time.monotonic()
        held = self._held.setdefault(ifname, {})
        if len(held) >= MAX_PER_LINK:
            for e in [e for e, h in held.items() if h.hold_until <= now]:
                del held[e]  # expired in the kernel already
            if len(held) >= MAX_PER_LINK:
                # Full of addresses only held for established connections: those go first
                # (their connections are cut) before an answer goes without addresses.
                stale = {e for e, h in held.items() if h.until <= now}
                await self._unlearn([], stale)
                for e in stale:
                    del held[e]
            if len(held) >= MAX_PER_LINK:
                return False
        fresh, refresh, rehold = [], [], []
        for e in elements:
            h = held.get(e)
            if h is not None and h.until - now > seconds / 2:
                continue  # admitted long enough already
            fresh.append((e, seconds))
            if h is not None and h.until - now > 1:
                refresh.append(e)  # still in the set: replaced, to take the new timeout
            if h is not None and h.hold_until - now > 1:
                rehold.append(e)
        if not fresh:
            return True
        try:
            await self._apply(nft.learn(self.table, fresh, refresh, rehold))
        except InfraFailure:
            # One of them expired in the kernel between our look and the update: add alone.
            await self._apply(nft.learn(self.table, fresh))
        for e, s in fresh:
            held[e] = _Held(now + s, now + s + nft.HOLD_S, permission)
        return True

    async def revoke(self, ifname: str, keep: Callable[[str], bool]) -> None:
        """Take back what permissions no longer granted (``keep(permission)`` False) admitted."""
        held = self._held.get(ifname, {})
        now = time.monotonic()
        gone = [e for e, h in held.items() if not keep(h.permission)]
        # The rest expired in the kernel by now.
        live = [e for e in gone if held[e].until - now > 1]
        holding = [e for e in gone if held[e].hold_until - now > 1]
        for e in gone:
            del held[e]
        await self._unlearn(live, holding)

    async def _unlearn(self, learned: Iterable[nft.Element], holding: Iterable[nft.Element]) -> None:
        learned, holding = sorted(learned), sorted(holding)
        if not learned and not holding:
            return
        try:
            await self._apply(nft.unlearn(self.table, learned, holding))
        except InfraFailure:
            # One had expired in the kernel already: the rest one by one.
            ones: list[tuple[list[nft.Element], list[nft.Element]]] = [([e], []) for e in learned]
            ones += [([], [e]) for e in holding]
            for one in ones:
                try:
                    await self._apply(nft.unlearn(self.table, *one))
                except InfraFailure:
                    continue

    async def forget(self, ifname: str) -> None:
        """The link is gone (its interface name never comes back): what it held goes now
        rather than in :data:`~dsec.netpolicy.nft.HOLD_S`."""
        await self.revoke(ifname, lambda _: False)
        self._held.pop(ifname, None)


class LinkNames:
    """Answers the queries of one link (see the module's docstring)."""

    def __init__(
        self,
        ifname: str,
        static: dict[str, list[str]],
        domains: DomainGrant,
        upstream: Upstream,
        admissions: Admissions,
        node_addresses: frozenset[str],
        grace_s: int,
    ) -> None:
        self.ifname = ifname
        self.static = static
        self.domains = domains
        self._upstream = upstream
        self._admissions = admissions
        self._node = node_addresses
        self._grace = grace_s

    async def respond(self, query: bytes) -> bytes | None:
        q = question(query)
        matching = self.domains.matching(q[0]) if q is not None and q[0] not in self.static else []
        if not matching:
            return answer(query, self.static.get)
        name, qtype = q  # type: ignore[misc]
        if qtype != QTYPE_A:
            return forwarded(query, dns.rcode.NOERROR, [], [], 0)
        resolved = await self._upstream.resolve(name)
        if resolved.rcode != dns.rcode.NOERROR:
            return forwarded(query, resolved.rcode, [], [], 0)
        ttl = max(1, resolved.remaining(time.monotonic()))
        kept: list[str] = []
        for address in resolved.addresses:
            named = any(rule.covers(ipaddress.IPv4Address(address)) for _, rule in matching)
            if named or not inside(address, self._node):
                kept.append(address)
        for perm, rule in matching:
            elements = [(self.ifname, a, rule.protocol, port) for a in kept for port in rule.ports]
            if not await self._admissions.admit(self.ifname, perm, elements, ttl + self._grace):
                log.warning("%s holds %d learned addresses: %s not admitted", self.ifname, MAX_PER_LINK, name)
                kept = []
        return forwarded(query, dns.rcode.NOERROR, list(resolved.chain), kept, ttl)
