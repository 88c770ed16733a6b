"""What an operator allows sandboxes to reach: permission names mapped to rules.

A sandbox asks for permissions by name (``network_rules={"pypi": True}``); only the node's
configuration says what a name opens, so an agent cannot widen its own reach by guessing
addresses. A permission is a list of rules, each one of:

- a :class:`Rule` naming ``domains`` (exact, or ``*.suffix`` for every name below it),
  resolved upstream by the edge's name server when a sandbox asks, each answer's addresses
  admitted for that sandbox for the answer's TTL; and/or fixed ``addresses`` (an address or a
  CIDR range); or ``public = true``: every public address (never private, loopback,
  link-local, multicast or the node's own);
- an :class:`Endpoint`: one fixed address with the names the resolver answers for it (a lab
  mirror; no upstream lookup).

A sandbox's rules may also name public IPv4 addresses or ranges themselves (:func:`address_of`):
open on every port, or taken out of what a ``public`` permission opens. Never a non-public
one, and only on a node that opens public addresses at all: the operator's configuration
still bounds everything a sandbox can reach.

``dsec up`` and ``dsec edge`` start from the catalogue that ships with DSec
(:mod:`.catalogue`: pypi, npm, debian, github, huggingface, crates, go, internet); the
operator's file (JSON or TOML) adds permissions or replaces one by name, and
``catalogue = false`` leaves the catalogue out::

    pool = "10.200.0.0/16"            # addresses of sandbox links (one /32 each)
    upstream = ["192.0.2.53"]         # resolvers for domain rules (default: /etc/resolv.conf)
    [[permissions.corp]]
    domains = ["git.corp.example", "*.pkg.corp.example"]
    ports = [443]
    [[permissions.pypi]]              # replaces the catalogue's pypi: a mirror of our own
    names = ["pypi.mirror.internal"]  # what the sandbox's resolver answers for
    address = "10.0.0.5"
    ports = [3141]
    [registries.corp]                 # corp also through the edge's registry proxy (as the
    kind = "pypi"                     # catalogue's pypi, npm and debian are: dsec.registry)
    index = "https://pypi.pkg.corp.example/simple/"
    port = 13150                      # on the gateway, open to links granted corp only
"""

from __future__ import annotations

import ipaddress
import json
import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dsec.netpolicy.nft import NONPUBLIC
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import GrantOptions, NetworkRules
from dsec.registry.config import CATALOGUE_REGISTRIES, CUTOFF_KINDS, CacheConfig, Registry

# The gateway's ports the edge listens on already: DNS and the name check (sniproxy's).
RESERVED_PORTS = frozenset({53, 16443, 16080})
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_HOST = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")
# A rule's key that names an address or a range rather than a permission (no permission may
# be named so).
_ADDRESS_KEY = re.compile(r"^\d{1,3}(\.\d{1,3}){3}(/\d{1,2})?$")
_NONPUBLIC = [ipaddress.IPv4Network(n) for n in NONPUBLIC]
MAX_ADDRESS_RULES = 64
MAX_OWN_DOMAINS = 64


class Endpoint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    address: ipaddress.IPv4Address
    ports: list[int] = Field(min_length=1, max_length=64)
    protocol: Literal["tcp", "udp"] = "tcp"
    names: list[str] = Field(default_factory=list, description="DNS names that resolve to address")

    @field_validator("ports")
    @classmethod
    def _check_ports(cls, v: list[int]) -> list[int]:
        return _ports(v)

    @field_validator("names")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        out = [n.lower().rstrip(".") for n in v]
        bad = [n for n in out if not _HOST.match(n)]
        if bad:
            raise ValueError(f"not DNS names: {bad}")
        return out


def address_of(key: str) -> ipaddress.IPv4Network | None:
    """The address or range a rule's key names (``"203.0.113.7"``, ``"203.0.113.0/24"``), None
    for a permission name. Granted (true), a sandbox's rules open it on every port and
    protocol: public addresses only, on a node that opens public addresses at all; refused
    (false), it is taken out of what a ``public`` permission opens (its own grants still win).
    InvalidRequest for an IPv6 address (sandboxes have no IPv6 route) or a range with host bits
    set."""
    if _ADDRESS_KEY.match(key) is None:
        if ":" in key and len(key) <= 64:
            try:
                ipaddress.IPv6Network(key, strict=False)
            except ValueError:
                return None
            raise InvalidRequest(f"{key}: sandboxes have no IPv6 route; name IPv4 addresses")
        return None
    try:
        return ipaddress.IPv4Network(key)
    except ValueError as exc:
        raise InvalidRequest(f"{key!r} is no IPv4 address or range: {exc}") from None


