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
- an ``allowOut`` domain no permission is named after: a domain of the sandbox's own, reached
  on 443 and 80 by that name (again only where the node opens public addresses);
- a ``denyOut`` address or range holding public addresses beside ``internet``: taken out of it,
  unless an ``allowOut`` range holds it (E2B: allow wins; DSec's opened ranges and permissions
  win over a denied range too). One that holds no public address, or any when the sandbox has
  no ``internet``, is denied already and adds nothing.

Everything else is a 400 naming the entry: an address or range allowed that holds private,
loopback, link-local or IPv6 addresses (DSec opens those by operator permission only), an
egress proxy, DNS servers. A ``denyOut`` entry that is no address or range is E2B's own 400
("invalid denied CIDR").

``rules`` (per-host header transforms, :func:`to_headers`) become the sandbox's egress headers
(:mod:`dsec.protocol.egress_headers`), checked with E2B's bounds and messages
(``validateNetworkRules``); ``${e2b.secrets.<name>}`` is DSec's ``${secrets.<name>}``, filled
from the project's secrets (:mod:`.secret_store`); ``${e2b.identity.tokens.<name>}`` (workload
identity) is a 400, and so is ``iam`` on create (:func:`check_iam`).
"""

from __future__ import annotations

import ipaddress
import re

from dsec.apiserver.e2b.models import Iam, NetworkInfo, NetworkUpdate
from dsec.apiserver.e2b.secret_store import normalize_name
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
            # A permission, or a domain of the sandbox's own (netpolicy.config.own_domain); the
            # edge refuses a name it cannot open (400).
            rules[entry] = True
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


def to_info(rules: NetworkRules, transforms: dict[str, list[dict[str, object]]] | None = None) -> NetworkInfo:
    """The rules as E2B's ``network`` of a sandbox's info (what :func:`to_rules` reads back),
    with its header ``transforms`` (:func:`headers_info`)."""
    granted = sorted(name for name, on in rules.items() if on)
    allow = [n for n in granted if n != INTERNET]
    refused = sorted(k for k, on in rules.items() if not on and address_of(k) is not None)
    if INTERNET in granted:
        return NetworkInfo(allow_out=allow or None, deny_out=refused or None, rules=transforms or None)
    return NetworkInfo(allow_out=allow, deny_out=[ALL_TRAFFIC], rules=transforms or None)


# E2B's bounds (sandbox_create.go, networktransform.MaxMarkerNames).
_MAX_DOMAINS, _MAX_DOMAIN_LEN, _MAX_HEADERS, _MAX_NAME, _MAX_VALUE, _MAX_SECRETS = 10, 128, 20, 64, 2048, 32
_E2B_SECRET, _E2B_TOKEN, _DSEC_SECRET = "${e2b.secrets.", "${e2b.identity.tokens.", "${secrets."
_LABEL = r"[A-Za-z0-9_][A-Za-z0-9_-]{0,62}"  # govalidator's IsDNSName, as E2B checks a rule's domain
_DNS_NAME = re.compile(rf"^{_LABEL}(\.{_LABEL})*[._]?$")
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def to_headers(net: NetworkUpdate) -> dict[str, dict[str, str]]:
    """E2B's ``rules`` as DSec egress headers (host -> header -> value, DSec's placeholders);
    E2B's 400 and message for each rule it refuses."""
    rules = net.rules or {}
    if len(rules) > _MAX_DOMAINS:
        raise InvalidRequest(f"Network rules can have at most {_MAX_DOMAINS} domains.")
    out: dict[str, dict[str, str]] = {}
    for domain, domain_rules in rules.items():
        if not domain:
            raise InvalidRequest("Rule domain must not be empty.")
        if len(domain) > _MAX_DOMAIN_LEN:
            raise InvalidRequest(
                f"Rule domain {domain[:_MAX_DOMAIN_LEN]!r} exceeds maximum length of 128 characters."
            )
        if not _DNS_NAME.match(domain):
            raise InvalidRequest(f"Rule domain {domain!r} is not a valid domain name.")
        if not isinstance(domain_rules, list):
            raise InvalidRequest(f"Rules of domain {domain!r} must be a list.")
        if len(domain_rules) > 1:
            raise InvalidRequest(f"Domain {domain!r} can have at most 1 transform rule.")
        headers: dict[str, str] = {}
        for rule in domain_rules:
            transform = rule.get("transform") if isinstance(rule, dict) else None
            given = transform.get("headers") if isinstance(transform, dict) else None
            if given is not None and not isinstance(given, dict):
                raise InvalidRequest(f"Headers of the rule for domain {domain!r} must be an object.")
            headers = _headers(domain, given or {})
        out[domain.lower().rstrip(".")] = headers
    return out


