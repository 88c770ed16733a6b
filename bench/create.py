"""Create and exec latency of container sandboxes, against floors measured in the same run.

    .venv/bin/python bench/create.py [--n 40] [--rate-total 120] [--concurrency 8]

Runs an embedded node on a scratch data directory that shares the layer store of `dsec up`
(the base layer must exist: `./setup.sh up` or `dsec base` builds it). Prints, with the core
count, p50/p99 of:
  - create-to-first-output (run_container + run_shell("echo")) vs bare `crun run` of the same
    rootfs (the EROFS base layer, read-only) printing the same line;
  - sustained creations per second at a given concurrency vs bare `crun run --detach` at the
    same concurrency;
  - run_shell("true") round trip SDK -> apiserver -> edge -> sandbox vs `crun exec true`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _stats import pct
from dsec import DSecClient, DSecContainerRunArgs
from dsec.backends.base import User
from dsec.backends.container import cgroups, oci
from dsec.images.mount import mounts_under
from dsec.images.mounts import LayerMounts
from dsec.images.store import LayerStore
from dsec.node.embedded import EmbeddedNode, NodeConfig
from dsec.protocol.models import ContainerSpec


def report(name: str, xs: list[float], floor: list[float], unit: str = "ms", scale: float = 1000) -> None:
    p50, p99, f50 = pct(xs, 50) * scale, pct(xs, 99) * scale, pct(floor, 50) * scale
    print(
        f"{name:<34} p50 {p50:8.2f} {unit}  p99 {p99:8.2f} {unit}  floor p50 {f50:8.2f} {unit}"
        f"  ratio {p50 / f50:5.2f}x"
    )


class BareCrun:
    """Bare crun on the same rootfs: the floor every DSec figure is compared with. Its state root,
    container names and parent cgroup are its own (named after its scratch directory, as a
    node's are: cgroups.parent_name), so it runs beside any node on the machine, and whatever
    it started goes in :meth:`close`, also when a run failed."""

    def __init__(self, rootfs: Path, runtime_dir: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-crun-"))
        self.state = self.dir / "state"
        self.parent = cgroups.parent_name("bench-floor", self.dir)
        cgroups.prepare_cpuset_parent(self.parent)  # as a node's: new cpusets copy its CPUs
        spec = ContainerSpec(image="x")
        config = oci.build_config(
            sandbox_id="bench",
            spec=spec,
            user=User("root", 0, 0, "/"),
            rootfs=str(rootfs),
            runtime_dir=str(runtime_dir),
            cgroup_path=f"/{self.parent}/bench",
            nofile=min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
        )
        config["root"]["readonly"] = True
        # The read-only image has no /.dsec mount point; the floor uses the image's own tools.
        config["mounts"] = [m for m in config["mounts"] if m["destination"] != "/.dsec"]
        # DSec's config has no mount namespace: its rootfs helper makes one and crun chroots in
        # it (oci.py). Bare crun runs as a user runs it, in a mount namespace of its own; without
        # one its /proc, /dev and masks land in the host's, stacked on the shared layer mount,
        # which then cannot be unmounted ("Device or resource busy").
        config["linux"]["namespaces"].append({"type": "mount"})
        self.config = config

    def _bundle(self, name: str, args: list[str]) -> Path:
        b = self.dir / name
        b.mkdir(exist_ok=True)
        cfg = json.loads(json.dumps(self.config))
        cfg["process"]["args"] = args
        cfg["linux"]["cgroupsPath"] = f"/{self.parent}/{name}"
        (b / "config.json").write_text(json.dumps(cfg))
        return b

    def run_echo(self, i: int) -> float:
        b = self._bundle(f"echo{i}", ["/bin/echo", "hi"])
        t = time.perf_counter()
        out = subprocess.run(
            ["crun", "--root", str(self.state), "run", "--bundle", str(b), f"echo{i}"],
            capture_output=True,
        )
        dt = time.perf_counter() - t
        assert out.returncode == 0 and out.stdout == b"hi\n", out.stderr
        return dt

    async def run_detached(self, name: str) -> None:
        b = self._bundle(name, ["/bin/sleep", "1000"])
        err = self.dir / f"{name}.err"
        with err.open("wb") as errors:  # a file, not a pipe: the detached container keeps crun's stdio
            p = await asyncio.create_subprocess_exec(
                "crun",
                "--root",
                str(self.state),
                "run",
                "--detach",
                "--bundle",
                str(b),
                name,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=errors,
            )
        if await p.wait() != 0:
            raise RuntimeError(f"bare crun run --detach {name}: {err.read_text(errors='replace').strip()}")

    def exec_true(self, name: str) -> float:
        t = time.perf_counter()
        subprocess.run(["crun", "--root", str(self.state), "exec", name, "/bin/true"], check=True)
        return time.perf_counter() - t

    def delete(self, name: str) -> None:
        subprocess.run(["crun", "--root", str(self.state), "delete", "--force", name], check=False)

    def close(self) -> None:
        if self.state.is_dir():  # what a failed run left running holds the layer's mount
            for name in os.listdir(self.state):
                self.delete(name)
        for h in cgroups.hierarchies():
            with contextlib.suppress(OSError):
                for d in (h / self.parent).iterdir():
                    if d.is_dir():
                        cgroups.rmdir(d)
            with contextlib.suppress(OSError):
                (h / self.parent).rmdir()
        shutil.rmtree(self.dir, ignore_errors=True)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--rate-total", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--shell-calls", type=int, default=1000)
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    ap.add_argument("--image", default="debian:bookworm")
    a = ap.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="dsec-bench-"))
    node = EmbeddedNode(
        NodeConfig(
            data_dir=scratch, layer_dir=a.layers, port=0, node="bench", config_file=scratch / "config.json"
        )
    )
    store = LayerStore(a.layers)
    mounts = LayerMounts(scratch / "bench-mnt")
    bare: BareCrun | None = None
    # Everything from here can fail (a missing image, a mount, crun): the finally below ends
    # what was started, or a failed run left LXCFS, the runtime tmpfs and cgroups behind.
    try:
        layer = store.resolve(a.image)  # before the node: a missing image starts nothing
        await node.start()
        rootfs = mounts.acquire(layer.digest, store.blob_path(layer.digest))
        bare = BareCrun(rootfs, scratch / "runtime")
        print(
            f"cores {os.cpu_count()}  image {a.image} ({layer.size / 1e6:.0f} MB EROFS)",
            f"python {sys.version.split()[0]}",
        )
        async with DSecClient(node.url, node.api_key) as client:
            args = DSecContainerRunArgs(container_image=a.image)
            # warm both paths once (page cache, layer mount)
            bare.run_echo(-1)
            sb = await client.run_container(args)
            await sb.stop()

            floor = [bare.run_echo(i) for i in range(a.n)]
            first: list[float] = []
            for _ in range(a.n):
                t = time.perf_counter()
                sb = await client.run_container(args)
                r = await sb.run_shell("echo hi")
                first.append(time.perf_counter() - t)
                assert r.stdout == "hi\n"
                await sb.stop()
            report("create-to-first-output", first, floor)

            async def bare_burst() -> float:
                names = [f"d{i}" for i in range(a.rate_total)]
                sem = asyncio.Semaphore(a.concurrency)

                async def one(n: str) -> None:
                    async with sem:
                        await bare.run_detached(n)

                t = time.perf_counter()
                await asyncio.gather(*(one(n) for n in names))
                dt = time.perf_counter() - t
                for n in names:
                    bare.delete(n)
                return a.rate_total / dt

            async def dsec_burst() -> float:
                sem = asyncio.Semaphore(a.concurrency)
                made = []

                async def one() -> None:
                    async with sem:
                        made.append(await client.run_container(args))

                t = time.perf_counter()
                await asyncio.gather(*(one() for _ in range(a.rate_total)))
                dt = time.perf_counter() - t
                await asyncio.gather(*(s.stop() for s in made))
                return a.rate_total / dt

            bare_rate = await bare_burst()
            rate = await dsec_burst()
            print(
                f"{'creations/s (concurrency ' + str(a.concurrency) + ')':<34} dsec {rate:8.1f}/s"
                f"        floor {bare_rate:8.1f}/s         ratio {rate / bare_rate:5.2f}x"
            )

            sb = await client.run_container(args)
            await bare.run_detached("execfloor")
            exec_floor = [bare.exec_true("execfloor") for _ in range(a.n)]
            bare.delete("execfloor")
            await sb.run_shell("true")
            rtt = []
            for _ in range(a.shell_calls):
                t = time.perf_counter()
                await sb.run_shell("true")
                rtt.append(time.perf_counter() - t)
            await sb.stop()
            report("run_shell('true') round trip", rtt, exec_floor)
            print("  (floor for the round trip: `crun exec <id> /bin/true`)")
    finally:
        try:
            if bare is not None:
                bare.close()
            mounts.unmount_all()
        finally:  # the node and its sandboxes go even if the floor's layer could not be unmounted
            await node.close(stop_sandboxes=True)
            store.close()
            if not mounts_under(scratch):
                shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
