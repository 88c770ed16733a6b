"""Layers, OCI images and VM images: the part of :class:`DSecClient` that manages what
sandboxes boot from (import, list, tag, verify, collect). Building a layer from a Dockerfile
drives sandboxes, so it stays on the client (``DSecClient.build_layer``)."""

from __future__ import annotations

import asyncio
import builtins
import json
import os
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.images.vm_images import VmImageInfo
from dsec.protocol.errors import InfraFailure, InfraReason, error_from_wire
from dsec.protocol.models import GcRequest, LayerInfo, RetagRequest
from dsec.sdk._transport import file_chunks

if TYPE_CHECKING:
    from dsec.sdk._transport import Transport


def _tar_dir(src: Path, archive: Path) -> None:
    with tarfile.open(archive, "w") as tar:
        tar.add(src, arcname=".")


class LayerCalls:
    if TYPE_CHECKING:

        @property
        def _t(self) -> Transport: ...

    async def layers(self) -> builtins.list[LayerInfo]:
        return [LayerInfo.model_validate(x) for x in await self._t.request("GET", "/v1/layers")]

    async def import_image(
        self,
        path: str | os.PathLike[str],
        ref: str,
        *,
        merge_below_mb: float = 0,
        image: str | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> builtins.list[LayerInfo]:
        """Import an OCI image as ``ref``: ``docker save`` output, or an OCI layout (directory
        or tarball, as skopeo writes them). Each image layer becomes an EROFS layer (layers
        shared with earlier imports are stored once); ``ref`` names their ordered list, usable
        as ``container_image``. Consecutive layers under ``merge_below_mb`` are merged.
        ``progress(stage, done, total)`` follows the server's work.
        """
        src = Path(path)
        params = {"ref": ref, "merge_below_mb": str(merge_below_mb)}
        if image:
            params["image"] = image
        with tempfile.TemporaryDirectory() as tmp:
            archive = src
            if await asyncio.to_thread(src.is_dir):
                archive = Path(tmp) / "image.tar"
                await asyncio.to_thread(_tar_dir, src, archive)
            async for line in self._t.lines(
                "POST", "/v1/images", params=params, data=file_chunks(archive), timeout=6 * 3600
            ):
                event = json.loads(line)
                if event["t"] == "progress" and progress is not None:
                    progress(event["stage"], event["done"], event["total"])
                elif event["t"] == "error":
                    raise error_from_wire(200, event)
                elif event["t"] == "done":
                    return [LayerInfo.model_validate(x) for x in event["layers"]]
        raise InfraFailure(f"image import of {ref} ended without a result", reason=InfraReason.protocol)

    async def retag(self, ref: str, target: str | builtins.list[str]) -> builtins.list[LayerInfo]:
        """Point ``ref`` at other content (a layer, or an ordered list for an image).

        Versions are immutable everywhere else: this explicit call is the only way a tag moves.
        """
        body = await self._t.request(
            "POST", "/v1/layers/retag", json_body=RetagRequest(ref=ref, target=target).model_dump()
        )
        return [LayerInfo.model_validate(x) for x in body]

    async def untag(self, ref: str) -> builtins.list[str]:
        """Remove tag ``ref``; its blobs go at the next :meth:`gc_layers` if nothing else names them."""
        body = await self._t.request("DELETE", "/v1/layers", params={"ref": ref})
        return [str(d) for d in body["untagged"]]

    async def mark_public(self, ref: str) -> builtins.list[LayerInfo]:
        """Let every project use layer or image ``ref`` (admin keys only; base layers are public).

        Otherwise a layer is seen only by the project that imported or committed it and by the
        projects above that one."""
        body = await self._t.request("POST", "/v1/layers/public", params={"ref": ref})
        return [LayerInfo.model_validate(x) for x in body]

    async def verify_layer(self, ref: str) -> LayerInfo:
        """Re-hash a layer's stored bytes; ``InfraFailure(reason="corrupt")`` if they changed."""
        body = await self._t.request("POST", "/v1/layers/verify", params={"ref": ref}, timeout=3600)
        return LayerInfo.model_validate(body)

    async def gc_layers(self, *, grace_s: float | None = None) -> builtins.list[str]:
        """Delete stored layers that no tag names and no sandbox uses; returns their digests."""
        body = await self._t.request(
            "POST", "/v1/layers/gc", json_body=GcRequest(grace_s=grace_s).model_dump(), timeout=3600
        )
        return [str(d) for d in body["removed"]]

    async def import_vm_image(self, path: str | os.PathLike[str], ref: str) -> VmImageInfo:
        """Import a bootable disk image (qcow2 or raw) as VM image ``ref`` (``name:version``),
        for ``DSecVMRunArgs(disk_image=ref)``."""
        body: Any = await self._t.request(
            "POST", "/v1/vm-images", params={"ref": ref}, data=file_chunks(Path(path)), timeout=3600
        )
        return VmImageInfo.model_validate(body)

    async def vm_images(self) -> builtins.list[VmImageInfo]:
        body: Any = await self._t.request("GET", "/v1/vm-images")
        return [VmImageInfo.model_validate(x) for x in body]

    async def import_layer(self, path: str | os.PathLike[str], ref: str) -> LayerInfo:
        """Import a directory or tar archive as layer ``ref`` (``name:version``)."""
        src = Path(path)
        with tempfile.TemporaryDirectory() as tmp:
            archive = src
            if await asyncio.to_thread(src.is_dir):
                archive = Path(tmp) / "layer.tar"
                await asyncio.to_thread(_tar_dir, src, archive)
            body: Any = await self._t.request(
                "POST", "/v1/layers", params={"ref": ref}, data=file_chunks(archive), timeout=3600
            )
        return LayerInfo.model_validate(body)
