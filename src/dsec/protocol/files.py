"""Wire models of files inside a sandbox: what stat, listings and change lists return.

File names are bytes (Linux allows any byte but ``/`` and NUL), and a sandbox's agent chooses
them. In Python a name is a ``str`` decoded with ``surrogateescape`` (what ``os.fsdecode``
gives and every ``os`` call takes back), so a name that is not UTF-8 holds lone surrogates,
which JSON encoders refuse (pydantic) or emit as escapes that strict parsers reject. On the
wire such a name therefore travels twice: ``path`` as readable text with U+FFFD for the odd
bytes, and ``path_b64`` as the exact bytes (URL-safe base64); readers take ``path_b64`` when
it is there. Query parameters do the same (``?path_b64=``, see :func:`path_query`).
"""

from __future__ import annotations

import base64
import binascii
import os
from enum import StrEnum
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer, model_validator

PATH_MAX = 4096
"""Longest name or path (in bytes) carried as ``*_b64``."""


def is_text(value: str) -> bool:
    """Whether ``value`` is a name JSON and URLs carry as it is (UTF-8, no lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def encode_name(value: str) -> str:
    """``value``'s bytes (surrogateescape) as URL-safe base64."""
    return base64.urlsafe_b64encode(os.fsencode(value)).decode("ascii")


def decode_name(value: str, what: str) -> str:
    """The name a ``*_b64`` field or parameter carries, as a surrogateescape ``str``.
    ValueError (with ``what`` in the message) for bad base64, a NUL or more than PATH_MAX bytes."""
    if len(value) > 2 * PATH_MAX:
        raise ValueError(f"{what}_b64 is longer than {PATH_MAX} bytes")
    try:
        raw = base64.b64decode(value.encode("ascii"), altchars=b"-_", validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError(f"{what}_b64 is not URL-safe base64") from exc
    if not raw or b"\0" in raw or len(raw) > PATH_MAX:
        raise ValueError(f"{what}_b64 must be 1-{PATH_MAX} bytes without NUL")
    return os.fsdecode(raw)


def path_query(name: str, value: str) -> dict[str, str]:
    """The query parameter for path ``value``: ``{name: value}``, or ``{name_b64: ...}`` for a
    name that is not UTF-8 (the servers' ``text_param`` reads either)."""
    return {name: value} if is_text(value) else {f"{name}_b64": encode_name(value)}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _BytesNames(_Model):
    """A model whose ``names`` fields are file names: carried as bytes when not UTF-8."""

    names: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _from_b64(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(f"{n}_b64" in data for n in cls.names):
            return data
        data = dict(data)
        for name in cls.names:
            raw = data.pop(f"{name}_b64", None)
            if raw is not None:
                if not isinstance(raw, str):
                    raise ValueError(f"{name}_b64 must be a string")
                data[name] = decode_name(raw, name)
        return data

    @model_serializer(mode="wrap")
    def _to_b64(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        for name in self.names:
            value = out.get(name)
            if isinstance(value, str) and not is_text(value):
                out[name] = os.fsencode(value).decode("utf-8", "replace")
                out[f"{name}_b64"] = encode_name(value)
        return out


class FileType(StrEnum):
    file = "file"
    dir = "dir"
    symlink = "symlink"
    other = "other"


class FileStat(_BytesNames):
    names = ("path", "name")

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


class Change(_BytesNames):
    """One path the sandbox changed relative to its layers (read from the host side).

    ``target``: a symbolic link's target as stored (read on the host, never followed), for an
    added or modified link; None otherwise."""

    names = ("path", "target")

    path: str
    kind: ChangeKind
    type: FileType
    target: str | None = None
