"""Bodies of E2B's template build API (the v2 ``Template()`` builder of SDKs 2.34 and 2.63),
bounded at the edge, and the records a built template leaves.

A template is a name a project owns that stands for a DSec layer list plus what a layer cannot
hold: the environment, working directory and user its steps left, and the start and ready
commands a sandbox created from it runs (:mod:`.templates`).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dsec.protocol.errors import InvalidRequest

MAX_STEPS = 256
MAX_ARG = 64 << 10  # one step argument (a RUN script): 64 KiB
MAX_CMD = 64 << 10
MAX_REF = 512  # fromImage / fromTemplate
MAX_TAGS = 16
MAX_ENV_BYTES = 1 << 20  # all ENV steps' names and values: they become a sandbox's environment
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]{0,127}$")  # E2B's names: lowercase, '-', '_', '.'
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
HASH_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # the SDK sends a sha256 hex digest
DEFAULT_TAG = "default"


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, allow_inf_nan=False)


def split_name(raw: str) -> tuple[str, str]:
    """``name`` or ``name:tag`` (E2B's form), checked: (name, tag)."""
    name, _, tag = raw.partition(":")
    tag = tag or DEFAULT_TAG
    if not _NAME_RE.match(name):
        raise InvalidRequest(
            f"template name {raw[:140]!r}: 1 to 128 of lowercase letters, digits, '.', '_', '-', '/'"
        )
    if not _TAG_RE.match(tag):
        raise InvalidRequest(f"template tag {tag[:80]!r}: 1 to 64 of letters, digits, '.', '_', '-'")
    return name, tag


class BuildRequest(_In):
    """``POST /v3/templates``: a template (new, or the project's of that name) and a build ID."""

    name: str | None = Field(default=None, max_length=200)
    alias: str | None = Field(default=None, max_length=200)  # the deprecated spelling of name
    tags: list[str] | None = Field(default=None, max_length=MAX_TAGS)
    cpu_count: int | None = Field(default=None, alias="cpuCount", ge=1, le=64)
    memory_mb: int | None = Field(default=None, alias="memoryMB", ge=128, le=65536)
    min_free_disk_mb: int | None = Field(default=None, alias="minFreeDiskMb", ge=0, le=1 << 20)

    def name_and_tags(self) -> tuple[str, list[str]]:
        raw = self.name or self.alias
        if not raw:
            raise InvalidRequest("name is required")
        name, tag = split_name(raw)
        tags = [tag, *(split_name(f"{name}:{t}")[1] for t in self.tags or [])]
        return name, list(dict.fromkeys(tags))


class Step(_In):
    type: Literal["COPY", "ENV", "RUN", "WORKDIR", "USER"]
    args: list[str] = Field(default_factory=list, max_length=512)
    files_hash: str | None = Field(default=None, alias="filesHash", max_length=128)
    force: bool | None = None
    force_upload: bool | None = Field(default=None, alias="forceUpload")

    @field_validator("args")
    @classmethod
    def _bounded(cls, args: list[str]) -> list[str]:
        for arg in args:
            if len(arg) > MAX_ARG or "\0" in arg:
                raise ValueError(f"a step argument is longer than {MAX_ARG} characters or has NUL")
        return args

    def check(self, number: int) -> None:
        """E2B's argument shapes (what the SDK's builder sends), 400 otherwise."""
        where = f"step {number} ({self.type})"
        n = len(self.args)
        if self.type == "RUN" and not (1 <= n <= 2 and self.args[0].strip()):
            raise InvalidRequest(f"{where}: args are [command] or [command, user]")
        if self.type == "COPY":
            if not 2 <= n <= 4 or not self.args[0] or not self.args[1]:
                raise InvalidRequest(f"{where}: args are [src, dest, user?, mode?]")
            if self.files_hash is None or not HASH_RE.match(self.files_hash):
                raise InvalidRequest(f"{where}: filesHash is required (the uploaded files' hash)")
            if self.args[0].startswith("/") or ".." in self.args[0].split("/"):
                raise InvalidRequest(f"{where}: src must be relative, inside the build context")
            if n == 4 and self.args[3] and not re.fullmatch(r"0?[0-7]{3,4}", self.args[3]):
                raise InvalidRequest(f"{where}: mode {self.args[3][:20]!r} is not octal")
        if self.type == "ENV":
            if n == 0 or n % 2:
                raise InvalidRequest(f"{where}: args are name, value pairs")
            for key in self.args[::2]:
                if not _ENV_RE.match(key):
                    raise InvalidRequest(f"{where}: {key[:80]!r} is not an environment variable name")
        if self.type == "WORKDIR" and (n != 1 or not self.args[0]):
            raise InvalidRequest(f"{where}: args are [path]")
        users = self.args[2:3] if self.type == "COPY" else self.args[1:2] if self.type == "RUN" else []
        if self.type == "USER":
            if n != 1:
                raise InvalidRequest(f"{where}: args are [user]")
            users = self.args
        for user in users:
            if user and not _USER_RE.match(user):
                raise InvalidRequest(f"{where}: {user[:40]!r} is not a user name")


class BuildStart(_In):
    """``POST /v2/templates/{templateID}/builds/{buildID}``: what the build runs."""

    from_image: str | None = Field(default=None, alias="fromImage", max_length=MAX_REF)
    from_template: str | None = Field(default=None, alias="fromTemplate", max_length=MAX_REF)
    from_image_registry: dict[str, object] | None = Field(default=None, alias="fromImageRegistry")
    steps: list[Step] = Field(default_factory=list, max_length=MAX_STEPS)
    force: bool | None = None
    start_cmd: str | None = Field(default=None, alias="startCmd", max_length=MAX_CMD)
    ready_cmd: str | None = Field(default=None, alias="readyCmd", max_length=MAX_CMD)

    def check(self) -> None:
        if self.from_image and self.from_template:
            raise InvalidRequest("give fromImage or fromTemplate, not both")
        if self.from_image_registry:
            raise InvalidRequest(
                "fromImageRegistry: DSec pulls no registry images in a build; import the image "
                "on the node (`dsec image import`) and build fromImage on it"
            )
        for number, step in enumerate(self.steps, 1):
            step.check(number)
        env_bytes = sum(len(a) for s in self.steps if s.type == "ENV" for a in s.args)
        if env_bytes > MAX_ENV_BYTES:
            raise InvalidRequest(f"the ENV steps hold more than {MAX_ENV_BYTES >> 10} KiB")
        for cmd in (self.start_cmd, self.ready_cmd):
            if cmd is not None and "\0" in cmd:
                raise InvalidRequest("startCmd and readyCmd may not hold NUL")


def build_key(base_digests: list[str], base: TemplateConfig, start: BuildStart) -> str:
    """The identity of a build's result: the base's layer digests and defaults, and the steps
    (a COPY's uploaded files by their hash). Start and ready commands do not change layers."""
    what = {
        "base": base_digests,
        "env": base.env,
        "workdir": base.workdir,
        "user": base.user,
        "steps": [[s.type, s.args, s.files_hash] for s in start.steps],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def forced(start: BuildStart) -> bool:
    """``skip_cache()`` (the whole build) or a step marked ``force``: E2B runs it, and every
    step after, again; with one cache entry per whole build, that is the whole build."""
    return bool(start.force) or any(s.force for s in start.steps)


class TemplateConfig(BaseModel):
    """What a ready build left: the layers and the sandbox's defaults."""

    refs: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    start_cmd: str | None = None
    ready_cmd: str | None = None
    build_id: str = ""
    # What made it (build_key): a later build of the same project with the same key reuses
    # these layers instead of running its steps again, as E2B's build cache does.
    build_key: str | None = None


class TemplateRecord(BaseModel):
    """One template of one project, as kept on disk."""

    template_id: str
    project: str
    name: str
    created_at: float
    updated_at: float
    cpu_count: int = 2
    memory_mb: int = 1024
    build_count: int = 0
    last_build: str = ""
    last_status: Literal["waiting", "building", "ready", "error"] = "waiting"
    tags: dict[str, TemplateConfig] = Field(default_factory=dict)  # tag -> its build's config
    tagged_at: dict[str, float] = Field(default_factory=dict)  # tag -> when it was assigned
