"""What a newcomer runs first: the README's quick-start code as printed there, clients nobody
closes (they must leave no warning at exit), both `with` forms, and `dsec down`."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs
from dsec.node.embedded import EmbeddedNode
from tests import leaks
from tests.conftest import BASE, DATA_DIR
from tests.support import DSEC, dsec_env, start_dsec_up

README = Path(__file__).parents[2] / "README.md"


def quick_start_block(marker: str) -> str:
    """The Python block of the README's quick start that contains ``marker``, as printed."""
    text = README.read_text()
    section = text[text.index("## Quick start") : text.index("## What a sandbox offers")]
    blocks = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", section, re.S)]
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"the quick start has {len(found)} Python blocks with {marker!r}"
    return found[0]


async def run_script(code: str, config: Path) -> tuple[str, str]:
    """``code`` in a fresh interpreter as a user runs it (the config file `dsec up` wrote), with
    every ResourceWarning shown: unclosed sessions, connectors, sockets and transports."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-W",
        "default::ResourceWarning",
        "-c",
        code,
        env=dsec_env(config),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode(), err.decode()


async def running_ids(client: DSecClient) -> set[str]:
    return {sb.id for sb in await client.list()}


async def test_listing_1_as_the_readme_prints_it_leaves_nothing_on_stderr(
    node: EmbeddedNode, client: DSecClient
) -> None:
    before = await running_ids(client)
    out, err = await run_script(quick_start_block("asyncio.run(main())"), node.config.config_file)
    assert out == "hello world\n\n"
    assert err == ""
    assert await running_ids(client) == before  # it stopped its sandbox


async def test_the_readme_sync_quick_start_stops_its_sandbox_and_prints_nothing_else(
    node: EmbeddedNode, client: DSecClient
) -> None:
    before = await running_ids(client)
    out, err = await run_script(quick_start_block("with DSec() as dsec"), node.config.config_file)
    assert (out, err) == ("hello world\n", "")
    assert await running_ids(client) == before


NEVER_CLOSED_SYNC = f"""
from dsec import DSec, DSecContainerRunArgs
sandbox = DSec().run_container(DSecContainerRunArgs(container_image={BASE!r}))
print(sandbox.run_shell("echo sync").stdout, end="")
sandbox.stop()
"""

# Dropped, not closed: the client made in a function and forgotten while the loop runs on.
DROPPED_ASYNC = f"""
import asyncio, gc
from dsec import DSecClient, DSecContainerRunArgs

async def use():
    client = DSecClient()
    sandbox = await client.run_container(DSecContainerRunArgs(container_image={BASE!r}))
    print((await sandbox.run_shell("echo dropped")).stdout, end="")
    await sandbox.stop()

async def main():
    await use()
    gc.collect()
    await asyncio.sleep(0)

asyncio.run(main())
"""

WITH_FORMS = f"""
import asyncio
from dsec import DSec, DSecClient, DSecContainerRunArgs
args = DSecContainerRunArgs(container_image={BASE!r})

async def main():
    async with DSecClient() as client:
        async with await client.run_container(args) as sandbox:
            print((await sandbox.run_shell("echo async-with")).stdout, end="")

asyncio.run(main())
with DSec() as client:
    with client.run_container(args) as sandbox:
        print(sandbox.run_shell("echo with").stdout, end="")
"""


@pytest.mark.parametrize(
    ("code", "printed"),
    [(NEVER_CLOSED_SYNC, "sync\n"), (DROPPED_ASYNC, "dropped\n"), (WITH_FORMS, "async-with\nwith\n")],
    ids=["sync-never-closed", "async-dropped", "with-forms"],
)
async def test_clients_close_without_a_warning(
    node: EmbeddedNode, client: DSecClient, code: str, printed: str
) -> None:
    before = await running_ids(client)
    out, err = await run_script(code, node.config.config_file)
    assert (out, err) == (printed, "")
    assert await running_ids(client) == before


def _mounts_below(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if Path(p).is_relative_to(path)]


@pytest.mark.slow
async def test_dsec_down_stops_what_ctrl_c_left_running(base_layer: str, tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    data_dir = (tmp_path / "node").resolve()
    env = dsec_env(config)
    down = [DSEC, "down", "--data-dir", str(data_dir), "--node", "down", "--no-microvm", "--no-vm"]
    up = await asyncio.to_thread(start_dsec_up, data_dir, DATA_DIR / "layers", config, "down")
    stopped_up = False
    try:
        async with DSecClient(*_url_and_key(config)) as c:
            made = [await c.run_container(DSecContainerRunArgs(container_image=BASE)) for _ in range(2)]
            await made[1].pause()
        refused = await asyncio.to_thread(subprocess.run, down, env=env, capture_output=True, text=True)
        assert refused.returncode == 2 and "a node runs on" in refused.stderr, refused.stderr
        up.send_signal(signal.SIGINT)
        out, _ = await asyncio.to_thread(up.communicate, timeout=60)
        stopped_up = True
        assert b"sandboxes keep running" in out
        left = leaks.snapshot(data_dir)
        assert sorted(left["workdirs"]) == sorted(sb.id for sb in made)  # type: ignore[arg-type]
        assert left["cgroups"] and _mounts_below(data_dir)

        done = await asyncio.to_thread(subprocess.run, down, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "node down is down: stopped 2 sandboxes" in " ".join(done.stdout.split())
        gone = leaks.snapshot(data_dir)
        assert gone["workdirs"] == [] and gone["cgroups"] == []
        assert leaks.own_parents(data_dir) == []
        assert _mounts_below(data_dir) == []
    finally:
        if not stopped_up:
            up.send_signal(signal.SIGINT)
            await asyncio.to_thread(up.communicate, timeout=60)
        # Whatever failed above: nothing of this node outlives the test.
        await asyncio.to_thread(subprocess.run, down, env=env, capture_output=True)


def _url_and_key(config: Path) -> tuple[str, str]:
    raw = json.loads(config.read_text())
    return raw["url"], raw["api_key"]