def _headers(domain: str, given: dict[str, object]) -> dict[str, str]:
    if len(given) > _MAX_HEADERS:
        raise InvalidRequest(f"Domain {domain!r} can have at most {_MAX_HEADERS} headers per rule.")
    headers: dict[str, str] = {}
    secrets: set[str] = set()
    for name, value in given.items():
        if not name:
            raise InvalidRequest(f"Header name in rule for domain {domain!r} must not be empty.")
        if not _TOKEN.match(name):
            raise InvalidRequest(
                f"Header name {name[:_MAX_NAME]!r} in rule for domain {domain!r} must contain only valid HTTP"
                " token characters."
            )
        if len(name) > _MAX_NAME:
            raise InvalidRequest(
                f"Header name {name[:_MAX_NAME]!r} in rule for domain {domain!r} exceeds maximum length of"
                f" {_MAX_NAME} characters."
            )
        if not isinstance(value, str) or _BAD_VALUE.search(value):
            raise InvalidRequest(
                f"Value for header {name!r} in rule for domain {domain!r} contains invalid characters."
            )
        if len(value) > _MAX_VALUE:
            raise InvalidRequest(
                f"Value for header {name!r} in rule for domain {domain!r} exceeds maximum length of"
                f" {_MAX_VALUE} characters."
            )
        headers[name], names = _placeholders(value)
        secrets |= names
        if len(secrets) > _MAX_SECRETS:
            raise InvalidRequest(f"Rule domain {domain!r} references more than {_MAX_SECRETS} secrets.")
    return headers


def _placeholders(value: str) -> tuple[str, set[str]]:
    """``value`` in DSec's spelling, and the secrets it names (E2B's ParsePlaceholders: text
    outside the two prefixes is opaque; an unclosed, empty or nested one is malformed)."""
    out, names, cursor = "", set[str](), 0
    malformed = "Network transform header contains a malformed E2B placeholder."
    while True:
        starts = [(i, p) for p in (_E2B_SECRET, _E2B_TOKEN) if (i := value.find(p, cursor)) >= 0]
        if not starts:
            return out + value[cursor:], names
        start, prefix = min(starts)
        end = value.find("}", start + len(prefix))
        name = value[start + len(prefix) : end] if end >= 0 else ""
        if not name or _E2B_SECRET in name or _E2B_TOKEN in name:
            raise InvalidRequest(malformed)
        if prefix == _E2B_TOKEN:
            raise InvalidRequest(
                "workload identity tokens (${e2b.identity.tokens.*}, iam) are not supported by DSec: "
                "put the credential in a secret (${e2b.secrets.<name>})"
            )
        canonical = normalize_name(name)
        if canonical is None:
            raise InvalidRequest(malformed)
        names.add(canonical)
        out += value[cursor:start] + _DSEC_SECRET + canonical + "}"
        cursor = end + 1


def headers_info(headers: dict[str, dict[str, str]]) -> dict[str, list[dict[str, object]]]:
    """The sandbox's egress headers as E2B's ``network.rules`` of its info (E2B's spelling)."""
    return {
        host: [{"transform": {"headers": {k: v.replace(_DSEC_SECRET, _E2B_SECRET) for k, v in hs.items()}}}]
        for host, hs in headers.items()
    }


MAX_IAM_TOKENS = 5  # E2B's maxIamTokens
IAM_TOKEN_TYPE = "JWT-SVID"  # the only type E2B's API takes
# E2B's answer to a team without its `enable-sandbox-iam-tokens` feature flag, which is off
# outside E2B's development environment.
IAM_UNAVAILABLE = "Sandbox IAM workload tokens are not available for your team."


def check_iam(iam: Iam | None) -> None:
    """``iam`` on create as E2B's API takes it (``buildSandboxIam``: its checks, in its order,
    with its messages), then the 400 it gives a team whose feature flag is off. DSec mints no
    workload tokens: E2B's issuer is not in e2b-dev/infra, so neither are its claims."""
    tokens = iam.tokens if iam is not None else None
    if not tokens:  # absent or empty: workload identity off, as E2B reads it
        return
    if len(tokens) > MAX_IAM_TOKENS:
        raise InvalidRequest(f"iam.tokens: too many tokens: {len(tokens)} (max {MAX_IAM_TOKENS})")
    for name, token in tokens.items():
        if not name:
            raise InvalidRequest("iam.tokens: token name must not be empty")
        if not token.audience:
            raise InvalidRequest(f"iam.tokens.{name}.audience: audience is required")
        if token.token_type != IAM_TOKEN_TYPE:
            raise InvalidRequest(f'iam.tokens.{name}.tokenType: only "{IAM_TOKEN_TYPE}" is supported')
    raise InvalidRequest(IAM_UNAVAILABLE)