def own_domain(key: str) -> Rule | None:
    """The rule a sandbox's own domain key opens (``"api.example.com"``, ``"*.example.com"``:
    HTTPS and HTTP, resolved when asked, checked by name, answers pointing inside dropped), or
    None for a key that is no DNS name with a dot. Granted only where the node opens public
    addresses: it is a narrower ``internet`` (E2B's ``allow_out`` of a domain)."""
    name = key.lower().rstrip(".")
    if "." not in name or _ADDRESS_KEY.match(name) or not _HOST.match(name.removeprefix("*.")):
        return None
    return Rule(domains=[name], ports=[443, 80])


def range_text(net: ipaddress.IPv4Network) -> str:
    """A range as nftables elements name it (a single address without its /32)."""
    return str(net.network_address) if net.prefixlen == 32 else str(net)


def is_public(net: ipaddress.IPv4Network) -> bool:
    """Every address of ``net`` is public (what a ``public`` permission opens)."""
    return not any(net.overlaps(n) for n in _NONPUBLIC)


def _ports(v: list[int]) -> list[int]:
    bad = [p for p in v if not 1 <= p <= 65535]
    if bad:
        raise ValueError(f"ports must be 1-65535, not {bad}")
    return sorted(set(v))


def domain_matches(pattern: str, name: str) -> bool:
    """``*.example.org`` matches every name below example.org (not example.org itself), as
    Cilium's ``matchPattern`` does; anything else matches only itself."""
    if pattern.startswith("*."):
        return name.endswith(pattern[1:]) and len(name) > len(pattern) - 1
    return name == pattern


