"""The backend conformance suite against :class:`FakeBackend`, plus the fake's own promises."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.base import Backend
from dsec.backends.fake import MARKER_ENV, FakeBackend
from dsec.protocol.errors import InfraFailure

from .conformance import BackendConformance, Made, build_layers, run


@pytest.fixture
def layer_dirs(tmp_path: Path) -> list[Path]:
    return build_layers(tmp_path / "layers")


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[FakeBackend]:
    fake = FakeBackend(tmp_path / "fake-state")
    await fake.prepare_node()
    yield fake
    left = await fake.leftovers()
    for sid in left:  # clean up first, complain after
        await fake.destroy(sid, {}, tmp_path / "unknown")
    assert left == [], "a test left fake sandboxes behind"


class TestFakeConformance(BackendConformance):
    async def create_failing(self, backend: Backend, made: Made) -> Any:
        assert isinstance(backend, FakeBackend)
        backend.fail_create = True
        try:
            await made.create()
        finally:
            backend.fail_create = False


async def test_failing_create_is_recorded_and_the_switch_can_be_turned_off(
    backend: FakeBackend, layer_dirs: list[Path], tmp_path: Path
) -> None:
    made = Made(backend, layer_dirs, tmp_path)
    backend.fail_create = True
    with pytest.raises(InfraFailure) as info:
        await made.create()
    assert info.value.reason == "runtime"
    assert backend.failed_creates == [made.all[-1][0].sandbox_id]
    backend.fail_create = False
    ctx, handle = await made.create()
    assert await backend.alive(ctx.sandbox_id, handle)
    await made.cleanup()


async def test_a_missing_layer_fails_create_cleanly(backend: FakeBackend, tmp_path: Path) -> None:
    made = Made(backend, [tmp_path / "no-such-layer"], tmp_path)
    with pytest.raises(InfraFailure, match="no-such-layer"):
        await made.create()
    assert await backend.leftovers() == []
    assert not made.all[-1][0].workdir.exists()


async def test_union_honours_overlay_whiteouts_and_opaque_dirs(backend: FakeBackend, tmp_path: Path) -> None:
    base, top = tmp_path / "base", tmp_path / "top"
    for d in (base / "gone-dir", base / "opaque", top / "opaque", base / "tmp"):
        d.mkdir(parents=True)
    (base / "gone.txt").write_text("x")
    (base / "gone-dir" / "f").write_text("x")
    (base / "opaque" / "old").write_text("x")
    (top / "opaque" / "new").write_text("x")
    os.setxattr(top / "opaque", "trusted.overlay.opaque", b"y")
    os.mknod(top / "gone.txt", stat.S_IFCHR | 0o600, 0)
    os.mknod(top / "gone-dir", stat.S_IFCHR | 0o600, 0)
    made = Made(backend, [base, top], tmp_path)
    _, handle = await made.create()
    root = Path(backend.root_path(handle))
    assert sorted(p.name for p in root.iterdir()) == ["opaque", "tmp"]
    assert [p.name for p in (root / "opaque").iterdir()] == ["new"]
    await made.cleanup()


async def test_spawn_of_a_missing_program_exits_127(
    backend: FakeBackend, layer_dirs: list[Path], tmp_path: Path
) -> None:
    made = Made(backend, layer_dirs, tmp_path)
    ctx, handle = await made.create()
    _, err, code = await run(backend, ctx, handle, ["no-such-program-anywhere"])
    assert code == 127, "as a shell reports a missing command"
    assert b"no-such-program-anywhere" in err
    await made.cleanup()


async def test_spawn_marks_processes_and_maps_missing_cwd_to_the_root(
    backend: FakeBackend, layer_dirs: list[Path], tmp_path: Path
) -> None:
    made = Made(backend, layer_dirs, tmp_path)
    ctx, handle = await made.create()
    out, _, _ = await run(backend, ctx, handle, ["sh", "-c", f'echo "${MARKER_ENV}"; pwd'], cwd="/nowhere")
    marker, cwd = out.decode().splitlines()
    assert marker == ctx.sandbox_id
    assert Path(cwd) == Path(backend.root_path(handle)).resolve()
    await made.cleanup()


async def test_a_new_instance_on_the_same_state_dir_adopts_and_destroys(
    backend: FakeBackend, layer_dirs: list[Path], tmp_path: Path
) -> None:
    # What an edge restart looks like to a backend: a fresh object, the same state on disk.
    made = Made(backend, layer_dirs, tmp_path)
    ctx, handle = await made.create()
    again = FakeBackend(backend.state_dir)
    assert await again.leftovers() == [ctx.sandbox_id]
    assert await again.alive(ctx.sandbox_id, handle)
    await again.destroy(ctx.sandbox_id, {}, ctx.workdir)
    assert not await backend.alive(ctx.sandbox_id, handle)
    assert await backend.leftovers() == []
