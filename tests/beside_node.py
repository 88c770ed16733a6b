"""The test suite's host-wide tests beside a running `dsec up` node (issue 28), as CI runs them.

Starts `dsec up` on a scratch data directory (its FnCall pool, ksmd and egress as `dsec up`
gives them), holds a few sandboxes in it (one with a background process, one paused), runs the
tests that touch host-wide names (cgroup parents, spare cgroups, ksmd, link pools, leak counts),
then checks that node's sandboxes are as they were: same state, same init, their processes and
files, the pool still answering. Then stops it and removes it, sandboxes included, and checks
it left no cgroup or mount behind.

    .venv/bin/python -m tests.beside_node [pytest arguments instead of the default subset]
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
from pathlib import Path

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


async def run(command: list[str]) -> int:
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
            print(f"beside node {NODE} on {data}: {len(boxes)} sandboxes held", flush=True)
            rc = (await asyncio.to_thread(subprocess.run, command)).returncode
            after = await observe(client, boxes)
            if after != before:
                failures.append(f"the node's sandboxes changed:\n before {before}\n after  {after}")
            if not await fncall_answers(client):
                failures.append("the node's FnCall pool did not answer after the tests")
            for sb in boxes:
                await sb.stop()
    finally:
        failures += await stop_and_clean(proc, data, config)
        shutil.rmtree(scratch, ignore_errors=True)
    for f in failures:
        print(f"beside node: {f}", file=sys.stderr)
    return rc or (1 if failures else 0)


async def stop_and_clean(proc: subprocess.Popen[bytes], data: Path, config: Path) -> list[str]:
    """Stop every sandbox left (also after a failure), then the node; what it left behind."""
    if proc.poll() is None and config.exists():
        url, key = (json.loads(config.read_text())[k] for k in ("url", "api_key"))
        async with DSecClient(url, key, timeout=120) as client:
            for left in await client.list():
                await left.stop()
    proc.send_signal(signal.SIGINT)
    try:
        await asyncio.to_thread(proc.wait, 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return ["dsec up did not stop on SIGINT within 120 s"]
    left = [str(p) for p in cgroups.CGROUP_ROOT.glob(f"*/{cgroups.parent_name(NODE, data)}")]
    left += [m.mount_point for m in mounts_under(data)]
    return [f"the node left {left} behind"] if left else []


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--command"]:
        command = args[1:]
    else:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(args or SUBSET)]
    sys.exit(asyncio.run(run(command)))
