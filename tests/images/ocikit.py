"""Build image archives by hand for the import tests, and read file trees back.

* :func:`layer` makes a layer tarball (pax, with xattrs) from :class:`E` entries;
* :class:`OciLayout` writes an OCI image layout (blobs, manifests, indexes, index.json);
* :func:`docker_save` writes the classic ``docker save`` tarball;
* :func:`apply_oci` is an independent, in-memory reference of what a stack of OCI layers
  means (whiteouts applied to lower layers only), to compare a real overlay mount against;
* :func:`read_tree` reads a mounted tree into the same shape; :func:`overlay` mounts one.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import posixpath
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.images.mount import MS_RDONLY, mount, umount
from dsec.images.mounts import LayerMounts
from dsec.images.store import LayerStore

T0 = 1_600_000_000


@dataclass
class E:
    """One tar member. kind: file, dir, symlink, hardlink, chr, fifo."""

    name: str
    kind: str = "file"
    data: bytes = b""
    target: str = ""
    mode: int | None = None
    uid: int = 0
    gid: int = 0
    mtime: int = T0
    xattrs: dict[str, bytes] = field(default_factory=dict)
    dev: tuple[int, int] = (0, 0)


def F(name: str, data: bytes | str = b"", **kw: Any) -> E:
    return E(name, "file", data.encode() if isinstance(data, str) else data, **kw)


def D(name: str, **kw: Any) -> E:
    return E(name, "dir", **kw)


def S(name: str, target: str, **kw: Any) -> E:
    return E(name, "symlink", target=target, **kw)


def H(name: str, target: str, **kw: Any) -> E:
    return E(name, "hardlink", target=target, **kw)


def WH(path: str) -> E:
    """An OCI whiteout deleting ``path`` from the layers below."""
    parent, base = posixpath.split(path)
    return F(posixpath.join(parent, ".wh." + base))


def OPQ(directory: str) -> E:
    return F(posixpath.join(directory, ".wh..wh..opq"))


_TYPES = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "chr": tarfile.CHRTYPE,
    "fifo": tarfile.FIFOTYPE,
}
_DEFAULT_MODES = {
    "file": 0o644,
    "dir": 0o755,
    "symlink": 0o777,
    "hardlink": 0o644,
    "chr": 0o666,
    "fifo": 0o644,
}


def layer(*entries: E) -> bytes:
    """An uncompressed pax layer tarball."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.type = _TYPES[e.kind]
            info.mode = _DEFAULT_MODES[e.kind] if e.mode is None else e.mode
            info.uid, info.gid, info.mtime = e.uid, e.gid, e.mtime
            info.uname = info.gname = ""
            if e.xattrs:
                info.pax_headers = {
                    "SCHILY.xattr." + k: v.decode("utf-8", "surrogateescape") for k, v in e.xattrs.items()
                }
            if e.kind in ("symlink", "hardlink"):
                info.linkname = e.target
            if e.kind == "chr":
                info.devmajor, info.devminor = e.dev
            if e.kind == "file":
                info.size = len(e.data)
                tf.addfile(info, io.BytesIO(e.data))
            else:
                tf.addfile(info)
    return buf.getvalue()


def compress(data: bytes, kind: str) -> bytes:
    if kind == "tar":
        return data
    if kind == "gzip":
        return gzip.compress(data, mtime=0)
    if kind == "zstd":
        return subprocess.run(["zstd", "-q", "-c"], input=data, capture_output=True, check=True).stdout
    raise ValueError(kind)


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


