"""Importing docker save archives and OCI image layouts: real mkfs.erofs, real overlay mounts.

Archives are built by hand (tests/images/ocikit.py) so every byte is under the test's control;
what an import produced is read back through a real overlayfs mount of its EROFS layers and
compared with an independent in-memory application of the OCI layer rules.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.images.mount import mount_erofs, mounts_under, umount
from dsec.images.mounts import LayerMounts
from dsec.images.oci import LAYER_NAME, import_oci
from dsec.images.store import LayerStore
from dsec.images.whiteouts import (
    OPAQUE_XATTR,
    is_opaque,
    is_whiteout,
    oci_to_overlay,
    overlay_to_oci,
)
from dsec.protocol.errors import InvalidRequest, LayerNotFound
from tests.support import flip_byte

from .conftest import _CAP_NET_RAW
from .ocikit import (
    OPQ,
    WH,
    D,
    E,
    F,
    H,
    OciLayout,
    S,
    SaveImage,
    apply_oci,
    config_json,
    docker_save,
    image_tree,
    layer,
    oci_layout,
    ref_name,
    sha256,
    tar_dir,
)

# ---- the image every round-trip test imports -----------------------------------------------

BASE = layer(
    D("bin"),
    F("bin/tool", b"#!/bin/sh\necho tool\n" * 300, mode=0o4755, uid=1000, gid=1000),
    H("bin/tool-again", "bin/tool"),
    S("bin/sh", "tool"),
    S("bin/abs", "/etc/hostname"),
    D("etc", mode=0o755, xattrs={"user.dir": b"etc"}),
    F("etc/hostname", "box\n", xattrs={"user.note": b"\x00\xffbinary", "user.other": b"v"}),
    # A file capability (cap_net_raw): stripped at import, like the device node below.
    F("etc/passwd", "root:x:0:0\n", mode=0o600, xattrs={"security.capability": _CAP_NET_RAW}),
    F("etc/deleted-then-readded", "old\n"),
    F("etc/deleted", "bye\n"),
    D("gone", mode=0o700),
    F("gone/inside", "x"),
    D("gone/sub"),
    F("gone/sub/deep", "y"),
    D("opq"),
    F("opq/lower1", "1"),
    F("opq/lower2", "2"),
    D("merge"),
    F("merge/lower", "l"),
    D("dev"),
    E("dev/null", "chr", mode=0o666, dev=(1, 3)),
    E("dev/fifo", "fifo", mode=0o640),
    D("empty", mode=0o711, uid=5, gid=6),
    D("replaced-by-file"),
    F("replaced-by-file/x", "x"),
    F("replaced-by-dir", "file"),
)
MIDDLE = layer(
    D("etc", mode=0o750, mtime=1_600_000_100),  # attributes change, contents merge
    WH("etc/deleted"),
    WH("etc/deleted-then-readded"),
    WH("gone"),
    D("opq"),
    OPQ("opq"),
    F("opq/upper", "u"),
    D("merge"),
    F("merge/upper", "u"),
    WH("never-existed"),
    F("replaced-by-file", "now a file"),
    D("replaced-by-dir"),
    F("replaced-by-dir/y", "y"),
)
TOP = layer(
    D("etc", mode=0o750, mtime=1_600_000_300),
    F("etc/deleted-then-readded", "new\n", mtime=1_600_000_200),
    F("etc/hostname", "box2\n", xattrs={"user.note": b"changed"}),
    D("gone"),  # a directory re-created after its deletion shows nothing of the old one
    F("gone/fresh", "f"),
    WH("etc/ghost"),  # a whiteout of a name nothing below has: harmless in a merged directory
    D("bin"),  # layer tars carry their parent directories (docker's do); overlayfs shows the top one
    F("bin/tool", b"upgraded", mode=0o755),
)
LAYERS = [BASE, MIDDLE, TOP]
EXPECTED = apply_oci(LAYERS)


def test_reference_model_says_what_we_expect() -> None:
    # The oracle itself, spelled out, so that a bug in it cannot hide one in the import.
    assert "etc/deleted" not in EXPECTED
    assert EXPECTED["etc/deleted-then-readded"][5] == b"new\n"
    assert sorted(k for k in EXPECTED if k.startswith("gone")) == ["gone", "gone/fresh"]
    assert sorted(k for k in EXPECTED if k.startswith("opq/")) == ["opq/upper"]
    assert sorted(k for k in EXPECTED if k.startswith("merge/")) == ["merge/lower", "merge/upper"]
    assert EXPECTED["etc"][1] == 0o750 and EXPECTED["etc"][4] == 1_600_000_300
    assert EXPECTED["replaced-by-file"][0] == "file" and EXPECTED["replaced-by-dir"][0] == "dir"


@pytest.fixture
def mounts(layer_mounts: LayerMounts) -> LayerMounts:
    return layer_mounts


def digests_of(store: LayerStore, ref: str) -> list[str]:
    return [info.digest for info in store.resolve_image(ref)]


def assert_shows(store: LayerStore, mounts: LayerMounts, ref: str, tmp: Path, expected: object) -> None:
    got = image_tree(store, mounts, digests_of(store, ref), tmp)
    if got != expected:
        assert isinstance(expected, dict)
        diff = {
            k: (got.get(k), expected.get(k))
            for k in set(got) | set(expected)
            if got.get(k) != expected.get(k)
        }
        raise AssertionError(f"tree differs: {diff}")


def assert_clean(store: LayerStore, tmp: Path) -> None:
    assert not list(store.tmp_dir.iterdir())
    assert not [m for m in mounts_under(tmp) if "/mnt/" not in m.mount_point]


# ---- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("symlinks", [False, True], ids=["plain", "symlinked-layers"])
def test_docker_save_round_trip(
    store: LayerStore, mounts: LayerMounts, tmp_path: Path, symlinks: bool
) -> None:
    archive = docker_save(tmp_path / "save.tar", [SaveImage(["team/app:1"], LAYERS)], symlinks=symlinks)
    infos = import_oci(store, archive, "app:1")
    assert len(infos) == 3
    assert [i.digest for i in store.resolve_image("app:1")] == [i.digest for i in infos]
    for info, t in zip(infos, LAYERS, strict=True):
        assert f"{LAYER_NAME}:{sha256(t)[7:]}" in info.names
    assert_shows(store, mounts, "app:1", tmp_path, EXPECTED)
    assert_clean(store, tmp_path)


def test_metadata_survives_in_detail(store: LayerStore, mounts: LayerMounts, tmp_path: Path) -> None:
    archive = docker_save(tmp_path / "save.tar", [SaveImage(["app:1"], [BASE])])
    (info,) = import_oci(store, archive, "base:1")
    mnt = mounts.acquire(info.digest, store.blob_path(info.digest))
    tool, again = os.lstat(mnt / "bin/tool"), os.lstat(mnt / "bin/tool-again")
    assert tool.st_ino == again.st_ino and tool.st_nlink == 2  # a hard link, not a copy
    assert stat.S_IMODE(tool.st_mode) == 0o4755 and (tool.st_uid, tool.st_gid) == (1000, 1000)
    assert os.readlink(mnt / "bin/abs") == "/etc/hostname"
    assert os.getxattr(mnt / "etc/hostname", "user.note") == b"\x00\xffbinary"
    assert os.getxattr(mnt / "etc", "user.dir") == b"etc"
    assert not os.path.lexists(mnt / "dev/null")  # a device node never comes in with a layer
    assert "security.capability" not in os.listxattr(mnt / "etc/passwd", follow_symlinks=False)
    assert stat.S_ISFIFO(os.lstat(mnt / "dev/fifo").st_mode)
    assert os.lstat(mnt / "etc/hostname").st_mtime == 1_600_000_000


@pytest.mark.parametrize(
    "compression", ["tar", "gzip", "zstd", ["zstd", "tar", "gzip"]], ids=["tar", "gzip", "zstd", "mixed"]
)
def test_oci_layout_directory(
    store: LayerStore, mounts: LayerMounts, tmp_path: Path, compression: str | list[str]
) -> None:
    layout = oci_layout(tmp_path / "layout", LAYERS, compression)
    import_oci(store, layout, "app:1")
    assert_shows(store, mounts, "app:1", tmp_path, EXPECTED)
    assert_clean(store, tmp_path)


def test_same_layers_give_the_same_digests_whatever_the_packaging(tmp_path: Path) -> None:
    """Layer images are reproducible: another store, format and compression, same EROFS bytes."""
    save = docker_save(tmp_path / "save.tar", [SaveImage(["app:1"], LAYERS)])
    layout = oci_layout(tmp_path / "layout", LAYERS, ["zstd", "gzip", "tar"])
    with LayerStore(tmp_path / "s1") as s1, LayerStore(tmp_path / "s2") as s2:
        a = [i.digest for i in import_oci(s1, save, "app:1")]
        b = [i.digest for i in import_oci(s2, tar_dir(layout, tmp_path / "layout.tar"), "app:1")]
    assert a == b


def test_oci_tarball_gzipped_and_multi_platform(
    store: LayerStore, mounts: LayerMounts, tmp_path: Path
) -> None:
    lay = OciLayout(tmp_path / "layout")
    arm = [layer(F("arch", "arm64"))]
    amd = [layer(F("arch", "amd64"))]
    entries = [
        lay.image(arm, arch="arm64", platform={"os": "linux", "architecture": "arm64", "variant": "v8"}),
        lay.image(amd, platform={"os": "linux", "architecture": "amd64"}),
        # buildkit's provenance attestation: not an image, never chosen
        lay.image(
            [layer(F("attestation", "x"))],
            platform={"os": "unknown", "architecture": "unknown"},
            annotations={"vnd.docker.reference.type": "attestation-manifest"},
        ),
    ]
    top = lay.index(entries, docker=True, **ref_name("multi"))
    layout = lay.finish([top])
    archive = tar_dir(layout, tmp_path / "layout.tar")
    subprocess.run(["gzip", "-k", str(archive)], check=True)
    import_oci(store, Path(f"{archive}.gz"), "multi:amd64")
    assert_shows(store, mounts, "multi:amd64", tmp_path, apply_oci(amd))
    import_oci(store, archive, "multi:arm64", platform="linux/arm64")
    assert_shows(store, mounts, "multi:arm64", tmp_path, apply_oci(arm))
    with pytest.raises(
        InvalidRequest, match=r"no image for platform linux/s390x \(it has: linux/amd64, linux/arm64/v8\)"
    ):
        import_oci(store, archive, "multi:s390x", platform="linux/s390x")
    assert_clean(store, tmp_path)


def test_several_images_need_a_selector(store: LayerStore, mounts: LayerMounts, tmp_path: Path) -> None:
    one, two = [layer(F("which", "one"))], [layer(F("which", "two"))]
    save = docker_save(
        tmp_path / "save.tar",
        [SaveImage(["docker.io/library/alpine:latest"], one), SaveImage(["team/tool:2"], two)],
    )
    with pytest.raises(InvalidRequest, match=r"several images .*alpine.*team/tool:2.*image="):
        import_oci(store, save, "x:1")
    import_oci(store, save, "x:1", image="alpine")  # docker's short name
    assert_shows(store, mounts, "x:1", tmp_path, apply_oci(one))
    import_oci(store, save, "x:2", image="team/tool:2")
    assert_shows(store, mounts, "x:2", tmp_path, apply_oci(two))
    with pytest.raises(InvalidRequest, match="no image 'nope:1'"):
        import_oci(store, save, "x:3", image="nope:1")

    lay = OciLayout(tmp_path / "layout")
    layout = lay.finish([lay.image(one, **ref_name("one")), lay.image(two, **ref_name("two"))])
    with pytest.raises(InvalidRequest, match="several images"):
        import_oci(store, layout, "y:1")
    import_oci(store, layout, "y:2", image="two")
    assert_shows(store, mounts, "y:2", tmp_path, apply_oci(two))
    assert not store.has_tag("x:3")


def test_reimport_is_idempotent_and_reuses_layers(store: LayerStore, tmp_path: Path) -> None:
    archive = docker_save(tmp_path / "save.tar", [SaveImage(["app:1"], LAYERS)])
    first = import_oci(store, archive, "app:1")
    blobs = sorted(store.blob_dir.iterdir())
    stages: list[str] = []
    again = import_oci(store, archive, "app:1", progress=lambda s, d, t: stages.append(s))
    assert again == first and sorted(store.blob_dir.iterdir()) == blobs
    assert [s for s in stages if s.endswith("cached")] == [
        "layer 1/3 cached",
        "layer 2/3 cached",
        "layer 3/3 cached",
    ]
    # another image sharing the base layer builds only what is new
    other = docker_save(tmp_path / "other.tar", [SaveImage(["o:1"], [BASE, layer(F("x", "x"))])])
    stages.clear()
    infos = import_oci(store, other, "other:1", progress=lambda s, d, t: stages.append(s))
    assert infos[0].digest == first[0].digest
    assert "layer 1/2 cached" in stages and "layer 2/2 mkfs" in stages
    with pytest.raises(InvalidRequest, match="immutable"):
        import_oci(store, other, "app:1")
    store.import_path(tmp_path / "save.tar", "plain:1")
    with pytest.raises(InvalidRequest, match="already names a layer"):
        import_oci(store, archive, "plain:1")


def test_a_repeated_layer_is_kept_once_where_it_matters(
    store: LayerStore, mounts: LayerMounts, tmp_path: Path
) -> None:
    """Overlayfs refuses one lower directory twice; the upper copy shadows the lower one."""
    empty = layer()
    again = layer(D("etc"), F("etc/passwd", "again"), F("etc/deleted", "back"))
    layers = [BASE, empty, again, MIDDLE, empty, again]
    archive = docker_save(tmp_path / "save.tar", [SaveImage(["app:1"], layers)])
    infos = import_oci(store, archive, "app:1")
    assert len(infos) == 4 and len({i.digest for i in infos}) == 4
    assert_shows(store, mounts, "app:1", tmp_path, apply_oci(layers))


def test_progress_reports_every_layer_stage(store: LayerStore, tmp_path: Path) -> None:
    layout = oci_layout(tmp_path / "layout", LAYERS, ["gzip", "tar", "zstd"])
    calls: list[tuple[str, int, int]] = []
    import_oci(store, layout, "app:1", progress=lambda s, d, t: calls.append((s, d, t)))
    stages = [c[0] for c in calls]
    for i in (1, 2, 3):
        for step in ("verify", "extract", "mkfs"):
            assert f"layer {i}/3 {step}" in stages
    assert "layer 1/3 decompress" in stages and "layer 2/3 decompress" not in stages
    assert stages.index("layer 3/3 verify") < stages.index("layer 1/3 extract")  # all verified first
    assert calls[-1] == ("tag", 3, 3)
    assert all(0 <= d <= t == 3 for s, d, t in calls)


# ---- corruption and hostile archives -------------------------------------------------------


def assert_nothing_imported(store: LayerStore, tmp_path: Path, ref: str = "app:1") -> None:
    assert store.list() == []
    with pytest.raises(LayerNotFound):
        store.resolve_image(ref)
    assert_clean(store, tmp_path)


@pytest.mark.parametrize("compression", ["gzip", "tar", "zstd"])
def test_corrupted_oci_layer_is_refused(store: LayerStore, tmp_path: Path, compression: str) -> None:
    layout = oci_layout(tmp_path / "layout", LAYERS, compression)
    manifest = json.loads(
        (
            layout
            / "blobs/sha256"
            / json.loads((layout / "index.json").read_text())["manifests"][0]["digest"][7:]
        ).read_bytes()
    )
    blob = layout / "blobs/sha256" / manifest["layers"][2]["digest"][7:]
    flip_byte(blob, blob.stat().st_size // 2)
    with pytest.raises(InvalidRequest) as exc:
        import_oci(store, layout, "app:1")
    assert "layer 3/3" in exc.value.message and "corrupted" in exc.value.message
    assert "digest mismatch" in exc.value.message
    assert_nothing_imported(store, tmp_path)  # layers 1 and 2 were fine, and still not imported


def test_truncated_blob_is_refused(store: LayerStore, tmp_path: Path) -> None:
    layout = oci_layout(tmp_path / "layout", LAYERS, "gzip")
    blob = max((layout / "blobs/sha256").iterdir(), key=lambda p: p.stat().st_size)
    blob.write_bytes(blob.read_bytes()[:-10])
    with pytest.raises(InvalidRequest, match="corrupted: size mismatch"):
        import_oci(store, layout, "app:1")
    assert_nothing_imported(store, tmp_path)


def test_corrupted_docker_save_layer_is_refused(store: LayerStore, tmp_path: Path) -> None:
    archive = docker_save(tmp_path / "save.tar", [SaveImage(["app:1"], LAYERS)])
    with tarfile.open(archive) as tf:
        member = next(m for m in tf if m.name.endswith("layer.tar") and m.size == len(MIDDLE))
    flip_byte(archive, member.offset_data + 700)  # inside the first file's data
    with pytest.raises(InvalidRequest, match=r"layer 2/3 .* is corrupted: digest mismatch"):
        import_oci(store, archive, "app:1")
    assert_nothing_imported(store, tmp_path)


def test_layer_content_must_match_the_config_diff_id(store: LayerStore, tmp_path: Path) -> None:
    """A blob that matches its manifest digest but not the config's diff_id is refused too."""
    lay = OciLayout(tmp_path / "layout")
    lying_config = config_json([BASE, layer(F("something", "else"))])
    layout = lay.finish([lay.image([BASE, TOP], "gzip", config=lying_config)])
    with pytest.raises(InvalidRequest, match=r"layer 2/2 .* corrupted: content \(diff_id\) digest mismatch"):
        import_oci(store, layout, "app:1")
    assert not store.has_tag("app:1") and not list(store.tmp_dir.iterdir())


