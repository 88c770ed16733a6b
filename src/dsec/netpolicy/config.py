"""What an operator allows sandboxes to reach: permission names mapped to endpoints.

A sandbox asks for permissions by name (``network_rules={"pypi": True}``); only the operator's
configuration says what a name opens, so an agent cannot widen its own reach by guessing
addresses. Loaded from JSON or TOML::

    pool = "10.200.0.0/16"          # addresses of sandbox links (one /32 each)
    [[permissions.pypi]]
    names = ["pypi.mirror.internal"] # what the sandbox's resolver answers for
    address = "10.0.0.5"
    ports = [3141]
"""

from __future__ import annotations

import ipaddress
import json
import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dsec.protocol.errors import InvalidRequest

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_HOST = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


class Endpoint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    address: ipaddress.IPv4Address
    ports: list[int] = Field(min_length=1, max_length=64)
    protocol: Literal["tcp", "udp"] = "tcp"
    names: list[str] = Field(default_factory=list, description="DNS names that resolve to address")

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        bad = [p for p in v if not 1 <= p <= 65535]
        if bad:
            raise ValueError(f"ports must be 1-65535, not {bad}")
        return sorted(set(v))

    @field_validator("names")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        out = [n.lower().rstrip(".") for n in v]
        bad = [n for n in out if not _HOST.match(n)]
        if bad:
            raise ValueError(f"not DNS names: {bad}")
        return out


class EgressConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    permissions: dict[str, list[Endpoint]] = Field(default_factory=dict)
    pool: ipaddress.IPv4Network = ipaddress.IPv4Network("10.200.0.0/16")

    @field_validator("permissions")
    @classmethod
    def _permission_names(cls, v: dict[str, list[Endpoint]]) -> dict[str, list[Endpoint]]:
        bad = [n for n in v if not _NAME.match(n)]
        if bad:
            raise ValueError(f"permission names must be short words ([A-Za-z0-9_.-]): {bad}")
        return v

    @model_validator(mode="after")
    def _pool(self) -> EgressConfig:
        if self.pool.prefixlen > 28:
            raise ValueError("the pool must hold at least 16 addresses (a /28 or larger)")
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

    def check(self, rules: dict[str, bool]) -> None:
        """Refuse rules that name permissions this node does not know (typos open nothing)."""
        unknown = sorted(set(rules) - set(self.permissions))
        if unknown:
            known = ", ".join(sorted(self.permissions)) or "none"
            raise InvalidRequest(f"unknown network permission(s) {unknown}; this node offers: {known}")

    def endpoints(self, rules: dict[str, bool]) -> list[Endpoint]:
        return [e for name, on in sorted(rules.items()) if on for e in self.permissions.get(name, [])]

    @classmethod
    def load(cls, path: Path) -> EgressConfig:
        try:
            text = path.read_text()
            raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
            return cls.model_validate(raw)
        except (OSError, ValueError, ValidationError) as exc:
            raise InvalidRequest(f"egress configuration {path}: {exc}") from exc