LAYER_MT = {
    "tar": "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}


def config_json(layers: list[bytes], arch: str = "amd64") -> bytes:
    return json.dumps(
        {
            "architecture": arch,
            "os": "linux",
            "config": {"Env": ["PATH=/usr/bin:/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [sha256(t) for t in layers]},
        }
    ).encode()


class OciLayout:
    """An OCI image layout directory being written."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "blobs/sha256").mkdir(parents=True)

    def blob(self, data: bytes) -> tuple[str, int]:
        digest = sha256(data)
        (self.root / "blobs/sha256" / digest[7:]).write_bytes(data)
        return digest, len(data)

    def desc(self, media_type: str, data: bytes, **extra: Any) -> dict[str, Any]:
        digest, size = self.blob(data)
        return {"mediaType": media_type, "digest": digest, "size": size, **extra}

    def image(
        self,
        layers: list[bytes],
        compression: str | list[str] = "gzip",
        arch: str = "amd64",
        config: bytes | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """Write config, layer blobs and the manifest; returns the manifest's descriptor."""
        kinds = [compression] * len(layers) if isinstance(compression, str) else compression
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": self.desc(
                "application/vnd.oci.image.config.v1+json", config or config_json(layers, arch)
            ),
            "layers": [self.desc(LAYER_MT[k], compress(t, k)) for t, k in zip(layers, kinds, strict=True)],
        }
        return self.desc("application/vnd.oci.image.manifest.v1+json", json.dumps(manifest).encode(), **extra)

    def index(self, manifests: list[dict[str, Any]], docker: bool = False, **extra: Any) -> dict[str, Any]:
        mt = (
            "application/vnd.docker.distribution.manifest.list.v2+json"
            if docker
            else "application/vnd.oci.image.index.v1+json"
        )
        doc = {"schemaVersion": 2, "mediaType": mt, "manifests": manifests}
        return self.desc(mt, json.dumps(doc).encode(), **extra)

    def finish(self, manifests: list[dict[str, Any]]) -> Path:
        (self.root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        (self.root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))
        return self.root


def ref_name(name: str) -> dict[str, Any]:
    return {"annotations": {"org.opencontainers.image.ref.name": name}}


def oci_layout(root: Path, layers: list[bytes], compression: str | list[str] = "gzip") -> Path:
    lay = OciLayout(root)
    return lay.finish([lay.image(layers, compression, **ref_name("latest"))])


def tar_dir(src: Path, out: Path) -> Path:
    with tarfile.open(out, "w") as tf:
        for p in sorted(src.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(src)), recursive=False)
    return out


@dataclass
class SaveImage:
    tags: list[str]
    layers: list[bytes]


def docker_save(
    path: Path, images: list[SaveImage], *, symlinks: bool = False, extra: list[tarfile.TarInfo] | None = None
) -> Path:
    """The classic ``docker save`` tarball: <id>/layer.tar, <config sha>.json, manifest.json.

    With ``symlinks``, layer files live at the top as <diff sha>.tar and <id>/layer.tar are
    symlinks to them, as skopeo writes docker-archive.
    """
    files: dict[str, bytes] = {}
    links: dict[str, str] = {}
    manifest = []
    repositories: dict[str, dict[str, str]] = {}
    for img in images:
        config = config_json(img.layers)
        config_name = sha256(config)[7:] + ".json"
        files[config_name] = config
        names = []
        for i, t in enumerate(img.layers):
            layer_id = hashlib.sha256(f"{config_name}/{i}".encode()).hexdigest()
            name = f"{layer_id}/layer.tar"
            if symlinks:
                files[sha256(t)[7:] + ".tar"] = t
                links[name] = f"../{sha256(t)[7:]}.tar"
            else:
                files[name] = t
            files[f"{layer_id}/VERSION"] = b"1.0"
            names.append(name)
        manifest.append({"Config": config_name, "RepoTags": img.tags, "Layers": names})
        for tag in img.tags:
            repo, _, version = tag.rpartition(":")
            repositories.setdefault(repo, {})[version] = hashlib.sha256(names[-1].encode()).hexdigest()
    files["manifest.json"] = json.dumps(manifest).encode()
    files["repositories"] = json.dumps(repositories).encode()
    with tarfile.open(path, "w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, target in links.items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tf.addfile(info)
        for info in extra or []:
            tf.addfile(info, io.BytesIO(b"x" * info.size) if info.isreg() else None)
    return path


# ---- trees -----------------------------------------------------------------------------------

# path -> (kind, mode, uid, gid, mtime_s, payload, xattrs)
Node = tuple[str, int, int, int, int, Any, tuple[tuple[str, bytes], ...]]
Tree = dict[str, Node]


def _kind_of(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "dir"),
        (stat.S_ISREG, "file"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISCHR, "chr"),
        (stat.S_ISBLK, "blk"),
        (stat.S_ISFIFO, "fifo"),
    ):
        if test(mode):
            return kind
    return "other"


