"""An OCI image is imported whole or not at all: a layer refused part-way (too large, past the
importer's storage quota, or the name taken at the end) takes back the layers the same import
stored before it, and leaves alone the layers it found cached or that others name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.iam.base import in_subtree
from dsec.images.catalogue import OWNERS
from dsec.images.oci import import_oci
from dsec.images.owners import Viewer
from dsec.images.store import LayerStore
from dsec.protocol.errors import InvalidRequest, QuotaExceeded, TooLarge

from .ocikit import F, layer, oci_layout, tar_dir

KIB = 1 << 10


def sees(project: str) -> Viewer:
    return lambda owner: in_subtree(owner, project)


def _state(store: LayerStore) -> tuple[list[str], list[str], list[str], list[Path]]:
    """Everything an import could leave behind: blobs, tags, owner records, scratch files."""
    return (
        store.blobs.list_digests(),
        sorted(t.ref for t in store.tags()),
        sorted(store.blobs.list_records(OWNERS)),
        sorted(store.tmp_dir.iterdir()),
    )


def _image(tmp_path: Path, name: str, *layers: bytes) -> Path:
    return tar_dir(oci_layout(tmp_path / name, list(layers), "gzip"), tmp_path / f"{name}.tar")


def _small(name: str) -> bytes:
    return layer(F(f"opt/{name}", os.urandom(4 * KIB)))


def test_a_layer_too_large_takes_back_the_layers_before_it(store: LayerStore, tmp_path: Path) -> None:
    big = layer(F("opt/big", os.urandom(512 * KIB)))
    archive = _image(tmp_path, "img", _small("one"), _small("two"), big)
    before = _state(store)
    with pytest.raises(TooLarge, match="layer"):
        import_oci(store, archive, "img:1", owner="root/p", viewer=sees("root/p"), max_bytes=256 * KIB)
    assert _state(store) == before
    # The same image within the cap imports whole.
    layers = import_oci(store, archive, "img:1", owner="root/p", viewer=sees("root/p"))
    assert len(layers) == 3 and store.has_image("img:1")


def test_a_layer_past_the_storage_quota_takes_back_the_charge_for_the_earlier_ones(
    store: LayerStore, tmp_path: Path
) -> None:
    store.set_storage_quota("root/q", 1)
    first = layer(F("opt/a", os.urandom(400 * KIB)))
    second = layer(F("opt/b", os.urandom(400 * KIB)))
    third = layer(F("opt/c", os.urandom(400 * KIB)))
    archive = _image(tmp_path, "img", first, second, third)
    before = _state(store)
    with pytest.raises(QuotaExceeded, match="'root/q'"):
        import_oci(store, archive, "img:1", owner="root/q", viewer=sees("root/q"))
    assert _state(store) == before
    assert store.storage_usage(["root/q"])["root/q"] == 0


def test_cached_layers_and_layers_others_name_stay(store: LayerStore, tmp_path: Path) -> None:
    shared = _small("shared")
    (cached,) = import_oci(store, _image(tmp_path, "base", shared), "base:1", owner="root/a")
    base_state = _state(store)
    big = layer(F("opt/big", os.urandom(512 * KIB)))
    archive = _image(tmp_path, "img", shared, _small("fresh"), big)
    with pytest.raises(TooLarge):
        import_oci(store, archive, "img:1", owner="root/b", viewer=sees("root/b"), max_bytes=256 * KIB)
    # The cached layer is still the cache's and root/a's; root/b did not become its owner.
    assert _state(store) == base_state
    assert "root/b" not in store.catalogue.owners(cached.digest)
    assert [layer.digest for layer in store.resolve_image("base:1")] == [cached.digest]


def test_a_name_taken_at_the_end_takes_back_every_layer(store: LayerStore, tmp_path: Path) -> None:
    archive = _image(tmp_path, "img", _small("one"), _small("two"))
    before = _state(store)

    def take_the_name(stage: str, done: int, total: int) -> None:
        if stage == "tag":  # someone else names the image while this import made its layers
            store.import_path(_tree(tmp_path / "other"), "img:1", owner="root/other")

    with pytest.raises(InvalidRequest):
        import_oci(store, archive, "img:1", owner="root/p", progress=take_the_name)
    blobs, tags, _owners, tmp = _state(store)
    assert tags == sorted([*before[1], "img:1"]) and tmp == before[3]
    assert len(blobs) == len(before[0]) + 1  # only the other importer's layer


def _tree(root: Path) -> Path:
    (root / "opt").mkdir(parents=True)
    (root / "opt/other").write_bytes(os.urandom(4 * KIB))
    return root
