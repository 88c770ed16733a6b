"""Wire models of projects, quotas and API keys (the IAM routes' requests)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Quotas are kept as SQL integers (64-bit; CPU as millicores): past these an insert overflowed
# and answered 500. Each is far above what any cluster holds, so no real quota is refused.
MAX_QUOTA_SANDBOXES = 10**9
MAX_QUOTA_CPU_CORES = 10**9  # x1000 millicores, still far inside 2**63
MAX_QUOTA_MEMORY_MIB = 1 << 40  # 1 EiB
MAX_QUOTA_STORAGE_MIB = 1 << 40  # 1 EiB of layer blobs


class _Model(BaseModel):
    # No inf/nan: a float on the wire is a number (JSON has no infinity; 1e400 parses as one).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class QuotaModel(_Model):
    """Bounds for a project's whole subtree; ``None``: only the ancestors' bounds apply."""

    sandboxes: int | None = Field(default=None, ge=0, le=MAX_QUOTA_SANDBOXES)
    cpu_cores: float | None = Field(default=None, ge=0, le=MAX_QUOTA_CPU_CORES)
    memory_mib: int | None = Field(default=None, ge=0, le=MAX_QUOTA_MEMORY_MIB)
    storage_mib: int | None = Field(
        default=None, ge=0, le=MAX_QUOTA_STORAGE_MIB, description="bytes of layers the subtree owns, in MiB"
    )


class ProjectCreate(_Model):
    parent: str = Field(max_length=4096)
    name: str = Field(max_length=256)
    quota: QuotaModel = Field(default_factory=QuotaModel)


class QuotaUpdate(_Model):
    project: str = Field(max_length=4096)
    quota: QuotaModel


class KeyCreate(_Model):
    project: str = Field(max_length=4096)
    admin: bool = False
    name: str = Field(default="", max_length=200)
    format: Literal["dsec", "e2b"] = Field(
        default="dsec", description="dsec: dsec_<hex>; e2b: e2b_<hex>, the form E2B's SDKs accept"
    )