def read_tree(root: Path) -> Tree:
    """Every entry below ``root`` (root itself excluded), with its metadata and content."""
    tree: Tree = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            kind = _kind_of(st.st_mode)
            payload: Any = None
            if kind == "file":
                payload = Path(path).read_bytes()
            elif kind == "symlink":
                payload = os.readlink(path)
            elif kind in ("chr", "blk"):
                payload = (os.major(st.st_rdev), os.minor(st.st_rdev))
            xattrs = tuple(
                sorted(
                    (k, os.getxattr(path, k, follow_symlinks=False))
                    for k in os.listxattr(path, follow_symlinks=False)
                    if not k.startswith("trusted.overlay.")
                )
            )
            mode = 0o777 if kind == "symlink" else stat.S_IMODE(st.st_mode)
            rel = os.path.relpath(path, root)
            tree[rel] = (kind, mode, st.st_uid, st.st_gid, int(st.st_mtime), payload, xattrs)
    return tree


def _norm(name: str) -> str:
    return "/".join(p for p in name.split("/") if p not in ("", "."))


def apply_oci(layers: list[bytes]) -> Tree:
    """What a stack of OCI layers shows, per the image spec, computed without any filesystem."""
    tree: Tree = {}

    def drop(path: str, children_only: bool = False) -> None:
        for key in [k for k in tree if k.startswith(path + "/") or (not path and k)]:
            del tree[key]
        if not children_only:
            tree.pop(path, None)

    for data in layers:
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            members = [(m, tf.extractfile(m).read() if m.isreg() else None) for m in tf]  # type: ignore[union-attr]
        for m, _ in members:  # whiteouts apply to the layers below only: first
            name = _norm(m.name)
            parent, base = posixpath.split(name)
            if base == ".wh..wh..opq":
                drop(parent, children_only=True)
            elif base.startswith(".wh."):
                drop(posixpath.join(parent, base[4:]))
        for m, content in members:
            name = _norm(m.name)
            base = posixpath.basename(name)
            if not name or base.startswith(".wh."):
                continue
            if (m.ischr() or m.isblk()) and (m.devmajor, m.devminor) != (0, 0):
                continue  # device nodes are stripped at import (dsec.images.sanitize)
            xattrs = tuple(
                sorted(
                    (k[len("SCHILY.xattr.") :], v.encode("utf-8", "surrogateescape"))
                    for k, v in m.pax_headers.items()
                    if k.startswith("SCHILY.xattr.") and k != "SCHILY.xattr.security.capability"
                )
            )
            if m.islnk():
                node = tree[_norm(m.linkname)]
            elif m.isdir():
                node = ("dir", m.mode, m.uid, m.gid, int(m.mtime), None, xattrs)
            else:
                kind = "file" if m.isreg() else "symlink" if m.issym() else "chr" if m.ischr() else "fifo"
                payload: Any = content if m.isreg() else m.linkname if m.issym() else None
                if m.ischr():
                    payload = (m.devmajor, m.devminor)
                mode = 0o777 if m.issym() else m.mode
                node = (kind, mode, m.uid, m.gid, int(m.mtime), payload, xattrs)
            old = tree.get(name)
            if old is not None and not (old[0] == "dir" and node[0] == "dir"):
                drop(name)
            tree[name] = node
    return tree


@contextmanager
def overlay(lowers: list[Path], where: Path) -> Iterator[Path]:
    """A read-only overlay of ``lowers`` (base first); an empty bottom layer makes one work."""
    where.mkdir(parents=True)
    (where / "empty").mkdir()
    (where / "merged").mkdir()
    lowerdir = ":".join([*(str(p) for p in reversed(lowers)), str(where / "empty")])
    mount("overlay", where / "merged", "overlay", MS_RDONLY, f"lowerdir={lowerdir}")
    try:
        yield where / "merged"
    finally:
        umount(where / "merged")


@contextmanager
def mounted_layers(store: LayerStore, mounts: LayerMounts, digests: list[str]) -> Iterator[list[Path]]:
    paths = [mounts.acquire(d, store.blob_path(d)) for d in digests]
    try:
        yield paths
    finally:
        for d in digests:
            mounts.release(d)


_counter = iter(range(1_000_000))


def image_tree(store: LayerStore, mounts: LayerMounts, digests: list[str], scratch: Path) -> Tree:
    """The tree the layers ``digests`` (base first) show through a real overlay mount."""
    with (
        mounted_layers(store, mounts, digests) as paths,
        overlay(paths, scratch / f"ovl{next(_counter)}") as mnt,
    ):
        return read_tree(mnt)
