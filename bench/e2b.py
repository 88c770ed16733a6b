"""A command round trip through the official ``e2b`` SDK against DSec's own SDK, same node.

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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from _node import scratch_node
from _stats import pct

REPO = Path(__file__).resolve().parents[1]

DSEC_CLIENT = """
import asyncio, json, sys, time
from dsec import DSecClient, DSecContainerRunArgs
async def main(url, key, n):
    async with DSecClient(url, key) as client:
        sb = await client.run_container(DSecContainerRunArgs(container_image="debian:bookworm"))
        out = {}
        calls = {
            "run_shell": lambda: sb.run_shell("true"),
            "exec": lambda: sb.exec(["true"]),
            "exec_bash_login": lambda: sb.exec(["/bin/bash", "-l", "-c", "true"]),
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
    print(json.dumps(out))
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""

E2B_CLIENT = """
import json, sys, time
from e2b import Sandbox
n = int(sys.argv[1])
sbx = Sandbox.create(timeout=600)
sbx.commands.run("true")  # warm
lat = []
for _ in range(n):
    t = time.perf_counter()
    sbx.commands.run("true")
    lat.append(time.perf_counter() - t)
sbx.kill()
print(json.dumps({"e2b_commands_run": lat}))
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
        lat: dict[str, list[float]] = {}
        for _ in range(a.rounds):
            dsec_argv = [sys.executable, "-c", textwrap.dedent(DSEC_CLIENT), node.url, key, str(a.n)]
            e2b_argv = [str(e2b), "-c", textwrap.dedent(E2B_CLIENT), str(a.n)]
            for got in (await child(dsec_argv, base), await child(e2b_argv, e2b_env)):
                for name, values in got.items():
                    lat.setdefault(name, []).extend(values)
        print(f"cores {os.cpu_count()}  n {a.n} x {a.rounds} rounds  e2b {a.version}")
        baseline = pct(lat["run_shell"], 50)
        for name, label in (
            ("run_shell", 'DSec run_shell("true") (baseline)'),
            ("exec", 'DSec exec(["true"])'),
            ("exec_bash_login", 'DSec exec(["/bin/bash", "-l", "-c", "true"])'),
            ("e2b_commands_run", 'e2b commands.run("true")'),
        ):
            p50, p99 = pct(lat[name], 50), pct(lat[name], 99)
            print(f"  {label:<48} p50 {p50 * 1e3:7.2f} ms  p99 {p99 * 1e3:7.2f} ms  {p50 / baseline:5.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