def test_corrupted_config_and_manifest_are_refused(store: LayerStore, tmp_path: Path) -> None:
    layout = oci_layout(tmp_path / "layout", [BASE], "gzip")
    index = json.loads((layout / "index.json").read_text())
    index["manifests"][0]["size"] += 1
    (layout / "index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidRequest, match=r"manifest sha256:.* corrupted: digest mismatch"):
        import_oci(store, layout, "app:1")

    archive = docker_save(tmp_path / "save.tar", [SaveImage(["app:1"], [BASE])])
    with tarfile.open(archive) as tf:
        member = next(m for m in tf if m.name.endswith(".json") and m.name != "manifest.json")
    flip_byte(archive, member.offset_data + 5)
    with pytest.raises(InvalidRequest, match=r"config .* corrupted: digest mismatch"):
        import_oci(store, archive, "app:1")
    assert_nothing_imported(store, tmp_path)


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ([F("../escape", "x")], "'..' component"),
        ([F("/abs-escape", "x")], "absolute path"),
        ([S("link", str(Path("/tmp"))), F("link/escape", "x")], "symlink"),
        ([S("up", ".."), F("up/escape", "x")], "symlink"),
        ([S("l", "/etc"), H("hl", "l/passwd")], "symlink"),
    ],
)
def test_layer_member_escaping_is_refused(
    store: LayerStore, tmp_path: Path, members: list[E], why: str
) -> None:
    archive = docker_save(tmp_path / "save.tar", [SaveImage(["app:1"], [BASE, layer(*members)])])
    with pytest.raises(InvalidRequest) as exc:
        import_oci(store, archive, "app:1")
    assert why in exc.value.message and "layer 2/2" in exc.value.message
    assert not Path("/tmp/escape").exists() and not Path("/abs-escape").exists()
    assert not (store.tmp_dir.parent / "escape").exists()
    assert not store.has_tag("app:1") and not list(store.tmp_dir.iterdir())


