"""runtime="gvisor" against crun, measured in the same run on the same node and image.

    .venv/bin/python bench/gvisor.py [--n 20] [--shell-calls 300] [--layers DIR] [--image NAME]

Runs an embedded node on a scratch data directory over an existing layer store (the base
layer must exist: `./setup.sh up` or `dsec base`). For each runtime, p50/p99 of:
  - create-to-first-output: run_container + run_shell("echo hi"), then stop (not timed);
  - run_shell("true") round trip in a warm session (SDK -> apiserver -> edge -> sandbox);
  - exec(["true"]): a new process per call (dsec-enter for crun, `runsc exec` for gVisor);
and the gVisor/crun ratio of each p50. Exits 2 when this node has no working gVisor.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _stats import pct
from dsec import DSecClient, DSecContainerRunArgs
from dsec.node.embedded import EmbeddedNode, NodeConfig
from dsec.protocol.errors import InvalidRequest
from dsec.sdk.client import Sandbox


async def measure(
    client: DSecClient, args: DSecContainerRunArgs, n: int, calls: int
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {
        "create-to-first-output": [],
        "run_shell('true')": [],
        "exec(['true'])": [],
    }
    warm = await client.run_container(args)  # page cache, layer mount, runsc binary
    await warm.stop()
    for _ in range(n):
        t = time.perf_counter()
        sb = await client.run_container(args)
        r = await sb.run_shell("echo hi")
        out["create-to-first-output"].append(time.perf_counter() - t)
        assert r.stdout == "hi\n", r
        await sb.stop()
    sb = await client.run_container(args)
    try:
        await timed(sb, calls, out["run_shell('true')"], shell=True)
        await timed(sb, max(1, calls // 5), out["exec(['true'])"], shell=False)
    finally:
        await sb.stop()
    return out


async def timed(sb: Sandbox, calls: int, into: list[float], *, shell: bool) -> None:
    await (sb.run_shell("true") if shell else sb.exec(["true"]))
    for _ in range(calls):
        t = time.perf_counter()
        r = await (sb.run_shell("true") if shell else sb.exec(["true"]))
        into.append(time.perf_counter() - t)
        assert r.exit_code == 0, r


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--shell-calls", type=int, default=300)
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    ap.add_argument("--image", default="debian:bookworm")
    a = ap.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="dsec-bench-gvisor-"))
    node = EmbeddedNode(
        NodeConfig(
            data_dir=scratch, layer_dir=a.layers, port=0, node="bench", config_file=scratch / "config.json"
        )
    )
    await node.start()
    try:
        async with DSecClient(node.url, node.api_key) as client:
            print(f"cores {os.cpu_count()}  image {a.image}  python {sys.version.split()[0]}")
            results = {}
            for runtime in ("crun", "gvisor"):
                args = DSecContainerRunArgs(container_image=a.image, runtime=runtime)  # type: ignore[arg-type]
                try:
                    results[runtime] = await measure(client, args, a.n, a.shell_calls)
                except InvalidRequest as exc:
                    print(f"no gVisor on this node: {exc}")
                    sys.exit(2)
            for name in results["crun"]:
                c, g = results["crun"][name], results["gvisor"][name]
                print(
                    f"{name:<24} crun p50 {pct(c, 50) * 1e3:8.2f} ms p99 {pct(c, 99) * 1e3:8.2f} ms"
                    f"   gvisor p50 {pct(g, 50) * 1e3:8.2f} ms p99 {pct(g, 99) * 1e3:8.2f} ms"
                    f"   ratio {pct(g, 50) / pct(c, 50):6.2f}x"
                )
    finally:
        await node.close(stop_sandboxes=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
