"""Import container images (``docker save`` output, OCI image layouts) as EROFS layers.

Accepted input, as a directory or a tarball (plain, gzip, xz, bzip2 or zstd):

* an OCI image layout (image-spec ``image-layout.md``): ``oci-layout``, ``index.json`` ->
  manifest, possibly through image indexes / docker manifest lists (we follow the entry for
  ``platform``, linux/amd64 by default) -> config + layers; layers ``tar``, ``tar+gzip`` or
  ``tar+zstd`` in their OCI and docker media types. ``docker save`` of Docker >= 25 writes
  this layout too and is read through it;
* the older ``docker save`` format: ``manifest.json`` naming a config and layer tars, which
  may be symlinks inside the archive (``<id>/layer.tar -> ../<sha>.tar``, as skopeo writes).

An archive holding several images needs ``image=`` (a name as written in the archive,
``RepoTags`` or the ``org.opencontainers.image.ref.name`` / ``io.containerd.image.name``
annotations, docker-style short names accepted, or the manifest/config digest).

Everything read from the archive is untrusted: names are resolved lexically inside it (no
absolute paths, no ``..`` out of it, symlinks followed only within it), JSON documents are
size-capped and shape-checked, every blob is checked against its sha256 (manifests, config,
layer blobs; and each layer's uncompressed content against the config's ``diff_ids``) before
it is used, and layer tars go through :func:`dsec.images.tarextract.extract_tar`, which
refuses members escaping the extraction directory. All blob digests are verified before the
first layer is imported, so a corrupted archive leaves nothing behind.

Each layer becomes one EROFS layer in the store: decompressed into the store's tmp
directory, extracted, its OCI whiteouts turned into overlayfs ones
(:mod:`dsec.images.whiteouts`), then imported with :meth:`LayerStore.import_path` under the tag
``dsec/oci-layer:<hex of its diff_id>``. The store's public API has no untagged import, and a
content-derived tag is better than a per-image one anyway: a layer shared by several images
(the same base) is built once, and importing an image again skips every layer already there.
Finally :meth:`LayerStore.tag_image` names the ordered list ``ref``, after dropping the lower
copy of a layer the image repeats (overlayfs refuses a lower directory twice; see
:func:`drop_shadowed_duplicates`) and, with ``merge_below_bytes``, merging runs of small
layers (:mod:`dsec.images.merge`).

A layer tarball should carry its parent directories (docker's and buildkit's do): overlayfs
shows a directory with the attributes of the upper-most layer that has it, and a directory a
tarball only implies gets fixed ones (0755, root, mtime 0) from the extractor.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dsec.images.merge import merge_layers
from dsec.images.refs import parse_tag
from dsec.images.store import LayerStore
from dsec.images.tarextract import extract_tar
from dsec.images.whiteouts import oci_to_overlay
from dsec.protocol.errors import InfraFailure, InvalidRequest
from dsec.protocol.models import LayerInfo

Progress = Callable[[str, int, int], None]

LAYER_NAME = "dsec/oci-layer"  # bump (oci-layer2) if the conversion of a layer ever changes
DEFAULT_PLATFORM = "linux/amd64"

MAX_JSON_BYTES = 8 << 20  # manifests, indexes and configs; real ones are kilobytes
MAX_LAYERS = 256  # docker itself stops at 125; overlayfs at 500 lower layers
MAX_INDEX_DEPTH = 4
MAX_SYMLINK_HOPS = 40
_CHUNK = 1 << 20

MT_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MT_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MT_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MT_DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
_INDEX_TYPES = frozenset({MT_OCI_INDEX, MT_DOCKER_LIST})
_MANIFEST_TYPES = frozenset({MT_OCI_MANIFEST, MT_DOCKER_MANIFEST})
_CONFIG_TYPES = frozenset({MT_OCI_CONFIG, MT_DOCKER_CONFIG})
# The compression is read from the blob's magic bytes (tools mislabel it); the media type
# only has to be one of an image layer.
LAYER_TYPES = frozenset(
    {
        "application/vnd.oci.image.layer.v1.tar",
        "application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.oci.image.layer.v1.tar+zstd",
        "application/vnd.oci.image.layer.nondistributable.v1.tar",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
        "application/vnd.docker.image.rootfs.diff.tar",
        "application/vnd.docker.image.rootfs.diff.tar.gzip",
        "application/vnd.docker.image.rootfs.diff.tar.zstd",
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
    }
)

_REF_NAME = "org.opencontainers.image.ref.name"
_CONTAINERD_NAME = "io.containerd.image.name"
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_HEX_NAME_RE = re.compile(r"(?:^|/)(?:blobs/sha256/)?([0-9a-f]{64})(?:\.json|\.tar)?$")
_MAGIC = [
    (b"\x1f\x8b", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"BZh", "bzip2"),
]


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


def _sniff(head: bytes) -> str:
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    return "tar"


@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str | None = None

    @classmethod
    def parse(cls, text: str) -> Platform:
        parts = text.split("/")
        if len(parts) not in (2, 3) or not all(parts):
            raise InvalidRequest(f"invalid platform {text!r}: expected os/arch or os/arch/variant")
        return cls(parts[0], parts[1], parts[2] if len(parts) == 3 else None)

    def matches(self, spec: dict[str, Any]) -> bool:
        if spec.get("os") != self.os or spec.get("architecture") != self.architecture:
            return False
        return self.variant is None or spec.get("variant") == self.variant

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)


@dataclass(frozen=True)
class _Descriptor:
    media_type: str
    digest: str
    size: int
    platform: dict[str, Any] | None = None
    annotations: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: Any, what: str) -> _Descriptor:
        obj = _obj(value, what)
        size = obj.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _bad(f"{what}.size", "is not a non-negative integer")
        media_type = obj.get("mediaType", "")
        platform = obj.get("platform")
        return cls(
            media_type=_str(media_type, f"{what}.mediaType"),
            digest=_digest(obj.get("digest"), f"{what}.digest"),
            size=size,
            platform=None if platform is None else _obj(platform, f"{what}.platform"),
            annotations=_str_map(obj.get("annotations"), f"{what}.annotations"),
        )

    @property
    def path(self) -> str:
        return f"blobs/sha256/{_sha256_hex(self.digest)}"

    def names(self) -> list[str]:
        return [self.annotations[k] for k in (_CONTAINERD_NAME, _REF_NAME) if k in self.annotations]

    def platform_text(self) -> str:
        p = self.platform or {}
        return "/".join(str(p[k]) for k in ("os", "architecture", "variant") if p.get(k)) or "(none)"


def _normal_name(name: str) -> str:
    """``alpine`` == ``alpine:latest`` == ``docker.io/library/alpine:latest``."""
    for prefix in ("docker.io/library/", "index.docker.io/library/", "docker.io/", "index.docker.io/"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    last = name.rsplit("/", 1)[-1]
    if ":" not in last and "@" not in last:
        name += ":latest"
    return name


def _name_matches(wanted: str, names: list[str], digests: list[str]) -> bool:
    if wanted in names or wanted in digests or f"sha256:{wanted}" in digests:
        return True
    return _normal_name(wanted) in {_normal_name(n) for n in names}


# ---- where the archive's files come from ---------------------------------------------------


class _Section(io.RawIOBase):
    """A read-only window ``[offset, offset + size)`` of an open file."""

    def __init__(self, fd: int, offset: int, size: int, what: str) -> None:
        self._fd, self._offset, self._size, self._what = fd, offset, size, what
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._size - self._pos)
        if n <= 0:
            return 0
        data = os.pread(self._fd, n, self._offset + self._pos)
        if not data:
            raise _bad(self._what, "is truncated")
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


class _Source:
    """The files of an image archive, addressed by relative names."""

    def open(self, name: str, what: str) -> tuple[io.BufferedReader, int]:
        raise NotImplementedError

    def real_path(self, name: str, what: str) -> Path | None:
        """A path on disk holding exactly this file's bytes, if there is one."""
        return None

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def read_small(self, name: str, what: str, limit: int = MAX_JSON_BYTES) -> bytes:
        reader, size = self.open(name, what)
        with reader:
            if size > limit:
                raise _bad(what, f"is {size} bytes, more than the {limit} allowed")
            data = reader.read(size + 1)
        if len(data) != size:
            raise _bad(what, "changed size while being read")
        return data