def _rewrite_manifest(archive: Path, out: Path, change: dict[str, object]) -> Path:
    with tarfile.open(archive) as src, tarfile.open(out, "w") as dst:
        for m in src:
            data = src.extractfile(m).read() if m.isreg() else None  # type: ignore[union-attr]
            if m.name == "manifest.json":
                doc = json.loads(data or b"")
                doc[0].update(change)
                data = json.dumps(doc).encode()
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    return out


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize(
    ("change", "extra", "match"),
    [
        ({"Layers": ["../../../etc/passwd"]}, [], r"'\.\.'"),
        ({"Layers": ["/etc/passwd"]}, [], "absolute path"),
        (
            {"Layers": ["evil/layer.tar"]},
            [_link("evil/layer.tar", "../../../etc/passwd")],
            "outside the archive",
        ),
        ({"Layers": ["evil/layer.tar"]}, [_link("evil/layer.tar", "/etc/passwd")], "leaves the archive"),
        ({"Layers": ["loop"]}, [_link("loop", "loop")], "too many levels"),
        ({"Layers": ["missing.tar"]}, [], "missing from the archive"),
        ({"Layers": ["adir"]}, [_link("adir", "", tarfile.DIRTYPE)], "not a regular file"),
        ({"Layers": "not-a-list"}, [], "is not a JSON list"),
        ({"Layers": [7]}, [], "is not a string"),
        ({"Layers": []}, [], "lists 0 layers but its config 1 diff_ids"),
        ({"Config": "nothere.json"}, [], "missing from the archive"),
        ({}, [_link("x/../../evil", "y")], r"'\.\.'"),
    ],
)
def test_hostile_docker_archive_is_refused(
    store: LayerStore, tmp_path: Path, change: dict[str, object], extra: list[tarfile.TarInfo], match: str
) -> None:
    base = docker_save(tmp_path / "base.tar", [SaveImage(["app:1"], [BASE])], extra=extra)
    archive = _rewrite_manifest(base, tmp_path / "evil.tar", change)
    with pytest.raises(InvalidRequest, match=match):
        import_oci(store, archive, "app:1")
    assert_nothing_imported(store, tmp_path)


