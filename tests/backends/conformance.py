"""The conformance suite of the backend seam: what the edge relies on from every backend.

A backend's test module subclasses :class:`BackendConformance` as ``Test<Name>Conformance``
and provides two fixtures, ``backend`` (prepared with ``prepare_node``) and ``layer_dirs``
(the layers every sandbox of the suite is built from, base first; see :func:`build_layers`),
and overrides the hooks below where its runtime needs to. The checks only use relative paths
under a working directory that exists in the image. A check that needs more than every backend
offers is skipped by the capability the backend declares, never by the backend's name:
host-side file access through ``root_path`` (:class:`~dsec.backends.base.HostRooted`), and
spawned processes that are host processes (``capabilities()["host_processes"]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.base import HOST_PROCESSES, Backend, CreateContext, HostRooted, User, sandbox_env
from dsec.executor.process import ByteStream, SandboxProcess
from dsec.protocol.errors import DSecError
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import ContainerSpec
from tests.support import DEADLINE_S, eventually

ROOT = User(name="root", uid=0, gid=0, home="/")
APPLETS = ("sh", "echo", "cat", "sleep", "ls", "sync")  # sync: a microVM template syncs first


def build_layers(base: Path) -> list[Path]:
    """Two small layers, base first: a static-busybox rootfs, and a layer on top of it.

    The base holds ``/bin/busybox`` with the applets as symlinks, ``/tmp`` and two files; the
    top layer overrides one of them and adds another, so the union can be checked.
    """
    lower, upper = base / "base", base / "top"
    for d in ("bin", "tmp", "etc"):
        (lower / d).mkdir(parents=True)
    busybox = shutil.which("busybox") or "/bin/busybox"
    shutil.copy2(busybox, lower / "bin" / "busybox")
    for applet in APPLETS:
        (lower / "bin" / applet).symlink_to("busybox")
    (lower / "tmp").chmod(0o1777)
    (lower / "base.txt").write_text("from base\n")
    (lower / "both.txt").write_text("base wins\n")
    (upper / "etc").mkdir(parents=True)
    (upper / "top.txt").write_text("from top\n")
    (upper / "both.txt").write_text("top wins\n")
    return [lower, upper]


def host_pids_running(argv: list[str]) -> list[int]:
    """Host pids of live (non-zombie) processes whose command line is exactly ``argv``."""
    want = b"".join(a.encode() + b"\0" for a in argv)
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read()
            with open(f"/proc/{entry}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cmdline == want and state not in ("Z", "X"):
            out.append(int(entry))
    return out


def require_host_root(backend: Backend) -> HostRooted:
    """The backend, for a check of host-side file access; skipped where it has none."""
    if not isinstance(backend, HostRooted):
        pytest.skip(f"capability HostRooted: the {backend.name} backend's sandbox root is no host path")
    return backend


def require_host_processes(backend: Backend) -> None:
    """Skips a check that needs the processes the backend spawns to be host processes."""
    if not backend.capabilities().get(HOST_PROCESSES):
        pytest.skip(
            f"capability {HOST_PROCESSES}: the {backend.name} backend's processes are not host processes"
        )


class Made:
    """The sandboxes one test created; the fixture destroys every one, also on failure."""

    def __init__(self, backend: Backend, layer_dirs: list[Path], tmp: Path) -> None:
        self.backend = backend
        self.layer_dirs = layer_dirs
        self.tmp = tmp
        self.all: list[tuple[CreateContext, dict[str, Any]]] = []

    def ctx(self, **spec: Any) -> CreateContext:
        sid = str(SandboxId.new("conformance", 1))
        spec.setdefault("layers", ["conformance:1"])
        return CreateContext(
            sandbox_id=sid,
            spec=ContainerSpec(**spec),
            layer_dirs=list(self.layer_dirs),
            user=ROOT,
            workdir=self.tmp / "sandboxes" / sid,
        )

    async def create(self, ctx: CreateContext | None = None) -> tuple[CreateContext, dict[str, Any]]:
        ctx = ctx or self.ctx()
        at = len(self.all)  # (not [-1]: creates may run in parallel)
        self.all.append((ctx, ctx.handle))
        handle = await self.backend.create(ctx)
        self.all[at] = (ctx, handle)
        return ctx, handle

    async def cleanup(self) -> None:
        for ctx, handle in self.all:
            await self.backend.destroy(ctx.sandbox_id, handle, ctx.workdir)


async def run(
    backend: Backend,
    ctx: CreateContext,
    handle: dict[str, Any],
    argv: list[str],
    *,
    cwd: str = "/",
    stdin: bytes | None = None,
    env: dict[str, str] | None = None,
) -> tuple[bytes, bytes, int]:
    proc = await backend.spawn(
        ctx.sandbox_id, handle, argv, env=sandbox_env(ctx.spec, ctx.user, env), cwd=cwd, user=ctx.user
    )
    out, err = await asyncio.wait_for(communicate(proc, stdin), DEADLINE_S)
    assert proc.returncode is not None
    return out, err, proc.returncode


async def communicate(proc: SandboxProcess, stdin: bytes | None = None) -> tuple[bytes, bytes]:
    """Feed ``stdin``, read both outputs to their end, wait for the exit: what the edge does,
    through :class:`SandboxProcess` only (a VM's process is no asyncio subprocess)."""

    async def feed() -> None:
        if proc.stdin is None:
            return
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it ended first
            if stdin:
                proc.stdin.write(stdin)
                await proc.stdin.drain()
            proc.stdin.close()

    async def drain(stream: ByteStream | None) -> bytes:
        out = b""
        while stream is not None and (chunk := await stream.read(1 << 16)):
            out += chunk
        return out

    _, out, err = await asyncio.gather(feed(), drain(proc.stdout), drain(proc.stderr))
    await proc.wait()
    return out, err


async def read_back(backend: Backend, ctx: CreateContext, handle: dict[str, Any], path: str) -> str:
    """A file of the sandbox (``path`` relative to its root): read on the host through
    ``root_path`` where the backend has one, else by a command inside."""
    if isinstance(backend, HostRooted):
        return (Path(backend.root_path(handle)) / path).read_text()
    out, err, code = await run(backend, ctx, handle, ["cat", f"/{path}"])
    assert code == 0, err
    return out.decode()


class BackendConformance:
    """Every backend passes these. Subclass as ``Test<Name>Conformance`` (see the module doc)."""

    # -- hooks --------------------------------------------------------------------------------

    async def create_failing(self, backend: Backend, made: Made) -> CreateContext:
        """Make one ``create`` fail part-way; returns its context. Must be overridden."""
        raise NotImplementedError

    def assert_released(self, backend: Backend, sandbox_id: str, handle: dict[str, Any]) -> None:
        """Backend-specific checks that nothing of a destroyed sandbox is left (cgroups...)."""

    async def running(
        self, backend: Backend, ctx: CreateContext, handle: dict[str, Any], argv: list[str]
    ) -> bool:
        """Whether a process with exactly ``argv`` runs in the sandbox; by default looked up on
        the host (a backend whose processes are not host processes overrides this)."""
        return bool(host_pids_running(argv))

    def kill_init(self, handle: dict[str, Any]) -> None:
        """Kill the sandbox's first process from outside, as the OOM killer or a crash would."""
        os.kill(handle.pid, signal.SIGKILL)

    # -- fixtures -----------------------------------------------------------------------------

    @pytest.fixture
    async def made(self, backend: Backend, layer_dirs: list[Path], tmp_path: Path) -> AsyncIterator[Made]:
        m = Made(backend, layer_dirs, tmp_path)
        try:
            yield m
        finally:
            await m.cleanup()

    # -- the suite ----------------------------------------------------------------------------

    async def test_lifecycle(self, backend: Backend, made: Made) -> None:
        """The whole life of a sandbox as the edge drives it, in order."""
        ctx, handle = await made.create()
        assert await backend.alive(ctx.sandbox_id, handle)
        out, err, code = await run(backend, ctx, handle, ["sh", "-c", "echo hi; echo err >&2; exit 3"])
        assert (out, err, code) == (b"hi\n", b"err\n", 3)
        _, err, code = await run(backend, ctx, handle, ["sh", "-c", "echo x > f"], cwd="/tmp")
        assert code == 0, err
        assert await read_back(backend, ctx, handle, "tmp/f") == "x\n"
        await backend.destroy(ctx.sandbox_id, handle, ctx.workdir)
        assert not await backend.alive(ctx.sandbox_id, handle)
        assert ctx.sandbox_id not in await backend.leftovers()
        self.assert_released(backend, ctx.sandbox_id, handle)
        await backend.destroy(ctx.sandbox_id, handle, ctx.workdir)  # again: a no-op
        assert ctx.sandbox_id not in await backend.leftovers()

    async def test_create_gives_a_live_sandbox_the_runtime_knows(self, backend: Backend, made: Made) -> None:
        ctx, handle = await made.create()
        assert type(handle).of(json.loads(json.dumps(handle.dump()))) == handle, (
            "the handle is journaled as JSON"
        )
        assert await backend.alive(ctx.sandbox_id, handle)
        assert ctx.sandbox_id in await backend.leftovers()
        assert backend.oom_kills(ctx.sandbox_id) == 0

    async def test_spawn_returns_stdout_stderr_and_exit_code(self, backend: Backend, made: Made) -> None:
        ctx, handle = await made.create()
        out, err, code = await run(backend, ctx, handle, ["sh", "-c", "echo hi; echo err >&2; exit 3"])
        assert (out, err, code) == (b"hi\n", b"err\n", 3)

    async def test_spawn_feeds_stdin_and_passes_env(self, backend: Backend, made: Made) -> None:
        ctx, handle = await made.create()
        argv = ["sh", "-c", 'cat; echo "$GREETING"']
        out, _, code = await run(backend, ctx, handle, argv, stdin=b"line\n", env={"GREETING": "hello"})
        assert (out, code) == (b"line\nhello\n", 0)

    async def test_spawned_process_leads_its_own_process_group(self, backend: Backend, made: Made) -> None:
        require_host_processes(backend)  # its group is looked up on the host
        ctx, handle = await made.create()
        proc = await backend.spawn(
            ctx.sandbox_id, handle, ["cat"], env=sandbox_env(ctx.spec, ROOT), cwd="/", user=ROOT
        )
        try:
            assert os.getpgid(proc.pid) == proc.pid, "a timeout kills the whole group of a command"
        finally:
            proc.kill()
            await communicate(proc)

    async def test_files_cross_between_spawn_and_root_path(self, backend: Backend, made: Made) -> None:
        rooted = require_host_root(backend)
        ctx, handle = await made.create()
        out, err, code = await run(backend, ctx, handle, ["sh", "-c", "echo inside > f"], cwd="/tmp")
        assert code == 0, err
        root = Path(rooted.root_path(handle))
        assert (root / "tmp" / "f").read_text() == "inside\n"
        (root / "tmp" / "g").write_text("from the host side\n")
        out, err, code = await run(backend, ctx, handle, ["cat", "g"], cwd="/tmp")
        assert (out, code) == (b"from the host side\n", 0), err

    async def test_root_is_the_union_of_the_layers_top_most_wins(self, backend: Backend, made: Made) -> None:
        ctx, handle = await made.create()
        out, _, code = await run(backend, ctx, handle, ["cat", "base.txt", "top.txt", "both.txt"])
        assert (out, code) == (b"from base\nfrom top\ntop wins\n", 0)

    async def test_root_path_shows_the_union_of_the_layers(self, backend: Backend, made: Made) -> None:
        rooted = require_host_root(backend)
        _, handle = await made.create()
        root = Path(rooted.root_path(handle))
        assert (root / "base.txt").read_text() == "from base\n"
        assert (root / "top.txt").read_text() == "from top\n"
        assert (root / "both.txt").read_text() == "top wins\n"

    async def test_writes_do_not_reach_the_layers(
        self, backend: Backend, made: Made, layer_dirs: list[Path]
    ) -> None:
        ctx, handle = await made.create()
        _, err, code = await run(backend, ctx, handle, ["sh", "-c", "echo changed > both.txt; echo new > n"])
        assert code == 0, err
        assert (layer_dirs[1] / "both.txt").read_text() == "top wins\n"
        assert not any((d / "n").exists() for d in layer_dirs)
        other, other_handle = await made.create()
        out, _, _ = await run(backend, other, other_handle, ["cat", "both.txt"])
        assert out == b"top wins\n", "one sandbox's writes are invisible to another"

    async def test_destroy_releases_everything_and_is_idempotent(self, backend: Backend, made: Made) -> None:
        ctx, handle = await made.create()
        sleeper = ["sleep", str(900_000 + secrets.randbelow(99_999))]
        # A daemon that outlives the command that started it (and leaves its stdio).
        _, err, code = await run(
            backend, ctx, handle, ["sh", "-c", f"{' '.join(sleeper)} </dev/null >/dev/null 2>&1 &"]
        )
        assert code == 0, err
        await eventually(lambda: self.running(backend, ctx, handle, sleeper), "the daemon to start")

        await backend.destroy(ctx.sandbox_id, handle, ctx.workdir)

        assert not await backend.alive(ctx.sandbox_id, handle)
        assert not await self.running(backend, ctx, handle, sleeper), (
            "destroy kills processes that left their command"
        )
        assert ctx.sandbox_id not in await backend.leftovers()
        assert not ctx.workdir.exists(), f"{ctx.workdir} outlived destroy"
        self.assert_released(backend, ctx.sandbox_id, handle)
        await backend.destroy(ctx.sandbox_id, handle, ctx.workdir)  # a second destroy is a no-op
        assert ctx.sandbox_id not in await backend.leftovers()

    async def test_destroy_without_a_handle_removes_an_orphan(self, backend: Backend, made: Made) -> None:
        # After a crash the edge destroys sandboxes it has no record of with an empty handle.
        ctx, handle = await made.create()
        await backend.destroy(ctx.sandbox_id, {}, ctx.workdir)
        assert not await backend.alive(ctx.sandbox_id, handle)
        assert ctx.sandbox_id not in await backend.leftovers()
        assert not ctx.workdir.exists()
        self.assert_released(backend, ctx.sandbox_id, handle)

    async def test_destroy_of_an_unknown_sandbox_is_a_noop(self, backend: Backend, tmp_path: Path) -> None:
        sid = str(SandboxId.new("conformance", 1))
        await backend.destroy(sid, {}, tmp_path / "never-created")
        assert sid not in await backend.leftovers()

    async def test_alive_turns_false_when_the_sandbox_dies(self, backend: Backend, made: Made) -> None:
        ctx, handle = await made.create()
        self.kill_init(handle)

        async def dead() -> bool:
            return not await backend.alive(ctx.sandbox_id, handle)

        await eventually(dead, "alive() to notice the dead sandbox")
        await backend.destroy(ctx.sandbox_id, handle, ctx.workdir)
        assert ctx.sandbox_id not in await backend.leftovers()
        self.assert_released(backend, ctx.sandbox_id, handle)

    async def test_parallel_creates_are_independent(self, backend: Backend, made: Made) -> None:
        boxes = await asyncio.gather(*(made.create() for _ in range(3)))
        assert len({ctx.sandbox_id for ctx, _ in boxes}) == 3
        for i, (ctx, handle) in enumerate(boxes):
            _, err, code = await run(backend, ctx, handle, ["sh", "-c", f"echo {i} > me"], cwd="/tmp")
            assert code == 0, err
        for i, (ctx, handle) in enumerate(boxes):
            assert await read_back(backend, ctx, handle, "tmp/me") == f"{i}\n"
        await asyncio.gather(*(backend.destroy(c.sandbox_id, h, c.workdir) for c, h in boxes))
        left = await backend.leftovers()
        assert not any(ctx.sandbox_id in left for ctx, _ in boxes)

    async def test_spawn_of_a_missing_program_is_the_commands_failure(
        self, backend: Backend, made: Made
    ) -> None:
        ctx, handle = await made.create()
        _, err, code = await run(backend, ctx, handle, ["no-such-program-anywhere"])
        assert code != 0
        assert b"no-such-program-anywhere" in err, "the caller learns what was missing"

    async def test_failed_create_raises_a_dsec_error_and_the_runtime_forgets_it(
        self, backend: Backend, made: Made
    ) -> None:
        with pytest.raises(DSecError):
            await self.create_failing(backend, made)
        ctx = made.all[-1][0]
        assert ctx.sandbox_id not in await backend.leftovers()
        self.assert_released(backend, ctx.sandbox_id, ctx.handle)
        # The failure is not sticky: the next create works.
        ok, handle = await made.create()
        assert await backend.alive(ok.sandbox_id, handle)

    async def test_failed_create_leaves_no_files(self, backend: Backend, made: Made) -> None:
        # base.py: "on failure leave nothing behind" (the edge also destroys, as a second line).
        with pytest.raises(DSecError):
            await self.create_failing(backend, made)
        ctx = made.all[-1][0]
        assert not ctx.workdir.exists(), f"a failed create left {ctx.workdir} behind"
