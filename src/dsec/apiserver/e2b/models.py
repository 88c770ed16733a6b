"""E2B's REST wire schemas, as the official SDKs (2.34 and 2.63) send and parse them.

Input models ignore fields they do not know (newer SDKs add some); output models carry every
field the SDKs' generated ``from_dict`` requires, since a missing one crashes the SDK. Field
names are E2B's (``sandboxID``, ``memoryMB``...), kept by aliases.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from dsec.protocol.bounds import OsStr

# The in-sandbox API version the answers claim. The SDKs gate features on it: 0.5.7 unlocks
# octet-stream uploads, 0.6.2 file metadata, 0.6.4 is the newest both 2.34 and 2.63 know.
ENVD_VERSION = "0.6.4"
E2BState = Literal["running", "paused"]
# The label that keeps a sandbox's ``autoResume`` (with the sandbox, so every apiserver and an
# edge restart see it); E2B's answers leave it out of ``metadata``.
AUTO_RESUME_LABEL = "e2b.autoResume"
# Kept "false" for a sandbox created with ``allow_public_traffic=False``: its ports want its
# traffic access token (apiserver/e2b/traffic.py). Left out of ``metadata`` too.
PRIVATE_TRAFFIC_LABEL = "e2b.allowPublicTraffic"


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, allow_inf_nan=False)


class _Out(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    def wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# An allow_out/deny_out entry: an address, a range, a name (DSec: a permission name).
NetworkEntry = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class NetworkUpdate(_In):
    """``PUT /sandboxes/{id}/network`` (``update_network``): the whole egress configuration,
    replaced. Also the egress part of a create's ``network``."""

    allow_out: list[NetworkEntry] | None = Field(default=None, alias="allowOut", max_length=256)
    deny_out: list[NetworkEntry] | None = Field(default=None, alias="denyOut", max_length=256)
    rules: dict[str, Any] | None = None
    egress_proxy: dict[str, Any] | None = Field(default=None, alias="egressProxy")
    dns_servers: list[NetworkEntry] | None = Field(default=None, alias="dnsServers", max_length=256)
    allow_internet_access: bool | None = None  # E2B's wire name, snake case
    allow_public_traffic: bool | None = Field(default=None, alias="allowPublicTraffic")  # at create


class AutoResume(_In):
    enabled: bool = False


class IamToken(_In):
    """One workload token of ``iam.tokens`` (E2B's ``SandboxIamToken``)."""

    audience: str = Field(default="", max_length=2048)
    token_type: str = Field(default="", alias="tokenType", max_length=64)


class Iam(_In):
    tokens: dict[Annotated[str, StringConstraints(max_length=256)], IamToken] | None = None


class NewSandbox(_In):
    """``POST /sandboxes`` (2.34) and ``POST /v2/sandboxes`` (2.63)."""

    template_id: OsStr = Field(alias="templateID", min_length=1, max_length=4096)  # a layer name: no NUL
    timeout: int = Field(default=15, ge=0, le=366 * 86400, description="seconds until stopped")
    auto_pause: bool = Field(default=False, alias="autoPause")
    auto_resume: AutoResume | None = Field(default=None, alias="autoResume")
    allow_internet_access: bool | None = None  # E2B's wire name, snake case
    network: NetworkUpdate | None = None  # of the ingress fields, only allowPublicTraffic is read
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(default=None, alias="envVars")
    mcp: dict[str, Any] | None = None
    iam: Iam | None = None  # workload identity tokens: E2B's checks, then its flag's 400
    volume_mounts: list[dict[str, Any]] | None = Field(default=None, alias="volumeMounts")


class ConnectSandbox(_In):
    """``POST /sandboxes/{id}/connect`` and its ``/v2`` twin; ``POST .../refreshes`` too."""

    timeout: int | None = Field(default=None, ge=0, le=366 * 86400)


class ResumeSandbox(_In):
    timeout: int = Field(default=15, ge=0, le=366 * 86400)
    auto_pause: bool = Field(default=False, alias="autoPause")


class TimeoutRequest(_In):
    timeout: int = Field(ge=-366 * 86400, le=366 * 86400)  # E2B's API takes below 0 as 0


class RefreshRequest(_In):
    duration: int | None = Field(default=None, ge=0, le=3600)


class Lifecycle(_Out):
    auto_resume: bool = Field(default=False, alias="autoResume")
    on_timeout: Literal["kill", "pause"] = Field(alias="onTimeout")


class Sandbox(_Out):
    """What create, connect and resume answer."""

    template_id: str = Field(alias="templateID")
    sandbox_id: str = Field(alias="sandboxID")
    client_id: str = Field(alias="clientID")
    envd_version: str = Field(default=ENVD_VERSION, alias="envdVersion")
    envd_access_token: str | None = Field(default=None, alias="envdAccessToken")
    traffic_access_token: str | None = Field(default=None, alias="trafficAccessToken")
    domain: str | None = None  # get_host(port) is PORT-ID.<domain> (the operator's --e2b-domain)


class ListedSandbox(_Out):
    template_id: str = Field(alias="templateID")
    sandbox_id: str = Field(alias="sandboxID")
    client_id: str = Field(alias="clientID")
    started_at: dt.datetime = Field(alias="startedAt")
    end_at: dt.datetime = Field(alias="endAt")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int = Field(alias="diskSizeMB")
    state: E2BState
    envd_version: str = Field(default=ENVD_VERSION, alias="envdVersion")
    metadata: dict[str, str] = Field(default_factory=dict)


class NetworkInfo(_Out):
    allow_out: list[str] | None = Field(default=None, alias="allowOut")
    deny_out: list[str] | None = Field(default=None, alias="denyOut")
    rules: dict[str, list[dict[str, Any]]] | None = None


class SandboxDetail(ListedSandbox):
    envd_access_token: str | None = Field(default=None, alias="envdAccessToken")
    lifecycle: Lifecycle | None = None
    network: NetworkInfo | None = None
    domain: str | None = None


def error_body(status: int, message: str) -> dict[str, Any]:
    """E2B's error body: the SDKs parse it (``code`` and ``message`` both required) before they
    look at the status."""
    return {"code": status, "message": message}