def test_outer_member_escaping_is_refused_although_never_written(store: LayerStore, tmp_path: Path) -> None:
    evil = tarfile.TarInfo("../outside")
    evil.size = 1
    archive = docker_save(tmp_path / "save.tar", [SaveImage(["app:1"], [BASE])], extra=[evil])
    with pytest.raises(InvalidRequest, match=r"'\.\.'"):
        import_oci(store, archive, "app:1")
    assert not (tmp_path / "outside").exists() and not (store.tmp_dir.parent / "outside").exists()
    assert_nothing_imported(store, tmp_path)


@pytest.mark.parametrize(
    ("what", "mutate", "match"),
    [
        ("index.json", lambda d: d.update(manifests={"a": 1}), "is not a JSON list"),
        ("index.json", lambda d: d["manifests"][0].update(digest="sha256:../../x"), "not a sha256 digest"),
        (
            "index.json",
            lambda d: d["manifests"][0].update(digest="sha512:" + "0" * 128),
            "not a sha256 digest",
        ),
        ("index.json", lambda d: d["manifests"][0].update(size=-1), "non-negative"),
        ("index.json", lambda d: d["manifests"][0].update(size=True), "non-negative"),
        ("index.json", lambda d: d.update(manifests=[]), "lists no image"),
        ("oci-layout", lambda d: d.update(imageLayoutVersion="2.0.0"), "imageLayoutVersion"),
        ("oci-layout", lambda d: d.update(imageLayoutVersion=1), "is not a string"),
    ],
)
def test_hostile_oci_layout_is_refused(
    store: LayerStore, tmp_path: Path, what: str, mutate: object, match: str
) -> None:
    layout = oci_layout(tmp_path / "layout", [BASE])
    doc = json.loads((layout / what).read_text())
    mutate(doc)  # type: ignore[operator]
    (layout / what).write_text(json.dumps(doc))
    with pytest.raises(InvalidRequest, match=match):
        import_oci(store, layout, "app:1")
    assert_nothing_imported(store, tmp_path)


