"""Core scheduling in real container sandboxes, on a kernel without it (this one: EINVAL, no SMT).

What runs live here: an unsupported node starts and enters LS sandboxes exactly as before, and
a helper asked to share a cookie the kernel cannot give fails closed. What cannot run here (a
kernel with CONFIG_SCHED_CORE on an SMT CPU) is replaced by fakes: ``dsec-enter`` linked with
``--wrap`` around prctl, fork and execve (a shim that records every call and answers
PR_SCHED_CORE with success), and the edge's ``coresched.new_cookie`` recording where it ran. They
show which calls are made, by which process and in which order; not what the kernel does with
them (that cookies really keep SMT siblings apart is untested here).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.base import User, sandbox_env
from dsec.backends.container import cgroups
from dsec.backends.container.backend import ContainerBackend
from dsec.density import coresched
from dsec.native import enter
from dsec.protocol.errors import InfraFailure
from tests.support import DEADLINE_S

from .conformance import Made, build_layers

if os.geteuid() != 0 or shutil.which("crun") is None or shutil.which("busybox") is None:
    pytest.skip("container sandboxes need root, crun and busybox-static", allow_module_level=True)
if shutil.which("gcc") is None or not Path("/usr/include/seccomp.h").exists():
    pytest.skip("dsec-enter needs gcc, libc6-dev and libseccomp-dev", allow_module_level=True)

pytestmark = pytest.mark.slow

ROOT = User(name="root", uid=0, gid=0, home="/")

# Linked with -Wl,--wrap=prctl,--wrap=fork,--wrap=execve,--wrap=syscall: the helper's own calls
# come here (a session shell is forked by a raw clone(CLONE_PARENT): a "fork" too).
SHIM_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>
int __real_prctl(int option, ...);
pid_t __real_fork(void);
long __real_syscall(long n, ...);
int __real_execve(const char *path, char *const argv[], char *const envp[]);
static int log_fd = -1;
/* Before main: the log is a host path, opened before the helper enters the mount namespace. */
__attribute__((constructor)) static void open_log(void) {
    log_fd = open(LOG_PATH, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
}
static void note(const char *line) {
    char buf[256];
    int n = snprintf(buf, sizeof buf, "%d %s\n", (int)getpid(), line);
    if (log_fd >= 0) write(log_fd, buf, (size_t)n);
}
int __wrap_prctl(int option, unsigned long a2, unsigned long a3, unsigned long a4, unsigned long a5) {
    char line[128];
    snprintf(line, sizeof line, "prctl %d %lu %lu %lu", option, a2, a3, a4);
    note(line);
    if (option == 62) return 0; /* PR_SCHED_CORE: as a kernel that has it */
    return __real_prctl(option, a2, a3, a4, a5);
}
pid_t __wrap_fork(void) { note("fork"); return __real_fork(); }
long __wrap_syscall(long n, long a, long b, long c, long d, long e) {
    if (n == SYS_clone) note("fork");
    return __real_syscall(n, a, b, c, d, e);
}
int __wrap_execve(const char *path, char *const argv[], char *const envp[]) {
    note("execve");
    return __real_execve(path, argv, envp);
}
"""
PR_SET_NO_NEW_PRIVS = 38
SHARE_FROM = f"prctl {coresched.PR_SCHED_CORE} {coresched.PR_SCHED_CORE_SHARE_FROM}"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("coresched-log")


