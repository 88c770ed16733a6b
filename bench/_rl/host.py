"""What bench/rl.py reads and does on the host, beside the SDK.

Cgroup reads (a sandbox's memory as its memory cgroup charges it), the freezer written by hand
(the baselines: freeze without page-out, and thaw without prefetch), the copy baseline of the
pack figure, statistics, and the removal of the layers the bench packed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from _stats import pct
from dsec.backends.container import cgroups
from dsec.images.catalogue import REFS, TAGS, tag_key
from dsec.images.erofs import build_erofs
from dsec.images.refs import digest_hex
from dsec.images.store import LayerStore
from dsec.protocol.errors import DSecError

MiB = 1 << 20
CGROUP = Path("/sys/fs/cgroup")


# ---------------------------------------------------------------- statistics


def dist_ms(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50_ms": round(pct(xs, 50) * 1e3, 2), "p99_ms": round(pct(xs, 99) * 1e3, 2)}


def timing(label: str, xs: list[float]) -> str:
    return f"    {label:<46} p50 {pct(xs, 50) * 1e3:8.1f} ms  p99 {pct(xs, 99) * 1e3:8.1f} ms  (n={len(xs)})"


# ---------------------------------------------------------------- cgroups


def memory_dir(sandbox_id: str) -> Path:
    return cgroups.sandbox_dir("memory", sandbox_id)


def usage(sandbox_id: str) -> int:
    """Bytes the sandbox's memory cgroup is charged for (anon, page cache, kernel)."""
    return int((memory_dir(sandbox_id) / "memory.usage_in_bytes").read_text())


def memory_stat(sandbox_id: str) -> dict[str, int]:
    out = {}
    for line in (memory_dir(sandbox_id) / "memory.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


def has_process(sandbox_id: str, comm: str) -> bool:
    """Whether a process named ``comm`` runs in the sandbox (read from the host)."""
    for pid in (memory_dir(sandbox_id) / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                return True
    return False


def cgroups_of(ids: set[str]) -> list[Path]:
    """Cgroups left in any hierarchy for these sandbox IDs (and only these)."""
    return sorted(d for i in ids for d in cgroups.sandbox_dirs(i))


async def wait_until(pred: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll ``pred`` until it holds: how this bench waits for anything, never a bare sleep."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.02)


async def set_freezer(sandbox_id: str, state: str) -> None:
    path = cgroups.sandbox_dir("freezer", sandbox_id) / "freezer.state"
    path.write_text(state)
    await wait_until(lambda: path.read_text().strip() == state, f"{sandbox_id} {state}", 10)


@contextlib.asynccontextmanager
async def frozen_by_hand(sandbox_id: str) -> AsyncIterator[None]:
    """Freeze the sandbox's freezer cgroup behind the edge's back, and always thaw it again
    (a frozen cgroup could not be stopped)."""
    await set_freezer(sandbox_id, "FROZEN")
    try:
        yield
    finally:
        await set_freezer(sandbox_id, "THAWED")


# ---------------------------------------------------------------- the pack baseline


def make_tree(root: Path, blob_mb: int, small: int, small_bytes: int) -> int:
    """The host twin of the sandbox's diff: one incompressible blob and ``small`` small files."""
    (root / "small").mkdir(parents=True)
    total = 0
    with open(root / "blob", "wb") as f:
        for _ in range(blob_mb):
            total += f.write(os.urandom(MiB))
    for i in range(1, small + 1):
        total += (root / "small" / f"f{i}").write_bytes(os.urandom(small_bytes))
    os.sync()
    return total


def copy_fsync(src: Path, dst: Path) -> int:
    """Read every file of ``src`` and write it once under ``dst``, durably (fsync): the least
    any packing of the same bytes must do. Plain read/write: no reflink, no copy offload."""
    copied = 0
    for dirpath, _dirs, files in os.walk(src):
        target = dst / Path(dirpath).relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            with open(Path(dirpath) / name, "rb") as fin, open(target / name, "wb") as fout:
                while chunk := fin.read(MiB):
                    copied += fout.write(chunk)
                fout.flush()
                os.fsync(fout.fileno())
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return copied


def mkfs_fsync(src: Path, image: Path) -> None:
    """What the layer store itself does with a diff: ``mkfs.erofs`` (its flags), then fsync."""
    build_erofs(src, image)
    with open(image, "rb") as f:
        os.fsync(f.fileno())


# ---------------------------------------------------------------- cleanup of packed layers


def remove_layers(layer_dir: Path, names: list[str]) -> tuple[int, int]:
    """Untag every version of ``names`` (the bench's packs and forks) and delete the blobs that
    no other tag names. Returns (tags removed, bytes of blobs deleted). Call with the node
    closed (its layer mounts gone)."""
    tags = freed = 0
    with LayerStore(layer_dir) as store:
        digests: set[str] = set()
        for name in names:
            for version in store.catalogue.versions(name):
                with contextlib.suppress(DSecError):
                    digests.update(store.untag(f"{name}:{version}"))
                    tags += 1
        _prune_empty_dirs(store, names, digests)
        for digest in sorted(digests):
            if store.catalogue.referrers(digest):
                continue  # the same bytes under another tag: not ours to delete
            split = None
            with contextlib.suppress(DSecError):
                split = store.split_info(digest)
            blobs = [digest, *([split.blob_digest] if split is not None else [])]
            for d in blobs:
                st = store.blobs.stat(d)
                if st is not None and store.blobs.delete(d):
                    freed += st.size
    return tags, freed


def _prune_empty_dirs(store: LayerStore, names: list[str], digests: set[str]) -> None:
    """A removed tag leaves the (now empty) directories of its records in a directory store:
    remove those of the bench's own names, and only if empty."""
    root = getattr(store.blobs, "record_dir", None)
    if not isinstance(root, Path):
        return
    encoded = [Path(tag_key(name, "0")).parent.name for name in names]
    candidates = [root / TAGS / enc for enc in encoded]
    for digest in digests:
        hexdigest = digest_hex(digest)
        candidates += [root / REFS / hexdigest / enc for enc in encoded]
        candidates.append(root / REFS / hexdigest)
    for d in candidates:
        with contextlib.suppress(OSError):
            d.rmdir()  # fails, as it should, on anything not empty
