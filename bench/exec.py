"""Spawn latency in a container sandbox: ``crun exec`` against ``dsec-enter``, as a node fills.

    .venv/bin/python bench/exec.py [--n 200] [--hold 500] [--concurrency 8]

A :class:`ContainerBackend` on a scratch data directory runs one target sandbox over a small
static-busybox rootfs built here (nothing else is needed). ``true`` is started in it ``--n``
times through each path, the two alternating so that drift hits both alike, timed from the
spawn call until the process has exited and its pipes are drained (what an exec costs the
edge):
  - ``crun exec``: what ``ContainerBackend.spawn`` runs today;
  - ``dsec-enter``: :func:`dsec.native.enter.spawn_entered`.
Then ``--hold`` idle sandboxes are created next to it and both are measured again. Prints the
core count, p50/p99 of each, and the ratio crun exec / dsec-enter in each phase. The machine is
shared and noisy: compare the ratios of one run, not runs with each other.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from _stats import pct
from dsec.backends.base import CreateContext, User, sandbox_env
from dsec.backends.container.backend import ContainerBackend
from dsec.native import enter
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import ContainerSpec

ROOT = User(name="root", uid=0, gid=0, home="/")
APPLETS = ("sh", "true", "sleep", "cat")


def build_layer(path: Path) -> Path:
    for d in ("bin", "tmp", "etc"):
        (path / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(shutil.which("busybox") or "/bin/busybox", path / "bin" / "busybox")
    for applet in APPLETS:
        (path / "bin" / applet).symlink_to("busybox")
    return path


class Node:
    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.backend = ContainerBackend(scratch / "data")
        self.layer = build_layer(scratch / "layer")
        self.made: list[tuple[CreateContext, dict[str, Any]]] = []
        self.helper = scratch / "unbuilt"

    async def prepare(self) -> None:
        await self.backend.prepare_node()
        self.helper = await asyncio.to_thread(enter.build_helper, self.scratch / "data" / "bin")

    async def create(self) -> tuple[CreateContext, dict[str, Any]]:
        sid = str(SandboxId.new("bench", 1))
        ctx = CreateContext(
            sandbox_id=sid,
            spec=ContainerSpec(layers=["bench:1"], memory_limit_mb=64),
            layer_dirs=[self.layer],
            user=ROOT,
            workdir=self.scratch / "sandboxes" / sid,
        )
        index = len(self.made)  # creates run concurrently: not necessarily the last one
        self.made.append((ctx, {}))
        handle = await self.backend.create(ctx)
        self.made[index] = (ctx, handle)
        return ctx, handle

    async def create_many(self, n: int, concurrency: int) -> None:
        left = [n]

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                await self.create()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await self.backend.release_node()  # its parent cgroups (named after its data directory)

    async def destroy_all(self, concurrency: int = 8) -> None:
        queue = list(self.made)
        self.made.clear()

        async def worker() -> None:
            while queue:
                ctx, handle = queue.pop()
                try:
                    await self.backend.destroy(ctx.sandbox_id, handle, ctx.workdir)
                except Exception as exc:  # keep cleaning up the others
                    print(f"destroy {ctx.sandbox_id}: {exc}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await self.backend.release_node()  # its parent cgroups (named after its data directory)


async def one(spawn: Any) -> float:
    t = time.perf_counter()
    proc = await spawn()
    await proc.communicate()
    elapsed = time.perf_counter() - t
    assert proc.returncode == 0, proc.returncode
    return elapsed


async def measure(
    node: Node, ctx: CreateContext, handle: dict[str, Any], n: int
) -> tuple[list[float], list[float]]:
    env = sandbox_env(ctx.spec, ROOT)

    def crun() -> Any:
        return node.backend.spawn(ctx.sandbox_id, handle, ["true"], env=env, cwd="/", user=ROOT)

    def entered() -> Any:
        return enter.spawn_entered(
            ctx.sandbox_id, handle, ["true"], env=env, cwd="/", user=ROOT, helper=node.helper
        )

    for _ in range(5):  # warm both paths (page cache, crun's state)
        await one(crun)
        await one(entered)
    a: list[float] = []
    b: list[float] = []
    for i in range(n):
        if i % 2:
            a.append(await one(crun))
            b.append(await one(entered))
        else:
            b.append(await one(entered))
            a.append(await one(crun))
    return a, b


def report(phase: str, crun: list[float], entered: list[float]) -> None:
    c50, c99, e50, e99 = (pct(x, p) * 1e3 for x in (crun, entered) for p in (50, 99))
    print(f"  {phase}")
    print(f"    crun exec    p50 {c50:7.2f} ms  p99 {c99:7.2f} ms")
    print(f"    dsec-enter   p50 {e50:7.2f} ms  p99 {e99:7.2f} ms")
    print(f"    ratio crun exec / dsec-enter: p50 {c50 / e50:5.2f}x  p99 {c99 / e99:5.2f}x")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200, help="spawns of `true` per path and phase")
    ap.add_argument("--hold", type=int, default=500, help="idle sandboxes held for the second phase")
    ap.add_argument("--concurrency", type=int, default=8, help="parallel creates while filling")
    ap.add_argument("--scratch", type=Path, default=None, help="data directory (default: a temp dir)")
    a = ap.parse_args()
    scratch = a.scratch or Path(tempfile.mkdtemp(prefix="dsec-bench-exec-"))
    node = Node(scratch)
    try:
        await node.prepare()
        ctx, handle = await node.create()
        mounts = len(Path("/proc/self/mountinfo").read_text().splitlines())
        print(f"cores {os.cpu_count()}  spawns of `true` per path and phase {a.n}  host mounts {mounts}")
        crun0, entered0 = await measure(node, ctx, handle, a.n)
        report("1 sandbox on the node", crun0, entered0)
        if a.hold > 0:
            t = time.perf_counter()
            await node.create_many(a.hold, a.concurrency)
            took = time.perf_counter() - t
            mounts = len(Path("/proc/self/mountinfo").read_text().splitlines())
            print(f"  (+{a.hold} idle sandboxes created in {took:.1f} s; host mounts {mounts})")
            crun1, entered1 = await measure(node, ctx, handle, a.n)
            report(f"{a.hold + 1} sandboxes on the node", crun1, entered1)
            print(
                f"  growth with the node's fill, p50: crun exec {pct(crun1, 50) / pct(crun0, 50):5.2f}x, "
                f"dsec-enter {pct(entered1, 50) / pct(entered0, 50):5.2f}x"
            )
    finally:
        await node.destroy_all()
        if a.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
