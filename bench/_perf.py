"""`perf record -a -g` around one part of a benchmark (the benches' --perf DIR).

On the VMs this project is measured on, perf records nothing of PID 1 (the platform's agent):
its CPU shows as idle time. Read it from /proc/1/stat instead (bench/density.py does)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path


def _enable(control: Path, ack: Path) -> None:
    with control.open("w") as ctl, ack.open() as answer:  # each open waits for perf's side
        ctl.write("enable\n")
        ctl.flush()
        if answer.readline().strip() != "ack":
            raise RuntimeError("perf did not acknowledge enable")


@contextlib.asynccontextmanager
async def recording(out: Path | None, name: str, events: tuple[str, ...] = ()) -> AsyncIterator[None]:
    """Record the whole machine into ``out/perf-<name>.data`` while the block runs; nothing
    when ``out`` is None. perf starts disabled and only FORK/COMM of existing tasks are read
    from /proc (``--synth=task``: at 8,000 sandboxes, reading every task's maps took longer
    than the probe); the block starts once perf acknowledged that it records."""
    if out is None:
        yield
        return
    if shutil.which("perf") is None:
        raise SystemExit("--perf needs perf (apt-get install linux-perf)")
    out.mkdir(parents=True, exist_ok=True)
    control, ack = out / f".{name}.ctl", out / f".{name}.ack"
    for fifo in (control, ack):
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo)
    perf = await asyncio.create_subprocess_exec(
        *["perf", "record", "-a", "-g", "--synth=task", "-D", "-1"],
        *[arg for event in events for arg in ("-e", event)],
        *["--control", f"fifo:{control},{ack}", "-o", str(out / f"perf-{name}.data")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await asyncio.to_thread(_enable, control, ack)
        yield
    finally:
        perf.send_signal(signal.SIGINT)
        await perf.wait()
        control.unlink(missing_ok=True)
        ack.unlink(missing_ok=True)
