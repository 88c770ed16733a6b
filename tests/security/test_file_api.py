"""The file API acts with the edge's host privileges, so it must refuse what the sandbox
itself could not read: kernel files (procfs, sysfs...) reached through a symlink the agent
plants. Found by the escape suite: /proc/1/stack and /proc/kallsyms read as host root, and a
read of /proc/kmsg blocked an edge thread on the HOST kernel log."""

from __future__ import annotations

import asyncio

import pytest

from dsec import DSecError, Sandbox


async def test_file_api_reads_nothing_the_sandbox_itself_cannot(sandbox: Sandbox) -> None:
    await sandbox.run_shell(
        "mkdir -p /work && ln -s /proc/1/stack /work/result.txt && ln -s /proc/kallsyms /work/symbols.txt",
        timeout=60,
    )
    inside = await sandbox.run_shell("cat /work/result.txt", timeout=60)
    assert inside.exit_code != 0 and "Permission denied" in inside.stderr, inside
    symbols_inside = (await sandbox.exec(["head", "-c", "4096", "/proc/kallsyms"], timeout=60)).stdout
    problems = []
    try:
        data = await sandbox.read_file("/work/result.txt")
        problems.append(f"/proc/1/stack through a symlink: {data[:120]!r}")
    except DSecError:
        pass
    try:
        data = await sandbox.read_file("/work/symbols.txt")
        if not data.decode().startswith(symbols_inside[:4096]):
            problems.append(f"/proc/kallsyms: API {data[:60]!r} vs inside {symbols_inside[:60]!r}")
    except DSecError:
        pass
    assert problems == []


async def test_file_api_read_of_kmsg_fails_instead_of_blocking(sandbox: Sandbox) -> None:
    await sandbox.run_shell("mkdir -p /work && ln -s /proc/kmsg /work/log.txt", timeout=60)
    with pytest.raises(DSecError, match="is a proc file"):
        await asyncio.wait_for(sandbox.read_file("/work/log.txt"), 30)  # a hang would fail, not wedge
