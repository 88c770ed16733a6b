"""The backend conformance suite against the real :class:`ContainerBackend` (crun, overlayfs).

Needs root, crun and a static busybox; the sandboxes run a two-layer busybox rootfs built in
the test's tmp directory. Beyond the suite, every sandbox must leave no cgroup under
``/sys/fs/cgroup/*/<node's parent>/<bucket>/<id>`` and no process in one, and the node's parent
goes with its last sandbox.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.base import Backend, CreateContext, sandbox_env
from dsec.backends.container import cgroups, spares
from dsec.backends.container.backend import ContainerBackend
from dsec.images.mount import mounts_under
from dsec.protocol.errors import DSecError
from tests.support import DEADLINE_S

from .conformance import BackendConformance, Made, build_layers, run

if os.geteuid() != 0 or shutil.which("crun") is None or shutil.which("busybox") is None:
    pytest.skip("the container backend needs root, crun and busybox-static", allow_module_level=True)

pytestmark = pytest.mark.slow


def _pids_in_cgroups_of(sandbox_id: str) -> list[int]:
    """Live processes in the sandbox's cgroups (a zombie is dead, its parent just not told yet)."""
    needle = f"/{cgroups.rel(sandbox_id)}"
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/cgroup").read_text()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state in ("Z", "X"):
            continue
        if any(line.split(":", 2)[-1].startswith(needle) for line in text.splitlines()):
            out.append(int(entry))
    return out


@pytest.fixture
def layer_dirs(tmp_path: Path) -> list[Path]:
    return build_layers(tmp_path / "layers")


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[ContainerBackend]:
    ct = ContainerBackend(tmp_path / "data")
    await ct.prepare_node()
    yield ct
    left = await ct.leftovers()
    for sid in left:  # clean up first, complain after
        await ct.destroy(sid, {}, tmp_path / "sandboxes" / sid)
    await ct.detach()  # the spare cgroups destroyed sandboxes left
    assert left == [], "a test left containers behind"
    assert spares.spare_dirs(ct.cgroup_parent) == []
    await ct.release_node()
    assert not list(cgroups.CGROUP_ROOT.glob(f"*/{ct.cgroup_parent}")), "its parent cgroups outlived it"
    assert not mounts_under(tmp_path), "a sandbox mount leaked into the host's mount namespace"


class TestContainerConformance(BackendConformance):
    async def create_failing(self, backend: Backend, made: Made) -> Any:
        # crun itself fails: the image has a regular file where /proc must be mounted.
        bad = made.tmp / "bad-layer"
        bad.mkdir(exist_ok=True)
        (bad / "proc").write_text("not a directory\n")
        ctx = made.ctx()
        ctx.layer_dirs = [*ctx.layer_dirs, bad]
        await made.create(ctx)

    async def test_failed_create_leaves_no_files(self, backend: Backend, made: Made) -> None:
        await super().test_failed_create_leaves_no_files(backend, made)

    async def test_a_vanished_layer_fails_create_with_a_typed_error(
        self, backend: Backend, made: Made
    ) -> None:
        ctx = made.ctx()
        ctx.layer_dirs = [*ctx.layer_dirs, made.tmp / "vanished-layer"]
        with pytest.raises(DSecError):
            await made.create(ctx)
        assert ctx.sandbox_id not in await backend.leftovers()
        self.assert_released(backend, ctx.sandbox_id, ctx.handle)

    def assert_released(self, backend: Backend, sandbox_id: str, handle: dict[str, Any]) -> None:
        assert cgroups.sandbox_dirs(sandbox_id) == [], "cgroups outlived the sandbox"
        assert _pids_in_cgroups_of(sandbox_id) == [], "processes outlived the sandbox"
        assert cgroups.oom_kills(sandbox_id) == 0


class GVisorMade(Made):
    """The suite's sandboxes on gVisor: every create asks for ``runtime="gvisor"``."""

    def ctx(self, **spec: Any) -> CreateContext:
        spec.setdefault("runtime", "gvisor")
        return super().ctx(**spec)


class TestGVisorConformance(TestContainerConformance):
    """The same suite with ``runtime="gvisor"``: runsc in place of crun, same backend."""

    async def running(
        self, backend: Backend, ctx: CreateContext, handle: dict[str, Any], argv: list[str]
    ) -> bool:
        # Processes on gVisor's kernel are not host processes: asked inside, through the
        # sandbox's own /proc (a destroyed sandbox cannot answer: nothing runs there).
        script = 'for f in /proc/[0-9]*/cmdline; do cat "$f"; echo; done'
        out, _, code = await run(backend, ctx, handle, ["sh", "-c", script])
        want = b"".join(a.encode() + b"\0" for a in argv)
        return code == 0 and want in out.split(b"\n")

    @pytest.fixture
    async def made(self, backend: Backend, layer_dirs: list[Path], tmp_path: Path) -> AsyncIterator[Made]:
        assert isinstance(backend, ContainerBackend)
        if shutil.which("runsc") is None:
            pytest.skip("runtime='gvisor' needs runsc (Debian package runsc): not installed")
        if not backend.gvisor.available:
            pytest.skip(f"runsc does not work on this host: {backend.gvisor.why_not}")
        m = GVisorMade(backend, layer_dirs, tmp_path)
        try:
            yield m
        finally:
            await m.cleanup()


async def test_gvisor_held_process_reports_its_pid_inside_and_dies_by_signal(
    backend: ContainerBackend, layer_dirs: list[Path], tmp_path: Path
) -> None:
    if not backend.gvisor.available:
        pytest.skip(f"runtime='gvisor' is not available here: {backend.gvisor.why_not}")
    made = GVisorMade(backend, layer_dirs, tmp_path)
    try:
        ctx, handle = await made.create()
        env = sandbox_env(ctx.spec, ctx.user)
        held = await backend.spawn_held(
            ctx.sandbox_id,
            handle,
            ["sh", "-c", "echo $$; exec cat"],
            env=env,
            cwd="/",
            user=ctx.user,
            tty=None,
            stdin=True,
        )
        assert held.host_pid is None, "a process on gVisor's kernel is no host process"
        assert held.proc.stdout is not None
        assert int(await held.proc.stdout.readline()) == held.pid, "the PID as the sandbox sees it"
        send = held.proc.send_signal
        send(signal.SIGTERM, tree=True)
        assert await asyncio.wait_for(held.proc.wait(), DEADLINE_S) == -signal.SIGTERM
    finally:
        await made.cleanup()