def test_blob_symlinked_out_of_a_layout_directory_is_refused(store: LayerStore, tmp_path: Path) -> None:
    layout = oci_layout(tmp_path / "layout", [BASE], "tar")
    blob = max((layout / "blobs/sha256").iterdir(), key=lambda p: p.stat().st_size)
    outside = tmp_path / "outside-blob"
    blob.rename(outside)
    blob.symlink_to(outside)
    with pytest.raises(InvalidRequest, match="leads outside the image directory"):
        import_oci(store, layout, "app:1")
    assert_nothing_imported(store, tmp_path)


def test_oversized_and_malformed_json(store: LayerStore, tmp_path: Path) -> None:
    layout = oci_layout(tmp_path / "layout", [BASE])
    (layout / "index.json").write_bytes(b" " * (9 << 20))
    with pytest.raises(InvalidRequest, match="more than the"):
        import_oci(store, layout, "app:1")
    (layout / "index.json").write_bytes(b"{not json")
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        import_oci(store, layout, "app:1")
    (tmp_path / "junk").write_bytes(os.urandom(10_000))
    with pytest.raises(InvalidRequest, match="tar archive"):
        import_oci(store, tmp_path / "junk", "app:1")
    (tmp_path / "empty.tar").write_bytes(b"\0" * 10240)
    with pytest.raises(InvalidRequest, match="not an image archive"):
        import_oci(store, tmp_path / "empty.tar", "app:1")
    with pytest.raises(InvalidRequest, match="no such file"):
        import_oci(store, tmp_path / "missing", "app:1")
    with pytest.raises(InvalidRequest, match="invalid layer tag"):
        import_oci(store, layout, "no-version")
    assert_nothing_imported(store, tmp_path)


