"""Headers the node's egress adds to a sandbox's outbound HTTP(S) requests, per host.

``egress_headers`` maps a host name to the headers every HTTPS request of the sandbox to that
host gets (set: a header of that name the sandbox sent is replaced; plain HTTP gets only the
headers that name no secret). A value may hold placeholders
``${secrets.<name>}``, filled at the edge from ``egress_secrets`` (name -> value): the
spec's headers are what any read of the sandbox shows; the secrets' values are never shown.
The edge terminates the sandbox's TLS to those hosts only, with a CA of its node that the
sandbox is given to trust, and re-encrypts to the host (netpolicy/intercept.py); the host must
be one the sandbox reaches by name (a permission naming its domain, port 443 or 80).

The bounds are E2B's (``sandbox_create.go``): 10 hosts, one rule of 20 headers each, names
of 64 token characters, values of 2048 characters, no control characters; and DSec's: 16 KiB
of headers in all, filled.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated

from pydantic import AfterValidator

MAX_HOSTS = 10
MAX_HOST_LEN = 128
MAX_HEADERS = 20
MAX_NAME_LEN = 64
MAX_VALUE_LEN = 2048
MAX_SECRETS = 32
MAX_SECRET_NAME_LEN = 128
MAX_SECRET_LEN = 2048  # a filled value is a header value: the same bound
# All of a sandbox's headers, filled (names and values): E2B's per-header bounds allow 400 KiB,
# which the edge's proxy would hold (and its map file repeat) for every sandbox; credentials
# are a few hundred bytes.
MAX_TOTAL = 16 << 10

# The environment of every process of a sandbox with egress headers, unless its spec sets these:
# runtimes that keep a CA bundle of their own pointed at the system's, which holds the node's
# CA (netpolicy/intercept.py writes both files).
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
CA_ENV = {"NODE_EXTRA_CA_CERTS": "/etc/ssl/certs/dsec-egress.pem", "REQUESTS_CA_BUNDLE": CA_BUNDLE}

PLACEHOLDER_PREFIX = "${secrets."
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")  # RFC 9110 token
_VALUE = re.compile(r"^[\t\x20-\x7e\x80-\U0010ffff]*$")  # no control characters but HTAB
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_HOST = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_SECRET_NAME = re.compile(r"^[^{}\x00-\x1f\x7f-\x9f]+$")
_PLACEHOLDER = re.compile(r"\$\{secrets\.([^}]*)\}")
# Headers that frame or route the request: set by a rule they would break it or send it elsewhere.
_RESERVED = {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer"}


def placeholders(value: str) -> list[str]:
    """The secret names ``value`` refers to, in order (a malformed one is a ValueError)."""
    names = _PLACEHOLDER.findall(value)
    if value.count(PLACEHOLDER_PREFIX) != len(names) or any(not n for n in names):
        raise ValueError("a secret placeholder is malformed: write ${secrets.<name>}")
    return names


def _headers(v: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    if len(v) > MAX_HOSTS:
        raise ValueError(f"egress_headers: at most {MAX_HOSTS} hosts")
    out: dict[str, dict[str, str]] = {}
    for host, headers in v.items():
        name = host.lower()
        if len(name) > MAX_HOST_LEN or not _HOST.match(name):
            raise ValueError(f"egress_headers: {host[:MAX_HOST_LEN]!r} is no host name")
        if len(headers) > MAX_HEADERS:
            raise ValueError(f"egress_headers {name}: at most {MAX_HEADERS} headers")
        for header, value in headers.items():
            if not header or len(header) > MAX_NAME_LEN or not _TOKEN.match(header):
                raise ValueError(
                    f"egress_headers {name}: header name {header[:MAX_NAME_LEN]!r} must be 1-{MAX_NAME_LEN}"
                    " HTTP token characters"
                )
            if header.lower() in _RESERVED:
                raise ValueError(f"egress_headers {name}: {header!r} frames the request and cannot be set")
            if len(value) > MAX_VALUE_LEN or not _VALUE.match(value):
                raise ValueError(
                    f"egress_headers {name}: the value of {header!r} must be at most {MAX_VALUE_LEN}"
                    " characters, with no control characters"
                )
            placeholders(value)
        if name in out:
            raise ValueError(f"egress_headers: {name} is named twice")
        out[name] = dict(headers)
    return out


def _secrets(v: dict[str, str]) -> dict[str, str]:
    if len(v) > MAX_SECRETS:
        raise ValueError(f"egress_secrets: at most {MAX_SECRETS} secrets")
    for name, value in v.items():
        if len(name) > MAX_SECRET_NAME_LEN or not _SECRET_NAME.match(name):
            raise ValueError(f"egress_secrets: {name[:MAX_SECRET_NAME_LEN]!r} is no secret name")
        if len(value) > MAX_SECRET_LEN or not _VALUE.match(value):
            raise ValueError(
                f"egress_secrets {name!r}: a value must be at most {MAX_SECRET_LEN} characters with no"
                " control characters (it goes into a header)"
            )
    return v


EgressHeaders = Annotated[dict[str, dict[str, str]], AfterValidator(_headers)]
EgressSecrets = Annotated[dict[str, str], AfterValidator(_secrets)]


def filled(headers: Mapping[str, Mapping[str, str]], secrets: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """``headers`` with every placeholder replaced by its secret (a ValueError naming the first
    secret ``secrets`` lacks, or a filled value past the bound)."""
    out: dict[str, dict[str, str]] = {}
    for host, hs in headers.items():
        out[host] = {}
        for header, value in hs.items():
            for name in placeholders(value):
                if name not in secrets:
                    raise ValueError(f"egress_headers {host}: secret {name!r} is not in egress_secrets")

            def secret(m: re.Match[str]) -> str:
                return secrets[m.group(1)]

            text = _PLACEHOLDER.sub(secret, value)
            if len(text) > MAX_VALUE_LEN:
                raise ValueError(f"egress_headers {host}: {header!r} is longer than {MAX_VALUE_LEN} filled")
            out[host][header] = text
    total = sum(len(h.encode()) + len(v.encode()) for hs in out.values() for h, v in hs.items())
    if total > MAX_TOTAL:
        raise ValueError(f"egress_headers: {total} bytes filled, at most {MAX_TOTAL} in all")
    return out


def used(headers: Mapping[str, Mapping[str, str]]) -> set[str]:
    """The secret names ``headers`` refer to."""
    return {n for hs in headers.values() for v in hs.values() for n in placeholders(v)}
