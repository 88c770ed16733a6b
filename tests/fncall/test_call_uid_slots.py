"""Two edge processes on one host never share FnCall call uids (edge/fncall/pool.py): a
runner kills every process of its call uid after each call, so a `dsec up` beside the test suite
must not hand out the uids the suite's edge does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# An edge process whose PID falls on slot 7, claiming its slot and holding it until told to end.
EDGE = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "from dsec.edge.fncall import pool\n"
    "pool._CALL_UID_CLAIMS = Path(sys.argv[1])\n"
    "os.getpid = lambda: 7\n"
    "print(pool._claim_call_uid_slot(), flush=True)\n"
    "sys.stdin.read()\n"
)


def test_edges_whose_pids_fall_on_one_slot_take_two(tmp_path: Path) -> None:
    edges = []
    try:
        for _ in range(2):
            edge = subprocess.Popen(
                [sys.executable, "-c", EDGE, str(tmp_path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            edges.append(edge)
        slots = [int(e.stdout.readline()) for e in edges]  # type: ignore[union-attr]
        assert sorted(slots) == [7, 8]
        edges[0].communicate("")  # the first edge ends: its slot is free again
        third = subprocess.run(
            [sys.executable, "-c", EDGE, str(tmp_path)], input="", capture_output=True, text=True, check=True
        )
        assert int(third.stdout) == slots[0]
    finally:
        for e in edges:
            e.kill()
            e.communicate()
