"""Commands, 1 MiB files and a watch event through the official ``e2b`` SDK against DSec's own.

    .venv/bin/python bench/e2b.py [--n 100] [--rounds 2] [--version 2.63.0]

An embedded node (containers) serves DSec's API and the E2B front on one loopback port. Two
client processes take turns, ``--rounds`` times, each timing ``--n`` calls in one sandbox of
its own (so neither pays for the other's interpreter, and drift hits both alike):
  - DSec SDK (this venv): ``run_shell("true")`` (the baseline: the sandbox's shell session
    runs it, no process is started), ``exec(["true"])`` (a process started per call through
    dsec-enter, output streamed), and ``exec(["/bin/bash", "-l", "-c", "true"])``, which is what
    E2B's ``commands.run`` starts;
  - e2b SDK (``.venv-e2b-<version>``, made here if missing): ``commands.run("true")``.
Prints the core count, p50/p99 of each and each p50 as a ratio to the baseline, so the gap can
be read as: process start (exec - run_shell), a login shell (bash -l - exec), and the E2B path's
own cost, Connect framing, its SDK and HTTP client (commands.run - bash -l exec).

Files, same turns: 1 MiB of random bytes written and read back, DSec's ``write_file`` and
``read_file`` (the baseline) against e2b's ``files.write`` and ``files.read(format="bytes")``,
and into a shared volume: DSec's ``write_volume_file``/``read_volume_file`` and e2b's
``Volume.write_file``/``read_file`` (the content API with the volume's token), each against
the same sandbox-file baseline.

A watch event's latency, from the start of a write to the first event naming the written file:
e2b's async ``files.watch_dir`` with ``files.write`` of a small file, against the edge's own
watch and write through the node's in-process link (the baseline: DSec's SDK has no watch;
this is the inotify path the E2B route streams from, without HTTP or an SDK in between).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

from _node import scratch_node
from _stats import pct
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.models import ContainerSpec

REPO = Path(__file__).resolve().parents[1]

DSEC_CLIENT = """
import asyncio, json, sys, time
import os
from dsec import DSecClient, DSecContainerRunArgs
MIB = os.urandom(1 << 20)
async def main(url, key, n):
    async with DSecClient(url, key) as client:
        sb = await client.run_container(DSecContainerRunArgs(container_image="debian:bookworm"))
        vol = await client.create_volume("bench-dsec", size_mb=64)
        out = {}
        calls = {
            "run_shell": lambda: sb.run_shell("true"),
            "exec": lambda: sb.exec(["true"]),
            "exec_bash_login": lambda: sb.exec(["/bin/bash", "-l", "-c", "true"]),
            "write_1m": lambda: sb.write_file("/tmp/one-mib", MIB),
            "read_1m": lambda: sb.read_file("/tmp/one-mib"),
            "vol_write_1m": lambda: client.write_volume_file(vol.id, "/one-mib", MIB),
            "vol_read_1m": lambda: client.read_volume_file(vol.id, "/one-mib"),
        }
        for name, call in calls.items():
            await call()  # warm
            lat = []
            for _ in range(n):
                t = time.perf_counter()
                await call()
                lat.append(time.perf_counter() - t)
            out[name] = lat
        await sb.stop()
        await client.delete_volume(vol.id)
    print(json.dumps(out))
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""

E2B_CLIENT = """
import json, os, sys, time
from e2b import Sandbox, Volume
n = int(sys.argv[1])
MIB = os.urandom(1 << 20)
sbx = Sandbox.create(timeout=600)
vol = Volume.create("bench-e2b")
calls = {
    "e2b_commands_run": lambda: sbx.commands.run("true"),
    "e2b_files_write_1m": lambda: sbx.files.write("/tmp/one-mib", MIB),
    "e2b_files_read_1m": lambda: sbx.files.read("/tmp/one-mib", format="bytes"),
    "e2b_volume_write_1m": lambda: vol.write_file("/one-mib", MIB, force=True),
    "e2b_volume_read_1m": lambda: vol.read_file("/one-mib", format="bytes"),
}
out = {}
for name, call in calls.items():
    call()  # warm
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        lat.append(time.perf_counter() - t)
    out[name] = lat
assert sbx.files.read("/tmp/one-mib", format="bytes") == MIB
assert vol.read_file("/one-mib", format="bytes") == MIB
sbx.kill()
Volume.destroy(vol.volume_id)
print(json.dumps(out))
sys.stdout.flush()
os._exit(0)  # e2b 2.63's client may abort at interpreter exit (docs/e2b.md)
"""

E2B_WATCH = """
import asyncio, json, os, sys, time
from e2b import AsyncSandbox
async def main(n):
    sbx = await AsyncSandbox.create(timeout=600)
    await sbx.files.make_dir("/tmp/w")
    seen = {}
    def on_event(ev):
        seen.setdefault(ev.name, time.perf_counter())
        if ev.name in waiting:
            waiting.pop(ev.name).set()
    waiting = {}
    handle = await sbx.files.watch_dir("/tmp/w", on_event, timeout=0)
    lat = []
    for i in range(n + 1):
        name = f"f{i}"
        waiting[name] = got = asyncio.Event()
        t = time.perf_counter()
        await sbx.files.write(f"/tmp/w/{name}", b"x")
        await got.wait()
        if i:  # the first one warms
            lat.append(seen[name] - t)
    await handle.stop()
    await sbx.kill()
    return lat
lat = asyncio.run(main(int(sys.argv[1])))
print(json.dumps({"e2b_watch_event": lat}))
sys.stdout.flush()
os._exit(0)
"""


