"""The backend conformance suite against :class:`MicroVMBackend`: QEMU microvm (TCG here) with
the guest kit's kernel, the suite's busybox layers attached as EROFS images.

One backend for the module: its first create boots cold and builds a template in the
background, later ones start from it. Checks that need host-side file access or host processes
are skipped by the capabilities the backend reports (see conformance.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.base import Backend
from dsec.backends.microvm.backend import MicroVMBackend
from tests.conftest import DATA_DIR

from .conformance import Made
from .vm_conformance import NO_QEMU, VmConformance, VmLayers, create_with_a_missing_layer

pytestmark = [pytest.mark.vm, pytest.mark.skipif(NO_QEMU, reason="qemu-system-x86 is not installed")]


@pytest.fixture(scope="module")
def vm_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("microvm-conformance")


@pytest.fixture(scope="module")
def vm_layers(vm_root: Path) -> Iterator[VmLayers]:
    layers = VmLayers(vm_root)
    yield layers
    layers.close()


@pytest.fixture(scope="module")
def layer_dirs(vm_layers: VmLayers) -> list[Path]:
    return vm_layers.dirs


@pytest.fixture(scope="module")
async def backend(vm_root: Path, vm_layers: VmLayers) -> AsyncIterator[MicroVMBackend]:
    # The kit the e2e node uses (built once per machine), under TCG as the test node runs it.
    vm = MicroVMBackend(
        vm_root / "data",
        accel="tcg",
        layer_file=vm_layers.store.blob_path,
        kit_dir=DATA_DIR / "node" / "guest-kit",
    )
    await vm.prepare_node()
    yield vm
    left = await vm.leftovers()
    for sid in left:  # clean up first, complain after
        await vm.destroy(sid, {}, vm_root / "sandboxes" / sid)
    await vm.release_node()  # also ends a template build still running
    assert left == [], "a test left microVMs behind"


class TestMicroVMConformance(VmConformance):
    async def create_failing(self, backend: Backend, made: Made) -> Any:
        await create_with_a_missing_layer(made)
