"""Parsing and validating image manifests, indexes and configs into the list of layers to import.

Covers OCI image layouts (through image indexes / docker manifest lists, picking a platform)
and the older ``docker save`` ``manifest.json``; every document is size-capped, shape-checked
and checked against its digest before it is used.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from dsec.images.oci.archive import MAX_JSON_BYTES, _Source
from dsec.images.oci.validation import (
    _bad,
    _digest,
    _list,
    _load_json,
    _obj,
    _safe_parts,
    _sha256_hex,
    _str,
    _str_map,
)
from dsec.protocol.errors import InvalidRequest

MAX_LAYERS = 256  # docker itself stops at 125; overlayfs at 500 lower layers
MAX_INDEX_DEPTH = 4

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
_HEX_NAME_RE = re.compile(r"(?:^|/)(?:blobs/sha256/)?([0-9a-f]{64})(?:\.json|\.tar)?$")


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