def e2b_python(version: str) -> Path:
    """The tests' venv for this SDK version (``.venv-e2b-2.63``), made if missing."""
    venv = REPO / f".venv-e2b-{version.rsplit('.', 1)[0]}"
    if not (venv / f".installed-{version}").exists():
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"e2b=={version}"], check=True)
        (venv / f".installed-{version}").touch()
    return venv / "bin" / "python"


async def child(argv: list[str], env: dict[str, str]) -> dict[str, list[float]]:
    pipe = subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=pipe, stderr=pipe)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed:\n{err.decode()}")
    result: dict[str, list[float]] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def link_watch(node: EmbeddedNode, n: int) -> dict[str, list[float]]:
    """The baseline of a watch event: the edge's watch and write through the in-process link."""
    sid = (await node.link.create(ContainerSpec(image="debian:bookworm"))).id
    events = node.link.watch_dir(sid, "/tmp", False)
    seen: dict[str, float] = {}
    waiting: dict[str, asyncio.Event] = {}

    async def consume() -> None:
        async for ev in events:
            seen.setdefault(ev.name, time.perf_counter())
            if ev.name in waiting:
                waiting.pop(ev.name).set()

    async def one_byte() -> AsyncIterator[bytes]:
        yield b"x"

    try:
        assert (await anext(events)).t == "start"
        task = asyncio.create_task(consume())
        lat = []
        for i in range(n + 1):
            name = f"f{i}"
            waiting[name] = got = asyncio.Event()
            t = time.perf_counter()
            await node.link.write_stream(sid, f"/tmp/{name}", one_byte())
            await got.wait()
            if i:  # the first one warms
                lat.append(seen[name] - t)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await events.aclose()
        await node.link.stop(sid)
    return {"link_watch_event": lat}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--version", default="2.63.0")
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    a = ap.parse_args()
    e2b = await asyncio.to_thread(e2b_python, a.version)
    async with scratch_node("e2b", a.layers) as node:
        key = await node.iam.issue_key("root", format="e2b", name="bench/e2b")
        base = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
        e2b_env = {**base, "E2B_API_URL": node.url, "E2B_SANDBOX_URL": node.url, "E2B_API_KEY": key}
        e2b_env["E2B_VOLUME_API_URL"] = node.url
        lat: dict[str, list[float]] = {}
        for _ in range(a.rounds):
            dsec_argv = [sys.executable, "-c", textwrap.dedent(DSEC_CLIENT), node.url, key, str(a.n)]
            e2b_argv = [str(e2b), "-c", textwrap.dedent(E2B_CLIENT), str(a.n)]
            watch_argv = [str(e2b), "-c", textwrap.dedent(E2B_WATCH), str(a.n)]
            for got in (
                await child(dsec_argv, base),
                await child(e2b_argv, e2b_env),
                await link_watch(node, a.n),
                await child(watch_argv, e2b_env),
            ):
                for name, values in got.items():
                    lat.setdefault(name, []).extend(values)
        print(f"cores {os.cpu_count()}  n {a.n} x {a.rounds} rounds  e2b {a.version}")
        for name, label, baseline in (
            ("run_shell", 'DSec run_shell("true") (baseline)', "run_shell"),
            ("exec", 'DSec exec(["true"])', "run_shell"),
            ("exec_bash_login", 'DSec exec(["/bin/bash", "-l", "-c", "true"])', "run_shell"),
            ("e2b_commands_run", 'e2b commands.run("true")', "run_shell"),
            ("write_1m", "DSec write_file 1 MiB (baseline)", "write_1m"),
            ("e2b_files_write_1m", "e2b files.write 1 MiB", "write_1m"),
            ("read_1m", "DSec read_file 1 MiB (baseline)", "read_1m"),
            ("e2b_files_read_1m", 'e2b files.read 1 MiB (format="bytes")', "read_1m"),
            ("vol_write_1m", "DSec write_volume_file 1 MiB", "write_1m"),
            ("e2b_volume_write_1m", "e2b Volume.write_file 1 MiB", "write_1m"),
            ("vol_read_1m", "DSec read_volume_file 1 MiB", "read_1m"),
            ("e2b_volume_read_1m", 'e2b Volume.read_file 1 MiB (format="bytes")', "read_1m"),
            ("link_watch_event", "edge watch via the link, write to event (baseline)", "link_watch_event"),
            ("e2b_watch_event", "e2b async watch_dir, files.write to event", "link_watch_event"),
        ):
            p50, p99, base50 = pct(lat[name], 50), pct(lat[name], 99), pct(lat[baseline], 50)
            print(f"  {label:<52} p50 {p50 * 1e3:7.2f} ms  p99 {p99 * 1e3:7.2f} ms  {p50 / base50:5.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
