"""Upstream name resolution for domain rules: the node's resolvers asked, answers cached.

Only A queries go upstream, and only for names a sandbox's grants allow (the name server
decides that before asking). From an answer only the CNAME chain that starts at the asked
name and the A records at its end are kept: records for other names in the same answer (an
upstream's "additional" data, or an injected record) never reach a sandbox or its allowed set.
Answers are cached for their TTL (negative ones for :data:`NEGATIVE_TTL_S`), and concurrent
questions for one name share one upstream query, so a burst of a thousand sandboxes resolving
``pypi.org`` asks upstream once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype

log = logging.getLogger(__name__)

NEGATIVE_TTL_S = 30
MAX_TTL_S = 3600  # a longer TTL would keep an address admitted long after its owner moved
MIN_TTL_S = 5
MAX_CHAIN = 8  # CNAMEs followed from the asked name


@dataclass(frozen=True)
class Resolved:
    """What upstream said of one name: its rcode, the CNAME chain from it, the addresses at
    the chain's end, and how long all of it may be trusted (seconds from ``at``)."""

    rcode: int
    chain: tuple[tuple[str, str], ...]
    addresses: tuple[str, ...]
    ttl: int
    at: float

    def remaining(self, now: float) -> int:
        return max(0, int(self.at + self.ttl - now))


SERVFAIL = Resolved(dns.rcode.SERVFAIL, (), (), 0, 0.0)


def resolv_conf(path: Path = Path("/etc/resolv.conf")) -> list[str]:
    """The IPv4 name servers the node itself uses."""
    servers = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                servers.append(str(ipaddress.IPv4Address(parts[1])))
            except ValueError:
                continue  # IPv6 resolvers: sandboxes have no IPv6, nor does this forwarder
    return servers


class Upstream:
    """Resolves names through ``servers`` in order (UDP, TCP when an answer is truncated)."""

    def __init__(
        self, servers: list[str], *, port: int = 53, timeout: float = 2.0, max_entries: int = 10_000
    ) -> None:
        self.servers, self.port = servers, port
        self.timeout = timeout
        self.max_entries = max_entries
        self._cache: OrderedDict[str, Resolved] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[Resolved]] = {}
        self.queries = 0  # sent upstream (what the cache saved is lookups - queries)
        self.lookups = 0

    async def resolve(self, name: str) -> Resolved:
        """The A answer for ``name`` (lower case, no trailing dot), from the cache if fresh."""
        self.lookups += 1
        now = time.monotonic()
        hit = self._cache.get(name)
        if hit is not None and hit.remaining(now) > 0:
            self._cache.move_to_end(name)
            return hit
        pending = self._inflight.get(name)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Resolved] = asyncio.get_running_loop().create_future()
        self._inflight[name] = future
        try:
            result = await self._ask(name)
        except BaseException:
            future.cancel()  # the waiters see the cancellation; upstream errors are answers
            raise
        finally:
            del self._inflight[name]
        future.set_result(result)
        if result.ttl > 0:
            self._cache[name] = result
            self._cache.move_to_end(name)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return result

    async def _ask(self, name: str) -> Resolved:
        query = dns.message.make_query(name, dns.rdatatype.A)
        for server in self.servers:
            self.queries += 1
            try:
                reply = await dns.asyncquery.udp(query, server, timeout=self.timeout, port=self.port)
                if reply.flags & dns.flags.TC:
                    reply = await dns.asyncquery.tcp(query, server, timeout=self.timeout, port=self.port)
            except (dns.exception.DNSException, OSError) as exc:
                log.info("upstream %s for %s: %s", server, name, exc)
                continue
            return _parse(name, reply)
        return SERVFAIL


def _parse(name: str, reply: dns.message.Message) -> Resolved:
    now = time.monotonic()
    rcode = reply.rcode()
    if rcode == dns.rcode.NXDOMAIN:
        return Resolved(rcode, (), (), NEGATIVE_TTL_S, now)
    if rcode != dns.rcode.NOERROR:
        return Resolved(rcode, (), (), 0, now)
    by_name: dict[tuple[dns.name.Name, int], tuple[list[str], int]] = {}
    for rrset in reply.answer:
        if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.CNAME):
            values = [r.to_text() for r in rrset]
            by_name[(rrset.name, rrset.rdtype)] = (values, rrset.ttl)
    current = dns.name.from_text(name)
    chain: list[tuple[str, str]] = []
    ttls: list[int] = []
    for _ in range(MAX_CHAIN):
        cname = by_name.get((current, dns.rdatatype.CNAME))
        if cname is None or not cname[0]:
            break
        target = dns.name.from_text(cname[0][0])
        chain.append((current.to_text(omit_final_dot=True), target.to_text(omit_final_dot=True)))
        ttls.append(cname[1])
        current = target
    addresses: tuple[str, ...] = ()
    found = by_name.get((current, dns.rdatatype.A))
    if found is not None:
        addresses = tuple(found[0])
        ttls.append(found[1])
    ttl = min(ttls) if addresses else NEGATIVE_TTL_S
    return Resolved(rcode, tuple(chain), addresses, max(MIN_TTL_S, min(MAX_TTL_S, ttl)), now)
