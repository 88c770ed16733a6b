"""A runner started ``--mergeable`` (as an edge running ksmd starts them): it lays its memory out
as every other runner of its pool does and marks it for KSM, while the programs its calls
exec get address randomization back. On the host, as the other runner tests."""

from __future__ import annotations

import ctypes
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.edge.fncall import RUNNER_PATH
from tests.fncall.client import SYSTEM_PYTHON, Runner, fresh_uid, kill_leftovers
from tests.support import mapping_flags

# What a call sees of its own layout: its personality (0x40000 is ADDR_NO_RANDOMIZE: what it
# execs would not be randomized), where a preloaded module's object lives, and a string's hash.
LAYOUT = (
    "import ctypes, json\n"
    "print(hex(ctypes.CDLL(None).personality(0xFFFFFFFF)), hex(id(json)), hash('dsec'))\n"
)
PERSONALITY_C = (
    "#include <stdio.h>\n#include <sys/personality.h>\n"
    'int main(void){ printf("%#x\\n", personality(0xffffffff)); return 0; }\n'
)


@pytest.fixture
def runners(tmp_path: Path) -> Iterator[list[Runner]]:
    made: list[Runner] = []
    try:
        yield made
    finally:
        for r in made:
            rc = r.close()
            assert kill_leftovers(r.uid) == []
            assert rc == 0


def start(runners: list[Runner], tmp_path: Path, **kw: object) -> Runner:
    r = Runner(tmp_path / f"w{len(runners)}", **kw)  # type: ignore[arg-type]
    runners.append(r)
    return r


def heap(line: str) -> bool:
    return line.split()[-1] == "[heap]"


def first_heap_flags(pid: int) -> set[str]:
    """The VmFlags of ``pid``'s lowest [heap] mapping: where the preloads' objects were when the
    runner marked its memory and forked the zygote. The heap may grow past it later (a brk past
    a marked mapping makes an unmarked one): whether it does depends on the host, not on the
    mark (it did with a `dsec up` node running beside the suite), so the last mapping says
    nothing about what the zygote inherited."""
    smaps = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    starts = [i for i, line in enumerate(smaps) if not line[:1].isupper() and heap(line)]
    assert starts, f"process {pid} has no heap"
    flags = next(line for line in smaps[starts[0] :] if line.startswith("VmFlags:"))
    return set(flags.split()[1:])


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_mergeable_runner_marks_what_its_preloads_built(runners: list[Runner], tmp_path: Path) -> None:
    r = start(runners, tmp_path, mergeable=7)
    assert r.ready.fixed_layout and r.ready.mergeable_bytes > 1 << 20, r.ready
    zygotes = children(r.proc.pid)
    assert len(zygotes) == 2  # the lean one, forked before the preloads, and the warm one
    assert "mg" in mapping_flags(r.proc.pid, heap)  # madvise(MADV_MERGEABLE): ksmd scans it
    # Each zygote was forked after a mark: calls come from them.
    assert all("mg" in first_heap_flags(z) for z in zygotes), zygotes


def test_runners_of_one_pool_lay_out_their_memory_alike(runners: list[Runner], tmp_path: Path) -> None:
    a, b = (start(runners, tmp_path, mergeable=7) for _ in range(2))
    other = start(runners, tmp_path, mergeable=8)
    plain = start(runners, tmp_path)
    seen = [r.call(language="python", code=LAYOUT).stdout.split() for r in (a, b, other, plain)]
    assert seen[0] == seen[1], seen  # same addresses, same hashes: the same pages
    assert seen[2][2] != seen[0][2]  # another pool's seed
    assert not plain.ready.fixed_layout and plain.ready.mergeable_bytes == 0
    assert seen[3][1:] != seen[0][1:]  # randomized as ever
    # The call's own process keeps the zygote's layout, but what it would exec is randomized.
    assert [s[0] for s in seen] == ["0x0"] * 4


def test_programs_a_call_execs_get_address_randomization_back(runners: list[Runner], tmp_path: Path) -> None:
    r = start(runners, tmp_path, mergeable=7)
    assert r.call(language="bash", code="cat /proc/self/personality").stdout == "00000000\n"
    c = r.call(language="c", code=PERSONALITY_C)
    assert (c.status, c.stdout) == ("ok", "0\n"), c
    # A Python call runs in the warm process (the pool's layout); what it starts is randomized.
    code = (
        "import subprocess as s\nprint(s.run(['cat', '/proc/self/personality'], capture_output=True).stdout)"
    )
    assert r.call(language="python", code=code).stdout == "b'00000000\\n'\n"


def test_an_operators_persona_is_left_as_it_is(tmp_path: Path) -> None:
    # Under `setarch -R` the runner starts without randomization already: it does not re-exec,
    # and what its calls exec keeps the operator's choice.
    # A call uid of its own: a runner kills every process of its call uid after each call, so a
    # fixed one killed this call when a suite beside ran the same test (CI's beside-node run).
    uid = str(fresh_uid())
    argv = ["setarch", "-R", SYSTEM_PYTHON, str(RUNNER_PATH), "--workdir", str(tmp_path / "w")]
    argv += ["--uid", uid, "--gid", uid, "--mergeable", "7"]
    task = b'{"language": "bash", "code": "cat /proc/self/personality"}\n'
    try:
        done = subprocess.run(argv, input=task, capture_output=True, timeout=60, check=True)
    finally:
        assert kill_leftovers(int(uid)) == []
    ready, result = (line for line in done.stdout.decode().splitlines())
    assert '"fixed_layout": false' in ready and '"mergeable_bytes": 0' not in ready
    assert '"stdout": "00040000\\n"' in result
    assert ctypes.CDLL(None).personality(0xFFFFFFFF) == 0  # this process was never touched
    assert os.listdir(tmp_path / "w") == []
