"""Merging runs of small layers: the merged stack must show exactly the tree the original showed.

Every comparison goes through real overlayfs mounts of real EROFS layers: the unmerged stack,
the merged stack, and an independent in-memory application of the OCI rules must agree.
"""

from __future__ import annotations

import os
import random
import stat
from pathlib import Path

import pytest

from dsec.images import merge as merge_mod
from dsec.images.merge import MERGED_NAME, find_runs, merge_layers
from dsec.images.mount import mount_erofs, mounts_under, umount
from dsec.images.mounts import LayerMounts
from dsec.images.oci import import_oci
from dsec.images.store import LayerStore
from dsec.images.whiteouts import is_opaque, is_whiteout

from .ocikit import OPQ, WH, D, E, F, H, S, SaveImage, apply_oci, docker_save, image_tree, layer

BIG = 64 << 10  # EROFS images of the "big" layers are above this, the small ones far below
THRESHOLD = 32 << 10


def big_layer(tag: str, size: int = BIG) -> bytes:
    rnd = random.Random(tag)
    return layer(D("big"), F(f"big/{tag}", rnd.randbytes(size)))  # incompressible


BASE = layer(
    D("big"),
    F("big/base", random.Random(0).randbytes(BIG)),
    D("etc"),
    F("etc/keep", "keep"),
    F("etc/del-in-group", "x"),
    F("etc/del-then-readd", "old"),
    D("dir"),
    F("dir/a", "a"),
    D("dir/sub"),
    F("dir/sub/b", "b"),
    D("opq"),
    F("opq/lower", "lower"),
    D("to-file"),
    F("to-file/x", "x"),
    F("to-dir", "file"),
    S("link", "etc/keep"),
)
SMALL = [
    layer(  # 1: deletions of base content, an opaque directory, a directory of the run's own
        D("etc"),
        WH("etc/del-in-group"),
        WH("etc/del-then-readd"),
        WH("dir"),
        D("opq"),
        OPQ("opq"),
        F("opq/s1", "s1"),
        D("new"),
        F("new/x", "x"),
        F("new/y", "y"),
        D("new/deep"),
        F("new/deep/z", "z"),
        D("hl"),
        F("hl/one", "linked", mode=0o640, xattrs={"user.k": b"v"}),
        H("hl/two", "hl/one"),
    ),
    layer(  # 2: delete what the run itself added; re-add; type changes; attributes
        D("etc", mode=0o700, mtime=1_700_000_000, xattrs={"user.etc": b"2"}),
        F("etc/del-then-readd", "new"),
        D("new"),
        WH("new/x"),  # nothing below the run has it: no whiteout may remain in the merge
        WH("new/deep"),
        F("to-file", "now a file"),
        D("to-dir"),
        F("to-dir/inner", "i"),
        D("dir"),  # re-created after its deletion: none of the base's dir/ shows
        F("dir/fresh", "f"),
    ),
    layer(  # 3: a whiteout in an opaque dir; a dir replacing a file inside the run
        D("opq"),
        WH("opq/s1"),
        F("opq/s3", "s3"),
        D("new"),
        F("new/y", "y3"),
        WH("link"),
        D("link"),  # over a base symlink: must hide the base's entry
        F("link/in", "in"),
    ),
]
ALL = [BASE, *SMALL]


def test_the_oracle() -> None:
    tree = apply_oci(ALL)
    assert {k for k in tree if k.startswith("dir")} == {"dir", "dir/fresh"}
    assert {k for k in tree if k.startswith("opq/")} == {"opq/s3"}
    assert {k for k in tree if k.startswith("new")} == {"new", "new/y"}
    assert tree["etc/del-then-readd"][5] == b"new" and "etc/del-in-group" not in tree
    assert tree["to-file"][0] == "file" and tree["to-dir"][0] == "dir" and tree["link"][0] == "dir"


@pytest.mark.parametrize(
    ("sizes", "runs"),
    [
        ([], []),
        ([1], []),
        ([1, 1], [(0, 2)]),
        ([9, 1, 1, 1, 9], [(1, 4)]),
        ([1, 9, 1, 1, 9, 1], [(2, 4)]),
        ([1, 1, 9, 1, 1], [(0, 2), (3, 5)]),
        ([5, 5], []),  # not strictly below
        ([4, 4, 4], [(0, 3)]),
    ],
)
def test_find_runs(sizes: list[int], runs: list[tuple[int, int]]) -> None:
    assert find_runs(sizes, 5) == runs


def imported(store: LayerStore, tmp_path: Path, layers: list[bytes], ref: str = "img:1") -> list[str]:
    archive = docker_save(tmp_path / f"{ref.replace(':', '-')}.tar", [SaveImage([ref], layers)])
    return [i.digest for i in import_oci(store, archive, ref)]