def test_unsupported_layer_media_type(store: LayerStore, tmp_path: Path) -> None:
    layout = oci_layout(tmp_path / "layout", [BASE], "gzip")
    index = json.loads((layout / "index.json").read_text())
    mpath = layout / "blobs/sha256" / index["manifests"][0]["digest"][7:]
    manifest = json.loads(mpath.read_bytes())
    manifest["layers"][0]["mediaType"] = "application/vnd.oci.image.layer.v1.tar+encrypted"
    data = json.dumps(manifest).encode()
    (layout / "blobs/sha256" / sha256(data)[7:]).write_bytes(data)
    index["manifests"][0].update(digest=sha256(data), size=len(data))
    (layout / "index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidRequest, match="unsupported media type"):
        import_oci(store, layout, "app:1")


# ---- whiteouts -------------------------------------------------------------------------------


def test_overlay_metadata_smuggled_into_a_layer_is_dropped(
    store: LayerStore, mounts: LayerMounts, tmp_path: Path
) -> None:
    evil = layer(
        D("d", xattrs={"trusted.overlay.redirect": b"/etc", "user.ok": b"1"}),
        F("d/f", "x", xattrs={"trusted.overlay.metacopy": b""}),
        D("o", xattrs={"trusted.overlay.opaque": b"y"}),
    )
    archive = docker_save(tmp_path / "save.tar", [SaveImage(["app:1"], [BASE, evil])])
    infos = import_oci(store, archive, "app:1")
    mnt = mounts.acquire(infos[1].digest, store.blob_path(infos[1].digest))
    for p in ("d", "d/f", "o"):
        assert not [
            k for k in os.listxattr(mnt / p, follow_symlinks=False) if k.startswith("trusted.overlay.")
        ]
    assert os.getxattr(mnt / "d", "user.ok") == b"1"


def test_whiteout_and_entry_in_one_layer(store: LayerStore, mounts: LayerMounts, tmp_path: Path) -> None:
    """The whiteout hides the lower entry; the layer's own entry of that name stays."""
    upper = layer(WH("opq"), D("opq"), F("opq/mine", "m"), WH("etc/passwd"), D("etc"), F("etc/passwd", "new"))
    archive = docker_save(tmp_path / "save.tar", [SaveImage(["app:1"], [BASE, upper])])
    import_oci(store, archive, "app:1")
    expected = apply_oci([BASE, upper])
    assert sorted(k for k in expected if k.startswith("opq/")) == ["opq/mine"]
    assert_shows(store, mounts, "app:1", tmp_path, expected)


def test_empty_whiteout_name_is_refused(store: LayerStore, tmp_path: Path) -> None:
    archive = docker_save(tmp_path / "save.tar", [SaveImage(["app:1"], [BASE, layer(F("etc/.wh.", ""))])])
    with pytest.raises(InvalidRequest, match="invalid whiteout"):
        import_oci(store, archive, "app:1")
    assert not store.has_tag("app:1")


def test_whiteout_conversion_both_ways(tmp_path: Path) -> None:
    root = tmp_path / "layer"
    (root / "d/sub").mkdir(parents=True)
    (root / "d/.wh.gone").write_text("")
    (root / "d/sub/.wh..wh..opq").write_text("")
    (root / "d/sub/.wh.inside").write_text("")  # inside an opaque directory: dropped
    (root / ".wh..wh..plnk").mkdir()  # aufs bookkeeping
    (root / "keep").write_text("k")
    for p in (root / "d", root / "d/sub", root):
        os.utime(p, ns=(0, 1_234_000_000_000))
    assert oci_to_overlay(root) == 3
    assert is_whiteout(os.lstat(root / "d/gone")) and is_opaque(root / "d/sub")
    assert sorted(os.listdir(root)) == ["d", "keep"] and os.listdir(root / "d/sub") == []
    assert {os.lstat(p).st_mtime_ns for p in (root, root / "d", root / "d/sub")} == {1_234_000_000_000}
    assert overlay_to_oci(root) == 2
    assert sorted(os.listdir(root / "d")) == [".wh.gone", "sub"]
    assert os.listdir(root / "d/sub") == [".wh..wh..opq"]
    assert OPAQUE_XATTR not in os.listxattr(root / "d/sub")
    assert os.lstat(root / "d").st_mtime_ns == 1_234_000_000_000


# ---- archives made by real tools: umoci and skopeo, offline ------------------------------------


# setup.sh installs both; without them these fail rather than skip.
def _umoci_image(tmp_path: Path) -> Path:
    """Three layers made by umoci from real directories: a file, its deletion, a new dir."""
    layout = tmp_path / "umoci"
    bundle = tmp_path / "bundle"

    def run(*args: str) -> None:
        subprocess.run(["umoci", *args], check=True, capture_output=True)

    run("init", "--layout", str(layout))
    run("new", "--image", f"{layout}:t")
    for step in range(3):
        run("unpack", "--image", f"{layout}:t", str(bundle))
        rootfs = bundle / "rootfs"
        if step == 0:
            (rootfs / "etc").mkdir()
            (rootfs / "etc/conf").write_text("v1")
            (rootfs / "etc/old").write_text("old")
            (rootfs / "data").mkdir()
            (rootfs / "data/a").write_text("a")
            os.setxattr(rootfs / "etc/conf", "user.tag", b"umoci")
            os.symlink("conf", rootfs / "etc/link")
        elif step == 1:
            (rootfs / "etc/old").unlink()
            shutil.rmtree(rootfs / "data")
        else:
            (rootfs / "data").mkdir()
            (rootfs / "data/b").write_text("b")
            (rootfs / "etc/conf").write_text("v2")
        run("repack", "--image", f"{layout}:t", str(bundle))
        shutil.rmtree(bundle)
    return layout


@pytest.fixture
def umoci_layout(tmp_path: Path) -> Iterator[Path]:
    yield _umoci_image(tmp_path)


def test_umoci_and_skopeo_archives(
    store: LayerStore, mounts: LayerMounts, tmp_path: Path, umoci_layout: Path
) -> None:
    import_oci(store, umoci_layout, "u:dir", image="t")
    tree = image_tree(store, mounts, digests_of(store, "u:dir"), tmp_path)
    assert {k for k in tree if not k.startswith(".")} >= {"etc", "etc/conf", "etc/link", "data", "data/b"}
    assert "etc/old" not in tree and "data/a" not in tree
    assert tree["etc/conf"][5] == b"v2" and ("user.tag", b"umoci") in tree["etc/conf"][6]

    skopeo = ["skopeo", "--insecure-policy", "copy", "--quiet"]
    subprocess.run([*skopeo, f"oci:{umoci_layout}:t", f"docker-archive:{tmp_path / 'd.tar'}:u:t"], check=True)
    subprocess.run([*skopeo, f"oci:{umoci_layout}:t", f"oci-archive:{tmp_path / 'o.tar'}:t"], check=True)
    subprocess.run(
        [*skopeo, "--dest-compress-format", "zstd", f"oci:{umoci_layout}:t", f"oci:{tmp_path / 'z'}:t"],
        check=True,
    )
    for source, ref in [("d.tar", "u:docker"), ("o.tar", "u:ociarchive"), ("z", "u:zstd")]:
        import_oci(store, tmp_path / source, ref)
        assert image_tree(store, mounts, digests_of(store, ref), tmp_path) == tree, source
    # the same layers, however packaged, are the same EROFS images
    assert digests_of(store, "u:docker") == digests_of(store, "u:dir") == digests_of(store, "u:zstd")
    assert_clean(store, tmp_path)


def test_erofs_layer_keeps_overlay_whiteouts(store: LayerStore, tmp_path: Path, umoci_layout: Path) -> None:
    infos = import_oci(store, umoci_layout, "u:1")
    mnt = tmp_path / "m"
    mnt.mkdir()
    mount_erofs(store.blob_path(infos[1].digest), mnt)
    try:
        assert is_whiteout(os.lstat(mnt / "etc/old")) and is_whiteout(os.lstat(mnt / "data"))
    finally:
        umount(mnt)
