"""The layer store: content-addressed EROFS blobs plus a SQLite catalogue of tags.

Layout under ``root``::

    blobs/sha256/<hex>.erofs   immutable images, named by the sha256 of their bytes
    catalog.sqlite             tags name:version -> digest, per-blob size and created_at (WAL)
    tmp/                       imports in progress (same filesystem, so publishing is a link)

Several threads and processes (an edge and a ``dsec layer import`` at once, or several nodes
over a shared directory) may use one store: a blob appears with one atomic ``link`` and is
never rewritten, and every catalogue write is one SQLite transaction.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import json
import os
import shutil
import sqlite3
import tempfile
import threading
import time
from pathlib import Path

from dsec.images.erofs import build_erofs
from dsec.images.refs import HEX_PREFIX_RE, REF_FORMS, digest_hex, make_digest, parse_tag
from dsec.images.tarextract import extract_tar
from dsec.protocol.errors import InfraFailure, InvalidRequest, LayerNotFound
from dsec.protocol.models import LayerInfo

DEFAULT_ROOT = Path("/var/lib/dsec/layers")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blobs (
    digest TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tags (
    name TEXT NOT NULL,
    version TEXT NOT NULL,
    digest TEXT NOT NULL REFERENCES blobs(digest),
    created_at REAL NOT NULL,
    PRIMARY KEY (name, version)
);
CREATE INDEX IF NOT EXISTS tags_by_digest ON tags(digest);
CREATE TABLE IF NOT EXISTS images (
    name TEXT NOT NULL,
    version TEXT NOT NULL,
    digests TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (name, version)
);
"""

