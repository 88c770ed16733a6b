"""Merge runs of small consecutive layers into one EROFS layer, offline (SPEC: "Small
consecutive layers are merged offline into one image (keeping overlay whiteouts)").

Every layer costs an EROFS mount and an overlayfs lower directory on each node that runs the
image, and overlayfs looks names up through every layer, so images with many tiny layers (one
per Dockerfile ``RUN``) are cheaper to run once their small layers are one.

A run of layers ``L_a .. L_b`` (base first) is replaced by one layer ``M`` such that
``M`` over the layers below the run shows exactly what ``L_b`` over ... over ``L_a`` over them
showed. ``M`` is built by applying the run's layers in order to an empty tree, with overlayfs
semantics:

* a whiteout in an upper layer deletes the lower entry inside the run, and an opaque
  directory (or a directory that replaces a non-directory or a whiteout) replaces the lower
  directory instead of merging with it;
* opaque markers are *kept* in ``M`` unless the run starts at the image's base: they must
  still hide what the layers below the run hold. A directory that replaced a lower
  non-directory (or a whiteout) inside the run becomes opaque, as that entry hid the layers
  below;
* a whiteout is kept only where it still hides something: when a layer below the run shows
  that path (looked up through those layers with overlayfs' rules) and no directory above it
  in ``M`` is opaque. Keeping every whiteout would be simpler but wrong to the eye: overlayfs
  lists a whiteout in a directory it does not merge (one that only ``M`` has, or an opaque
  one) as an entry that cannot be looked up, so ``ls`` would show ``c?????????`` names;
* the attributes (owner, mode, mtime, xattrs) of a directory present in several layers are the
  upper-most layer's, as overlayfs shows them; hard links within one layer stay hard links.

Merged layers are tagged ``dsec/merged:<key>``, the key hashing the input digests and the
base flag, so merging the same run again (another image with the same small layers) reuses it.
The inputs (and the layers below the run, for the whiteout rule) are read by mounting their
EROFS images under the store's tmp directory; every mount is removed before returning, also
on failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from dsec.images.mount import umount, unmount_tree
from dsec.images.mounts import mount_stored_layer
from dsec.images.store import LayerStore
from dsec.images.whiteouts import OPAQUE_XATTR, is_opaque, is_whiteout, make_whiteout, set_opaque
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest

MERGED_NAME = "dsec/merged"
_MERGE_FORMAT = 1  # bump when the merge rules change: old tags then no longer match

Progress = Callable[[str, int, int], None]


def find_runs(sizes: list[int], below_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of at least two consecutive sizes each below ``below_bytes``."""
    runs = []
    start = None
    for i, size in enumerate([*sizes, below_bytes]):  # the sentinel closes a trailing run
        if size < below_bytes:
            if start is None:
                start = i
            continue
        if start is not None and i - start >= 2:
            runs.append((start, i))
        start = None
    return runs


def merge_key(digests: list[str], below: list[str]) -> str:
    """What a merged layer depends on: its inputs, and the layers below (the whiteout rule)."""
    spec = {"format": _MERGE_FORMAT, "layers": digests, "below": below}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def merge_layers(
    store: LayerStore, digests: list[str], below_bytes: int, *, progress: Progress | None = None
) -> list[str]:
    """Replace each run of >= 2 consecutive layers smaller than ``below_bytes`` by one layer.

    ``digests`` lists an image's layers base first; returns the new list (full digests),
    which shows the same tree through overlayfs. Layers at or above the threshold, and a small
    layer without a small neighbour, are kept as they are.
    """
    infos = [store.resolve(d) for d in digests]
    result = [info.digest for info in infos]
    if below_bytes <= 0:
        return result
    runs = find_runs([info.size for info in infos], below_bytes)
    # Right to left, so that replacing a run does not shift the indices of those before it.
    for n, (start, end) in enumerate(reversed(runs)):
        if progress is not None:
            progress(f"merge layers {start + 1}-{end} of {len(infos)}", n, len(runs))
        result[start:end] = [_merge_run(store, result[start:end], below=result[:start])]
    if progress is not None and runs:
        progress("merge done", len(runs), len(runs))
    return result


