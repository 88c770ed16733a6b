"""Layers as the apiserver hands them out: who may see which, and how large an import may be.

A layer belongs to the project that imported or committed it; a key sees what its project's
subtree owns plus the public layers (:mod:`dsec.images.owners` has the rules). Every route
that names a layer on behalf of a key passes the key's :func:`layer_viewer` to the store; a
create checks the layers of its spec with :func:`admit_layers` before any node works, and pins
digest prefixes to the full digests it checked, so the edge mounts exactly what was admitted.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from dsec.iam import Principal, can_access
from dsec.images.owners import Viewer
from dsec.images.refs import parse_tag
from dsec.images.store import LayerStore
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import ContainerSpec

_MIB = 1 << 20
_MAX_UPLOAD = 1 << 40  # 1 TiB: past any image; the body is spooled to the store's disk
_MAX_EXPAND = 4 << 40
_MAX_RATIO = 10_000


@dataclass(frozen=True)
class LayerLimits:
    """Caps on what one import may cost the store (``TooLarge``, 413, past any of them).

    The expansion cap is ``min(max_expand_bytes, max(expand_floor_bytes, expand_ratio *
    upload size))``: a real image compresses 2-10x, a zero-filled bomb 1000x (a 254 KiB gzip
    expanded to 256 MiB), so a ratio bound stops bombs early whatever the absolute cap.
    """

    max_upload_bytes: int = 16 << 30
    max_expand_bytes: int = 64 << 30
    expand_ratio: int = 100
    expand_floor_bytes: int = 64 * _MIB

    def __post_init__(self) -> None:
        checks = (
            ("upload", self.max_upload_bytes, _MIB, _MAX_UPLOAD),
            ("expand", self.max_expand_bytes, _MIB, _MAX_EXPAND),
            ("ratio", self.expand_ratio, 1, _MAX_RATIO),
            ("floor", self.expand_floor_bytes, 0, self.max_expand_bytes),
        )
        for name, value, low, high in checks:
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidRequest(f"layer limit {name}: {value!r} is not an integer from {low} to {high}")

    @classmethod
    def parse(cls, text: str) -> LayerLimits:
        """``upload=MiB,expand=MiB,ratio=N,floor=MiB`` (any subset; the rest keep defaults)."""
        keys = {"upload": "max_upload_bytes", "expand": "max_expand_bytes", "floor": "expand_floor_bytes"}
        values: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, _, value = item.partition("=")
            if key not in (*keys, "ratio") or not value.isdigit() or len(value) > 12:
                why = f"{item!r} is not upload=MiB, expand=MiB, ratio=N or floor=MiB"
                raise InvalidRequest(f"layer limits: {why}")
            if key == "ratio":
                values["expand_ratio"] = int(value)
            else:
                values[keys[key]] = int(value) * _MIB
        return cls(**values)

    def expand_cap(self, upload_bytes: int) -> int:
        return min(self.max_expand_bytes, max(self.expand_floor_bytes, self.expand_ratio * upload_bytes))


def layer_viewer(principal: Principal) -> Viewer:
    """What a key may see: its project's subtree (as for sandboxes)."""
    return lambda owner: can_access(principal, owner)


def _is_tag(ref: str) -> bool:
    return ":" in ref and not ref.startswith("sha256:")


def visible_tag(store: LayerStore, ref: str, viewer: Viewer | None) -> list[str] | None:
    """The digests of ``ref`` when it is a tag ``viewer`` sees and whose blobs are all stored;
    None otherwise, and the caller asks :meth:`LayerStore.resolve_image` (in a thread) for
    the answer or the error.

    Meant for the event loop: one small record read and a stat per layer. Sending that to a
    thread cost more than doing it, about 1 ms of CPU per create on 2 cores under load, and
    ``resolve_image`` also reads every tag that names each layer (docs/decisions.md)."""
    if not _is_tag(ref):
        return None
    name, version = parse_tag(ref)  # a malformed tag: InvalidRequest, as resolve_image says
    rec = store.catalogue.get(name, version)
    if rec is None or not store.sees_tag(rec, viewer):
        return None
    if any(store.blobs.stat(d) is None for d in rec.digests):
        return None  # resolve_image names the missing blob
    return list(rec.digests)


async def resolve_digests(store: LayerStore, ref: str, viewer: Viewer | None) -> list[str]:
    """The digests ``ref`` stands for (base first), among what ``viewer`` may see."""
    digests = visible_tag(store, ref, viewer)
    if digests is None:
        layers = await asyncio.to_thread(store.resolve_image, ref, viewer=viewer)
        digests = [layer.digest for layer in layers]
    return digests


async def admit_layers(store: LayerStore, principal: Principal, spec: ContainerSpec) -> ContainerSpec:
    """``spec`` if the key may use all its layers (LayerNotFound: one it may not see, as if it
    did not exist), with digests and digest prefixes replaced by the full digests checked."""
    viewer = layer_viewer(principal)

    async def pin(ref: str) -> str:
        digests = await resolve_digests(store, ref, viewer)
        return ref if _is_tag(ref) else digests[0]

    if spec.image is not None:
        return spec.model_copy(update={"image": await pin(spec.image)})
    if spec.layers:
        pinned = [await pin(ref) for ref in spec.layers]
        return spec.model_copy(update={"layers": pinned})
    return spec
