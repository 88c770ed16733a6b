"""A full VM's handle: a microVM's, and what garbage collection must keep while it lives."""

from __future__ import annotations

from dsec.backends.microvm.handle import MicroVmHandle


class VmHandle(MicroVmHandle):
    base: str | None = None  # the shared base image its root overlays (vm/bases.py)
    disk_image: str | None = None  # or the imported image it boots from (its digest)

    def image_in_use(self) -> str | None:
        return self.disk_image
