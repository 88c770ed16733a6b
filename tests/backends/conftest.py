"""Fixtures shared by the backend tests."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.backends.microvm import host, kit


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Path]:
    """The guest agent built as the kit builds it, listening on a unix socket on this host
    (the vsock mode's connection handling), as PID 1 of a PID namespace of its own with its
    own /proc (the PIDs it reads there are its children's): its fatal() powers off, which
    there only ends the namespace."""
    if shutil.which("gcc") is None or shutil.which("unshare") is None:
        pytest.skip("gcc and unshare are needed to run the agent here")
    binary = tmp_path / "agent"
    await asyncio.to_thread(kit._compile_agent, binary)
    sock = host.SOCKET_ROOT / f"test-agent-{os.getpid()}-{tmp_path.name[-12:]}.sock"
    sock.parent.mkdir(parents=True, exist_ok=True)
    sock.unlink(missing_ok=True)
    proc = await asyncio.create_subprocess_exec(
        "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
        str(binary), f"unix:{sock}", "/",
        stdin=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield sock
    finally:
        proc.kill()
        await proc.wait()
        sock.unlink(missing_ok=True)