def assert_trees_equal(got: dict[str, object], want: dict[str, object]) -> None:
    if got != want:
        diff = {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
        raise AssertionError(f"trees differ: {diff}")


def erofs_entries(store: LayerStore, digest: str, mnt: Path) -> dict[str, os.stat_result]:
    mnt.mkdir()
    mount_erofs(store.blob_path(digest), mnt)
    try:
        out = {}
        for dirpath, dirnames, filenames in os.walk(mnt):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                out[os.path.relpath(path, mnt)] = os.lstat(path)
        out["."] = os.lstat(mnt)
        out.update({f"{k}@opaque": os.lstat(mnt) for k in list(out) if is_opaque(mnt / k)})
        return out
    finally:
        umount(mnt)


def test_merge_keeps_deletions_of_lower_content(
    store: LayerStore, layer_mounts: LayerMounts, tmp_path: Path
) -> None:
    digests = imported(store, tmp_path, ALL)
    sizes = [store.resolve(d).size for d in digests]
    assert sizes[0] > THRESHOLD and all(s < THRESHOLD for s in sizes[1:])
    merged = merge_layers(store, digests, THRESHOLD)
    assert len(merged) == 2 and merged[0] == digests[0]
    assert MERGED_NAME + ":" in " ".join(store.resolve(merged[1]).names)

    before = image_tree(store, layer_mounts, digests, tmp_path)
    after = image_tree(store, layer_mounts, merged, tmp_path)
    assert_trees_equal(after, before)
    assert_trees_equal(after, apply_oci(ALL))

    entries = erofs_entries(store, merged[1], tmp_path / "m")
    whiteouts = sorted(k for k, st in entries.items() if "@" not in k and is_whiteout(st))
    # Hiding base content: kept. Deleting the run's own content (new/x, new/deep), or inside
    # an opaque directory (opq/s1): dropped, overlayfs would list them as broken entries.
    assert whiteouts == ["etc/del-in-group"]
    opaque = sorted(k.removesuffix("@opaque") for k in entries if k.endswith("@opaque"))
    # dir and link: re-created over a whiteout; to-dir needs none (only the base had the file)
    assert opaque == ["dir", "link", "opq"]
    one, two = entries["hl/one"], entries["hl/two"]
    assert one.st_ino == two.st_ino and one.st_nlink == 2  # still a hard link
    assert stat.S_IMODE(one.st_mode) == 0o640
    assert entries["etc"].st_mtime == 1_700_000_000 and stat.S_IMODE(entries["etc"].st_mode) == 0o700
    assert not list(store.tmp_dir.iterdir())


def test_run_at_the_base_needs_no_markers(
    store: LayerStore, layer_mounts: LayerMounts, tmp_path: Path
) -> None:
    layers = [*ALL, big_layer("top", 4 * BIG)]
    digests = imported(store, tmp_path, layers)
    # a large threshold makes everything but the top layer "small": one run from the base
    merged = merge_layers(store, digests, 2 * BIG)
    assert len(merged) == 2 and merged[1] == digests[-1]
    entries = erofs_entries(store, merged[0], tmp_path / "m")
    assert not [k for k, st in entries.items() if is_whiteout(st)]
    assert not [k for k in entries if k.endswith("@opaque")]
    assert_trees_equal(
        image_tree(store, layer_mounts, merged, tmp_path), image_tree(store, layer_mounts, digests, tmp_path)
    )


def test_threshold_is_respected(store: LayerStore, tmp_path: Path) -> None:
    tiny = [layer(F(f"t{i}", str(i))) for i in range(6)]
    layers = [tiny[0], big_layer("a"), tiny[2], tiny[3], big_layer("b"), tiny[5]]
    digests = imported(store, tmp_path, layers)
    merged = merge_layers(store, digests, THRESHOLD)
    assert len(merged) == 5
    assert merged[:2] == digests[:2] and merged[3:] == digests[4:]  # big ones and lone small ones
    assert merged[2] not in digests
    assert merge_layers(store, digests, 0) == digests
    assert merge_layers(store, digests, 100) == digests  # nothing below 100 bytes
    everything = merge_layers(store, digests, 10 * BIG)
    assert len(everything) == 1


def test_merging_again_reuses_the_merged_layer(store: LayerStore, tmp_path: Path) -> None:
    digests = imported(store, tmp_path, ALL)
    first = merge_layers(store, digests, THRESHOLD)
    blobs = sorted(p.name for p in store.blob_dir.iterdir())
    assert merge_layers(store, [d[7:19] for d in digests], THRESHOLD) == first  # prefixes resolve
    assert sorted(p.name for p in store.blob_dir.iterdir()) == blobs


def test_import_with_merge(store: LayerStore, layer_mounts: LayerMounts, tmp_path: Path) -> None:
    layers = [*ALL, big_layer("top"), layer(F("last", "1")), layer(F("last", "2"))]
    plain = imported(store, tmp_path, layers, "plain:1")
    archive = docker_save(tmp_path / "m.tar", [SaveImage(["m:1"], layers)])
    stages: list[str] = []
    infos = import_oci(
        store, archive, "merged:1", merge_below_bytes=THRESHOLD, progress=lambda s, d, t: stages.append(s)
    )
    digests = [i.digest for i in infos]
    assert [i.digest for i in store.resolve_image("merged:1")] == digests
    assert len(digests) == 4 and digests[0] == plain[0] and digests[2] == plain[4]
    assert any(s.startswith("merge layers 2-4") for s in stages) and "merge done" in stages
    assert stages[-1] == "tag"
    assert_trees_equal(
        image_tree(store, layer_mounts, digests, tmp_path), image_tree(store, layer_mounts, plain, tmp_path)
    )


def test_every_mount_is_removed_when_a_merge_fails(
    store: LayerStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    digests = imported(store, tmp_path, ALL)
    seen: list[Path] = []

    def boom(self: object, layer_root: Path) -> None:
        seen.append(layer_root)
        assert mounts_under(layer_root)  # really mounted while merging
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(merge_mod._Merger, "apply", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        merge_layers(store, digests, THRESHOLD)
    assert seen
    assert not mounts_under(store.tmp_dir)
    assert not list(store.tmp_dir.iterdir())
    assert not [t for t in store.list() if any(n.startswith(MERGED_NAME) for n in t.names)]


# ---- randomised stacks: merged == unmerged == the OCI rules ------------------------------------

NAMES = ["a", "b", "c", "d"]


def _random_layer(rnd: random.Random, tree: dict[str, tuple[object, ...]], n: int, big: bool) -> bytes:
    """Random operations on the current tree, never touching one path twice in one layer."""
    entries: list[E] = []
    declared: set[str] = set()  # directories this layer names (shared by its additions)
    owned: list[str] = []  # subtrees an operation of this layer owns

    def free(path: str) -> bool:
        for o in owned:
            if path == o or path.startswith(o + "/") or o.startswith(path + "/"):
                return False
        return path not in declared

    def declare_parents(path: str) -> bool:
        parts = path.split("/")[:-1]
        for i in range(len(parts)):
            d = "/".join(parts[: i + 1])
            if any(d == o or d.startswith(o + "/") for o in owned):
                return False
        for i in range(len(parts)):
            d = "/".join(parts[: i + 1])
            if d not in declared:
                declared.add(d)
                entries.append(D(d, mtime=1_600_000_000 + n))
        return True

    dirs = [""] + [p for p, node in tree.items() if node[0] == "dir"]
    existing = list(tree)
    for _ in range(rnd.randint(2, 6)):
        op = rnd.choice(["add", "add", "add", "delete", "opaque", "replace"])
        if op == "add":
            parent = rnd.choice(dirs)
            path = "/".join(p for p in (parent, rnd.choice(NAMES)) if p)
            if rnd.random() < 0.3:
                path += "/" + rnd.choice(NAMES)  # through a directory that may be new
            if not free(path) or not declare_parents(path):
                continue
            owned.append(path)
            kind = rnd.choice(["file", "file", "dir", "symlink"])
            if kind == "file":
                entries.append(F(path, f"{path}@{n}", mode=rnd.choice([0o644, 0o600, 0o755])))
                if rnd.random() < 0.3 and free(path + ".hl"):
                    owned.append(path + ".hl")
                    entries.append(H(path + ".hl", path))
            elif kind == "dir":
                entries.append(D(path, mode=0o750, mtime=1_600_000_000 + n))
                entries.append(F(path + "/in", f"in@{n}"))
            else:
                entries.append(S(path, f"../{rnd.choice(NAMES)}"))
        elif existing:
            path = rnd.choice(existing)
            if not free(path) or not declare_parents(path):
                continue
            owned.append(path)
            node = tree[path]
            if op == "delete":
                entries.append(WH(path))
            elif op == "opaque" and node[0] == "dir":
                entries += [D(path), OPQ(path), F(path + "/fresh", f"fresh@{n}")]
            elif op == "replace" and node[0] == "dir":
                entries.append(F(path, f"was a dir@{n}"))
            elif op == "replace":
                entries += [D(path), F(path + "/inside", f"was a file@{n}")]
            else:
                entries.append(WH(path))
    if big:
        entries += [D("big"), F(f"big/{n}", rnd.randbytes(BIG))]
    return layer(*entries)


@pytest.mark.parametrize("seed", range(12))
def test_random_stacks_merge_faithfully(
    store: LayerStore, layer_mounts: LayerMounts, tmp_path: Path, seed: int
) -> None:
    rnd = random.Random(seed)
    layers: list[bytes] = []
    for n in range(rnd.randint(4, 8)):
        layers.append(_random_layer(rnd, apply_oci(layers), n, big=n == 0 or rnd.random() < 0.25))
    digests = imported(store, tmp_path, layers)
    want = apply_oci(layers)
    assert_trees_equal(image_tree(store, layer_mounts, digests, tmp_path), want)
    for threshold in (THRESHOLD, 10 * BIG):
        merged = merge_layers(store, digests, threshold)
        assert len(merged) < len(digests) or not find_runs(
            [store.resolve(d).size for d in digests], threshold
        )
        assert_trees_equal(image_tree(store, layer_mounts, merged, tmp_path), want)
    assert not list(store.tmp_dir.iterdir())