def _merge_run(store: LayerStore, digests: list[str], below: list[str]) -> str:
    """One layer for ``digests``, to sit on ``below`` (both base first)."""
    tag = f"{MERGED_NAME}:{merge_key(digests, below)}"
    if store.has_tag(tag):
        return store.resolve(tag).digest
    work = Path(tempfile.mkdtemp(prefix="merge-", dir=store.tmp_dir))
    try:
        lowers = [_mount(store, digest, work / f"below{i}") for i, digest in enumerate(below)]
        out = work / "rootfs"
        out.mkdir()
        merger = _Merger(out, _Below(list(reversed(lowers))) if below else None)
        for i, digest in enumerate(digests):
            mnt = _mount(store, digest, work / f"layer{i}")
            try:
                merger.apply(mnt)
            finally:
                _unmount(mnt)
        for mnt in lowers:
            _unmount(mnt)
        merger.finish()
        try:
            return store.import_path(out, tag).digest
        except InvalidRequest:
            # A concurrent merge of the same run won the tag (with an equal image unless
            # mkfs.erofs differs between the two builders); its layer is as good as ours.
            if store.has_tag(tag):
                return store.resolve(tag).digest
            raise
    except OSError as err:
        raise InfraFailure(
            f"merging layers {', '.join(digests)} failed: {err}", reason=InfraReason.storage
        ) from err
    finally:
        unmount_tree(work)  # whatever an error left mounted: never rmtree into a mount
        shutil.rmtree(work, ignore_errors=True)


def _mount(store: LayerStore, digest: str, mnt: Path) -> Path:
    mnt.mkdir()
    mount_stored_layer(store, digest, mnt)  # either format: a split layer needs its data blob
    return mnt


def _unmount(mnt: Path) -> None:
    try:
        umount(mnt)
    except OSError:
        umount(mnt, lazy=True)  # a reader we do not know of; detach now, kernel cleans up
    mnt.rmdir()


def _copy_data(src: str, dst: str) -> None:
    fd_in = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            offset = 0
            while True:
                sent = os.sendfile(fd_out, fd_in, offset, 1 << 30)
                if sent == 0:
                    break
                offset += sent
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def _remove(path: str) -> None:
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _lstat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _xattrs(path: str) -> dict[str, bytes]:
    return {
        key: os.getxattr(path, key, follow_symlinks=False)
        for key in os.listxattr(path, follow_symlinks=False)
        if key != OPAQUE_XATTR
    }