class _DirSource(_Source):
    """An unpacked layout; symlinks inside it are followed as long as they stay inside."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root)

    def _path(self, name: str, what: str) -> str:
        parts = _safe_parts(name, what)
        real = os.path.realpath(os.path.join(self.root, *parts))
        if not real.startswith(self.root.rstrip("/") + "/"):
            raise _bad(what, f"{name!r} leads outside the image directory")
        return real

    def exists(self, name: str) -> bool:
        try:
            return os.path.isfile(self._path(name, name))
        except InvalidRequest:
            return False

    def real_path(self, name: str, what: str) -> Path | None:
        return Path(self._path(name, what))

    def open(self, name: str, what: str) -> tuple[io.BufferedReader, int]:
        path = self._path(name, what)
        try:
            f = open(path, "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise _bad(what, f"{name!r} is missing from the image directory") from None
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            f.close()
            raise _bad(what, f"{name!r} is not a regular file")
        return f, st.st_size


@dataclass(frozen=True)
class _Member:
    kind: str  # "file", "dir", "symlink", "hardlink"
    offset: int = 0
    size: int = 0
    target: str = ""


class _TarSource(_Source):
    """An uncompressed tar, read in place: blobs are windows of the file, nothing is unpacked."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.members: dict[str, _Member] = {}
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            raise InvalidRequest(f"cannot read {path}: {err.strerror}") from err
        try:
            self._index()
        except BaseException:
            os.close(self._fd)
            raise

    def _index(self) -> None:
        try:
            with tarfile.open(self.path, mode="r:") as tf:
                for m in tf:
                    what = f"archive member {m.name[:200]!r}"
                    if all(p in ("", ".") for p in m.name.split("/")):
                        continue  # "./" itself
                    key = "/".join(_safe_parts(m.name, what))
                    if m.issparse():
                        raise _bad(what, "is a sparse file")
                    if m.isreg():
                        self.members[key] = _Member("file", m.offset_data, m.size)
                    elif m.isdir():
                        self.members[key] = _Member("dir")
                    elif m.issym():
                        self.members[key] = _Member("symlink", target=m.linkname)
                    elif m.islnk():
                        self.members[key] = _Member("hardlink", target=m.linkname)
                    # devices, fifos: nothing an image archive uses; never looked at
        except (tarfile.TarError, EOFError) as err:
            raise InvalidRequest(f"cannot read {self.path} as a tar archive: {err}") from err
        size = os.fstat(self._fd).st_size
        for key, member in self.members.items():
            if member.kind == "file" and member.offset + member.size > size:
                raise _bad(f"archive member {key!r}", "is truncated")

    def _resolve(self, name: str, what: str) -> _Member:
        todo = _safe_parts(name, what)
        done: list[str] = []
        hops = 0
        while todo:
            part = todo.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                if not done:
                    raise _bad(what, f"{name!r} resolves outside the archive")
                done.pop()
                continue
            member = self.members.get("/".join([*done, part]))
            if member is not None and member.kind in ("symlink", "hardlink"):
                hops += 1
                if hops > MAX_SYMLINK_HOPS:
                    raise _bad(what, f"{name!r}: too many levels of links")
                if member.target.startswith("/") or "\0" in member.target:
                    raise _bad(what, f"{name!r}: link to {member.target[:200]!r} leaves the archive")
                if member.kind == "hardlink":  # tar names hard-link targets from the root
                    done = []
                todo = member.target.split("/") + todo
                continue
            done.append(part)
        member = self.members.get("/".join(done))
        if member is None:
            raise _bad(what, f"{name!r} is missing from the archive")
        if member.kind != "file":
            raise _bad(what, f"{name!r} is not a regular file")
        return member

    def exists(self, name: str) -> bool:
        try:
            self._resolve(name, name)
        except InvalidRequest:
            return False
        return True

    def open(self, name: str, what: str) -> tuple[io.BufferedReader, int]:
        member = self._resolve(name, what)
        return io.BufferedReader(_Section(self._fd, member.offset, member.size, what), _CHUNK), member.size

    def close(self) -> None:
        os.close(self._fd)


