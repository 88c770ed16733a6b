"""The layer catalogue: tags as small files beside the blobs, on any :class:`BlobStore`.

A tag ``name:version`` names an ordered list of blob digests (base first): a layer tag
(``kind`` "layer") is a list of one, an image (``kind`` "image") a list of one or more. Layers
and images share one namespace. Records (keys of the blob store's record space)::

    tags/<name>/<version>.json      {"ref": "name:version", "kind": "layer" | "image",
                                     "digests": [...], "created_at": t,
                                     "owner": project, "public": bool}
    refs/<hex>/<name>/<version>     empty: "this tag may refer to blob <hex>" (reverse index)
    owners/<hex>/<project>          empty: "project imported or committed blob <hex>"
    public/<hex>                    empty: "an admin made blob <hex> visible to every project"
    quotas/<project>                {"storage_mib": N}: IAM's storage quota, mirrored for the nodes
                                    (:mod:`dsec.images.storage_quota`)
    meta/<what>.json                bookkeeping, e.g. the one-time import of a legacy catalogue

``<name>`` and ``<version>`` are percent-encoded so that a name's "/" (team/tool) and a
version's leading "." never become path structure.

The tag records are the truth; the reverse index only makes "which tags name this blob" cheap
(it is asked on every resolve, which must not read the whole catalogue). Writers add index
entries before and again after writing a tag record; removers delete an entry only after
re-reading the tag, and put it back if the tag came to refer to the blob meanwhile. So the
index is always a superset of the truth, and readers filter it through the tag records.

Ownership (see :mod:`dsec.images.owners`): a tag belongs to the project that created it, a
blob to every project that imported or committed its content (content is deduplicated, so
several may). A tag or blob written before ownership existed has no owner recorded and
counts as the root project's (:data:`LEGACY_OWNER`): visible to root keys only, until an
admin marks it public.

Versions are immutable: :meth:`Catalogue.create` is an atomic create-if-absent (creating an
existing tag with the same digests is a no-op, with other digests an InvalidRequest). Only
:meth:`Catalogue.replace` (an explicit retag) moves a tag, with one atomic rename.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import quote, unquote

from dsec.images.blobstore import BlobStore
from dsec.images.refs import digest_hex, parse_tag
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest

log = logging.getLogger(__name__)

TAGS = "tags"
REFS = "refs"
OWNERS = "owners"
PUBLIC = "public"
# Who owns what was stored before ownership was recorded: the root project (iam.ROOT_PROJECT).
LEGACY_OWNER = "root"
MAX_PERMISSIONS, MAX_PERMISSION = 64, 80  # a tag's recorded network permissions
LEGACY_MARKER = "meta/migrated-catalog-sqlite.json"


def _enc(part: str) -> str:
    out = quote(part, safe="")
    return "%2E" + out[1:] if out.startswith(".") else out


Kind = Literal["layer", "image"]
LAYER: Kind = "layer"
IMAGE: Kind = "image"


@dataclass(frozen=True)
class TagRecord:
    name: str
    version: str
    digests: tuple[str, ...]
    created_at: float
    kind: Kind = LAYER
    owner: str = LEGACY_OWNER
    public: bool = False
    network: tuple[str, ...] = ()  # the permissions that built it ("pypi", "pypi@2025-06-01")

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"

    @property
    def is_layer(self) -> bool:
        return self.kind == LAYER

    def to_bytes(self) -> bytes:
        body = {
            "ref": self.ref,
            "kind": self.kind,
            "digests": list(self.digests),
            "created_at": self.created_at,
            "owner": self.owner,
            "public": self.public,
        }
        if self.network:
            body["network"] = list(self.network)
        return json.dumps(body, indent=1).encode() + b"\n"


def tag_key(name: str, version: str) -> str:
    return f"{TAGS}/{_enc(name)}/{_enc(version)}.json"


def _ref_key(digest: str, name: str, version: str) -> str:
    return f"{REFS}/{digest_hex(digest)}/{_enc(name)}/{_enc(version)}"


_PARSED_MAX = 4096  # tag records kept parsed (a few hundred bytes each)
# A record deleted and created again within one tick of the file system's clock may show the
# same version (see _DirBlobStore.record_version): a parsed record is read again after this.
_PARSED_MAX_AGE_S = 2.0


class Catalogue:
    def __init__(self, blobs: BlobStore) -> None:
        self.blobs = blobs
        # Tags as last parsed, by key, under the record's version: a create reads its image's
        # tag, and a stat costs less than an open, a read and a parse (docs/decisions.md).
        self._parsed: dict[str, tuple[Hashable, TagRecord, float]] = {}
        self._parsed_lock = threading.Lock()

    # -- reading -----------------------------------------------------------------------------

    def _parse(self, key: str, data: bytes, name: str, version: str) -> TagRecord:
        try:
            body = json.loads(data)
            digests = tuple(str(d) for d in body["digests"])
            for d in digests:
                digest_hex(d)
            created_at = float(body["created_at"])
            kind = body.get("kind", LAYER if len(digests) == 1 else IMAGE)
            if kind not in (LAYER, IMAGE) or not digests or (kind == LAYER and len(digests) != 1):
                raise ValueError(f"{kind} of {len(digests)} digests")
            owner = str(body.get("owner") or LEGACY_OWNER)
            public = bool(body.get("public", False))
            network = tuple(str(n)[:MAX_PERMISSION] for n in body.get("network", [])[:MAX_PERMISSIONS])
        except (ValueError, KeyError, TypeError, InvalidRequest) as err:
            raise InfraFailure(
                f"catalogue record {key} is unreadable: {err}", reason=InfraReason.storage
            ) from err
        return TagRecord(name, version, digests, created_at, kind, owner, public, network)

    def get(self, name: str, version: str) -> TagRecord | None:
        key = tag_key(name, version)
        stamp = self.blobs.record_version(key)
        if stamp is None:
            return None
        now = time.monotonic()
        kept = self._parsed.get(key)
        if kept is not None and kept[0] == stamp and now - kept[2] < _PARSED_MAX_AGE_S:
            return kept[1]
        data = self.blobs.read_record(key)
        if data is None:
            return None
        # Kept under the version seen before the read: if the record changed in between, the
        # next get sees another version and reads again.
        rec = self._parse(key, data, name, version)
        with self._parsed_lock:
            if len(self._parsed) >= _PARSED_MAX and key not in self._parsed:
                del self._parsed[next(iter(self._parsed))]  # the oldest entry
            self._parsed[key] = (stamp, rec, now)
        return rec

    def versions(self, name: str) -> list[str]:
        prefix = f"{TAGS}/{_enc(name)}"
        return sorted(
            unquote(k.rsplit("/", 1)[1].removesuffix(".json")) for k in self.blobs.list_records(prefix)
        )

    def records(self) -> list[TagRecord]:
        """Every tag (reads the whole catalogue: for listings and garbage collection)."""
        out = []
        for key in self.blobs.list_records(TAGS):
            parts = key.split("/")
            if len(parts) != 3 or not parts[2].endswith(".json"):
                continue
            name, version = unquote(parts[1]), unquote(parts[2].removesuffix(".json"))
            data = self.blobs.read_record(key)
            if data is not None:  # removed since the listing
                out.append(self._parse(key, data, name, version))
        return sorted(out, key=lambda r: (r.name, r.version))

    def referrers(self, digest: str) -> list[TagRecord]:
        """The tags whose digests include ``digest`` (via the index, checked against the tags)."""
        out = []
        for name, version in self._index_entries(digest):
            rec = self.get(name, version)
            if rec is not None and digest in rec.digests:
                out.append(rec)
        return sorted(out, key=lambda r: (r.name, r.version))

    def _index_entries(self, digest: str) -> list[tuple[str, str]]:
        prefix = f"{REFS}/{digest_hex(digest)}"
        out = []
        for key in self.blobs.list_records(prefix):
            parts = key.split("/")
            if len(parts) == 4:
                out.append((unquote(parts[2]), unquote(parts[3])))
        return out

    def owners(self, digest: str) -> list[str]:
        """The projects that imported or committed blob ``digest`` (none recorded: legacy)."""
        return [
            unquote(k.rsplit("/", 1)[1]) for k in self.blobs.list_records(f"{OWNERS}/{digest_hex(digest)}")
        ]

    def is_public(self, digest: str) -> bool:
        return self.blobs.read_record(f"{PUBLIC}/{digest_hex(digest)}") is not None

    def public_digests(self) -> set[str]:
        return {f"sha256:{k.rsplit('/', 1)[1]}" for k in self.blobs.list_records(PUBLIC)}

    # -- writing -----------------------------------------------------------------------------

    def add_owner(self, digest: str, project: str) -> None:
        self.blobs.create_record(f"{OWNERS}/{digest_hex(digest)}/{_enc(project)}", b"")

    def remove_owner(self, digest: str, project: str) -> None:
        self.blobs.delete_record(f"{OWNERS}/{digest_hex(digest)}/{_enc(project)}")

    def set_public(self, digest: str) -> None:
        self.blobs.create_record(f"{PUBLIC}/{digest_hex(digest)}", b"")

    def mark_public(self, name: str, version: str) -> TagRecord | None:
        """Make the tag (and so what it names) visible to every project; None if it does not exist."""
        for _ in range(10):
            rec = self.get(name, version)
            if rec is None or rec.public:
                return rec
            new = dataclasses.replace(rec, public=True)
            self.blobs.replace_record(tag_key(name, version), new.to_bytes())
            if self.get(name, version) == new:
                return new
        raise InfraFailure(
            f"could not mark {name}:{version} public: it keeps changing", reason=InfraReason.storage
        )

    def _index(self, digests: Iterable[str], name: str, version: str) -> None:
        for d in dict.fromkeys(digests):
            self.blobs.create_record(_ref_key(d, name, version), b"")

    def _unindex(self, digest: str, name: str, version: str) -> None:
        """Drop the index entry unless the tag (now) refers to ``digest``."""
        rec = self.get(name, version)
        if rec is not None and digest in rec.digests:
            return
        self.blobs.delete_record(_ref_key(digest, name, version))
        rec = self.get(name, version)
        if rec is not None and digest in rec.digests:  # a writer moved the tag meanwhile
            self._index([digest], name, version)

    def create(
        self,
        name: str,
        version: str,
        digests: Sequence[str],
        *,
        kind: Kind = LAYER,
        created_at: float | None = None,
        owner: str = LEGACY_OWNER,
        network: Sequence[str] = (),
    ) -> tuple[TagRecord, bool]:
        """Create the tag unless it exists; returns (the tag, whether this call created it).

        InvalidRequest if it exists with other digests or as the other kind (versions are
        immutable). The record returned for an existing tag keeps its own owner: the caller
        decides whether that owner's tag may be handed to it.
        """
        rec = _new_record(name, version, digests, kind, created_at, owner, network=network)
        self._index(rec.digests, name, version)
        for _ in range(10):
            if self.blobs.create_record(tag_key(name, version), rec.to_bytes()):
                self._index(rec.digests, name, version)  # again: a remover may have raced
                return rec, True
            existing = self.get(name, version)
            if existing is None:  # untagged between our attempt and our read: try again
                continue
            if (existing.digests, existing.kind) == (rec.digests, rec.kind):
                return existing, False
            for d in set(rec.digests) - set(existing.digests):
                self._unindex(d, name, version)
            raise InvalidRequest(_clash(existing, rec))
        raise InfraFailure(f"could not create tag {rec.ref}: it keeps changing", reason=InfraReason.storage)

    def replace(
        self,
        name: str,
        version: str,
        digests: Sequence[str],
        *,
        kind: Kind = LAYER,
        owner: str = LEGACY_OWNER,
        public: bool = False,
    ) -> tuple[TagRecord, TagRecord | None]:
        """Point the tag at ``digests`` whatever it named before (an explicit retag).

        Returns (the new tag, the previous one or None); the new tag's ``created_at`` is now.
        """
        rec = _new_record(name, version, digests, kind, None, owner, public)
        old = self.get(name, version)
        self._index(rec.digests, name, version)
        self.blobs.replace_record(tag_key(name, version), rec.to_bytes())
        self._index(rec.digests, name, version)
        if old is not None:
            for d in set(old.digests) - set(rec.digests):
                self._unindex(d, name, version)
        return rec, old

    def delete(self, name: str, version: str) -> TagRecord | None:
        """Remove the tag; returns what it named, or None if it did not exist."""
        old = self.get(name, version)
        if old is None or not self.blobs.delete_record(tag_key(name, version)):
            return None
        for d in set(old.digests):
            self._unindex(d, name, version)
        return old

    def repair_index(self, records: Sequence[TagRecord]) -> int:
        """Drop index entries that no tag in ``records`` backs; returns how many.

        ``records`` is a recent full read; every removal re-checks the tag itself.
        """
        backed = {(digest_hex(d), r.name, r.version) for r in records for d in r.digests}
        dropped = 0
        for key in self.blobs.list_records(REFS):
            parts = key.split("/")
            if len(parts) != 4:
                continue
            hexdigest, name, version = parts[1], unquote(parts[2]), unquote(parts[3])
            if (hexdigest, name, version) not in backed:
                self._unindex(f"sha256:{hexdigest}", name, version)
                dropped += 1
        return dropped


def _new_record(
    name: str,
    version: str,
    digests: Sequence[str],
    kind: Kind,
    created_at: float | None,
    owner: str = LEGACY_OWNER,
    public: bool = False,
    network: Sequence[str] = (),
) -> TagRecord:
    parse_tag(f"{name}:{version}")
    if kind not in (LAYER, IMAGE):
        raise InvalidRequest(f"unknown tag kind {kind!r}")
    if not digests:
        raise InvalidRequest(f"{name}:{version} needs at least one layer")
    if kind == LAYER and len(digests) != 1:
        raise InvalidRequest(f"layer tag {name}:{version} names exactly one blob, not {len(digests)}")
    for d in digests:
        digest_hex(d)
    at = time.time() if created_at is None else created_at
    if len(network) > MAX_PERMISSIONS or any(len(n) > MAX_PERMISSION for n in network):
        raise InvalidRequest(f"at most {MAX_PERMISSIONS} network permissions of {MAX_PERMISSION} characters")
    return TagRecord(name, version, tuple(digests), at, kind, owner, public, tuple(sorted(set(network))))


def _describe(kind: str, digests: Sequence[str]) -> str:
    return f"{kind} {digests[0]}" if kind == LAYER else f"{kind} {list(digests)}"


def _clash(existing: TagRecord, new: TagRecord) -> str:
    return (
        f"{existing.ref} already names the {_describe(existing.kind, existing.digests)} and versions "
        f"are immutable; store this {_describe(new.kind, new.digests)} under a new version, or move "
        "the tag explicitly with retag"
    )


# ---- the catalogue of the earlier design ---------------------------------------------------------


def migrate_sqlite(catalogue: Catalogue, path: Path) -> dict[str, object] | None:
    """Import the tags and images of a legacy ``catalog.sqlite`` once; idempotent.

    Tags whose blob is missing are skipped; a tag that the new catalogue already holds with
    other digests keeps the new catalogue's digests. The SQLite file is only read, never
    changed. Returns the summary recorded under ``meta/`` (None if this was done before or
    the file cannot be read; an unreadable file is tried again on the next open).
    """
    if catalogue.blobs.read_record(LEGACY_MARKER) is not None:
        return None
    # Without a write-ahead log to read, open it immutable: SQLite then creates no -wal/-shm
    # files next to it. With one, read-only mode reads the log (the side files exist already).
    wal = path.with_name(path.name + "-wal")
    mode = "mode=ro" if wal.exists() and wal.stat().st_size > 0 else "immutable=1"
    try:
        db = sqlite3.connect(f"file:{quote(str(path))}?{mode}", uri=True)
    except sqlite3.Error as err:
        log.error("cannot read the legacy layer catalogue %s: %s", path, err)
        return None
    try:
        rows: list[tuple[str, str, list[str], float, Kind]] = [
            (n, v, [d], float(c), LAYER)
            for n, v, d, c in db.execute("SELECT name, version, digest, created_at FROM tags")
        ]
        has_images = db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'images'"
        ).fetchone()
        if has_images:
            rows += [
                (n, v, list(json.loads(ds)), float(c), IMAGE)
                for n, v, ds, c in db.execute("SELECT name, version, digests, created_at FROM images")
            ]
    except (sqlite3.Error, ValueError) as err:
        log.error("cannot read the legacy layer catalogue %s: %s", path, err)
        return None
    finally:
        db.close()
    imported, kept, skipped = [], [], []
    for name, version, digests, created_at, kind in rows:
        ref = f"{name}:{version}"
        missing = [d for d in digests if not catalogue.blobs.exists(d)]
        if missing:
            skipped.append(f"{ref} (blob {missing[0]} is missing)")
            continue
        try:
            _, created = catalogue.create(name, version, digests, kind=kind, created_at=created_at)
        except InvalidRequest as err:
            kept.append(f"{ref} ({err.message})")
            continue
        if created:
            imported.append(ref)
    summary: dict[str, object] = {
        "source": str(path),
        "migrated_at": time.time(),
        "tags": len(rows),
        "imported": imported,
        "kept_newer": kept,
        "skipped": skipped,
    }
    catalogue.blobs.create_record(LEGACY_MARKER, json.dumps(summary, indent=1).encode())
    if skipped or kept:
        log.warning("legacy catalogue %s: skipped %s; kept the newer %s", path, skipped, kept)
    log.info("imported %d tags from the legacy layer catalogue %s", len(imported), path)
    return summary
