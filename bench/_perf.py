"""`perf record -a -g` around one part of a benchmark (the benches' --perf DIR)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path


@contextlib.asynccontextmanager
async def recording(out: Path | None, name: str) -> AsyncIterator[None]:
    """Record the whole machine into ``out/perf-<name>.data`` while the block runs; nothing
    when ``out`` is None."""
    if out is None:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    perf = await asyncio.create_subprocess_exec(
        *["perf", "record", "-a", "-g", "-o", str(out / f"perf-{name}.data")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    await asyncio.sleep(1)  # perf's own start-up stays out of what the block measures
    try:
        yield
    finally:
        perf.send_signal(signal.SIGINT)
        await perf.wait()
