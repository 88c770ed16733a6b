"""Egress policy of one edge: links made on demand, grants in the kernel, names answered.

A sandbox starts in a network namespace of its own with nothing but loopback. The first time
its rules allow something it gets a link (see :mod:`.links`; a VM asking for rules gets a tap
before it starts, :meth:`EgressPolicy.open_tap`, and a gVisor sandbox a veth in a namespace
made for it to start in, :meth:`EgressPolicy.open_netns`); the link then stays for its
lifetime while grants come and go (``set_network_rules``), each change one atomic nftables
element update. Sandboxes that never ask for the network cost nothing here: no veth, no
route, no set element (at thousands per node that matters).

Links are journaled (sandbox -> index), and the kernel's table outlives the edge process, so
an edge restart re-learns its links and keeps every sandbox's reach as it was (addresses
learned from answers excepted: the table is rebuilt, and a sandbox asks its name server
again).

Domain rules are answered by :mod:`.names`: the link's responder resolves an allowed name
upstream and admits the answer's addresses for that link only, for the answer's TTL.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from dsec.netpolicy import intercept, links, nft, pools
from dsec.netpolicy.config import EgressConfig, Endpoint, range_text
from dsec.netpolicy.dns import NameServer, Responder
from dsec.netpolicy.grants import cutoff_of
from dsec.netpolicy.names import Admissions, DomainGrant, LinkNames
from dsec.netpolicy.sniproxy import CHECKED, SniProxy, keys
from dsec.netpolicy.upstream import Upstream, resolv_conf
from dsec.protocol.errors import CapacityExhausted, InfraFailure, InfraReason, InvalidRequest
from dsec.protocol.models import NetworkRules
from dsec.registry.config import Registry
from dsec.registry.proxy import RegistryProxy

log = logging.getLogger(__name__)

_IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


Headers = dict[str, dict[str, str]]  # egress headers: host -> header -> value (placeholders kept)


class LinkStore(Protocol):
    def links(self) -> dict[str, int]: ...

    def put_link(self, sandbox_id: str, index: int) -> None: ...

    def drop_link(self, sandbox_id: str) -> None: ...


@dataclass
class _Link:
    index: int
    ifname: str
    address: str
    reach: nft.Reach = field(default_factory=nft.Reach)
    names: dict[str, list[str]] = field(default_factory=dict)
    domains: DomainGrant = field(default_factory=DomainGrant)
    rules: NetworkRules = field(default_factory=dict)
    answers: LinkNames | None = None
    checked_names: set[str] = field(default_factory=set)  # the proxy's keys for this link
    headers: dict[str, str] = field(default_factory=dict)  # its egress headers' map entries


class EgressPolicy:
    def __init__(self, config: EgressConfig, node: str, store: LinkStore, state_dir: Path) -> None:
        self._state_dir = state_dir
        if config.permissions:  # a pool of the node's own, unless the operator named one (pools.py)
            if "pool" in config.model_fields_set:
                other = pools.claim_configured(config.pool, state_dir)
                if other is not None:
                    log.warning(
                        "link pool %s is also the node's in %s: their links collide", config.pool, other
                    )
            else:
                chosen = pools.choose(node, state_dir, had_links=bool(store.links()))
                config = config.model_copy(update={"pool": chosen})
        self.config = config
        self.table = nft.table_name(node, str(state_dir.resolve()))
        self._store = store
        self._links: dict[str, _Link] = {}
        self._by_ifindex: dict[int, _Link] = {}
        self._lock = asyncio.Lock()
        self._dns: NameServer | None = None
        self._netns: dict[str, int] = {}  # sandbox -> its namespace's fd, until it runs in it
        self._forward_marker = state_dir / "ip_forward.set-by-dsec"
        self.upstream = Upstream([str(a) for a in config.upstream] or resolv_conf())
        self.admissions = Admissions(self.table, nft.apply)
        self._node_addresses: frozenset[str] = frozenset()
        self._firewall: dict[str, int] = {}  # the table's counters at the last read_firewall
        self._name_checks: dict[tuple[str, str], int] = {}  # the proxy's, likewise
        # The name check runs only where some permission names domains, or sandboxes may name
        # their own (a node that opens public addresses); no HAProxy otherwise.
        self.proxy: SniProxy | None = None
        named = any(getattr(r, "domains", None) for perm in config.permissions.values() for r in perm)
        if named or config.offers_public:
            self.proxy = SniProxy(state_dir, config.gateway, config.upstream_ca, node)
        # The package registries' caching proxy, in this process (it reads the links' grants).
        self.registry: RegistryProxy | None = None
        if config.registries:
            self.registry = RegistryProxy(
                config.registries,
                config.registry_cache,
                state_dir / "registry-cache",
                config.gateway,
                self.upstream,
                self.rules_of_address,
            )

    @property
    def enabled(self) -> bool:
        return bool(self.config.permissions)

    def check(self, rules: NetworkRules) -> None:
        self.config.check(rules)

    def check_headers(self, rules: NetworkRules, hosts: Iterable[str]) -> None:
        """Egress headers go only to hosts the name check sees: reached by a permission naming
        their domain on 443 or 80 (an address or ``internet`` is spliced unread)."""
        for host in hosts:
            if self.proxy is None or not self.config.reaches_by_name(rules, host):
                raise InvalidRequest(
                    f"egress headers for {host}: the sandbox must reach it by a network permission naming"
                    " its domain on port 443 or 80 (the node reads no other traffic); this node's"
                    f" permissions: {', '.join(sorted(self.config.permissions)) or 'none'}"
                )

    async def set_headers(self, sandbox_id: str, headers: Headers, secrets: dict[str, str]) -> None:
        """The sandbox's requests to each host of ``headers`` get those headers (placeholders
        filled from ``secrets``)."""
        async with self._lock:
            link = self._links.get(sandbox_id)
            if link is None or self.proxy is None:
                if headers:
                    raise InvalidRequest("egress headers need a network permission naming their hosts")
                return
            new = intercept.entries(headers, secrets, link.address)
            await self.proxy.set_headers(link.headers, new)
            link.headers = new

    def node_ca(self) -> bytes | None:
        """The certificate sandboxes with egress headers trust (None: no name check here)."""
        return None if self.proxy is None else self.proxy.ca.certificate()

    def rules_need_link(self, rules: NetworkRules) -> bool:
        opened = any(on for _, on in self.config.address_rules(rules))
        return bool(opened or self.config.endpoints(rules) or self.registries_granted(rules))

    def registries_granted(self, rules: NetworkRules) -> list[Registry]:
        return [r for name, r in sorted(self.config.registries.items()) if rules.get(name)]

    def rules_of_address(self, address: str) -> NetworkRules | None:
        """The rules of the sandbox whose link has ``address`` (the registry proxy's requester)."""
        link = next((lk for lk in self._links.values() if lk.address == address), None)
        return None if link is None else link.rules

    def dns_answers(self) -> dict[str, int]:
        """The sandboxes' name server's answers by verdict (granted, denied, error)."""
        return dict(self._dns.answers) if self._dns is not None else {}

    async def read_firewall(self) -> None:
        """Read the table's counters and the name check's (what :meth:`firewall_counts` and
        :meth:`name_checks` answer until the next read), side by side: the edge's metrics call
        it before each scrape. Nothing to read without a table."""
        if not (self.enabled or self._links):
            return
        if self.proxy is None:
            self._firewall = await nft.read_counters(self.table)
            return
        self._firewall, self._name_checks = await asyncio.gather(
            nft.read_counters(self.table), self.proxy.counts()
        )

    def firewall_counts(self) -> dict[str, int]:
        """The firewall's counters at the last :meth:`read_firewall` (see :data:`nft.DENIALS`):
        they start again at 0 when the edge rebuilds its table (a restart)."""
        return dict(self._firewall)

    def name_checks(self) -> dict[tuple[str, str], int]:
        """The name check's verdicts at the last :meth:`read_firewall`, (kind, verdict) -> count
        (see :data:`sniproxy.STATS`); empty without a proxy or when it did not answer. They
        start again at 0 when HAProxy restarts (it outlives an edge restart that keeps its
        configuration)."""
        return dict(self._name_checks)

    def has_link(self, sandbox_id: str) -> bool:
        return sandbox_id in self._links

    async def start(
        self,
        live_rules: dict[str, NetworkRules],
        live_headers: dict[str, tuple[Headers, dict[str, str]]] | None = None,
    ) -> None:
        """Re-learn the links of sandboxes still live (``live_rules``: ID -> their rules;
        ``live_headers``: ID -> their egress headers and secrets), forget the rest, and (re)install
        the table, the name check and the name server."""
        self._node_addresses = frozenset(await links.host_addresses())
        journaled = self._store.links()
        for sid, index in journaled.items():
            ifname = links.link_name(sid)
            if sid not in live_rules or not links.exists(ifname):
                await links.remove(ifname)
                self._store.drop_link(sid)
                continue
            link = _Link(index, ifname, self.config.sandbox_address(index))
            self._grant_locally(link, live_rules[sid])
            headers, secrets = (live_headers or {}).get(sid, ({}, {}))
            link.headers = intercept.entries(headers, secrets, link.address)
            self._links[sid] = link
        if not self.enabled and not self._links:
            if journaled:  # permissions were configured before: take their table away
                await self._drop_table()
            return
        self._enable_forwarding()
        await nft.apply(
            nft.ruleset(
                self.table,
                self.config.gateway,
                str(self.config.pool),
                {link.ifname: link.address for link in self._links.values()},
                {link.ifname: link.reach for link in self._links.values()},
                CHECKED if self.proxy is not None else None,
            )
        )
        if self.proxy is not None:
            try:
                await self.proxy.start(
                    {k for link in self._links.values() for k in link.checked_names},
                    {k: v for link in self._links.values() for k, v in link.headers.items()},
                )
            except InfraFailure as exc:
                # Fail closed: learned addresses on the checked ports are redirected to a port
                # nothing listens on, while everything else keeps working.
                log.error("the name check (HAProxy) did not start; TLS/HTTP by name is refused: %s", exc)
        self._reindex()
        if self.registry is not None:
            try:
                await self.registry.start()
            except OSError as exc:
                raise InfraFailure(
                    f"the package registry proxy cannot listen on {self.config.gateway}: {exc}",
                    reason=InfraReason.network,
                ) from exc
        self._dns = NameServer(self.config.gateway, self._responder_of_index, self._responder_of_address)
        try:
            await self._dns.start()
        except OSError as exc:
            self._dns = None
            raise InfraFailure(
                f"the sandboxes' name server cannot listen on {self.config.gateway}:53: {exc}",
                reason=InfraReason.network,
            ) from exc

    async def set_rules(self, sandbox_id: str, pid: int | None, rules: NetworkRules) -> None:
        """Give the sandbox exactly what ``rules`` allow (a link first, if it needs one).
        ``pid`` enters its network namespace; None: its backend has no way in."""
        self.check(rules)
        async with self._lock:
            link = self._links.get(sandbox_id)
            if link is None:
                if not self.rules_need_link(rules):
                    return
                if pid is None:
                    raise InvalidRequest("network permissions are not available for this backend yet")
                link = await self._new_link(sandbox_id, pid)
            old, old_rules, old_names = link.reach, link.rules, link.checked_names
            self._grant_locally(link, rules)
            try:
                await nft.apply(nft.grant(self.table, link.ifname, link.address, old, link.reach))
                if self.proxy is not None:
                    await self.proxy.update(old_names, link.checked_names)
            except BaseException:
                self._grant_locally(link, old_rules)
                raise
            await self.admissions.revoke(link.ifname, lambda perm: bool(rules.get(perm)))

    async def open_tap(self, sandbox_id: str) -> tuple[str, str]:
        """A tap link for a VM about to start (QEMU needs it on its command line), known to
        the table but granted nothing yet; returns (interface, the guest's address)."""
        async with self._lock:
            link = self._links.get(sandbox_id) or await self._open_before_start(sandbox_id, None)
            return link.ifname, link.address

    async def open_netns(self, sandbox_id: str) -> tuple[str, str, str]:
        """A fresh network namespace holding a veth link (addressed, routed, granted nothing
        yet) for a sandbox whose runtime copies its namespace's links once, when it starts
        (gVisor's netstack); returns (interface, the sandbox's address, the namespace's path
        for the runtime to join). The namespace is held until :meth:`started` or
        :meth:`release`; after that the sandbox's processes hold it."""
        async with self._lock:
            if sandbox_id in self._links:
                raise InfraFailure(f"{sandbox_id} already has a link", reason=InfraReason.network)
            fd = await asyncio.to_thread(links.new_netns)
            try:
                link = await self._open_before_start(sandbox_id, links.fd_path(fd))
            except BaseException:
                os.close(fd)
                raise
            self._netns[sandbox_id] = fd
            return link.ifname, link.address, links.fd_path(fd)

    def started(self, sandbox_id: str) -> None:
        """The sandbox runs (in the namespace :meth:`open_netns` made): the edge lets go of it."""
        fd = self._netns.pop(sandbox_id, None)
        if fd is not None:
            os.close(fd)

    async def release(self, sandbox_id: str) -> None:
        """The sandbox is gone: its link, grants and index go too."""
        async with self._lock:
            self.started(sandbox_id)  # a namespace made for a start that failed
            link = self._links.pop(sandbox_id, None)
            if link is None:
                return
            await links.remove(link.ifname)
            await self.admissions.forget(link.ifname)
            if self.proxy is not None:
                try:
                    await self.proxy.update(link.checked_names, set())
                    await self.proxy.set_headers(link.headers, {})
                except InfraFailure as exc:  # its next start writes the map from the links
                    log.warning("forgetting %s's names in the proxy: %s", sandbox_id, exc)
            try:
                await nft.apply(nft.forget(self.table, link.ifname, link.address, link.reach))
            except InfraFailure as exc:  # the next start rebuilds the table from the journal
                log.warning("forgetting %s's link: %s", sandbox_id, exc)
            self._store.drop_link(sandbox_id)
            self._by_ifindex = {i: lk for i, lk in self._by_ifindex.items() if lk is not link}

    async def close(self) -> None:
        """The edge stops. Links and grants stay with their running sandboxes; with none left
        the table goes, and forwarding is turned off again if this edge turned it on."""
        if self._dns is not None:
            self._dns.close()
            self._dns = None
        if self.registry is not None:
            await self.registry.close()
        if self.enabled and not self._links:
            await self._drop_table()
            if self.proxy is not None:
                await self.proxy.close()
            pools.release(self.config.pool, self._state_dir)

    # -- internals --------------------------------------------------------------------------

    async def _open_before_start(self, sandbox_id: str, netns: str | None) -> _Link:
        """A link made before its sandbox starts, known to the table with no grant."""
        link = await self._new_link(sandbox_id, netns)
        try:
            await nft.apply(nft.grant(self.table, link.ifname, link.address, nft.Reach(), nft.Reach()))
        except BaseException:
            self._links.pop(sandbox_id, None)
            await links.remove(link.ifname)
            self._store.drop_link(sandbox_id)
            raise
        return link

    async def _new_link(self, sandbox_id: str, netns: int | str | None) -> _Link:
        """A veth into the network namespace ``netns`` (a PID in it, or its path); None: a
        tap (a VM's)."""
        used = {link.index for link in self._links.values()}
        index = next((i for i in range(1, self.config.capacity + 1) if i not in used), None)
        if index is None:
            raise CapacityExhausted(f"the link pool {self.config.pool} is full")
        link = _Link(index, links.link_name(sandbox_id), self.config.sandbox_address(index))
        self._store.put_link(sandbox_id, index)  # journaled first: a crash leaves nothing unknown
        try:
            if netns is None:
                await links.create_tap(link.ifname, self.config.gateway, link.address)
            else:
                await links.create(link.ifname, netns, self.config.gateway, link.address)
        except BaseException:
            self._store.drop_link(sandbox_id)
            raise
        self._links[sandbox_id] = link
        index = links.ifindex(link.ifname)
        if index is not None:
            self._by_ifindex[index] = link
        return link

    def _grant_locally(self, link: _Link, rules: NetworkRules) -> None:
        grants: set[nft.Element] = set()
        names: dict[str, list[str]] = {}
        domains = DomainGrant()
        public = False
        for perm, on in sorted(rules.items()):
            # Under a cutoff the registry is reached through the proxy only: its upstream
            # names stay closed, or the sandbox would fetch newer releases around it.
            through_proxy_only = perm in self.config.registries and cutoff_of(on) is not None
            for rule in self.config.rules_of(perm) if on and not through_proxy_only else []:
                if isinstance(rule, Endpoint):
                    address = str(rule.address)
                    grants.update((link.ifname, address, rule.protocol, port) for port in rule.ports)
                    for name in rule.names:
                        if address not in names.setdefault(name, []):
                            names[name].append(address)
                    continue
                public = public or rule.public
                for net in rule.addresses:
                    grants.update((link.ifname, range_text(net), rule.protocol, port) for port in rule.ports)
                if rule.domains:
                    domains.rules.append((perm, rule))
        # Opened addresses only while the node opens public ones at all (an operator who took
        # that permission away since, and restarted the edge, has taken them away too).
        addresses = [
            (net, on) for net, on in self.config.address_rules(rules) if self.config.offers_public or not on
        ]
        link.reach = nft.Reach(
            elements=frozenset(grants),
            public=public,
            registry=frozenset((link.ifname, r.port) for r in self.registries_granted(rules)),
            opened=frozenset(range_text(net) for net, on in addresses if on),
            denied=frozenset(range_text(net) for net, on in addresses if not on),
        )
        link.names, link.domains, link.rules = names, domains, rules
        checked_ports = set(CHECKED)
        link.checked_names = keys(
            (d for _, rule in domains.rules if checked_ports & set(rule.ports) for d in rule.domains),
            link.address,
        )
        link.answers = LinkNames(
            link.ifname,
            names,
            domains,
            self.upstream,
            self.admissions,
            self._node_addresses,
            self.config.grace_s,
        )

    def _reindex(self) -> None:
        by_index = {}
        for link in self._links.values():
            index = links.ifindex(link.ifname)
            if index is not None:
                by_index[index] = link
        self._by_ifindex = by_index

    def _responder_of_index(self, ifindex: int) -> Responder | None:
        link = self._by_ifindex.get(ifindex)
        return None if link is None or link.answers is None else link.answers.respond

    def _responder_of_address(self, address: str) -> Responder | None:
        # The firewall drops a link's packets that do not carry its own address: a TCP peer's
        # address names its link.
        link = next((lk for lk in self._links.values() if lk.address == address), None)
        return None if link is None or link.answers is None else link.answers.respond

    def _enable_forwarding(self) -> None:
        if _IP_FORWARD.read_text().strip() != "1":
            _IP_FORWARD.write_text("1\n")
            self._forward_marker.parent.mkdir(parents=True, exist_ok=True)
            self._forward_marker.touch()
            log.info("turned on IPv4 forwarding for sandbox links (the dsec table filters them)")

    async def _drop_table(self) -> None:
        await nft.apply(nft.drop_table(self.table))
        self._restore_forwarding()

    def _restore_forwarding(self) -> None:
        if self._forward_marker.exists():
            _IP_FORWARD.write_text("0\n")
            self._forward_marker.unlink()
