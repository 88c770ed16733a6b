"""Core scheduling: the node's probe, its capability report, and which processes get a cookie.

The kernel side (PR_SCHED_CORE) is replaced by a fake where a test needs an answer this host
cannot give (this kernel has no CONFIG_SCHED_CORE and the CPU no SMT). The real sandboxes, with
the helper's calls recorded, are in tests/backends/test_coresched.py.
"""

from __future__ import annotations

import ctypes
import errno
from pathlib import Path

import pytest

from dsec.backends.base import User
from dsec.backends.container.backend import ContainerBackend
from dsec.backends.container.handle import ContainerHandle
from dsec.density import coresched
from dsec.density.coresched import Support
from dsec.native import enter

ROOT = User(name="root", uid=0, gid=0, home="/")


def sysfs(tmp: Path, *, active: str | None, siblings: list[str]) -> Path:
    if active is not None:
        (tmp / "smt").mkdir(parents=True)
        (tmp / "smt" / "active").write_text(active + "\n")
    for i, cpus in enumerate(siblings):
        (tmp / f"cpu{i}" / "topology").mkdir(parents=True)
        (tmp / f"cpu{i}" / "topology" / "thread_siblings_list").write_text(cpus + "\n")
    return tmp


def fake_prctl(monkeypatch: pytest.MonkeyPatch, err: int | None) -> list[tuple[int, ...]]:
    calls: list[tuple[int, ...]] = []

    def prctl(*args: int) -> int:
        calls.append(args)
        if err is not None:
            raise OSError(err, "fake")
        return 0

    monkeypatch.setattr(coresched, "_prctl", prctl)
    return calls


def test_threads_per_core_from_smt_active_or_the_sibling_lists(tmp_path: Path) -> None:
    assert coresched.smt_threads_per_core(sysfs(tmp_path / "a", active="0", siblings=["0-1"])) == 1
    assert coresched.smt_threads_per_core(sysfs(tmp_path / "b", active="1", siblings=["0,2", "1,3"])) == 2
    assert coresched.smt_threads_per_core(sysfs(tmp_path / "c", active=None, siblings=["0-3", "4"])) == 4
    assert coresched.smt_threads_per_core(sysfs(tmp_path / "d", active=None, siblings=["0", "1"])) == 1
    assert coresched.smt_threads_per_core(tmp_path / "nothing") is None


def test_probe_needs_the_kernel_and_smt_and_names_every_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    smt = sysfs(tmp_path / "smt", active="1", siblings=["0,1"])
    no_smt = sysfs(tmp_path / "nosmt", active="0", siblings=["0"])
    calls = fake_prctl(monkeypatch, None)
    assert coresched.probe(smt) == Support(True)
    # PR_SCHED_CORE_GET on ourselves, one task, into a u64.
    assert calls[0][:4] == (coresched.PR_SCHED_CORE, coresched.PR_SCHED_CORE_GET, 0, coresched.PIDTYPE_PID)
    off = coresched.probe(no_smt)
    assert not off.available and off.why_not is not None and "one thread per core" in off.why_not

    fake_prctl(monkeypatch, errno.EINVAL)
    off = coresched.probe(smt)
    assert not off.available and off.why_not is not None and "EINVAL" in off.why_not
    off = coresched.probe(no_smt)  # this host: both reasons
    assert off.why_not is not None and "EINVAL" in off.why_not and "one thread per core" in off.why_not

    fake_prctl(monkeypatch, errno.ENODEV)  # a kernel with it, on a CPU without SMT
    off = coresched.probe(smt)
    assert not off.available and off.why_not is not None and "ENODEV" in off.why_not
    fake_prctl(monkeypatch, errno.EPERM)
    assert not coresched.probe(smt).available


def test_this_host_reports_core_scheduling_off_with_the_reason() -> None:
    cookie = ctypes.c_ulonglong(0)
    try:
        coresched._prctl(coresched.PR_SCHED_CORE, 0, 0, 0, ctypes.addressof(cookie))
    except OSError as exc:
        kernel_err = exc.errno
    else:
        pytest.skip("this kernel has core scheduling")
    support = coresched.probe()
    assert not support.available and support.why_not is not None
    if kernel_err == errno.EINVAL:
        assert "CONFIG_SCHED_CORE" in support.why_not
    caps = coresched.capabilities()
    assert caps == {"core_scheduling": False, "core_scheduling_missing": coresched.node_support().why_not}


def test_the_container_backend_reports_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    caps = ContainerBackend(tmp_path).capabilities()
    assert caps["core_scheduling"] is coresched.node_support().available
    assert ("core_scheduling_missing" in caps) is (not caps["core_scheduling"])
    monkeypatch.setattr(coresched, "node_support", lambda: Support(True))
    caps = ContainerBackend(tmp_path).capabilities()
    assert caps["core_scheduling"] is True and "core_scheduling_missing" not in caps


def test_only_ls_sandboxes_on_a_node_that_can_get_a_cookie() -> None:
    on, off = Support(True), Support(False, "no SMT")
    assert coresched.wants_cookie("ls", on)
    assert not coresched.wants_cookie("be", on)  # SCHED_IDLE already; cookie 0 never sits beside LS
    assert not coresched.wants_cookie("ls", off)
    assert not coresched.wants_cookie("be", off)


def test_a_new_cookie_covers_the_calling_process_and_what_it_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_prctl(monkeypatch, None)
    coresched.new_cookie()
    assert calls == [(coresched.PR_SCHED_CORE, coresched.PR_SCHED_CORE_CREATE, 0, coresched.PIDTYPE_TGID, 0)]


def test_later_processes_share_the_inits_cookie_only_when_it_got_one(tmp_path: Path) -> None:
    def argv(handle: dict[str, object]) -> list[str]:
        return enter.helper_argv(
            tmp_path / "dsec-enter",
            "sid",
            ContainerHandle.of(handle),
            cwd="/",
            user=ROOT,
            spec_fd=3,
            status_fd=4,
        )

    base = {"pid": 42, "start_time": 7}
    assert "--share-core-cookie" in argv({**base, "cpu_class": "ls", "core_cookie": True})
    assert "--share-core-cookie" not in argv({**base, "cpu_class": "ls"})  # node without support
    assert "--share-core-cookie" not in argv({**base, "cpu_class": "be"})
    assert "--share-core-cookie" not in argv(base)  # a handle of an older edge
