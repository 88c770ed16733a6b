"""Shape checks for what an image archive says: JSON documents, digests, relative paths.

Everything in an archive is untrusted; these raise :class:`InvalidRequest` naming what is wrong.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dsec.protocol.errors import InvalidRequest

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


# ---- small validation helpers ------------------------------------------------------------------


def _bad(what: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"invalid image archive: {what} {why}")


def _load_json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise _bad(what, f"is not valid JSON ({err})") from err


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(what, "is not a JSON object")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise _bad(what, "is not a JSON list")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _bad(what, "is not a string")
    return value


def _digest(value: Any, what: str) -> str:
    text = _str(value, what)
    if not _DIGEST_RE.match(text):
        raise _bad(what, f"is not a sha256 digest: {text[:100]!r}")
    return text


def _str_map(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    return {_str(k, what): _str(v, f"{what}[{k!r}]") for k, v in _obj(value, what).items()}


def _safe_parts(name: str, what: str) -> list[str]:
    """Components of a relative path named by the archive; nothing that could leave it."""
    if not name or "\0" in name or len(name) > 4096:
        raise _bad(what, f"names an invalid path {name[:200]!r}")
    if name.startswith("/"):
        raise _bad(what, f"names an absolute path {name[:200]!r}")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _bad(what, f"names a path with '..': {name[:200]!r}")
    if not parts or any(len(p.encode(errors="surrogateescape")) > 255 for p in parts):
        raise _bad(what, f"names an invalid path {name[:200]!r}")
    return parts


def _sha256_hex(digest: str) -> str:
    return digest.removeprefix("sha256:")
