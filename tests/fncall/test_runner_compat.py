"""What SandboxFusion's clients rely on, at the runner (issue 29): no per-call memory limit when
none is asked for, real thread counts, POSIX semaphores in /dev/shm, absolute paths in and out;
each cleaned after the call. A real runner as root on the host, as in ``test_runner.py``."""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.edge.fncall.runner import process as runner_module
from tests.fncall.client import Runner, procs_of

THREADS = """
import threading
n = int(input())
barrier = threading.Barrier(n + 1)  # every thread alive at once, not one after another
threads = [threading.Thread(target=barrier.wait) for _ in range(n)]
try:
    for t in threads:
        t.start()
except BaseException:
    barrier.abort()  # the started ones end with BrokenBarrierError; the error is the answer
    raise
barrier.wait()
for t in threads:
    t.join()
print("started", n)
"""


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A root-owned 0755 directory outside the runner's, reachable by the call uid (as /mnt is)."""
    d = Path(f"/tmp/dsec-fncall-abs-{secrets.token_hex(6)}")
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_no_memory_limit_means_the_pool_sandboxs_memory_only(runner: Runner) -> None:
    code = "b = bytearray(400 << 20); print(len(b) >> 20)"
    r = runner.call(language="python", code=code, memory_limit_mb=None)
    assert (r.status, r.stdout) == ("ok", "400\n"), r.stderr
    limited = runner.call(language="python", code=code, memory_limit_mb=256)
    assert limited.status == "memory_exceeded"


def test_a_call_can_run_over_a_thousand_threads_at_once_and_no_more_than_its_bound(runner: Runner) -> None:
    r = runner.call(language="python", code=THREADS, stdin="1100\n", memory_limit_mb=None, run_timeout_s=60)
    assert (r.status, r.stdout) == ("ok", "started 1100\n"), r.stderr[-2000:]
    over = runner.call(
        language="python",
        code=THREADS,
        stdin=f"{runner_module.NPROC + 10}\n",
        memory_limit_mb=None,
        run_timeout_s=60,
    )
    assert over.status == "runtime_error" and "can't start new thread" in over.stderr, over.stderr[-2000:]
    assert (over.clean, procs_of(runner.uid)) == (True, [])


def test_multiprocessing_pool_works_and_its_semaphores_are_removed_after(runner: Runner) -> None:
    code = (
        "import multiprocessing as mp\n"
        "with mp.Pool(4) as p:\n"
        "    print(sum(p.map(abs, range(-100, 0))))\n"
        "import os, sys\n"
        "sem = mp.Semaphore()\n"  # a named POSIX semaphore, left behind on purpose
        "sys.stdout.flush()\n"
        "os._exit(0)\n"
    )
    r = runner.call(language="python", code=code, memory_limit_mb=None)
    assert (r.status, r.stdout) == ("ok", "5050\n"), r.stderr
    assert r.clean
    assert [e for e in os.scandir("/dev/shm") if e.stat(follow_symlinks=False).st_uid == runner.uid] == []


def test_absolute_paths_go_in_and_come_back_and_are_gone_after(runner: Runner, open_dir: Path) -> None:
    given, made, out = open_dir / "in/deep/a.txt", open_dir / "out.txt", open_dir / "new/b.txt"
    code = (
        f"data = open({str(given)!r}).read()\n"
        f"open({str(made)!r}, 'w').write(data.upper())\n"
        f"open({str(out)!r}, 'w').write('sauce')\n"
        "open('rel.txt', 'w').write('r')\n"
    )
    (open_dir / "image.txt").write_text("the pool sandbox's own")
    r = runner.call(
        language="python",
        code=code,
        files={str(given): base64.b64encode(b"secret").decode()},
        fetch_files=[str(made), str(out), "rel.txt", str(open_dir / "image.txt"), str(open_dir / "missing")],
    )
    assert r.status == "ok", r.stderr
    assert (r.file_bytes(str(made)), r.file_bytes(str(out)), r.file_bytes("rel.txt")) == (
        b"SECRET",
        b"sauce",
        b"r",
    )
    assert set(r.fetch_errors) == {str(open_dir / "image.txt"), str(open_dir / "missing")}
    assert r.clean
    # Everything the call made is gone, the directory it was let into is as it was.
    assert sorted(p.name for p in open_dir.iterdir()) == ["image.txt"]
    assert stat.S_IMODE(open_dir.stat().st_mode) == 0o755


def test_a_call_cannot_plant_a_link_to_fetch_through(runner: Runner, open_dir: Path) -> None:
    code = f"import os; os.symlink('/root', {str(open_dir / 'd')!r})"
    first = runner.call(language="python", code=code, fetch_files=[str(open_dir / "x")])
    assert first.status == "ok" and first.clean, first.stderr
    # Within one call: a link made by the call itself on the way to a fetched file.
    # The runner made d for the call and opened open_dir to it (for "out"); the call swaps d for a link.
    code = f"import os; os.rmdir({str(open_dir / 'd')!r}); os.symlink('/etc', {str(open_dir / 'd')!r})"
    r = runner.call(
        language="python", code=code, fetch_files=[str(open_dir / "out"), str(open_dir / "d/hostname")]
    )
    assert r.status == "ok", r.stderr
    assert r.files == {} and r.fetch_errors[str(open_dir / "d/hostname")] == "a link on the way"
    assert r.clean and list(open_dir.iterdir()) == []


def test_an_absolute_input_file_may_not_replace_one_of_the_sandbox(runner: Runner, open_dir: Path) -> None:
    (open_dir / "taken").write_text("mine")
    r = runner.call(language="python", code="print(1)", files={str(open_dir / "taken"): ""})
    assert r.status == "internal_error" and "exists" in r.stderr
    assert (open_dir / "taken").read_text() == "mine" and r.clean