class Rule(BaseModel):
    """Reach by name, by range, or to the public internet (see the module's docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    domains: list[str] = Field(default_factory=list, max_length=256)
    addresses: list[ipaddress.IPv4Network] = Field(default_factory=list, max_length=256)
    public: bool = Field(default=False, description="every public address, on every port")
    resolves_to: list[ipaddress.IPv4Network] = Field(
        default_factory=list,
        max_length=64,
        description="non-public ranges the domains may resolve to (an internal registry); without"
        " it such an answer is dropped as DNS rebinding. Not reachable by address alone",
    )
    ports: list[int] = Field(default_factory=lambda: [443], min_length=1, max_length=64)
    protocol: Literal["tcp", "udp"] = "tcp"

    @field_validator("ports")
    @classmethod
    def _check_ports(cls, v: list[int]) -> list[int]:
        return _ports(v)

    @field_validator("domains")
    @classmethod
    def _domains(cls, v: list[str]) -> list[str]:
        out = [d.lower().rstrip(".") for d in v]
        bad = [d for d in out if not _HOST.match(d.removeprefix("*."))]
        if bad:
            raise ValueError(f"not DNS names or *.wildcards: {bad}")
        return out

    @model_validator(mode="after")
    def _something(self) -> Rule:
        if not (self.domains or self.addresses or self.public):
            raise ValueError("a rule names domains, addresses or public = true")
        if self.domains and self.protocol == "udp" and 443 in self.ports:
            # QUIC carries its server name encrypted: the edge cannot check it by name.
            raise ValueError("UDP 443 (QUIC) cannot be opened by name; clients fall back to TCP")
        return self

    def matches(self, name: str) -> bool:
        return any(domain_matches(d, name) for d in self.domains)

    def covers(self, address: ipaddress.IPv4Address) -> bool:
        """The rule names this address (so an answer pointing there is not rebinding)."""
        return any(address in net for net in (*self.addresses, *self.resolves_to))


Permission = list[Endpoint | Rule]


class EgressConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    permissions: dict[str, Permission] = Field(default_factory=dict)
    pool: ipaddress.IPv4Network = ipaddress.IPv4Network("10.200.0.0/16")
    catalogue: bool = Field(
        default=False,
        description="start from DSec's catalogue (dsec up/edge set it; a file may say false)",
    )
    upstream: list[ipaddress.IPv4Address] = Field(
        default_factory=list, max_length=8, description="resolvers for domain rules (default: resolv.conf)"
    )
    grace_s: int = Field(
        default=60, ge=0, le=3600, description="seconds an answer's addresses stay admitted past its TTL"
    )
    registries: dict[str, Registry] = Field(
        default_factory=dict,
        max_length=16,
        description="permissions served through the edge's package proxy (dsec.registry), by name",
    )
    registry_cache: CacheConfig = Field(default_factory=CacheConfig)
    upstream_ca: Path = Field(
        default=Path("/etc/ssl/certs/ca-certificates.crt"),
        description="PEM bundle the egress trusts when it re-encrypts a request it added headers "
        "to (egress_headers) on its way to the host",
    )

    @field_validator("permissions")
    @classmethod
    def _permission_names(cls, v: dict[str, Permission]) -> dict[str, Permission]:
        bad = [n for n in v if not _NAME.match(n)]
        if bad:
            raise ValueError(f"permission names must be short words ([A-Za-z0-9_.-]): {bad}")
        addresses = [n for n in v if _ADDRESS_KEY.match(n)]
        if addresses:
            raise ValueError(f"permission names must not read as addresses (such keys open one): {addresses}")
        return v

    @model_validator(mode="after")
    def _pool(self) -> EgressConfig:
        if self.pool.prefixlen > 28:
            raise ValueError("the pool must hold at least 16 addresses (a /28 or larger)")
        if self.catalogue:
            from dsec.netpolicy.catalogue import CATALOGUE

            # The operator's permission of the same name replaces the catalogue's whole (and
            # merging again, as a re-validation does, changes nothing).
            replaced = {n for n, p in self.permissions.items() if CATALOGUE.get(n) != p}
            self.permissions = {**CATALOGUE, **self.permissions}
            # A catalogue permission the operator replaced (a mirror of their own) keeps no
            # proxy in front of the public registry.
            shipped = {n: r for n, r in CATALOGUE_REGISTRIES.items() if n not in replaced}
            self.registries = {**shipped, **self.registries}
        stray = sorted(set(self.registries) - set(self.permissions))
        if stray:
            raise ValueError(f"registries name no permission: {stray}")
        ports = [r.port for r in self.registries.values()]
        if len(set(ports)) != len(ports) or set(ports) & RESERVED_PORTS:
            raise ValueError(f"registry ports must differ from each other and from {sorted(RESERVED_PORTS)}")
        return self

    @property
    def gateway(self) -> str:
        """The host side of every sandbox link, and the sandboxes' name server."""
        return str(self.pool.network_address + 1)

    def sandbox_address(self, index: int) -> str:
        """The address of the ``index``-th link (1-based)."""
        if not 1 <= index <= self.capacity:
            raise ValueError(f"link index {index} is outside the pool {self.pool}")
        return str(self.pool.network_address + 1 + index)

    @property
    def capacity(self) -> int:
        return self.pool.num_addresses - 3  # network, gateway, broadcast

    @property
    def offers_public(self) -> bool:
        """Some permission opens every public address (the catalogue's ``internet``): then a
        sandbox's rules may open public addresses of their own (:func:`address_of`)."""
        return any(isinstance(r, Rule) and r.public for perm in self.permissions.values() for r in perm)

    def address_rules(self, rules: NetworkRules) -> list[tuple[ipaddress.IPv4Network, bool]]:
        """The rules' addresses and ranges: open (True) or taken out of ``public`` (False)."""
        return [(net, bool(on)) for key, on in rules.items() if (net := address_of(key)) is not None]

    def check(self, rules: NetworkRules) -> None:
        """Refuse rules that name permissions this node does not know (typos open nothing),
        cutoffs on permissions that have no registry publishing upload times, and addresses a
        sandbox may not open on its own (:func:`address_of`)."""
        addresses = 0
        for key, grant in rules.items():
            net = address_of(key)  # InvalidRequest: no address DSec can use
            if net is None:
                continue
            addresses += 1
            if isinstance(grant, GrantOptions):
                raise InvalidRequest(f"{key}: options apply to package registries, not to addresses")
            if grant and not is_public(net):
                raise InvalidRequest(
                    f"{key} holds addresses that are not public (private, loopback, link-local,"
                    " multicast...): a sandbox opens only public addresses itself; the operator's"
                    " permissions name the others"
                )
            if grant and not self.offers_public:
                raise InvalidRequest(
                    f"{key}: this node opens no public addresses (no permission with public = true),"
                    " so a sandbox cannot open one itself; name one of its permissions"
                )
        if addresses > MAX_ADDRESS_RULES:
            raise InvalidRequest(f"at most {MAX_ADDRESS_RULES} addresses or ranges in a sandbox's rules")
        self._check_own_domains(rules)
        unknown = sorted(
            k for k in rules if address_of(k) is None and k not in self.permissions and own_domain(k) is None
        )
        if unknown:
            known = ", ".join(sorted(self.permissions)) or "none"
            raise InvalidRequest(f"unknown network permission(s) {unknown}; this node offers: {known}")
        for name, grant in sorted(rules.items()):
            if isinstance(grant, GrantOptions) and grant.before is not None:
                registry = self.registries.get(name)
                if registry is None or registry.kind not in CUTOFF_KINDS:
                    dated = ", ".join(sorted(n for n, r in self.registries.items() if r.kind in CUTOFF_KINDS))
                    raise InvalidRequest(
                        f"network permission {name!r} takes no 'before' cutoff: only a package registry"
                        f" whose uploads are dated can hide newer releases (here: {dated or 'none'})"
                    )

    def reaches_by_name(self, rules: NetworkRules, host: str) -> bool:
        """``rules`` reach ``host`` by a domain rule on port 443 or 80: a connection the name
        check sees, so one egress headers can be added to."""
        return any(
            isinstance(r, Rule) and {80, 443} & set(r.ports) and r.matches(host)
            for r in self.endpoints(rules)
        )

    def endpoints(self, rules: NetworkRules) -> list[Endpoint | Rule]:
        """What the granted permission names and domains open (addresses and ranges aside)."""
        return [e for name, on in sorted(rules.items()) if on for e in self.rules_of(name)]

    def rules_of(self, key: str) -> list[Endpoint | Rule]:
        """What a rule's key opens: the permission of that name, or a sandbox's own domain
        (:func:`own_domain`) where the node opens public addresses; nothing otherwise."""
        if key in self.permissions:
            return list(self.permissions[key])
        rule = own_domain(key) if self.offers_public else None
        return [rule] if rule is not None else []

    def _check_own_domains(self, rules: NetworkRules) -> None:
        own = [(k, grant) for k, grant in rules.items() if k not in self.permissions and own_domain(k)]
        if len(own) > MAX_OWN_DOMAINS:
            raise InvalidRequest(f"at most {MAX_OWN_DOMAINS} domains of a sandbox's own in its rules")
        for key, grant in own:
            if isinstance(grant, GrantOptions):
                raise InvalidRequest(f"{key}: options apply to package registries, not to domains")
            if not grant:
                raise InvalidRequest(f"{key}: a sandbox's own domain is opened (true), never taken out")
            if not self.offers_public:
                raise InvalidRequest(
                    f"{key}: this node opens no public addresses (no permission with public = true),"
                    " so a sandbox cannot open a domain itself; name one of its permissions"
                )

    @classmethod
    def load(cls, path: Path | None, *, catalogue: bool = False) -> EgressConfig:
        """The operator's file (None: none), over the shipped catalogue if ``catalogue`` and
        the file does not say ``catalogue = false``."""
        try:
            raw: dict[str, object] = {}
            if path is not None:
                text = path.read_text()
                raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
                if not isinstance(raw, dict):
                    raise ValueError("the file must hold a table (an object)")
            raw.setdefault("catalogue", catalogue)
            return cls.model_validate(raw)
        except (OSError, ValueError, ValidationError) as exc:
            raise InvalidRequest(f"egress configuration {path}: {exc}") from exc
