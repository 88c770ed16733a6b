"""Layer references: ``name:version`` tags and ``sha256:<hex>`` digests.

Kept apart from the store so that code which only mounts layers (no catalogue, no SQLite) can
validate digests before they become path components.
"""

from __future__ import annotations

import re

from dsec.protocol.errors import InvalidRequest

# Names may contain "/" so that teams can namespace their layers ("team/tool:1.0"); they are
# catalogue keys, never paths, so no component rules beyond the character set are needed.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
_VERSION_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
HEX_PREFIX_RE = re.compile(r"^[0-9a-f]{12,64}$")
MIN_PREFIX = 12

# "sha256:<hex>" would otherwise also parse as name "sha256", version "<hex>".
_RESERVED_NAMES = frozenset({"sha256"})

REF_FORMS = "name:version, sha256:<64 hex>, or a digest prefix of at least 12 hex characters"


def parse_tag(ref: str) -> tuple[str, str]:
    """Split and validate ``name:version``; raise :class:`InvalidRequest` on anything else."""
    name, sep, version = ref.partition(":")
    if not sep or not _NAME_RE.match(name) or not _VERSION_RE.match(version):
        raise InvalidRequest(
            f"invalid layer tag {ref!r}: expected name:version, name of A-Za-z0-9._/- "
            "starting with a letter or digit, version of A-Za-z0-9._-"
        )
    if name in _RESERVED_NAMES:
        raise InvalidRequest(f"invalid layer tag {ref!r}: the name {name!r} is reserved for digests")
    return name, version


def is_tag(ref: str) -> bool:
    try:
        parse_tag(ref)
    except InvalidRequest:
        return False
    return True


def digest_hex(digest: str) -> str:
    """The 64 hex characters of a ``sha256:<hex>`` digest, validated (they become file names)."""
    m = _DIGEST_RE.match(digest)
    if m is None:
        raise InvalidRequest(f"invalid layer digest {digest!r}: expected sha256:<64 lowercase hex>")
    return m.group(1)


def make_digest(hexdigest: str) -> str:
    return f"sha256:{digest_hex('sha256:' + hexdigest)}"
