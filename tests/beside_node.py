"""The test suite's host-wide tests beside a running `dsec up` node (issue 28), as CI runs them.

Starts `dsec up` on a scratch data directory (its FnCall pool, ksmd and egress as `dsec up`
gives them), holds a few sandboxes in it (one with a background process, one paused), runs the
tests that touch host-wide names (cgroup parents, spare cgroups, ksmd, link pools, leak counts),
then checks that node's sandboxes are as they were: same state, same init, their processes and
files, the pool still answering. Then stops it and removes it, sandboxes included, and checks
it left no cgroup or mount behind.

Two suites run that subset at once, side by side (issue 28: two suites on two data directories):
the first on ``DSEC_TEST_DATA_DIR``, the second on a scratch data directory sharing the first's
layer store (a symlink: no second base build) with a link pool of its own; both must pass.

    .venv/bin/python -m tests.beside_node [pytest arguments instead of the default subset]
    .venv/bin/python -m tests.beside_node --suites 1 [...]   (one suite only)
    .venv/bin/python -m tests.beside_node --command CMD ARG...   (e.g. a benchmark)

Exit status: pytest's (or the command's) if it failed, else 1 if the node beside was disturbed
or not cleaned up.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from dsec.backends.container import cgroups
from dsec.images.mount import mounts_under
from dsec.protocol.models import SandboxState
from dsec.sdk.args import DSecContainerRunArgs
from dsec.sdk.client import DSecClient, Sandbox
from tests.support import DSEC, dsec_env

NODE = "beside"
LAYERS = Path(os.environ.get("DSEC_TEST_DATA_DIR", "/var/lib/dsec-test")) / "layers"
BASE = "debian:bookworm"
# The tests that name, count or clear host-wide things: cgroup parents and spares, restarts that
# re-adopt by scanning cgroups, leak snapshots, ksmd, link pools, FnCall runners.
SUBSET = [
    "tests/backends/test_node_names.py",
    "tests/backends/test_spares.py",
    "tests/unit/test_ksm.py",
    "tests/netpolicy/test_pools.py",
    "tests/fncall/test_runner_layout.py",
    "tests/fncall/test_call_uid_slots.py",
    "tests/e2e/test_pause.py",
    "tests/e2e/test_lifecycle.py",
]
# The second suite's addresses (tests/netpolicy/mirror.py): its session node's link pool, and the
# /24s of its mirror and of the pools single tests configure. In 10.230-10.239 (the tests' and
# benchmarks', which the node-pool picker never takes), where no test or benchmark names them.
SECOND_NETS = [("10.238.0.0/16", "10.239.{}")]
START_DEADLINE_S = 180.0  # a first start mounts the base layer and fills the FnCall pool


def start_node(data: Path, config: Path) -> subprocess.Popen[bytes]:
    log = data.parent / "dsec-up.log"
    argv = [DSEC, "up", "--data-dir", str(data), "--layer-dir", str(LAYERS), "--port", "0", "--node", NODE]
    argv += ["--swap", "file:256", "--no-microvm", "--no-vm", "--fncall-pool-size", "1"]
    with log.open("wb") as out:  # the node keeps its own copy of the descriptor
        proc = subprocess.Popen(argv, env=dsec_env(config), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_DEADLINE_S
    while not config.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"dsec up did not start:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.1)
    return proc


async def hold(client: DSecClient) -> tuple[list[Sandbox], dict[str, object]]:
    """Three sandboxes: a background process and a file in each, the last one paused."""
    boxes = [await client.run_container(DSecContainerRunArgs(container_image=BASE)) for _ in range(3)]
    for i, sb in enumerate(boxes):
        await sb.write_file("/root/mark", f"beside {i}")
        await sb.run_shell("nohup sleep 100000 >/dev/null 2>&1 &")
    await boxes[-1].pause()
    return boxes, await observe(client, boxes)


async def observe(client: DSecClient, boxes: list[Sandbox]) -> dict[str, object]:
    """What must not change: each sandbox's state, cgroups and init's PID (from its memory
    cgroup, as the node placed it), and, for the running ones, their file and sleeper."""
    seen: dict[str, object] = {}
    for sb in boxes:
        state = (await client.get(sb.id)).info.state
        memory = [d for d in cgroups.CGROUP_ROOT.glob(f"memory/dsec-{NODE}-*/*/{sb.id}")]
        procs = sorted((memory[0] / "cgroup.procs").read_text().split()) if memory else []
        seen[sb.id] = {"state": str(state), "cgroup": [str(d) for d in memory], "procs": procs}
        if state is SandboxState.running:
            r = await sb.run_shell("cat /root/mark; cat /proc/[0-9]*/comm | grep -c '^sleep$'")
            seen[sb.id] |= {"inside": r.stdout}  # type: ignore[operator]
    return seen


async def fncall_answers(client: DSecClient) -> bool:
    r = await client.fncall({"language": "python", "code": "print(6 * 7)"})
    return r.stdout == "42\n"


class Job(NamedTuple):
    """One command run beside the node: its name (its output lines' prefix) and environment."""

    name: str
    argv: list[str]
    env: dict[str, str]


def suites(scratch: Path, count: int, pytest_args: list[str]) -> list[Job]:
    """``count`` pytest runs of the same tests, each on a data directory of its own."""
    jobs = []
    for i in range(count):
        name = "ab"[i] if count > 1 else ""
        env = dict(os.environ)
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
        if i:
            data = scratch / f"suite-{name}"
            data.mkdir()
            # The layer store holds blobs and a catalogue, written by atomic renames: nodes
            # share it (each mounts under its own data directory), so no second base build.
            (data / "layers").symlink_to(LAYERS)
            pool, nets = SECOND_NETS[i - 1]
            env |= {"DSEC_TEST_DATA_DIR": str(data), "DSEC_TEST_EGRESS_POOL": pool, "DSEC_TEST_NETS": nets}
            argv.append(f"--basetemp={scratch / f'pytest-{name}'}")
        jobs.append(Job(name, argv, env))
    return jobs


async def run_job(job: Job) -> int:
    """Run one job, its output prefixed with its name (two suites' lines interleave)."""
    proc = await asyncio.create_subprocess_exec(
        *job.argv, env=job.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    assert proc.stdout is not None
    prefix = f"[{job.name}] " if job.name else ""
    async for line in proc.stdout:
        sys.stdout.write(prefix + line.decode(errors="replace"))
        sys.stdout.flush()
    rc = await proc.wait()
    print(f"{prefix}exit {rc}", flush=True)
    return rc


async def run(jobs_for: Callable[[Path], list[Job]]) -> int:
    scratch = Path(tempfile.mkdtemp(prefix="dsec-beside-"))
    data, config = scratch / "data", scratch / "config.json"
    proc = start_node(data, config)
    url, key = (json.loads(config.read_text())[k] for k in ("url", "api_key"))
    failures: list[str] = []
    rc = 1
    try:
        async with DSecClient(url, key, timeout=120) as client:
            boxes, before = await hold(client)
            if not await fncall_answers(client):
                failures.append("the node's FnCall pool did not answer before the tests")
            jobs = jobs_for(scratch)
            print(f"beside node {NODE} on {data}: {len(boxes)} sandboxes, {len(jobs)} run(s)", flush=True)
            codes = await asyncio.gather(*(run_job(job) for job in jobs))
            rc = next((c for c in codes if c), 0)
            after = await observe(client, boxes)
            if after != before:
                failures.append(f"the node's sandboxes changed:\n before {before}\n after  {after}")
            if not await fncall_answers(client):
                failures.append("the node's FnCall pool did not answer after the tests")
            for sb in boxes:
                await sb.stop()
    finally:
        failures += await stop_and_clean(proc, data, config)
        failures += remove_scratch(scratch)
    for f in failures:
        print(f"beside node: {f}", file=sys.stderr)
    return rc or (1 if failures else 0)


def remove_scratch(scratch: Path) -> list[str]:
    """Remove the scratch directory, unless something is still mounted below it (removing a
    mounted layer's files would reach through the mount)."""
    left = [m.mount_point for m in mounts_under(scratch)]
    if left:
        return [f"mounts left below {scratch}, not removed: {left}"]
    shutil.rmtree(scratch, ignore_errors=True)
    return []


async def stop_and_clean(proc: subprocess.Popen[bytes], data: Path, config: Path) -> list[str]:
    """Stop every sandbox left (also after a failure), then the node, then `dsec down` as the
    README says (what a node killed or failed part-way still holds); what it left behind."""
    failures = []
    try:
        if proc.poll() is None and config.exists():
            url, key = (json.loads(config.read_text())[k] for k in ("url", "api_key"))
            async with DSecClient(url, key, timeout=120) as client:
                for left in await client.list():
                    await left.stop()
    except Exception as exc:  # the node is stopped and brought down below all the same
        failures.append(f"stopping the node's sandboxes failed: {exc!r}")
    proc.send_signal(signal.SIGINT)
    try:
        await asyncio.to_thread(proc.wait, 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        failures.append("dsec up did not stop on SIGINT within 120 s")
    failures += [f"dsec up left {left} behind" for left in [leftovers(data)] if left]
    # Whatever happened, `dsec down` releases the rest (so a failed run leaves nothing behind).
    down = [DSEC, "down", "--data-dir", str(data), "--node", NODE, "--layer-dir", str(LAYERS), "--no-microvm"]
    done = await asyncio.to_thread(
        subprocess.run, [*down, "--no-vm"], env=dsec_env(config), capture_output=True, text=True
    )
    if done.returncode != 0:
        failures.append(f"dsec down failed: {done.stdout}{done.stderr}")
    return failures + [f"dsec down left {left} behind" for left in [leftovers(data)] if left]


def leftovers(data: Path) -> list[str]:
    left = [str(p) for p in cgroups.CGROUP_ROOT.glob(f"*/{cgroups.parent_name(NODE, data)}")]
    return left + [m.mount_point for m in mounts_under(data)]


def main(args: list[str]) -> int:
    if args[:1] == ["--command"]:
        return asyncio.run(run(lambda _: [Job("", args[1:], dict(os.environ))]))
    count = 2
    if args[:1] == ["--suites"]:
        count, args = int(args[1]), args[2:]
    if not 1 <= count <= 1 + len(SECOND_NETS):
        raise SystemExit(f"--suites: 1 to {1 + len(SECOND_NETS)}")
    return asyncio.run(run(lambda scratch: suites(scratch, count, args or SUBSET)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
