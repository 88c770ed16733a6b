"""Which permissions are package registries, served through the edge's caching proxy
(:mod:`.proxy`), and where their upstreams are.

A registry belongs to the permission of the same name: holding ``pypi`` opens the proxy's
PyPI port on the gateway to that sandbox (and writes ``/etc/pip.conf`` into it); holding it
with a cutoff (``{"pypi": {"before": "2025-06-01"}}``) opens the proxy only, not the
permission's upstream names, so the cutoff cannot be walked around.
"""

from __future__ import annotations

import ssl
import urllib.parse
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Kind = Literal["pypi", "npm", "debian"]
CUTOFF_KINDS: frozenset[str] = frozenset({"pypi", "npm"})  # registries that publish upload times


class Registry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Kind
    index: str = Field(
        description="upstream base: PyPI's simple index (https://pypi.org/simple/), npm's registry"
        " (https://registry.npmjs.org/), Debian's archive host (http://deb.debian.org/)"
    )
    origins: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="other upstream origins the index's links may point at (PyPI's file host;"
        " for Debian, other archive hosts apt may ask for)",
    )
    port: int = Field(ge=1024, le=65535, description="the proxy's port on the gateway for this registry")

    @field_validator("index")
    @classmethod
    def _index(cls, v: str) -> str:
        _origin(v)
        return v if v.endswith("/") else v + "/"

    @field_validator("origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        return [_origin(o) for o in v]

    def allowed_origins(self) -> frozenset[str]:
        return frozenset({_origin(self.index), *self.origins})


def _origin(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or len(url) > 512:
        raise ValueError(f"not an http(s) URL: {url[:80]!r}")
    return f"{parts.scheme}://{parts.netloc.lower()}"


def origin(url: str) -> str:
    """``scheme://host[:port]`` of ``url`` (ValueError if it is not an http(s) URL)."""
    return _origin(url)


# The catalogue's registries (on when the catalogue's permission of that name is).
CATALOGUE_REGISTRIES: dict[str, Registry] = {
    "pypi": Registry(
        kind="pypi", index="https://pypi.org/simple/", origins=["https://files.pythonhosted.org"], port=13141
    ),
    "npm": Registry(kind="npm", index="https://registry.npmjs.org/", port=13142),
    "debian": Registry(
        kind="debian", index="http://deb.debian.org/", origins=["http://security.debian.org"], port=13143
    ),
}


class CacheConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_mb: int = Field(default=20_480, ge=16, le=10_000_000, description="the file cache's disk budget")
    max_file_mb: int = Field(default=2_048, ge=1, le=65_536, description="the largest file the proxy fetches")
    max_index_mb: int = Field(default=64, ge=1, le=1024, description="the largest index/packument it parses")
    index_ttl_s: int = Field(default=300, ge=0, le=86_400, description="how long an index is reused")
    ca_file: Path | None = Field(
        default=None,
        description="PEM file of certificate authorities the proxy trusts for upstream TLS besides the"
        " system's (a private mirror, a workplace TLS proxy); upstream certificates are always verified",
    )

    @field_validator("ca_file")
    @classmethod
    def _ca_file(cls, v: Path | None) -> Path | None:
        if v is None:
            return v
        try:
            ssl.create_default_context().load_verify_locations(cafile=str(v))
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"registry_cache.ca_file {str(v)[:200]!r}: no PEM certificates there ({exc})"
            ) from exc
        return v