def _decompress_file(path: Path, kind: str, out: Path) -> None:
    with open(path, "rb") as raw, open(out, "xb") as dst:
        for chunk in _decompressed(io.BufferedReader(raw, _CHUNK), kind, str(path)):
            dst.write(chunk)


@contextmanager
def _open_source(path: Path, work: Path) -> Iterator[_Source]:
    if path.is_dir():
        yield _DirSource(path)
        return
    if not path.is_file():
        raise InvalidRequest(f"cannot import {path}: no such file or directory")
    try:
        with open(path, "rb") as f:
            kind = _sniff(f.read(8))
    except OSError as err:
        raise InvalidRequest(f"cannot read {path}: {err.strerror}") from err
    if kind != "tar":  # a compressed archive: unpack the outer layer once, then read in place
        plain = work / "archive.tar"
        _decompress_file(path, kind, plain)
        path = plain
    source = _TarSource(path)
    try:
        yield source
    finally:
        source.close()


# ---- decompression and hashing ---------------------------------------------------------------


def _decompressed(reader: IO[bytes], kind: str, what: str) -> Iterator[bytes]:
    """The decompressed bytes of ``reader`` (``kind`` from :func:`_sniff`), in chunks."""
    if kind == "zstd":
        yield from _zstd(reader, what)
        return
    stream: io.BufferedIOBase | IO[bytes]
    if kind == "gzip":
        stream = gzip.GzipFile(fileobj=reader, mode="rb")
    elif kind == "xz":
        stream = lzma.LZMAFile(reader)
    elif kind == "bzip2":
        stream = bz2.BZ2File(reader)
    else:
        stream = reader
    with stream:
        while True:
            try:
                chunk = stream.read(_CHUNK)
            except (OSError, EOFError, zlib.error, lzma.LZMAError) as err:
                raise _bad(what, f"cannot be decompressed ({kind}): {err}") from err
            if not chunk:
                return
            yield chunk


