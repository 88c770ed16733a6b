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

from dsec.images.oci.archive import MAX_JSON_BYTES, MAX_SYMLINK_HOPS
from dsec.images.oci.importer import (
    DEFAULT_PLATFORM,
    LAYER_NAME,
    Progress,
    drop_shadowed_duplicates,
    import_oci,
)
from dsec.images.oci.manifest import (
    LAYER_TYPES,
    MAX_INDEX_DEPTH,
    MAX_LAYERS,
    MT_DOCKER_CONFIG,
    MT_DOCKER_LIST,
    MT_DOCKER_MANIFEST,
    MT_OCI_CONFIG,
    MT_OCI_INDEX,
    MT_OCI_MANIFEST,
    Platform,
)

__all__ = [
    "DEFAULT_PLATFORM",
    "LAYER_NAME",
    "LAYER_TYPES",
    "MAX_INDEX_DEPTH",
    "MAX_JSON_BYTES",
    "MAX_LAYERS",
    "MAX_SYMLINK_HOPS",
    "MT_DOCKER_CONFIG",
    "MT_DOCKER_LIST",
    "MT_DOCKER_MANIFEST",
    "MT_OCI_CONFIG",
    "MT_OCI_INDEX",
    "MT_OCI_MANIFEST",
    "Platform",
    "Progress",
    "drop_shadowed_duplicates",
    "import_oci",
]
