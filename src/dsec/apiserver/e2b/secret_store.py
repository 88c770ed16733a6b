"""Where E2B's secrets are kept: one JSON file per project under ``e2b-secrets/``, beside the
E2B templates in the layer store, each value sealed with AES-GCM.

A project's file is ``e2b-secrets/<project path>/_secrets.json`` (a project name never starts
with ``_``): a key's subtree is a directory walk. Every operation reads the files it needs
anew under an ``fcntl.flock`` of ``e2b-secrets/.lock`` (shared to read, exclusive to
read-modify-write), and a write replaces the file whole (temp file, fsync, ``os.replace``):
apiserver processes sharing the layer store see one another's writes and never half of one.
Directories are 0700 and files 0600: root's alone.

A value is sealed under a key derived from the front's token secret (HMAC-SHA256, its own
context: it reveals nothing of the token secret), with ``project NUL secretID`` as associated
data, so a sealed value moved to another record or project does not open. Only the current
version's value is kept; nothing here logs or returns a value but :meth:`SecretStore.resolve`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from dsec.iam.base import in_subtree
from dsec.protocol.errors import Conflict, InvalidRequest, SecretNotFound

# E2B's fixed texts (packages/api/internal/middleware/secrets.go); a DSec reason may follow
# after ": ", and never quotes the request (a name is a confidential selector there too).
INVALID_MESSAGE = "Invalid secrets request"
NOT_FOUND_MESSAGE = "Secret not found"
CONFLICT_MESSAGE = "Secret cannot be modified in its current state"

ID_PREFIX = "sec_"  # E2B's SecretIDPrefix: reserved, never a name
MAX_NAME_BYTES = 128  # E2B's secretsstore.maxNameBytes
MAX_VALUE_BYTES = 64 << 10  # E2B's backend is closed: DSec's bound (UTF-8 bytes)
MAX_SECRETS_PER_PROJECT = 100  # likewise
MAX_METADATA_ENTRIES = 32  # E2B's spec (SecretMetadata)
MAX_METADATA_KEY_BYTES = 128
MAX_METADATA_VALUE_BYTES = 1024
MAX_METADATA_BYTES = 8192  # keys and values together

_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")
_PROJECT_PART_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
# TypeID's suffix: 26 of Crockford's base32, lower case; the first at most 7 (130 bits hold 128).
_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"
_ID_RE = re.compile(r"sec_[0-7][0-9a-hjkmnp-tv-z]{25}")
_FILE = "_secrets.json"
_KEY_CONTEXT = b"dsec-e2b-secrets-v1"
_NONCE_BYTES = 12

T = TypeVar("T")


def not_found() -> SecretNotFound:
    return SecretNotFound(NOT_FOUND_MESSAGE)


def invalid(reason: str) -> InvalidRequest:
    return InvalidRequest(f"{INVALID_MESSAGE}: {reason}")


def conflict(reason: str) -> Conflict:
    return Conflict(f"{CONFLICT_MESSAGE}: {reason}")


def normalize_name(raw: str) -> str | None:
    """E2B's ``secretsstore.NormalizeName``: trimmed, 1-128 of ``[A-Za-z0-9_-]``, lower-cased,
    not ``sec_...``; None when it is none of that."""
    name = raw.strip()
    if not 0 < len(name) <= MAX_NAME_BYTES or not _NAME_RE.fullmatch(name):
        return None
    name = name.lower()
    return None if name.startswith(ID_PREFIX) else name


def parse_selector(raw: str) -> tuple[str, str]:
    """``("id", ID)`` or ``("name", name)`` as E2B's ``secretRef`` reads a path segment: what
    looks like an ID (``sec_``, trimmed, any case) is one, valid or a 400, never a name."""
    classified = raw.strip().lower()
    if classified.startswith(ID_PREFIX):
        if not _ID_RE.fullmatch(classified):
            raise invalid("not a secret ID")
        return "id", classified
    name = normalize_name(raw)
    if name is None:
        raise invalid("a secret is named by 1-128 of A-Z, a-z, 0-9, '_', '-', not starting with sec_")
    return "name", name


_last_id = [0, 0]  # the last ID's milliseconds and counter (below): IDs of a process only grow
_id_lock = threading.Lock()


def new_secret_id() -> str:
    """``sec_`` + the TypeID spelling of a UUIDv7 (E2B's ``id.SecretID``): IDs sort by creation,
    within one millisecond too (RFC 9562's counter: the 74 random bits count on from the last)."""
    with _id_lock:
        millis = time.time_ns() // 1_000_000 % (1 << 48)
        if millis <= _last_id[0]:
            millis, counter = _last_id[0], _last_id[1] + 1
        else:
            counter = secrets.randbits(73)  # the top bit clear: room to count on
        _last_id[:] = [millis, counter]
    n = millis << 80 | 0x7 << 76 | (counter >> 62) << 64 | 0b10 << 62 | counter & ((1 << 62) - 1)
    return ID_PREFIX + "".join(_CROCKFORD[(n >> (5 * i)) & 31] for i in reversed(range(26)))


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat().replace("+00:00", "Z")


@dataclass
class SecretRecord:
    id: str
    project: str
    name: str
    version: int
    metadata: dict[str, str]
    created_at: float
    updated_at: float
    sealed: str = field(repr=False)  # base64 of nonce + AES-GCM ciphertext: never on the wire

    FIELDS: ClassVar[tuple[str, ...]] = (
        "id", "project", "name", "version", "metadata", "created_at", "updated_at", "sealed",
    )  # fmt: skip

    def wire(self) -> dict[str, Any]:
        """E2B's ``Secret``: metadata only, never the value."""
        return {
            "secretID": self.id,
            "name": self.name,
            "currentVersion": self.version,
            "metadata": dict(self.metadata),
            "createdAt": iso(self.created_at),
            "updatedAt": iso(self.updated_at),
        }

    @classmethod
    def load(cls, raw: dict[str, Any]) -> SecretRecord:
        return cls(**{k: raw[k] for k in cls.FIELDS})


class SecretStore:
    def __init__(self, directory: Path, token_secret: bytes | None = None) -> None:
        self.dir = directory
        # No token secret: a random key, as envd tokens do; values die with this process.
        root = token_secret if token_secret is not None else secrets.token_bytes(32)
        self._aead = AESGCM(hmac.new(root, _KEY_CONTEXT, hashlib.sha256).digest())

    # -- sealing ---------------------------------------------------------------------------------

    @staticmethod
    def _aad(project: str, secret_id: str) -> bytes:
        return project.encode() + b"\0" + secret_id.encode()

    def _seal(self, project: str, secret_id: str, value: str) -> str:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, value.encode(), self._aad(project, secret_id))
        return base64.b64encode(nonce + sealed).decode()

    def _open(self, rec: SecretRecord) -> str:
        try:
            raw = base64.b64decode(rec.sealed)
            plain = self._aead.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], self._aad(rec.project, rec.id))
        except (InvalidTag, ValueError):
            raise InvalidRequest(
                f"secret {rec.name!r} cannot be opened: it was sealed under another token secret"
            ) from None
        return plain.decode()

    # -- files -----------------------------------------------------------------------------------

    def _project_dir(self, project: str) -> Path:
        parts = project.split("/")
        if not all(_PROJECT_PART_RE.fullmatch(p) for p in parts):
            raise InvalidRequest(f"invalid project {project[:200]!r}")
        return self.dir.joinpath(*parts)

    def _mkdirs(self, path: Path) -> None:
        missing = []
        while not path.is_dir():
            missing.append(path)
            path = path.parent
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):
                d.mkdir(mode=0o700)
            os.chmod(d, 0o700)

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        self._mkdirs(self.dir)
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _read(self, project: str) -> dict[str, SecretRecord]:
        try:
            raw = json.loads((self._project_dir(project) / _FILE).read_bytes())
        except FileNotFoundError:
            return {}
        return {sid: SecretRecord.load(r) for sid, r in raw["secrets"].items()}

    def _write(self, project: str, records: dict[str, SecretRecord]) -> None:
        folder = self._project_dir(project)
        self._mkdirs(folder)
        data = json.dumps({"secrets": {sid: asdict(r) for sid, r in records.items()}}).encode()
        tmp = folder / f".{_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, folder / _FILE)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _subtree(self, within: str) -> list[SecretRecord]:
        """Every secret of ``within`` and the projects below it, oldest first."""
        top = self._project_dir(within)
        out: list[SecretRecord] = []
        for folder, _dirs, files in os.walk(top):
            if _FILE in files:
                project = "/".join(Path(folder).relative_to(self.dir).parts)
                out.extend(r for r in self._read(project).values() if in_subtree(r.project, within))
        return sorted(out, key=lambda r: r.id)

    def _find(self, within: str, selector: tuple[str, str]) -> SecretRecord:
        """The secret a key of ``within`` selects: by ID anywhere in its subtree; by name its own
        project's first, else the one secret of that name below it."""
        kind, value = selector
        if kind == "name":
            own = [r for r in self._read(within).values() if r.name == value]
            if own:
                return own[0]
        found = [r for r in self._subtree(within) if (r.id if kind == "id" else r.name) == value]
        if not found:
            raise not_found()
        if len(found) > 1:
            raise invalid("projects below this key's hold several secrets of this name: use the secretID")
        return found[0]

    async def _run(self, exclusive: bool, fn: Callable[[], T]) -> T:
        def locked() -> T:
            with self._locked(exclusive):
                return fn()

        return await asyncio.to_thread(locked)

    # -- operations ------------------------------------------------------------------------------

    async def create(self, project: str, name: str, value: str, metadata: dict[str, str]) -> SecretRecord:
        """A new secret in ``project``; ``name`` already normalized, every bound already checked."""

        def create() -> SecretRecord:
            records = self._read(project)
            if any(r.name == name for r in records.values()):
                raise conflict("this project already has a secret of this name")
            if len(records) >= MAX_SECRETS_PER_PROJECT:
                raise conflict(f"a project holds at most {MAX_SECRETS_PER_PROJECT} secrets")
            sid, now = new_secret_id(), time.time()
            sealed = self._seal(project, sid, value)
            rec = SecretRecord(sid, project, name, 1, dict(metadata), now, now, sealed)
            records[sid] = rec
            self._write(project, records)
            return rec

        return await self._run(True, create)

    async def list(self, within: str) -> list[SecretRecord]:
        return await self._run(False, lambda: self._subtree(within))

    async def get(self, within: str, selector: tuple[str, str]) -> SecretRecord:
        return await self._run(False, lambda: self._find(within, selector))

    async def update(
        self, within: str, selector: tuple[str, str], value: str, metadata: dict[str, str] | None
    ) -> SecretRecord:
        """A new version: ``value`` replaces the current one; ``metadata`` too unless None."""

        def update() -> SecretRecord:
            found = self._find(within, selector)
            records = self._read(found.project)
            rec = records[found.id]
            rec.version += 1
            rec.sealed = self._seal(rec.project, rec.id, value)
            if metadata is not None:
                rec.metadata = dict(metadata)
            rec.updated_at = max(time.time(), rec.updated_at)
            self._write(rec.project, records)
            return rec

        return await self._run(True, update)

    async def delete(self, within: str, selector: tuple[str, str]) -> None:
        def delete() -> None:
            found = self._find(within, selector)
            records = self._read(found.project)
            del records[found.id]
            self._write(found.project, records)

        await self._run(True, delete)

    async def resolve(self, project: str, names: Iterable[str]) -> dict[str, str]:
        """The current values of the secrets ``names`` (as placeholders spell them, normalized as
        on create) of exactly ``project``, by the names as given; :class:`InvalidRequest` naming
        the first that does not exist."""
        wanted = list(dict.fromkeys(names))

        def resolve() -> dict[str, str]:
            by_name = {r.name: r for r in self._read(project).values()}
            out: dict[str, str] = {}
            for raw in wanted:
                rec = by_name.get(normalize_name(raw) or "")
                if rec is None:
                    raise InvalidRequest(f"secret {raw[:MAX_NAME_BYTES]!r} does not exist in this project")
                out[raw] = self._open(rec)
            return out

        return await self._run(False, resolve)


__all__ = [
    "MAX_METADATA_BYTES",
    "MAX_METADATA_ENTRIES",
    "MAX_METADATA_KEY_BYTES",
    "MAX_METADATA_VALUE_BYTES",
    "MAX_NAME_BYTES",
    "MAX_SECRETS_PER_PROJECT",
    "MAX_VALUE_BYTES",
    "SecretRecord",
    "SecretStore",
    "normalize_name",
    "not_found",
    "parse_selector",
]
