"""Users' own bootable disk images for full VMs, beside the layer store.

An image is imported once (``dsec vm-image import FILE --ref name:version``): qcow2 or raw,
checked with ``qemu-img info`` (a qcow2 with a backing file or an external data file is refused:
QEMU would open host paths the user named), converted to a standalone qcow2 and stored under the
digest of the bytes the user gave (the same file imported twice is stored once). A tag is a small
JSON file naming that digest. Every VM booting the image gets a qcow2 overlay over the stored
file: the base is never written.

Layout under ``<layer store>/vm-images/``::

    blobs/sha256-<hex>.qcow2       the image, read-only for VMs
    tags/<name>/<version>.json     {"ref", "digest", "size", "created_at"}

Files are written to a temporary name and renamed, so a store on a shared filesystem is read
by every node like the layer catalogue.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel

from dsec.images.refs import parse_tag
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest, LayerNotFound

FORMATS = ("qcow2", "raw")


class VmImageInfo(BaseModel):
    ref: str
    digest: str
    size: int  # bytes of the stored qcow2
    virtual_size: int  # the disk's size as the guest sees it
    created_at: float


class VmImageStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "blobs"
        self.tags = root / "tags"
        self.tmp = root / "tmp"

    def _dirs(self) -> None:
        for d in (self.blobs, self.tags, self.tmp):
            d.mkdir(parents=True, exist_ok=True)

    def blob(self, digest: str) -> Path:
        if not digest.startswith("sha256:") or len(digest) != 71:
            raise InvalidRequest(f"not a VM image digest: {digest!r}")
        return self.blobs / f"sha256-{digest[7:]}.qcow2"

    def _tag_path(self, ref: str) -> Path:
        name, version = parse_tag(ref)
        return self.tags / name.replace("/", "%2F") / f"{version}.json"

    def import_file(self, src: Path, ref: str) -> VmImageInfo:
        """Store ``src`` (qcow2 or raw) as image ``ref``; versions are immutable."""
        path = self._tag_path(ref)
        self._dirs()
        fmt = _checked_format(src)
        digest = "sha256:" + _sha256(src)
        blob = self.blob(digest)
        if not blob.exists():
            fd, part = tempfile.mkstemp(dir=self.tmp, suffix=".qcow2")
            os.close(fd)
            try:
                _qemu_img("convert", "-f", fmt, "-O", "qcow2", str(src), part)
                os.chmod(part, 0o444)
                os.replace(part, blob)
            finally:
                Path(part).unlink(missing_ok=True)
        existing = self._read_tag(path)
        if existing is not None:
            if existing.digest != digest:
                raise InvalidRequest(f"{ref} already names VM image {existing.digest}; use a new version")
            return existing
        info = VmImageInfo(
            ref=ref,
            digest=digest,
            size=blob.stat().st_size,
            virtual_size=_virtual_size(blob),
            created_at=time.time(),
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            fh.write(info.model_dump_json())
        os.replace(part, path)
        return info

    def _read_tag(self, path: Path) -> VmImageInfo | None:
        try:
            return VmImageInfo.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise InfraFailure(
                f"VM image tag {path} is unreadable: {exc}", reason=InfraReason.storage
            ) from exc

    def resolve(self, ref: str) -> VmImageInfo:
        info = self._read_tag(self._tag_path(ref))
        if info is None or not self.blob(info.digest).exists():
            raise LayerNotFound(f"no VM image {ref!r} (import one with `dsec vm-image import`)")
        return info

    def list(self) -> list[VmImageInfo]:
        if not self.tags.is_dir():
            return []
        found = [self._read_tag(p) for p in sorted(self.tags.glob("*/*.json"))]
        return [i for i in found if i is not None]

    def remove(self, ref: str) -> bool:
        """Untag ``ref``; its file goes at the next :meth:`gc` once no VM uses it."""
        try:
            self._tag_path(ref).unlink()
            return True
        except FileNotFoundError:
            return False

    def gc(self, in_use: Iterable[str], *, grace_s: float = 600.0) -> builtins.list[str]:
        """Delete image files no tag names and no VM uses (``in_use``: digests every node's VMs
        boot from), once older than ``grace_s`` (an import stores before it tags)."""
        keep = set(in_use) | {i.digest for i in self.list()}
        removed = []
        now = time.time()
        for blob in sorted(self.blobs.glob("sha256-*.qcow2")) if self.blobs.is_dir() else []:
            digest = "sha256:" + blob.name[7:-6]
            try:
                young = now - blob.stat().st_mtime < grace_s
            except FileNotFoundError:
                continue
            if digest in keep or young:
                continue
            blob.unlink(missing_ok=True)
            removed.append(digest)
        return removed


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _qemu_img(*args: str) -> str:
    done = subprocess.run(["qemu-img", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise InvalidRequest(f"qemu-img {args[0]}: {done.stderr.strip()[-500:]}")
    return done.stdout


def _info(path: Path, fmt: str | None = None) -> dict[str, object]:
    argv = ["info", "--output=json"] + (["-f", fmt] if fmt else []) + [str(path)]
    info: dict[str, object] = json.loads(_qemu_img(*argv))
    return info


def _checked_format(src: Path) -> str:
    """The image's format (qcow2 or raw), refusing anything that would make QEMU open another
    file: a backing file, an external data file."""
    info = _info(src)
    fmt = str(info.get("format"))
    if fmt not in FORMATS:
        raise InvalidRequest(f"a VM image must be qcow2 or raw, not {fmt}")
    if info.get("backing-filename") or info.get("full-backing-filename"):
        raise InvalidRequest("a VM image must stand alone: this qcow2 has a backing file")
    specific = info.get("format-specific")
    data = specific.get("data", {}) if isinstance(specific, dict) else {}
    if isinstance(data, dict) and data.get("data-file"):
        raise InvalidRequest("a VM image must stand alone: this qcow2 has an external data file")
    return fmt


def _virtual_size(path: Path) -> int:
    size = _info(path, "qcow2").get("virtual-size", 0)
    return int(size) if isinstance(size, int | str) else 0
