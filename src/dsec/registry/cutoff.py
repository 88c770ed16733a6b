"""What a cutoff date hides: releases uploaded on or after it, by the upload times the
registries themselves publish.

- PyPI's simple API in JSON (PEP 691, with PEP 700's ``upload-time`` per file) and its JSON
  API (``upload_time_iso_8601``): a file uploaded at or after the cutoff is dropped, and so is
  a file with no upload time at all (a client cannot be shown a release whose age is unknown);
- npm's packument: a version whose ``time`` is at or after the cutoff (or missing) is dropped
  from ``versions`` and ``time``, and a dist-tag pointing at a dropped version is taken away
  (``latest`` is moved to the newest version left, as npm's resolver expects one).

Pure functions on parsed JSON, so the rules are tested without any server.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

Json = dict[str, Any]


def instant(day: datetime.date) -> datetime.datetime:
    """The first moment of ``day`` in UTC: uploads from then on are hidden."""
    return datetime.datetime(day.year, day.month, day.day, tzinfo=datetime.UTC)


def parse_time(value: object) -> datetime.datetime | None:
    """An ISO 8601 time as registries write it (``2025-05-01T12:00:00.123456Z``); None when
    absent or unreadable."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=datetime.UTC)


def _before(value: object, cutoff: datetime.datetime) -> bool:
    at = parse_time(value)
    return at is not None and at < cutoff


def pypi_simple(doc: Json, cutoff: datetime.datetime | None) -> Json:
    """A PEP 691 project page with only the files uploaded before ``cutoff``."""
    files = [f for f in doc.get("files", []) if isinstance(f, dict)]
    if cutoff is None:
        return {**doc, "files": files}
    kept = [f for f in files if _before(f.get("upload-time"), cutoff)]
    out = {**doc, "files": kept}
    if isinstance(doc.get("versions"), list):
        names = [str(f.get("filename", "")) for f in kept]
        out["versions"] = [v for v in doc["versions"] if any(_names_version(n, str(v)) for n in names)]
    return out


def _names_version(filename: str, version: str) -> bool:
    """Whether a distribution file is of ``version`` (``name-1.0-py3-none-any.whl``,
    ``name-1.0.tar.gz``): the version follows the name's last dash before the tags."""
    return bool(re.search(rf"-{re.escape(version)}(-|\.tar\.|\.zip$|\.tar$)", filename))


def pypi_json(doc: Json, cutoff: datetime.datetime | None) -> Json:
    """PyPI's JSON API document (``/pypi/NAME/json``) with only the files uploaded before
    ``cutoff``; releases left with no file are dropped, and ``info.version`` names the newest
    release left."""
    if cutoff is None:
        return doc
    releases = doc.get("releases")
    kept: dict[str, list[Json]] = {}
    if isinstance(releases, dict):
        for version, files in releases.items():
            left = [
                f
                for f in files
                if isinstance(f, dict) and _before(f.get("upload_time_iso_8601"), cutoff)
            ] if isinstance(files, list) else []  # fmt: skip
            if left:
                kept[str(version)] = left
    urls = [
        u
        for u in doc.get("urls", [])
        if isinstance(u, dict) and _before(u.get("upload_time_iso_8601"), cutoff)
    ]
    out = {**doc, "releases": kept, "urls": urls}
    info = doc.get("info")
    if isinstance(info, dict):
        newest = max(kept, key=version_key, default=None)
        out["info"] = {**info, "version": newest}
    return out


def npm_packument(doc: Json, cutoff: datetime.datetime | None) -> Json:
    """An npm packument with only the versions published before ``cutoff``."""
    if cutoff is None:
        return doc
    times = doc.get("time") if isinstance(doc.get("time"), dict) else {}
    versions = doc.get("versions") if isinstance(doc.get("versions"), dict) else {}
    assert isinstance(times, dict) and isinstance(versions, dict)
    kept = {v: meta for v, meta in versions.items() if _before(times.get(v), cutoff)}
    out = {**doc, "versions": kept}
    out["time"] = {k: t for k, t in times.items() if k in kept or (k in ("created",) and _before(t, cutoff))}
    tags = doc.get("dist-tags") if isinstance(doc.get("dist-tags"), dict) else {}
    assert isinstance(tags, dict)
    new_tags = {tag: v for tag, v in tags.items() if v in kept}
    if "latest" not in new_tags:
        stable = [v for v in kept if "-" not in v]
        newest = max(stable or list(kept), key=version_key, default=None)
        if newest is not None:
            new_tags["latest"] = newest
    out["dist-tags"] = new_tags
    return out


def version_key(version: str) -> tuple[tuple[int, ...], int, str]:
    """An ordering good enough to pick the newest of a registry's versions: the numeric
    release parts, then a release above its pre-releases (``1.0.0`` > ``1.0.0-rc.1``, and
    PEP 440's ``1.0rc1``, ``1.0a1``, ``1.0.dev1``), then the rest as text."""
    m = re.match(r"v?(\d+(?:\.\d+)*)(.*)$", version)
    if m is None:
        return ((), 0, version)
    release = tuple(int(p) for p in m.group(1).split("."))
    while release and release[-1] == 0:
        release = release[:-1]
    rest = m.group(2)
    pre = bool(re.match(r"[-.]?(a|b|rc|c|alpha|beta|pre|preview|dev)\d*", rest, re.I)) or rest.startswith("-")
    post = rest.startswith((".post", "-post", "post"))
    return (release, 2 if post else 0 if pre else 1, rest)
