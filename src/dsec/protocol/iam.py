"""Wire models of projects, quotas and API keys (the IAM routes' requests)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class QuotaModel(_Model):
    """Bounds for a project's whole subtree; ``None``: only the ancestors' bounds apply."""

    sandboxes: int | None = Field(default=None, ge=0)
    cpu_cores: float | None = Field(default=None, ge=0)
    memory_mib: int | None = Field(default=None, ge=0)


class ProjectCreate(_Model):
    parent: str
    name: str
    quota: QuotaModel = Field(default_factory=QuotaModel)


class QuotaUpdate(_Model):
    project: str
    quota: QuotaModel


class KeyCreate(_Model):
    project: str
    admin: bool = False
    name: str = Field(default="", max_length=200)
    format: Literal["dsec", "e2b"] = Field(
        default="dsec", description="dsec: dsec_<hex>; e2b: e2b_<hex>, the form E2B's SDKs accept"
    )
