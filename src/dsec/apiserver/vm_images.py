"""HTTP routes of the VM image store (:mod:`dsec.images.vm_images`): import and list."""

from __future__ import annotations

import asyncio

from aiohttp import web

from dsec.apiserver._http import body_to_file, query_param, require_admin, respond
from dsec.images.store import LayerStore
from dsec.images.vm_images import VmImageStore
from dsec.observe.audit import audited

_CHUNK = 1 << 20


def vm_image_store(store: LayerStore) -> VmImageStore:
    """The VM images live beside the layers (a shared layer store shares them too)."""
    return VmImageStore(store.root / "vm-images")


class VmImageRoutes:
    def __init__(self, store: LayerStore) -> None:
        self.images = vm_image_store(store)

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_get("/v1/vm-images", self.list)
        r.add_post("/v1/vm-images", self.import_image)

    async def list(self, request: web.Request) -> web.Response:
        return respond(await asyncio.to_thread(self.images.list))

    @audited("vm_image.import", query=("ref",))
    async def import_image(self, request: web.Request) -> web.Response:
        """Import the disk image (qcow2 or raw) streamed as the body as ``?ref=name:version``."""
        require_admin(request)
        ref = query_param(request, "ref")
        await asyncio.to_thread(self.images.tmp.mkdir, parents=True, exist_ok=True)
        async with body_to_file(request, self.images.tmp, ".upload") as upload:
            info = await asyncio.to_thread(self.images.import_file, upload, ref)
        return respond(info, status=201)
