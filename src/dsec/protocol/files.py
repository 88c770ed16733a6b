"""Wire models of files inside a sandbox: what stat, listings and change lists return."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FileType(StrEnum):
    file = "file"
    dir = "dir"
    symlink = "symlink"
    other = "other"


class FileStat(_Model):
    path: str
    name: str
    type: FileType
    size: int
    mode: int
    mtime: float
    uid: int
    gid: int


class ChangeKind(StrEnum):
    added = "added"
    modified = "modified"
    deleted = "deleted"


class Change(_Model):
    """One path the sandbox changed relative to its layers (read from the host side)."""

    path: str
    kind: ChangeKind
    type: FileType
