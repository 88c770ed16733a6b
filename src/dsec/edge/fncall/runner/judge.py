"""What a finished run of a call was: its status (timeout, memory_exceeded, wrong_answer...).

Kept apart from running the call: it is pure (a wait status, rusage and the captured output
in, fields of an FnResult out), and it is where the FnResult doc's rules for each status live.
"""

from __future__ import annotations

import math
import os
import re
import signal
from typing import Any

from .capture import Proc
from .wire import Task

# A failing program with one of these in the tail of its stderr ran out of memory (FnResult doc).
MEMORY_RE = re.compile(rb"std::bad_alloc|MemoryError|[Cc]annot allocate|[Oo]ut of memory")


def _lines(text: str) -> list[str]:
    """The judge's view of an output: trailing whitespace of lines and trailing blank lines ignored."""
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def exit_code(status: int) -> tuple[int | None, int | None]:
    """A wait status as (exit code, None) or (None, signal)."""
    return (os.WEXITSTATUS(status), None) if os.WIFEXITED(status) else (None, os.WTERMSIG(status))


def classify(res: dict[str, Any], run: Proc, t: Task) -> None:
    """Fill ``res`` in from a finished run: what it printed, what it used, and its status."""
    code, sig = exit_code(run.status)
    stdout = run.out.text()
    res.update(exit_code=code, signal=sig, stdout=stdout, stderr=run.err.text())
    res.update(stdout_truncated=run.out.truncated, stderr_truncated=run.err.truncated)
    res.update(run_time_s=run.wall_s, cpu_time_s=run.cpu_s, max_rss_kib=run.maxrss_kib)
    killed = sig == signal.SIGKILL
    if run.timed_out or sig == signal.SIGXCPU or (killed and run.cpu_s >= math.ceil(t.run_timeout_s) + 1):
        status = "timeout"
    elif code != 0 and (
        (run.marker[:1] == b"S" and b"M" in run.marker[1:])
        or MEMORY_RE.search(run.err.tail)
        or (killed and t.memory_limit_mb is None)  # only the sandbox's cgroup OOM kills it then
        or (
            killed
            and t.memory_limit_mb is not None
            and run.maxrss_kib * 1024 >= 0.9 * (t.memory_limit_mb << 20)
        )
    ):
        status = "memory_exceeded"
    elif code != 0:
        status = "runtime_error"
    elif run.out.truncated or run.err.truncated:
        status = "output_truncated"
    elif t.expected_stdout is not None and _lines(stdout) != _lines(t.expected_stdout):
        status = "wrong_answer"
    else:
        status = "ok"
    res["status"] = status
    res["judged"] = None if t.expected_stdout is None else status == "ok"
