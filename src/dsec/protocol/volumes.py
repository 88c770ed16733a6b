"""Shared volumes: a project's persistent directories, kept by one node, mounted into sandboxes.

A volume outlives every sandbox that mounts it: files one sandbox writes there, the next one
(on the same node) reads. It is a btrfs subvolume of the node's quota file system with a limit
on the bytes it holds (backends/container/shared_volumes.py), bind-mounted read-write,
``nosuid,nodev``, at the paths a :class:`~dsec.protocol.models.ContainerSpec` names in
``volumes`` (crun containers). Its content is also reached without a sandbox, through the
node's edge, every path resolved inside the volume's root as a sandbox's files are.

Like a sandbox ID, a volume ID names its node (``vol-<node>-<tag>``), so any apiserver routes
an operation on it without a lookup table; a sandbox that mounts it is placed on that node.

Operations, as the sandbox ones (protocol/ops.py): a pydantic model per operation, naming its
answer; :data:`VOLUME_OPS` is the closed set an edge serves on ``POST /edge/v1/volumes/{kind}``.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from dsec.protocol.errors import InvalidRequest, VolumeNotFound
from dsec.protocol.files import FileStat
from dsec.protocol.ids import validate_node_name
from dsec.protocol.models import invalid_request
from dsec.protocol.ops import SandboxPath

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # E2B's rule (volume_create.go), bounded
_ID_RE = re.compile(r"^vol-(?P<node>[a-z0-9-]{1,40})-(?P<tag>[0-9a-f]{16})$")
MAX_VOLUMES_PER_PROJECT = 100  # on one node
MAX_VOLUME_MOUNTS = 8  # per sandbox
DEFAULT_SIZE_MB = 10 * 1024
MAX_LIST_DEPTH = 10  # E2B's maxDepth (dir_list.go)
MAX_LIST_ENTRIES = 100_000
# E2B's defaults for what its content API creates (orchestrator/pkg/volumes/service.go).
DEFAULT_OWNER = 9090
DEFAULT_DIR_MODE = 0o777
DEFAULT_FILE_MODE = 0o666


@dataclass(frozen=True)
class VolumeId:
    node: str
    tag: str

    @classmethod
    def new(cls, node: str) -> VolumeId:
        return cls(node, secrets.token_hex(8))

    @classmethod
    def parse(cls, text: str) -> VolumeId:
        """``VolumeNotFound`` for what names no volume (E2B's SDK takes a bad ID for a missing one)."""
        m = _ID_RE.fullmatch(text) if len(text) <= 64 else None
        if m is None:
            raise VolumeNotFound(f"volume {text[:80]!r} not found")
        try:
            validate_node_name(m["node"])
        except InvalidRequest:
            raise VolumeNotFound(f"volume {text[:80]!r} not found") from None
        return cls(m["node"], m["tag"])

    def __str__(self) -> str:
        return f"vol-{self.node}-{self.tag}"


def _name(value: str) -> str:
    if not _NAME_RE.fullmatch(value):
        raise ValueError("a volume name is 1-128 of A-Z a-z 0-9 _ -")
    return value


VolumeName = Annotated[str, AfterValidator(_name)]
VolumePath = SandboxPath  # inside the volume: "/" is its root
Owner = Annotated[int, Field(ge=0, lt=1 << 31)]
Mode = Annotated[int, Field(ge=0, le=0o7777)]


class VolumeInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    name: str
    project: str
    size_mb: int
    created_at: float
    # What it holds (data and metadata, as of btrfs's last commit: up to 30 s behind), read
    # for get and list; None in what a create or the record on disk says.
    used_bytes: int | None = None


class VolumeEntry(FileStat):
    """A file of a volume: :class:`FileStat` and the times and link target E2B shows."""

    atime: float
    ctime: float
    target: str | None = None  # a symlink's, as stored


class _VolumeOp(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: str
    response: ClassVar[Any]
    adapter: ClassVar[TypeAdapter[Any]]

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise invalid_request(exc) from exc


class _OnVolume(_VolumeOp):
    volume_id: str = Field(max_length=64)
    # The caller's project, set by the apiserver from the key (never the client's say): the
    # edge shows its subtree's volumes only. "" sees nothing.
    within: str = Field(default="", max_length=1024)


class _OnPath(_OnVolume):
    path: VolumePath


class CreateVolume(_VolumeOp):
    kind: Literal["create"] = "create"
    name: VolumeName
    project: str = Field(default="", max_length=1024)  # "": the key's (the apiserver fills it in)
    size_mb: int = Field(default=DEFAULT_SIZE_MB, ge=1, le=1 << 20)


class ListVolumes(_VolumeOp):
    kind: Literal["list"] = "list"
    within: str = Field(default="", max_length=1024)


class GetVolume(_OnVolume):
    kind: Literal["get"] = "get"


class DeleteVolume(_OnVolume):
    kind: Literal["delete"] = "delete"


class StatPath(_OnPath):
    kind: Literal["stat"] = "stat"


class ListDir(_OnPath):
    kind: Literal["list_dir"] = "list_dir"
    depth: int = Field(default=1, ge=1, le=MAX_LIST_DEPTH)


class MakeDir(_OnPath):
    kind: Literal["make_dir"] = "make_dir"
    uid: Owner = DEFAULT_OWNER
    gid: Owner = DEFAULT_OWNER
    mode: Mode = DEFAULT_DIR_MODE
    force: bool = False  # make missing parents; an existing directory is then no error


class RemovePath(_OnPath):
    kind: Literal["remove"] = "remove"


class UpdatePath(_OnPath):
    kind: Literal["update"] = "update"
    uid: Owner | None = None
    gid: Owner | None = None
    mode: Mode | None = None


class WriteOptions(BaseModel):
    """How ``PUT .../content`` writes a file (its query)."""

    model_config = ConfigDict(extra="forbid")

    uid: Owner = DEFAULT_OWNER
    gid: Owner = DEFAULT_OWNER
    mode: Mode = DEFAULT_FILE_MODE
    force: bool = False  # replace an existing file and make missing parents

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> WriteOptions:
        """The options a ``PUT .../content`` query names (others are the route's own)."""
        try:
            return cls.model_validate({k: v for k, v in query.items() if k in cls.model_fields})
        except ValidationError as exc:
            raise invalid_request(exc) from exc

    def to_query(self) -> dict[str, str]:
        return {k: str(v).lower() for k, v in self.model_dump().items()}


_ANSWERS: dict[type[_VolumeOp], Any] = {
    CreateVolume: VolumeInfo,
    ListVolumes: list[VolumeInfo],
    GetVolume: VolumeInfo,
    DeleteVolume: None,
    StatPath: VolumeEntry,
    ListDir: list[VolumeEntry],
    MakeDir: VolumeEntry,
    RemovePath: None,
    UpdatePath: VolumeEntry,
}
VOLUME_OPS: dict[str, type[_VolumeOp]] = {}
for _model, _answer in _ANSWERS.items():
    _model.response = _answer
    _model.adapter = TypeAdapter(_answer)
    VOLUME_OPS[_model.model_fields["kind"].default] = _model
VolumeOp = _VolumeOp


def parse_volume_op(kind: str, body: bytes) -> VolumeOp:
    model = VOLUME_OPS.get(kind)
    if model is None:
        raise InvalidRequest(f"unknown volume operation {kind[:64]!r}")
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise invalid_request(exc) from exc


def volume_node(volume_id: str) -> str:
    return VolumeId.parse(volume_id).node


__all__ = [
    "VOLUME_OPS",
    "CreateVolume",
    "DeleteVolume",
    "GetVolume",
    "ListDir",
    "ListVolumes",
    "MakeDir",
    "RemovePath",
    "StatPath",
    "UpdatePath",
    "VolumeEntry",
    "VolumeId",
    "VolumeInfo",
    "VolumeOp",
    "WriteOptions",
    "parse_volume_op",
    "volume_node",
]