@pytest.fixture(scope="module")
def shimmed_helper(tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Path:
    """dsec-enter from the same source, its prctl/fork/execve recorded into log_dir/calls."""
    real = enter.build_helper(tmp_path_factory.mktemp("enter-bin"))
    d = tmp_path_factory.mktemp("shim")
    (d / "shim.c").write_text(SHIM_C)
    out = d / "dsec-enter-shimmed"
    wrap = "-Wl,--wrap=prctl,--wrap=fork,--wrap=execve,--wrap=syscall"
    log = f'-DLOG_PATH="{log_dir / "calls"}"'
    cmd = [*enter.CC, wrap, log, "-o", str(out), str(enter.SOURCE), str(d / "shim.c"), *enter.LIBS]
    subprocess.run(cmd, check=True, capture_output=True)
    shutil.copy2(enter.seccomp_program(real), enter.seccomp_program(out))  # the same program
    return out


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[ContainerBackend]:
    ct = ContainerBackend(tmp_path / "data")
    await ct.prepare_node()
    yield ct
    left = await ct.leftovers()
    for sid in left:
        await ct.destroy(sid, {}, tmp_path / "sandboxes" / sid)
    await ct.detach()  # the spare cgroups destroyed sandboxes left
    await ct.release_node()  # and the node's parent cgroups
    assert left == [], "a test left containers behind"


@pytest.fixture
async def made(backend: ContainerBackend, tmp_path: Path) -> AsyncIterator[Made]:
    m = Made(backend, build_layers(tmp_path / "layers"), tmp_path)
    try:
        yield m
    finally:
        await m.cleanup()
        for ctx, _ in m.all:
            assert cgroups.sandbox_dirs(ctx.sandbox_id) == [], "cgroups outlived the sandbox"


def kernel_lacks_core_scheduling() -> bool:
    return not coresched.node_support().available


async def run(
    backend: ContainerBackend, sid: str, handle: dict[str, Any], argv: list[str], stdin: bytes | None = None
) -> tuple[bytes, bytes, int]:
    proc = await backend.spawn(sid, handle, argv, env={"PATH": "/bin"}, cwd="/", user=ROOT)
    out, err = await asyncio.wait_for(proc.communicate(stdin), DEADLINE_S)
    assert proc.returncode is not None
    return out, err, proc.returncode


# -- live: a node without core scheduling -------------------------------------------------------


async def test_without_core_scheduling_ls_sandboxes_start_and_run_as_before(
    backend: ContainerBackend, made: Made
) -> None:
    if not kernel_lacks_core_scheduling():
        pytest.skip("this node has core scheduling")
    caps = backend.capabilities()
    assert caps["core_scheduling"] is False and caps["core_scheduling_missing"]
    ctx, h = await made.create(made.ctx(cpu_class="ls"))
    assert "core_cookie" not in h.dump()
    argv = enter.helper_argv(
        backend.enter_helper, ctx.sandbox_id, h, cwd="/", user=ROOT, spec_fd=3, status_fd=4
    )
    assert "--share-core-cookie" not in argv
    # Exit codes, deaths by signal and the three streams as ever.
    assert await run(backend, ctx.sandbox_id, h, ["sh", "-c", "exit 3"]) == (b"", b"", 3)
    assert (await run(backend, ctx.sandbox_id, h, ["sh", "-c", "kill -9 $$"]))[2] == 128 + 9
    out, err, code = await run(backend, ctx.sandbox_id, h, ["sh", "-c", "cat; echo oops >&2"], b"in\n")
    assert (out, err, code) == (b"in\n", b"oops\n", 0)


async def test_a_helper_told_to_share_a_cookie_the_kernel_cannot_give_fails_closed(
    backend: ContainerBackend, made: Made
) -> None:
    if not kernel_lacks_core_scheduling():
        pytest.skip("this node has core scheduling")
    ctx, h = await made.create(made.ctx(cpu_class="ls"))
    # As if the sandbox had been given a cookie: the command must not run without it.
    with pytest.raises(InfraFailure, match="PR_SCHED_CORE_SHARE_FROM"):
        await run(backend, ctx.sandbox_id, h.model_copy(update={"core_cookie": True}), ["true"])


# -- fakes: the calls a node with core scheduling makes -----------------------------------------


def calls(log_dir: Path) -> list[tuple[int, str]]:
    lines = (log_dir / "calls").read_text().splitlines() if (log_dir / "calls").exists() else []
    return [(int(pid), what) for pid, _, what in (line.partition(" ") for line in lines)]


async def test_with_core_scheduling_ls_gets_a_cookie_at_start_and_every_process_shares_the_inits(
    backend: ContainerBackend,
    made: Made,
    shimmed_helper: Path,
    log_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    created = tmp_path / "new-cookie"
    # dsec-rootfs makes the cookie (PR_SCHED_CORE_CREATE after its mount, before it execs crun);
    # this kernel has none to give, so a wrapper records the request and passes the rest on.
    wrapper = tmp_path / "dsec-rootfs-wrapper"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --new-core-cookie ]; then shift; echo "$$ $*" >> {created}; fi\n'
        f'exec {backend.rootfs_helper} "$@"\n'
    )
    wrapper.chmod(0o700)
    backend.rootfs_helper = wrapper
    rootfs_of: list[str] = []
    monkeypatch.setattr(coresched, "node_support", lambda: coresched.Support(True))
    backend.enter_helper = shimmed_helper
    assert backend.capabilities()["core_scheduling"] is True

    be_ctx = made.ctx(cpu_class="be")
    rootfs_of[:] = [str(be_ctx.workdir / "rootfs")]
    _, be = await made.create(be_ctx)
    assert "core_cookie" not in be.dump() and not created.exists(), "BE sandboxes get no cookie"
    ls_ctx = made.ctx(cpu_class="ls")
    rootfs_of[:] = [str(ls_ctx.workdir / "rootfs")]
    _, ls = await made.create(ls_ctx)
    assert ls.core_cookie is True
    # Once, asked of the helper that mounts this sandbox's root and execs crun (not the edge).
    (made_in,) = created.read_text().splitlines()
    pid, *args = made_in.split()
    assert int(pid) != os.getpid() and rootfs_of[0] in args

    env = sandbox_env(ls_ctx.spec, ROOT)
    sid = ls_ctx.sandbox_id
    (log_dir / "calls").unlink(missing_ok=True)
    assert await run(backend, sid, ls, ["sh", "-c", "exit 3"]) == (b"", b"", 3)
    session = await backend.spawn_session(sid, ls, ["sh"], env=env, cwd="/", user=ROOT)
    held = await backend.spawn_held(
        sid, ls, ["sleep", "30"], env=env, cwd="/", user=ROOT, tty=None, stdin=False
    )
    try:
        log = calls(log_dir)
        helpers = sorted({p for p, what in log if what.startswith("prctl 4 ")})  # PR_SET_DUMPABLE
        assert len(helpers) == 3, log
        for helper in helpers:
            mine = [what for p, what in log if p == helper]
            # The helper itself, before it forks: "prctl 62 3 <init pid> 0" (SHARE_FROM, one task).
            assert mine.count(f"{SHARE_FROM} {ls.pid} 0") == 1, mine
            assert mine.index(f"{SHARE_FROM} {ls.pid} 0") < mine.index("fork")
            assert sum(what.startswith("prctl 62 ") for what in mine) == 1
            # Its child (the command) makes no core scheduling call of its own: it inherited
            # the cookie with the fork, and sets no-new-privs, then execs.
            child = [what for p, what in log if p not in helpers]
            assert not any(what.startswith("prctl 62 ") for what in child)
        children = sorted({p for p, _ in log} - set(helpers))
        assert len(children) == 3, log
        for child_pid in children:  # each command: no-new-privs, then exec (one try per PATH dir)
            mine = [what for p, what in log if p == child_pid]
            assert mine.index(f"prctl {PR_SET_NO_NEW_PRIVS} 1 0 0") < mine.index("execve"), mine
    finally:
        session.kill()
        held.proc.kill()
        await session.wait()
        await held.proc.wait()

    (log_dir / "calls").unlink(missing_ok=True)
    assert await run(backend, be_ctx.sandbox_id, be, ["sh", "-c", "exit 0"]) == (b"", b"", 0)
    assert not any(what.startswith("prctl 62 ") for _, what in calls(log_dir)), "BE joins no cookie"
