"""What the conformance suite needs to run against the VM backends (microVM, full VM).

A VM attaches its layers as the store keeps them (EROFS files, by digest), so the suite's two
busybox layers are imported into a store of the module's own; a VM's processes run on its own
kernel, so whether one runs is asked inside, through the guest's /proc. Each create boots a
VM (TCG here: slow), so a module shares one backend, one store and one set of layers.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dsec import _linux
from dsec.backends.base import Backend, CreateContext
from dsec.backends.microvm import host
from dsec.backends.microvm.backend import MicroVMBackend
from dsec.backends.microvm.handle import MicroVmHandle
from dsec.images.store import LayerStore

from .conformance import BackendConformance, Made, build_layers, run

NO_QEMU = shutil.which("qemu-system-x86_64") is None
# A digest no store holds: a VM asked to attach it fails to start, before any boot.
MISSING_DIGEST = "sha256:" + "0" * 64


def import_layers(store: LayerStore, dirs: list[Path]) -> list[str]:
    """The layers as the store keeps them (one EROFS image each), base first."""
    return [store.import_path(d, f"conformance-{i}:1").digest for i, d in enumerate(dirs)]


class VmLayers:
    """The module's layers: directories (a full VM builds its disk from them) and digests."""

    def __init__(self, root: Path) -> None:
        self.dirs = build_layers(root / "layers")
        self.store = LayerStore(root / "store")
        self.digests = import_layers(self.store, self.dirs)

    def close(self) -> None:
        self.store.close()


class VmMade(Made):
    """The suite's sandboxes, with the layers' digests a VM attaches (or keys its disk by)."""

    def __init__(self, backend: Backend, layers: VmLayers, tmp: Path) -> None:
        super().__init__(backend, layers.dirs, tmp)
        self.digests = layers.digests

    def ctx(self, **spec: Any) -> CreateContext:
        ctx = super().ctx(**spec)
        ctx.layer_digests = list(self.digests)
        return ctx


class VmConformance(BackendConformance):
    """The suite's hooks for a VM: its processes are the guest's, its host side is one QEMU."""

    @pytest.fixture
    async def made(self, backend: Backend, vm_layers: VmLayers, tmp_path: Path) -> AsyncIterator[Made]:
        m = VmMade(backend, vm_layers, tmp_path)
        try:
            yield m
        finally:
            await m.cleanup()

    async def running(
        self, backend: Backend, ctx: CreateContext, handle: dict[str, Any], argv: list[str]
    ) -> bool:
        # A VM whose QEMU is gone runs nothing; a live one is asked through its own /proc.
        if not await backend.alive(ctx.sandbox_id, handle):
            return False
        script = 'for f in /proc/[0-9]*/cmdline; do cat "$f"; echo; done'
        out, _, code = await run(backend, ctx, handle, ["sh", "-c", script])
        want = b"".join(a.encode() + b"\0" for a in argv)
        return code == 0 and want in out.split(b"\n")

    def assert_released(self, backend: Backend, sandbox_id: str, handle: dict[str, Any]) -> None:
        assert isinstance(backend, MicroVMBackend)
        h = MicroVmHandle.of(handle)
        pid = h.pid
        if pid:
            assert _linux.proc_start_time(pid) != h.start_time, "its QEMU outlived it"
        assert not (backend.state_dir / f"{sandbox_id}.json").exists(), "its journal entry outlived it"
        if h.dir:
            assert not host.socket_dir(Path(h.dir)).exists(), "its sockets outlived it"
        assert sandbox_id not in backend._channels, "the backend still holds its agent channel"


async def create_with_a_missing_layer(made: Made) -> None:
    """A create whose last layer the store does not hold: it fails before the VM boots."""
    ctx = made.ctx()
    ctx.layer_digests = [*ctx.layer_digests, MISSING_DIGEST]
    ctx.layer_dirs = [*ctx.layer_dirs, made.tmp / "vanished-layer"]
    await made.create(ctx)