def _zstd(reader: IO[bytes], what: str) -> Iterator[bytes]:
    # This Python has no zstd module; the zstd tool streams just as well. A thread feeds it.
    tool = shutil.which("zstd")
    if tool is None:
        raise InfraFailure("zstd-compressed layers need the zstd tool: install zstd", reason="storage")
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen([tool, "-dcq"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
        assert proc.stdin is not None and proc.stdout is not None
        stdin, stdout = proc.stdin, proc.stdout
        errors: list[BaseException] = []

        def feed() -> None:
            try:
                while chunk := reader.read(_CHUNK):
                    stdin.write(chunk)
            except BrokenPipeError:
                pass  # zstd stopped reading: its exit code tells why
            except BaseException as err:
                errors.append(err)
            finally:
                try:
                    stdin.close()
                except BrokenPipeError:
                    pass

        feeder = threading.Thread(target=feed, name="zstd-feed", daemon=True)
        feeder.start()
        finished = False
        try:
            while chunk := stdout.read(_CHUNK):
                yield chunk
            finished = True
        finally:
            if not finished:
                proc.kill()
            stdout.close()
            feeder.join()
            rc = proc.wait()
        if errors:
            raise errors[0]
        if rc != 0:
            stderr.seek(0)
            message = stderr.read(2000).decode(errors="replace").strip()
            raise _bad(what, f"cannot be decompressed (zstd exit {rc}): {message or 'no message'}")


def _hash_reader(reader: IO[bytes]) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    while chunk := reader.read(_CHUNK):
        h.update(chunk)
        n += len(chunk)
    return f"sha256:{h.hexdigest()}", n


# ---- what to import: the plan -------------------------------------------------------------


@dataclass(frozen=True)
class _LayerPlan:
    path: str  # inside the archive
    diff_id: str  # sha256 of the uncompressed tar, from the config
    digest: str | None  # sha256 of the blob as stored, when the archive states it
    size: int | None
    what: str  # for messages: "layer 2/5 (sha256:...)"


def _diff_ids(config: dict[str, Any]) -> list[str]:
    rootfs = _obj(config.get("rootfs"), "image config rootfs")
    if rootfs.get("type") != "layers":
        raise _bad("image config rootfs.type", f"is {rootfs.get('type')!r}, not 'layers'")
    ids = _list(rootfs.get("diff_ids"), "image config rootfs.diff_ids")
    return [_digest(d, f"image config rootfs.diff_ids[{i}]") for i, d in enumerate(ids)]


def _check_count(n_layers: int, n_diff_ids: int) -> None:
    if n_layers != n_diff_ids:
        raise _bad("image", f"lists {n_layers} layers but its config {n_diff_ids} diff_ids")
    if n_layers == 0:
        raise _bad("image", "has no layers")
    if n_layers > MAX_LAYERS:
        raise _bad("image", f"has {n_layers} layers, more than the {MAX_LAYERS} supported")


def _read_blob(src: _Source, desc: _Descriptor, what: str) -> bytes:
    if desc.size > MAX_JSON_BYTES:
        raise _bad(what, f"is {desc.size} bytes, more than the {MAX_JSON_BYTES} allowed")
    data = src.read_small(desc.path, what)
    actual = f"sha256:{hashlib.sha256(data).hexdigest()}"
    if len(data) != desc.size or actual != desc.digest:
        raise InvalidRequest(
            f"{what} is corrupted: digest mismatch (expected {desc.digest}, {desc.size} bytes; "
            f"found {actual}, {len(data)} bytes)"
        )
    return data


def _is_attestation(desc: _Descriptor) -> bool:
    p = desc.platform or {}
    return (
        desc.annotations.get("vnd.docker.reference.type") == "attestation-manifest"
        or p.get("os") == "unknown"
    )


def _pick_platform(entries: list[_Descriptor], platform: Platform, what: str) -> _Descriptor:
    images = [e for e in entries if not _is_attestation(e)]
    if len(images) == 1 and images[0].platform is None:
        return images[0]
    matching = [e for e in images if e.platform is not None and platform.matches(e.platform)]
    if not matching:
        have = ", ".join(sorted({e.platform_text() for e in images})) or "none"
        raise InvalidRequest(f"{what} has no image for platform {platform} (it has: {have})")
    # Without a wanted variant, prefer the entry without one (amd64 "v1" baseline).
    matching.sort(key=lambda e: bool((e.platform or {}).get("variant")))
    return matching[0]


def _plan_oci(src: _Source, image: str | None, platform: Platform) -> list[_LayerPlan]:
    layout = _obj(_load_json(src.read_small("oci-layout", "oci-layout"), "oci-layout"), "oci-layout")
    version = _str(layout.get("imageLayoutVersion"), "oci-layout imageLayoutVersion")
    if not version.startswith("1."):
        raise _bad("oci-layout", f"has unsupported imageLayoutVersion {version!r}")
    index = _obj(_load_json(src.read_small("index.json", "index.json"), "index.json"), "index.json")
    entries = [
        _Descriptor.parse(m, f"index.json manifests[{i}]")
        for i, m in enumerate(_list(index.get("manifests"), "index.json manifests"))
    ]
    entries = [e for e in entries if not _is_attestation(e)]
    if image is not None:
        entries = [e for e in entries if _name_matches(image, e.names(), [e.digest])]
        if not entries:
            raise InvalidRequest(f"the archive has no image {image!r}; it holds {_oci_names(src)}")
    if not entries:
        raise _bad("index.json", "lists no image")
    if len({tuple(e.names()) for e in entries}) > 1:
        raise InvalidRequest(
            f"the archive holds several images ({_oci_names(src)}): choose one with image=<name>"
        )
    desc = entries[0] if len(entries) == 1 else _pick_platform(entries, platform, "index.json")
    manifest: dict[str, Any] | None = None
    for depth in range(MAX_INDEX_DEPTH + 1):
        what = f"manifest {desc.digest}"
        doc = _obj(_load_json(_read_blob(src, desc, what), what), what)
        media_type = desc.media_type or _str(doc.get("mediaType", ""), f"{what} mediaType")
        if media_type in _INDEX_TYPES or (not media_type and "manifests" in doc):
            if depth == MAX_INDEX_DEPTH:
                raise _bad(what, "nests image indexes too deeply")
            children = [
                _Descriptor.parse(m, f"{what} manifests[{i}]")
                for i, m in enumerate(_list(doc.get("manifests"), f"{what} manifests"))
            ]
            desc = _pick_platform(children, platform, f"image index {desc.digest}")
            continue
        if media_type in _MANIFEST_TYPES or (not media_type and "layers" in doc):
            manifest = doc
            break
        raise InvalidRequest(f"{what} has media type {media_type!r}, which is not an image manifest")
    assert manifest is not None
    if manifest.get("schemaVersion") != 2:
        raise _bad(f"manifest {desc.digest}", "is not schemaVersion 2")
    config_desc = _Descriptor.parse(manifest.get("config"), "manifest config")
    if config_desc.media_type not in _CONFIG_TYPES:
        raise InvalidRequest(
            f"manifest {desc.digest} is not a container image (config type {config_desc.media_type!r})"
        )
    config = _obj(_load_json(_read_blob(src, config_desc, "image config"), "image config"), "image config")
    diff_ids = _diff_ids(config)
    layers = [
        _Descriptor.parse(d, f"manifest layers[{i}]")
        for i, d in enumerate(_list(manifest.get("layers"), "manifest layers"))
    ]
    _check_count(len(layers), len(diff_ids))
    plans = []
    for i, layer in enumerate(layers):
        if layer.media_type not in LAYER_TYPES:
            raise InvalidRequest(f"layer {i + 1} has unsupported media type {layer.media_type!r}")
        plans.append(
            _LayerPlan(
                path=layer.path,
                diff_id=diff_ids[i],
                digest=layer.digest,
                size=layer.size,
                what=f"layer {i + 1}/{len(layers)} ({layer.digest})",
            )
        )
    return plans


def _oci_names(src: _Source) -> str:
    index = _obj(_load_json(src.read_small("index.json", "index.json"), "index.json"), "index.json")
    names = []
    for i, m in enumerate(_list(index.get("manifests"), "index.json manifests")):
        desc = _Descriptor.parse(m, f"index.json manifests[{i}]")
        if not _is_attestation(desc):
            names.append(" = ".join(desc.names()) or desc.digest)
    return ", ".join(sorted(set(names)))


def _plan_docker(src: _Source, image: str | None) -> list[_LayerPlan]:
    entries = _list(
        _load_json(src.read_small("manifest.json", "manifest.json"), "manifest.json"), "manifest.json"
    )
    parsed = []
    for i, raw in enumerate(entries):
        what = f"manifest.json[{i}]"
        entry = _obj(raw, what)
        config = _str(entry.get("Config"), f"{what}.Config")
        tags = [_str(t, f"{what}.RepoTags") for t in _list(entry.get("RepoTags") or [], f"{what}.RepoTags")]
        layers = [_str(p, f"{what}.Layers") for p in _list(entry.get("Layers"), f"{what}.Layers")]
        m = _HEX_NAME_RE.search(config)
        config_digest = f"sha256:{m.group(1)}" if m else None
        parsed.append((config, tags, layers, config_digest))
    held = ", ".join(", ".join(t) or (d or c) for c, t, _, d in parsed)
    if image is not None:
        parsed = [p for p in parsed if _name_matches(image, p[1], [p[3]] if p[3] else [])]
        if not parsed:
            raise InvalidRequest(f"the archive has no image {image!r}; it holds {held}")
    if not parsed:
        raise _bad("manifest.json", "lists no image")
    if len(parsed) > 1:
        raise InvalidRequest(f"the archive holds several images ({held}): choose one with image=<name>")
    config_name, _tags, layer_names, config_digest = parsed[0]
    data = src.read_small(config_name, "image config")
    if config_digest is not None:  # docker names the config by its digest: the image ID
        actual = f"sha256:{hashlib.sha256(data).hexdigest()}"
        if actual != config_digest:
            raise InvalidRequest(f"image config {config_name} is corrupted: digest mismatch ({actual})")
    diff_ids = _diff_ids(_obj(_load_json(data, "image config"), "image config"))
    _check_count(len(layer_names), len(diff_ids))
    plans = []
    for i, name in enumerate(layer_names):
        _safe_parts(name, f"manifest.json layer {name!r}")
        m = _HEX_NAME_RE.search(name)
        # Docker >= 25 names layers blobs/sha256/<digest>; older ones <v1 id>/layer.tar, which
        # is no digest: those are checked against their diff_id only.
        digest = f"sha256:{m.group(1)}" if m and name.startswith("blobs/sha256/") else None
        plans.append(
            _LayerPlan(
                path=name,
                diff_id=diff_ids[i],
                digest=digest,
                size=None,
                what=f"layer {i + 1}/{len(layer_names)} ({name})",
            )
        )
    return plans


def _plan(src: _Source, image: str | None, platform: Platform) -> list[_LayerPlan]:
    if src.exists("oci-layout") and src.exists("index.json"):
        return _plan_oci(src, image, platform)
    if src.exists("manifest.json"):
        return _plan_docker(src, image)
    raise InvalidRequest(
        "not an image archive: expected docker save output (manifest.json) or an OCI image "
        "layout (oci-layout, index.json)"
    )


# ---- the import ---------------------------------------------------------------------------------


def _corrupted(plan: _LayerPlan, kind: str, expected: str, actual: str) -> InvalidRequest:
    return InvalidRequest(f"{plan.what} is corrupted: {kind} mismatch (expected {expected}, found {actual})")


def _verify_blob(src: _Source, plan: _LayerPlan) -> str:
    """Hash the blob as stored; returns its compression. Raises on a digest or size mismatch."""
    reader, size = src.open(plan.path, plan.what)
    with reader:
        if plan.size is not None and size != plan.size:
            raise _corrupted(plan, "size", f"{plan.size} bytes", f"{size} bytes")
        kind = _sniff(reader.peek(8)[:8])
        digest, n = _hash_reader(reader)
    if n != size:
        raise _corrupted(plan, "size", f"{size} bytes", f"{n} bytes")
    if plan.digest is not None and digest != plan.digest:
        raise _corrupted(plan, "digest", plan.digest, digest)
    if kind == "tar" and digest != plan.diff_id:  # an uncompressed blob is its own diff
        raise _corrupted(plan, "digest", plan.diff_id, digest)
    return kind


def _layer_tar(src: _Source, plan: _LayerPlan, kind: str, work: Path) -> tuple[Path, bool]:
    """The layer as a plain tar file on disk, its content checked against the diff_id.

    Returns (path, whether it is a temporary copy to delete).
    """
    if kind == "tar":
        real = src.real_path(plan.path, plan.what)
        if real is not None:
            return real, False  # verified by _verify_blob already
    out = work / "layer.tar"
    h = hashlib.sha256()
    reader, _size = src.open(plan.path, plan.what)
    with reader, open(out, "xb") as dst:
        for chunk in _decompressed(reader, kind, plan.what):
            h.update(chunk)
            dst.write(chunk)
    actual = f"sha256:{h.hexdigest()}"
    if actual != plan.diff_id:
        out.unlink()
        raise _corrupted(plan, "content (diff_id) digest", plan.diff_id, actual)
    return out, True


def _store_layer(store: LayerStore, rootfs: Path, tag: str) -> LayerInfo:
    try:
        return store.import_path(rootfs, tag)
    except InvalidRequest:
        # Someone imported the same layer meanwhile (with an equal image unless their
        # mkfs.erofs differs); theirs serves as well.
        if store.has_tag(tag):
            return store.resolve(tag)
        raise


def drop_shadowed_duplicates(digests: list[str]) -> list[str]:
    """Keep only the upper-most copy of a layer that occurs twice in a stack (base first).

    Overlayfs refuses one directory twice among its lower layers (ELOOP, "overlapping
    layers"), and images do repeat layers (identical empty layers are common). Dropping the
    lower copy changes nothing: every entry of it is also in the upper copy, which takes
    precedence over it and over whatever lies between, and the upper copy's whiteouts and
    opaque directories hide at least what the lower copy's did.
    """
    seen: set[str] = set()
    kept = []
    for digest in reversed(digests):
        if digest not in seen:
            seen.add(digest)
            kept.append(digest)
    return kept[::-1]


def import_oci(
    store: LayerStore,
    path: Path,
    ref: str,
    *,
    merge_below_bytes: int = 0,
    progress: Progress | None = None,
    image: str | None = None,
    platform: str = DEFAULT_PLATFORM,
) -> list[LayerInfo]:
    """Import a ``docker save`` archive or an OCI image layout as the image ``ref``.

    ``ref`` (``name:version``) names the ordered list of layers, base first, as
    :meth:`LayerStore.tag_image` does; returns that list. ``image`` picks one image from an
    archive holding several; ``platform`` (os/arch[/variant]) picks from a multi-platform
    index. With ``merge_below_bytes`` > 0, runs of consecutive layers whose EROFS images are
    each smaller than that are merged into one (:func:`dsec.images.merge.merge_layers`).

    ``progress(stage, done, total)`` is called as each layer goes through its stages, with
    ``stage`` like ``"layer 2/5 verify"``, ``"layer 2/5 extract"``, ``"layer 2/5 mkfs"``,
    ``"layer 2/5 cached"``, then merge stages and ``"tag"``; ``done``/``total`` count layers
    (merge stages count runs).
    """
    parse_tag(ref)  # before any work
    if store.has_tag(ref):
        raise InvalidRequest(f"{ref} already names a layer and versions are immutable; choose another")
    wanted = Platform.parse(platform)
    if not path.exists():
        raise InvalidRequest(f"cannot import {path}: no such file or directory")

    def report(stage: str, done: int, total: int) -> None:
        if progress is not None:
            progress(stage, done, total)

    work = Path(tempfile.mkdtemp(prefix="oci-", dir=store.tmp_dir))
    try:
        with _open_source(path, work) as src:
            plans = _plan(src, image, wanted)
            n = len(plans)
            # Every blob first: a corrupted archive must not leave half an image behind.
            kinds = []
            for i, plan in enumerate(plans):
                report(f"layer {i + 1}/{n} verify", i, n)
                kinds.append(_verify_blob(src, plan))
            digests = []
            for i, (plan, kind) in enumerate(zip(plans, kinds, strict=True)):
                stage = f"layer {i + 1}/{n}"
                tag = f"{LAYER_NAME}:{_sha256_hex(plan.diff_id)}"
                if store.has_tag(tag):
                    report(f"{stage} cached", i, n)
                    digests.append(store.resolve(tag).digest)
                    continue
                report(f"{stage} {'extract' if kind == 'tar' else 'decompress'}", i, n)
                tar, temporary = _layer_tar(src, plan, kind, work)
                if kind != "tar":
                    report(f"{stage} extract", i, n)
                rootfs = work / "rootfs"
                rootfs.mkdir()
                try:
                    extract_tar(tar, rootfs)
                    oci_to_overlay(rootfs)
                except InvalidRequest as err:
                    raise InvalidRequest(f"{plan.what}: {err.message}") from err
                finally:
                    if temporary:
                        tar.unlink()
                report(f"{stage} mkfs", i, n)
                digests.append(_store_layer(store, rootfs, tag).digest)
                shutil.rmtree(rootfs)
            report("layers imported", n, n)
        digests = drop_shadowed_duplicates(digests)
        if merge_below_bytes > 0:
            digests = merge_layers(store, digests, merge_below_bytes, progress=progress)
        report("tag", len(digests), len(digests))
        return store.tag_image(ref, digests)
    except OSError as err:
        raise InfraFailure(f"importing {path} failed: {err}", reason="storage") from err
    finally:
        shutil.rmtree(work, ignore_errors=True)
