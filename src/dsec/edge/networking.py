"""Network permissions of the edge's sandboxes: checked at create, applied once the sandbox
runs, changed live by ``set_network_rules`` (journaled and recorded like any other request).
The mechanics live in :mod:`dsec.netpolicy`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from dsec.backends.base import Backend, CreateContext, GuestLink, Networked, Tapped, User
from dsec.edge import egress_trust
from dsec.edge.journal import Journal, Record
from dsec.edge.tally import LiveSandboxes
from dsec.edge.trajectory import Recorder
from dsec.executor.file_ops import one_chunk
from dsec.netpolicy import grants
from dsec.netpolicy.policy import EgressPolicy
from dsec.protocol.egress_headers import used
from dsec.protocol.errors import DSecError, InvalidRequest
from dsec.protocol.models import ContainerSpec, NetworkRules, SandboxInfo
from dsec.registry import clients as registry_clients

log = logging.getLogger(__name__)


class Networking:
    """The edge's network permissions service: what its sandboxes may reach, and what they held."""

    def __init__(
        self,
        egress: EgressPolicy,
        journal: Journal,
        recorder: Recorder,
        live: LiveSandboxes,
        backend_of: Callable[[Record], Backend],
        node: str,
    ) -> None:
        self.egress = egress
        self.journal = journal
        self.recorder = recorder
        self.live = live
        self.backend_of = backend_of
        self.node = node

    def check(self, spec: ContainerSpec, backend: Backend) -> None:
        """Before anything is made: known permission names, a backend that can be linked, and
        egress headers for hosts the name check sees."""
        self.egress.check(spec.network_rules)
        linkable = isinstance(backend, Networked | Tapped)
        if self.egress.rules_need_link(spec.network_rules) and not linkable:
            raise InvalidRequest(f"network permissions are not available for {backend.name} sandboxes yet")
        self.egress.check_headers(spec.network_rules, spec.egress_headers)

    async def _trust_node_ca(self, rec: Record, trusted: bool = True) -> None:
        """The node's egress CA trusted by the sandbox (or no longer: ``trusted`` False)."""
        ca = self.egress.node_ca()
        if ca is not None:
            files = self.backend_of(rec).files(rec.handle, User("root", 0, 0, "/root"))
            await (egress_trust.trust if trusted else egress_trust.distrust)(files, ca)

    async def open_link(self, ctx: CreateContext, backend: Backend) -> None:
        """A sandbox that names network rules (even all False: it may be granted later) and
        takes its links only at start gets one before it starts: a VM its tap (QEMU attaches
        the network card at start, microvm cannot hot-plug), a gVisor sandbox a namespace with
        its veth in it (netstack copies the namespace's interfaces at start)."""
        if not ctx.spec.network_rules:
            return
        gateway = self.egress.config.gateway
        if isinstance(backend, Tapped):
            ifname, address = await self.egress.open_tap(ctx.sandbox_id)
            ctx.link = GuestLink(ifname, address, gateway)
        elif isinstance(backend, Networked) and backend.link_at_start(ctx.spec):
            ifname, address, netns = await self.egress.open_netns(ctx.sandbox_id)
            ctx.link = GuestLink(ifname, address, gateway, netns=netns)

    async def _point_package_clients(self, rec: Record, old: NetworkRules, new: NetworkRules) -> None:
        """pip, npm and apt inside the sandbox pointed at the node's registry proxy for the
        registries it now holds (:mod:`dsec.registry.clients`); the files of registries it no
        longer holds go. Best effort: the proxy and the kernel enforce, these files only guide."""
        gateway = self.egress.config.gateway
        had = registry_clients.files(gateway, self.egress.registries_granted(old))
        wanted = registry_clients.files(gateway, self.egress.registries_granted(new))
        if not had and not wanted:
            return
        files = self.backend_of(rec).files(rec.handle, User("root", 0, 0, "/root"))
        try:
            for path in registry_clients.ALL:
                if path in wanted and had.get(path) != wanted[path]:
                    await files.mkdir(path.rsplit("/", 1)[0], parents=True)
                    await files.write_stream(path, one_chunk(wanted[path].encode()), 0o444)
                elif path in had and path not in wanted:
                    await files.remove(path)
        except (DSecError, OSError) as exc:
            log.warning("pointing %s's package clients at the registry proxy: %s", rec.id, exc)

    def network_held(self, sandbox_id: str, rules: NetworkRules) -> list[str]:
        """Every permission the sandbox held since it started (with its cutoff), and ``rules``
        (what a layer packed from it records: a build's last step may run without network,
        its earlier ones did not). Kept in the journal, so an edge restart forgets none."""
        return sorted(self.journal.network_held(sandbox_id) | set(grants.describe(rules)))

    def node_files(self, sandbox_id: str) -> list[str]:
        """The files the edge wrote into the sandbox (paths relative to /) that a layer packed
        from it must not carry: the package clients' if it ever held a registry (they point at
        this node's proxy, for this sandbox's grants), the node's CA while it has egress headers
        (the system bundle with it: the image's own is what a layer keeps)."""
        spec = self.live.touch(sandbox_id).record.spec
        held = {n.split("@", 1)[0] for n in self.network_held(sandbox_id, spec.network_rules)}
        out = (
            [p.lstrip("/") for p in registry_clients.ALL] if held & set(self.egress.config.registries) else []
        )
        return out + (egress_trust.written() if spec.egress_headers else [])

    def _note_network(self, sandbox_id: str, rules: NetworkRules) -> None:
        if held := set(grants.describe(rules)):
            self.journal.add_network_held(sandbox_id, held)

    def forget(self, sandbox_id: str) -> None:
        self.journal.drop_network_held(sandbox_id)

    def _netns_pid(self, rec: Record) -> int | None:
        backend = self.backend_of(rec)
        return backend.netns_pid(rec.handle) if isinstance(backend, Networked) else None

    async def connect(self, rec: Record) -> None:
        """A new sandbox gets what its rules allow (nothing to do for most: no rules)."""
        self.egress.started(rec.id)  # it runs in the namespace made for it, if one was
        self._note_network(rec.id, rec.spec.network_rules)
        if self.egress.rules_need_link(rec.spec.network_rules):
            await self.egress.set_rules(rec.id, self._netns_pid(rec), rec.spec.network_rules)
            await self._point_package_clients(rec, {}, rec.spec.network_rules)
        if rec.spec.egress_headers:
            await self._trust_node_ca(rec)
            await self.egress.set_headers(rec.id, rec.spec.egress_headers, rec.spec.egress_secrets)

    async def set_network_rules(
        self,
        sandbox_id: str,
        rules: NetworkRules,
        headers: dict[str, dict[str, str]] | None = None,
        secrets: dict[str, str] | None = None,
    ) -> SandboxInfo:
        """Replace the sandbox's network rules (and its egress headers, unless ``headers`` is
        None); effective in the kernel and the proxy when this returns."""
        live = self.live.touch(sandbox_id)  # a paused sandbox's rules change without waking it
        self.egress.check(rules)
        if headers:
            self.egress.check_headers(rules, headers)
        backend = self.backend_of(live.record)
        if self.egress.rules_need_link(rules):
            if isinstance(backend, Tapped) and not backend.has_link(live.record.handle):
                raise InvalidRequest(
                    f"{sandbox_id} was created without network rules, so it has no network card: a VM"
                    " gets one at create when network_rules is given (all False is enough)"
                )
            only_at_start = isinstance(backend, Networked) and backend.netns_pid(live.record.handle) is None
            if only_at_start and not self.egress.has_link(sandbox_id):
                raise InvalidRequest(
                    f"{sandbox_id} was created without network rules, so it has no network link: a"
                    f" {live.record.spec.runtime} sandbox's network stack takes its links when it starts,"
                    " and gets one at create when network_rules is given (all False is enough)"
                )

        async def run() -> dict[str, Any]:
            async with live.stopping:  # not while it is being stopped
                rec = live.record
                before = rec.spec.network_rules
                await self.egress.set_rules(sandbox_id, self._netns_pid(rec), rules)
                await self._point_package_clients(rec, before, rules)
                self._note_network(sandbox_id, rules)
                update: dict[str, Any] = {"network_rules": dict(rules)}
                if headers is not None:
                    if bool(headers) != bool(rec.spec.egress_headers):
                        await self._trust_node_ca(rec, trusted=bool(headers))
                    await self.egress.set_headers(sandbox_id, headers, secrets or {})
                    names = used(headers)  # a spec keeps only the secrets its headers name
                    kept = {k: v for k, v in (secrets or {}).items() if k in names}
                    update |= {"egress_headers": headers, "egress_secrets": kept}
                rec.spec = rec.spec.model_copy(update=update)
                self.journal.set_spec(sandbox_id, rec.spec)
            return wire

        # What the trajectory keeps: the headers as given, never a secret's value.
        wire: dict[str, Any] = {"network_rules": grants.to_wire(rules)}
        if headers is not None:
            wire["egress_headers"] = headers
        await self.recorder.call(sandbox_id, "network", None, wire, run)
        return live.record.info(self.node)