class _Below:
    """The layers below a run, top first, answering "does this path show through them?"."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots = [os.fspath(r) for r in roots]

    def shows(self, rel: str) -> bool:
        """Whether overlayfs would show ``rel`` from these layers (lookup rules of namei.c)."""
        parts = rel.split("/")
        layers = self.roots  # the layers that contribute to the directory reached so far
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            merged = []
            for layer in layers:
                path = os.path.join(layer, part)
                st = _lstat_or_none(path)
                if st is None:
                    continue
                if is_whiteout(st):
                    break
                if last:
                    return True
                if not stat.S_ISDIR(st.st_mode):
                    break  # a file ends the lookup; below a directory above it, it is ignored
                merged.append(path)
                if is_opaque(path):
                    break
            if not merged:
                return False
            layers = merged
        return False


class _Merger:
    """Applies layer trees, lowest first, onto ``out`` with overlayfs semantics."""

    def __init__(self, out: Path, below: _Below | None) -> None:
        self.out = os.fspath(out)
        self.below = below  # None: the run starts at the base, nothing to hide
        self.keep_markers = below is not None
        # Directory mtimes are set last: creating entries inside a directory changes its own.
        self.dir_mtimes: dict[str, int] = {}

    def apply(self, layer: Path) -> None:
        src_root = os.fspath(layer)
        # Per layer: the source inode of a hard-linked file -> (its copy, the copy's inode).
        links: dict[int, tuple[str, int]] = {}
        self._apply_dir("", src_root, os.lstat(src_root))
        stack = [""]
        while stack:
            rel = stack.pop()
            src_dir = os.path.join(src_root, rel) if rel else src_root
            with os.scandir(src_dir) as it:
                entries = sorted(it, key=lambda e: e.name)
            for entry in entries:
                child = f"{rel}/{entry.name}" if rel else entry.name
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    self._apply_dir(child, entry.path, st)
                    stack.append(child)
                else:
                    self._apply_other(child, entry.path, st, links)

    def _dst(self, rel: str) -> str:
        return os.path.join(self.out, rel) if rel else self.out

    def _apply_dir(self, rel: str, src: str, st: os.stat_result) -> None:
        dst = self._dst(rel)
        opaque = is_opaque(src)
        existing = _lstat_or_none(dst)
        hides_below = False
        if existing is not None and not stat.S_ISDIR(existing.st_mode):
            os.unlink(dst)  # a file, link or whiteout of a lower layer in the run
            existing = None
            hides_below = True
        elif existing is not None and opaque:
            if rel:
                shutil.rmtree(dst)
                existing = None
            else:  # the root itself cannot be removed: empty it
                for name in os.listdir(dst):
                    _remove(os.path.join(dst, name))
        if existing is None:
            os.mkdir(dst, 0o700)
        if self.keep_markers and (opaque or hides_below):
            set_opaque(dst)
        # The upper directory's attributes win, xattrs included (except the opaque marker).
        for key in os.listxattr(dst, follow_symlinks=False):
            if key != OPAQUE_XATTR:
                os.removexattr(dst, key, follow_symlinks=False)
        self._set_attrs(dst, st, _xattrs(src), is_link=False)
        self.dir_mtimes[rel] = st.st_mtime_ns

    def _apply_other(self, rel: str, src: str, st: os.stat_result, links: dict[int, tuple[str, int]]) -> None:
        dst = self._dst(rel)
        if _lstat_or_none(dst) is not None:
            _remove(dst)
        mode = st.st_mode
        if is_whiteout(st):
            if self._needs_whiteout(rel):
                make_whiteout(dst, st)
            return
        if stat.S_ISREG(mode):
            if st.st_nlink > 1 and st.st_ino in links:
                first, first_ino = links[st.st_ino]
                current = _lstat_or_none(first)
                if current is not None and current.st_ino == first_ino:
                    os.link(first, dst, follow_symlinks=False)
                    return
            _copy_data(src, dst)
            if st.st_nlink > 1:
                links[st.st_ino] = (dst, os.lstat(dst).st_ino)
        elif stat.S_ISLNK(mode):
            os.symlink(os.readlink(src), dst)
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            os.mknod(dst, stat.S_IFMT(mode) | 0o600, st.st_rdev)
        else:
            raise InfraFailure(f"cannot merge {src}: unknown file type {mode:o}", reason=InfraReason.storage)
        self._set_attrs(dst, st, _xattrs(src), is_link=stat.S_ISLNK(mode))
        os.utime(dst, ns=(st.st_mtime_ns, st.st_mtime_ns), follow_symlinks=False)

    def _needs_whiteout(self, rel: str) -> bool:
        if self.below is None:
            return False
        parent = os.path.dirname(rel)
        while parent:
            if is_opaque(self._dst(parent)):
                return False  # the directory hides all below already
            parent = os.path.dirname(parent)
        return self.below.shows(rel)

    @staticmethod
    def _set_attrs(dst: str, st: os.stat_result, xattrs: dict[str, bytes], is_link: bool) -> None:
        os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
        if not is_link:
            os.chmod(dst, stat.S_IMODE(st.st_mode))  # after chown, which clears setuid/setgid
        for key, value in xattrs.items():
            os.setxattr(dst, key, value, follow_symlinks=False)

    def finish(self) -> None:
        """Set directory mtimes, walking the result itself (never through a symlink)."""
        for dirpath, _dirnames, _files in os.walk(self.out):
            rel = os.path.relpath(dirpath, self.out)
            mtime = self.dir_mtimes.get("" if rel == "." else rel)
            if mtime is not None:
                os.utime(dirpath, ns=(mtime, mtime), follow_symlinks=False)
