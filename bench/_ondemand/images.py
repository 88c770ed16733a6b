"""The bench's images: built once from bench/_ondemand/tree.py and cached (a few GiB).

The cache directory is also what the bench's sshd serves (chrooted), so every component of
its path must be owned by root and not writable by group or others.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from _ondemand import tree
from dsec.images.ondemand import DEFAULT_CHUNK_SIZE, build_split

FORMAT = "1"  # bump to rebuild cached images
MIB = 1 << 20


@dataclass(frozen=True)
class Image:
    name: str
    profile: str  # workload profile: "big" or "small"
    meta_size: int
    blob_size: int

    @property
    def size(self) -> int:
        return self.meta_size + self.blob_size


def _cache_key() -> str:
    h = hashlib.sha256(FORMAT.encode())
    for f in ("tree.py", "workload.py"):
        h.update((Path(__file__).parent / f).read_bytes())
    h.update(str(DEFAULT_CHUNK_SIZE).encode())
    return h.hexdigest()[:16]


def ensure_images(cache_root: Path, n_small: int) -> tuple[Path, Image, list[Image]]:
    """The served directory and its images, building what is missing (minutes, once)."""
    key = _cache_key()
    served = cache_root / key
    served.mkdir(parents=True, exist_ok=True)
    for p in (*reversed(served.parents), served):  # sshd's ChrootDirectory insists on this
        st = os.stat(p)
        if st.st_uid != 0 or st.st_mode & 0o022:
            raise RuntimeError(f"{p} must be owned by root and not group/world-writable")
    for old in cache_root.iterdir():  # images of earlier generator versions
        if old.is_dir() and old.name != key and len(old.name) == 16:
            shutil.rmtree(old)

    def one(name: str, spec: tree.TreeSpec, seed: int, profile: str) -> Image:
        d = served / name
        info_file = d / "info.json"
        if not info_file.exists():
            t0 = time.monotonic()
            print(f"building image {name} (cached in {d}) ...", flush=True)
            shutil.rmtree(d, ignore_errors=True)
            src = served / f".build-{name}"
            try:
                tree.build_tree(src, spec, seed)
                d.mkdir()
                img = build_split(src, d / "meta.erofs", d / "blob.erofs")
            finally:
                shutil.rmtree(src, ignore_errors=True)
            info_file.write_text(
                json.dumps({"meta_size": img.meta_size, "blob_size": img.blob_size, "meta": img.meta_digest})
            )
            print(
                f"  {img.blob_size / MIB:.0f} MiB blob, {img.meta_size / MIB:.2f} MiB meta, "
                f"{time.monotonic() - t0:.0f} s",
                flush=True,
            )
        info = json.loads(info_file.read_text())
        return Image(name, profile, info["meta_size"], info["blob_size"])

    big = one("big", tree.BIG, 1, "big")
    smalls = [one(f"small-{i}", tree.SMALL, 100 + i, "small") for i in range(n_small)]
    return served, big, smalls