_LS_HINT = "see the available layers with `dsec layer ls`"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LayerStore:
    def __init__(self, root: Path = DEFAULT_ROOT) -> None:
        self.root = root
        self.blob_dir = root / "blobs" / "sha256"
        self.tmp_dir = root / "tmp"
        for d in (self.blob_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        # One connection behind a lock: catalogue queries take microseconds, so serialising
        # them in-process costs nothing, and other processes are kept consistent by SQLite's
        # own file locking (busy_timeout makes them wait instead of failing).
        self._lock = threading.Lock()
        self._db = sqlite3.connect(root / "catalog.sqlite", isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA busy_timeout = 30000")
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = NORMAL")
        with self._lock:
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> LayerStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- blobs -------------------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        return self.blob_dir / f"{digest_hex(digest)}.erofs"

    def _publish(self, image: Path) -> tuple[str, int]:
        """Move a built image to its content address; returns (digest, size)."""
        hexdigest = _sha256_file(image)
        size = image.stat().st_size
        final = self.blob_dir / f"{hexdigest}.erofs"
        os.chmod(image, 0o444)
        with open(image, "rb") as f:
            os.fsync(f.fileno())
        try:
            # link, unlike rename, never replaces a blob that is already there (and mounted):
            # importing the same content twice stores it once.
            os.link(image, final)
        except FileExistsError:
            if final.stat().st_size != size:  # a torn copy from some other tool: heal it
                os.replace(image, final)
        except OSError as err:
            # Some shared filesystems have no hard links; rename is atomic too.
            if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                raise
            os.replace(image, final)
        _fsync_dir(self.blob_dir)
        return make_digest(hexdigest), size

    # ---- import --------------------------------------------------------------------------------

    def import_path(self, path: Path, ref: str) -> LayerInfo:
        """Import a directory or a tar archive (plain, gz, bz2, xz, zst) as layer ``ref``."""
        name, version = parse_tag(ref)  # before the expensive part
        if not path.exists():
            raise InvalidRequest(f"cannot import {path}: no such file or directory")
        work = Path(tempfile.mkdtemp(prefix="import-", dir=self.tmp_dir))
        try:
            if path.is_dir():
                src = Path(os.path.realpath(path))  # mkfs.erofs would store a symlink as such
            else:
                src = work / "rootfs"
                src.mkdir()
                extract_tar(path, src)
            image = work / "layer.erofs"
            build_erofs(src, image)
            digest, size = self._publish(image)
        except OSError as err:
            raise InfraFailure(f"importing {path} failed: {err}", reason="storage") from err
        finally:
            shutil.rmtree(work, ignore_errors=True)
        self._catalogue(digest, size, name, version)
        return self.resolve(digest)

    def _catalogue(self, digest: str, size: int, name: str, version: str) -> None:
        now = time.time()
        with self._lock:
            # IMMEDIATE takes the write lock before reading, so two importers of one tag cannot
            # both see it absent and both insert.
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT OR IGNORE INTO blobs (digest, size, created_at) VALUES (?, ?, ?)",
                    (digest, size, now),
                )
                row = self._db.execute(
                    "SELECT digest FROM tags WHERE name = ? AND version = ?", (name, version)
                ).fetchone()
                if row is None:
                    self._db.execute(
                        "INSERT INTO tags (name, version, digest, created_at) VALUES (?, ?, ?, ?)",
                        (name, version, digest, now),
                    )
                elif row[0] != digest:
                    raise InvalidRequest(
                        f"layer {name}:{version} already exists with digest {row[0]} and versions are "
                        f"immutable; import this content ({digest}) under a new version"
                    )
                self._db.execute("COMMIT")
            except sqlite3.Error as err:
                self._db.execute("ROLLBACK")
                raise InfraFailure(f"layer catalogue write failed: {err}", reason="storage") from err
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def tag(self, digest: str, ref: str) -> LayerInfo:
        """Give an already stored blob another ``name:version`` (same immutability rules)."""
        name, version = parse_tag(ref)
        info = self.resolve(digest)
        self._catalogue(info.digest, info.size, name, version)
        return self.resolve(info.digest)

    # ---- lookup --------------------------------------------------------------------------------

    def _names(self, digest: str) -> builtins.list[str]:
        rows = self._db.execute(
            "SELECT name, version FROM tags WHERE digest = ? ORDER BY name, version", (digest,)
        ).fetchall()
        return [f"{n}:{v}" for n, v in rows]

    def _info(self, digest: str) -> LayerInfo | None:
        row = self._db.execute("SELECT size, created_at FROM blobs WHERE digest = ?", (digest,)).fetchone()
        if row is None:
            return None
        return LayerInfo(digest=digest, size=row[0], names=self._names(digest), created_at=row[1])

    def _not_found(self, ref: str, extra: str = "") -> LayerNotFound:
        return LayerNotFound(f"no layer {ref!r}{extra}; {_LS_HINT}")

    def resolve(self, ref: str) -> LayerInfo:
        """Find a layer by ``name:version``, ``sha256:<hex>``, or a unique hex prefix (>= 12)."""
        hexpart = ref.removeprefix("sha256:").lower()
        if HEX_PREFIX_RE.match(hexpart) and (hexpart != ref or ":" not in ref):
            return self._by_prefix(ref, hexpart)
        if ref.startswith("sha256:"):
            digest_hex(ref)  # raises: a malformed digest is a bad request, not a missing layer
        if ":" in ref:
            return self._by_tag(ref)
        with self._lock:
            versions = [v for (v,) in self._db.execute("SELECT version FROM tags WHERE name = ?", (ref,))]
        if versions:
            known = ", ".join(f"{ref}:{v}" for v in sorted(versions))
            raise self._not_found(ref, f" (a version is required: {known})")
        raise LayerNotFound(f"no layer {ref!r}: a layer reference is {REF_FORMS}; {_LS_HINT}")

    def _by_prefix(self, ref: str, hexpart: str) -> LayerInfo:
        with self._lock:
            rows = self._db.execute(
                "SELECT digest FROM blobs WHERE digest >= ? AND digest < ? LIMIT 2",
                (f"sha256:{hexpart}", f"sha256:{hexpart}g"),  # 'g' sorts after every hex digit
            ).fetchall()
            if len(rows) > 1:
                raise InvalidRequest(f"layer prefix {ref!r} is ambiguous; give more characters")
            info = self._info(rows[0][0]) if rows else None
        if info is None:
            raise self._not_found(ref)
        return info

    def _by_tag(self, ref: str) -> LayerInfo:
        name, version = parse_tag(ref)
        with self._lock:
            row = self._db.execute(
                "SELECT digest FROM tags WHERE name = ? AND version = ?", (name, version)
            ).fetchone()
            if row is not None:
                info = self._info(row[0])
                if info is None:
                    raise InfraFailure(f"catalogue tags {ref} with unknown blob {row[0]}", reason="storage")
                return info
            versions = [v for (v,) in self._db.execute("SELECT version FROM tags WHERE name = ?", (name,))]
        extra = f" (known versions of {name}: {', '.join(sorted(versions))})" if versions else ""
        raise self._not_found(ref, extra)

    # ---- images: ordered lists of layers under one name:version ------------------------------

    def tag_image(self, ref: str, digests: builtins.list[str]) -> builtins.list[LayerInfo]:
        """Name an ordered list of stored layers (base first) ``name:version``; immutable."""
        name, version = parse_tag(ref)
        layers = [self.resolve(d) for d in digests]
        if not layers:
            raise InvalidRequest(f"image {ref} needs at least one layer")
        encoded = json.dumps([layer.digest for layer in layers])
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                clash = self._db.execute(
                    "SELECT 1 FROM tags WHERE name = ? AND version = ?", (name, version)
                ).fetchone()
                row = self._db.execute(
                    "SELECT digests FROM images WHERE name = ? AND version = ?", (name, version)
                ).fetchone()
                if clash is not None or (row is not None and row[0] != encoded):
                    raise InvalidRequest(f"{ref} already names other content and versions are immutable")
                if row is None:
                    self._db.execute(
                        "INSERT INTO images VALUES (?, ?, ?, ?)", (name, version, encoded, time.time())
                    )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return layers

    def resolve_image(self, ref: str) -> builtins.list[LayerInfo]:
        """The layers (base first) that ``ref`` stands for: an image's list, or one layer."""
        if ":" in ref and not ref.startswith("sha256:"):
            name, version = parse_tag(ref)
            with self._lock:
                row = self._db.execute(
                    "SELECT digests FROM images WHERE name = ? AND version = ?", (name, version)
                ).fetchone()
            if row is not None:
                return [self.resolve(d) for d in json.loads(row[0])]
        return [self.resolve(ref)]

    def has_tag(self, ref: str) -> bool:
        name, version = parse_tag(ref)
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM tags WHERE name = ? AND version = ?", (name, version)
            ).fetchone()
        return row is not None

    def list(self) -> builtins.list[LayerInfo]:
        """Every stored layer, oldest first, with all its tags."""
        with self._lock:
            blobs = self._db.execute(
                "SELECT digest, size, created_at FROM blobs ORDER BY created_at"
            ).fetchall()
            names: dict[str, builtins.list[str]] = {}
            for name, version, digest in self._db.execute(
                "SELECT name, version, digest FROM tags ORDER BY name, version"
            ):
                names.setdefault(digest, []).append(f"{name}:{version}")
        return [LayerInfo(digest=d, size=s, names=names.get(d, []), created_at=c) for d, s, c in blobs]
