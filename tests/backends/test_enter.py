"""``dsec-enter``: processes started in real container sandboxes by entering their namespaces.

Every check runs a process through :func:`spawn_entered` in a sandbox that
:class:`ContainerBackend` created, and where ``crun exec`` (today's ``ContainerBackend.spawn``)
is the reference, compares both. The sandboxes run the conformance suite's busybox layers plus
a layer with more applets and ``probe``, a static C program compiled here that reports
syscall results, its argv and environment, and allocates memory on demand.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.base import CreateContext, User, sandbox_env
from dsec.backends.container import cgroups, spares
from dsec.backends.container.backend import ContainerBackend
from dsec.executor.process import descendants, kill_tree, run_streaming
from dsec.native import enter
from dsec.protocol.errors import InfraFailure, InvalidRequest
from dsec.protocol.models import ExecEvent
from tests.support import DEADLINE_S, eventually

from .conformance import Made, build_layers

if os.geteuid() != 0 or shutil.which("crun") is None or shutil.which("busybox") is None:
    pytest.skip("container sandboxes need root, crun and busybox-static", allow_module_level=True)
if shutil.which("gcc") is None or not Path("/usr/include/seccomp.h").exists():
    pytest.skip("dsec-enter needs gcc, libc6-dev and libseccomp-dev", allow_module_level=True)

pytestmark = pytest.mark.slow

ROOT = User(name="root", uid=0, gid=0, home="/")
ALICE = User(name="alice", uid=1000, gid=1000, home="/home/alice")
EXTRA_APPLETS = (
    "ps",
    "true",
    "false",
    "hostname",
    "env",
    "pwd",
    "id",
    "kill",
    "grep",
    "head",
    "wc",
    "readlink",
)
NAMESPACES = ("pid", "mnt", "net", "uts", "ipc", "cgroup", "user", "time")
STATUS_KEYS = (
    "Umask", "Uid", "Gid", "Groups", "NSpgid", "NSsid", "SigBlk", "SigIgn", "CapInh", "CapPrm",
    "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp", "Seccomp_filters",
    "Speculation_Store_Bypass", "Cpus_allowed_list",
)  # fmt: skip

PROBE_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <unistd.h>
extern char **environ;
static void show(const char *what, int rc) {
    printf("%s %s\n", what, rc == 0 ? "ok" : strerrorname_np(errno));
}
int main(int argc, char **argv) {
    if (argc < 2) return 2;
    if (!strcmp(argv[1], "syscalls")) {
        /* Harmless without the filter (the test runs it on the host too): unshare(0) does
         * nothing, setns(-1) is EBADF, and mount on a path that does not exist is ENOENT. */
        show("unshare", unshare(0));
        show("setns", setns(-1, 0));
        show("mount", mount("none", "/no/such/dir", "tmpfs", 0, NULL));
        show("getpid", getpid() > 0 ? 0 : -1);
        /* ioctl by command: TIOCSTI is refused by the filter (the host: /dev/null is no tty),
         * FIONREAD on a pipe passes. */
        int null = open("/dev/null", O_RDONLY), fds[2], n;
        char c = 'x';
        show("tiocsti", ioctl(null, TIOCSTI, &c));
        show("fionread", pipe(fds) || ioctl(fds[0], FIONREAD, &n));
        return 0;
    }
    if (!strcmp(argv[1], "argv")) {
        for (int i = 2; i < argc; i++) fwrite(argv[i], 1, strlen(argv[i]) + 1, stdout);
        return 0;
    }
    if (!strcmp(argv[1], "env")) {
        for (char **e = environ; *e; e++) fwrite(*e, 1, strlen(*e) + 1, stdout);
        return 0;
    }
    if (!strcmp(argv[1], "hog")) {
        size_t mb = strtoul(argv[2], NULL, 10);
        for (size_t i = 0; i < mb; i++) {
            char *p = malloc(1 << 20);
            if (!p) { puts("malloc failed"); return 3; }
            memset(p, 1, 1 << 20);
        }
        puts("survived");
        return 0;
    }
    return 2;
}
"""


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return enter.build_helper(tmp_path_factory.mktemp("enter-bin"))


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("probe")
    (d / "probe.c").write_text(PROBE_C)
    out = d / "probe"
    subprocess.run(["gcc", "-static", "-O2", "-o", str(out), str(d / "probe.c")], check=True)
    return out


@pytest.fixture
def layer_dirs(tmp_path: Path, probe: Path) -> list[Path]:
    layers = build_layers(tmp_path / "layers")
    extra = tmp_path / "layers" / "enter"
    (extra / "bin").mkdir(parents=True)
    for applet in EXTRA_APPLETS:
        (extra / "bin" / applet).symlink_to("busybox")
    shutil.copy2(probe, extra / "bin" / "probe")
    (extra / "home" / "alice").mkdir(parents=True)
    os.chown(extra / "home" / "alice", ALICE.uid, ALICE.gid)
    (extra / "private").mkdir(mode=0o700)
    (extra / "not-a-program").write_text("data\n")
    return [*layers, extra]


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[ContainerBackend]:
    ct = ContainerBackend(tmp_path / "data")
    await ct.prepare_node()
    yield ct
    left = await ct.leftovers()
    for sid in left:
        await ct.destroy(sid, {}, tmp_path / "sandboxes" / sid)
    await ct.detach()  # the spare cgroups destroyed sandboxes left
    assert left == [], "a test left containers behind"
    assert spares.spare_dirs(ct.cgroup_parent) == []
    await ct.release_node()


@pytest.fixture
async def made(backend: ContainerBackend, layer_dirs: list[Path], tmp_path: Path) -> AsyncIterator[Made]:
    m = Made(backend, layer_dirs, tmp_path)
    try:
        yield m
    finally:
        await m.cleanup()
        for ctx, _ in m.all:
            assert cgroups.sandbox_dirs(ctx.sandbox_id) == [], "cgroups outlived the sandbox"


async def sandbox(made: Made, **spec: Any) -> tuple[CreateContext, dict[str, Any]]:
    return await made.create(made.ctx(**spec))


# -- helpers ------------------------------------------------------------------------------------


async def entered(
    helper: Path,
    ctx: CreateContext,
    handle: dict[str, Any],
    argv: list[str],
    *,
    user: User = ROOT,
    cwd: str = "/",
    env: dict[str, str] | None = None,
) -> asyncio.subprocess.Process:
    return await enter.spawn_entered(
        ctx.sandbox_id,
        handle,
        argv,
        env=sandbox_env(ctx.spec, user) if env is None else env,
        cwd=cwd,
        user=user,
        helper=helper,
    )


async def run_entered(
    helper: Path,
    ctx: CreateContext,
    handle: dict[str, Any],
    argv: list[str],
    stdin: bytes | None = None,
    **kw: Any,
) -> tuple[bytes, bytes, int]:
    proc = await entered(helper, ctx, handle, argv, **kw)
    out, err = await asyncio.wait_for(proc.communicate(stdin), DEADLINE_S)
    assert proc.returncode is not None
    return out, err, proc.returncode


async def run_crun(
    backend: ContainerBackend,
    ctx: CreateContext,
    handle: dict[str, Any],
    argv: list[str],
    *,
    user: User = ROOT,
    cwd: str = "/",
) -> tuple[bytes, bytes, int]:
    proc = await backend.spawn(
        ctx.sandbox_id, handle, argv, env=sandbox_env(ctx.spec, user), cwd=cwd, user=user
    )
    out, err = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    assert proc.returncode is not None
    return out, err, proc.returncode


async def run_host(argv: list[str], *, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[bytes]:
    def run() -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(argv, capture_output=True, check=check, **kw)

    return await asyncio.to_thread(run)


def status_fields(text: bytes) -> dict[str, str]:
    fields = dict(line.split(":", 1) for line in text.decode().splitlines() if ":" in line)
    return {k: fields[k].strip() for k in STATUS_KEYS if k in fields}


async def command_pid(proc: asyncio.subprocess.Process) -> int:
    """The host pid of the command the helper ``proc`` started (its only child)."""
    kids: list[int] = await eventually(lambda: descendants(proc.pid), "the helper's child")
    return kids[0]


# -- where the process runs ---------------------------------------------------------------------


async def test_the_command_runs_in_every_namespace_of_the_sandbox(helper: Path, made: Made) -> None:
    ctx, h = await sandbox(made)
    proc = await entered(helper, ctx, h, ["sleep", "30"])
    try:
        child = await command_pid(proc)
        init = h.pid
        for ns in NAMESPACES:
            assert os.readlink(f"/proc/{child}/ns/{ns}") == os.readlink(f"/proc/{init}/ns/{ns}"), ns
        assert os.readlink(f"/proc/{child}/ns/net") != os.readlink("/proc/self/ns/net")
        # The same root directory as the init: the container's rootfs, not the host's.
        assert os.stat(f"/proc/{child}/root/").st_ino == os.stat(f"/proc/{init}/root/").st_ino
        # The process group and session the edge gave the helper (a timeout kills the group).
        assert os.getpgid(child) == os.getsid(child) == proc.pid
        host_root = os.stat("/")
        assert os.stat(f"/proc/{child}/root/")[1:3] != (host_root.st_ino, host_root.st_dev)
    finally:
        kill_tree(proc.pid)
        await proc.wait()


async def test_only_the_sandboxs_processes_are_visible(helper: Path, made: Made) -> None:
    ctx, h = await sandbox(made)
    out, err, code = await run_entered(helper, ctx, h, ["ps", "-o", "pid,args"])
    assert code == 0, err
    rows = [line.split(None, 1) for line in out.decode().splitlines()[1:]]
    pids = {int(pid) for pid, _ in rows}
    # PID 1 (the sandbox's init) and ps itself: nothing of the host.
    assert 1 in pids and len(pids) == 2, rows
    assert any("ps -o" in args for _, args in rows)
    assert all(int(pid) < 100 for pid, _ in rows)


async def test_it_sees_the_sandboxs_files_hostname_and_network(
    helper: Path, backend: ContainerBackend, made: Made
) -> None:
    ctx, h = await sandbox(made)
    out, _, code = await run_entered(helper, ctx, h, ["cat", "/top.txt", "/both.txt"])
    assert (code, out) == (0, b"from top\ntop wins\n")
    _, _, code = await run_entered(helper, ctx, h, ["ls", "/work"])
    assert code != 0, "the host's /work must not be visible"
    # A file written through one path is there for the other and in the sandbox's rootfs.
    _, err, code = await run_entered(helper, ctx, h, ["sh", "-c", "echo entered > /tmp/mark"])
    assert code == 0, err
    out, _, _ = await run_crun(backend, ctx, h, ["cat", "/tmp/mark"])
    assert out == b"entered\n"
    assert (Path(backend.root_path(h)) / "tmp" / "mark").read_text() == "entered\n"
    for argv in (["hostname"], ["cat", "/proc/net/dev"], ["cat", "/proc/self/mountinfo"]):
        mine, _, _ = await run_entered(helper, ctx, h, argv)
        theirs, _, _ = await run_crun(backend, ctx, h, argv)
        assert mine == theirs, argv
    assert (await run_entered(helper, ctx, h, ["hostname"]))[0] == b"sandbox\n"


async def test_the_command_is_charged_to_the_sandboxs_cgroups(
    helper: Path, backend: ContainerBackend, made: Made
) -> None:
    ctx, h = await sandbox(made)
    mine, _, _ = await run_entered(helper, ctx, h, ["cat", "/proc/self/cgroup"])
    theirs, _, _ = await run_crun(backend, ctx, h, ["cat", "/proc/self/cgroup"])
    # The backend's command has a cgroup2 child of its own below the sandbox's (enter.py,
    # CommandCgroup): the same v1 cgroups, the sandbox's cgroup2 directory above it.
    lines = theirs.decode().splitlines()
    own = [line.rsplit("/", 1)[0] if line.startswith("0::") else line for line in lines]
    assert mine.decode().splitlines() == own
    assert mine.decode().count(f"/{cgroups.rel(ctx.sandbox_id)}") == len(mine.decode().splitlines())
    proc = await entered(helper, ctx, h, ["sleep", "30"])
    try:
        child = await command_pid(proc)
        assert {child, proc.pid} <= set(cgroups.pids(ctx.sandbox_id))
    finally:
        kill_tree(proc.pid)
        await proc.wait()


async def test_a_memory_hog_is_oom_killed_by_the_sandboxs_limit(helper: Path, made: Made) -> None:
    ctx, h = await sandbox(made, memory_limit_mb=64)
    before = cgroups.oom_kills(ctx.sandbox_id)
    out, _, code = await run_entered(helper, ctx, h, ["probe", "hog", "256"])
    assert code == 128 + signal.SIGKILL, out
    assert b"survived" not in out
    assert cgroups.oom_kills(ctx.sandbox_id) > before
    out, _, code = await run_entered(helper, ctx, h, ["probe", "hog", "8"])
    assert (code, out) == (0, b"survived\n"), "a small allocation still fits"


# -- what the process may do --------------------------------------------------------------------


@pytest.mark.parametrize("user", [ROOT, ALICE], ids=["root", "uid1000"])
async def test_credentials_and_limits_are_those_of_crun_exec(
    helper: Path, backend: ContainerBackend, made: Made, user: User
) -> None:
    ctx, h = await sandbox(made)
    mine, err, code = await run_entered(helper, ctx, h, ["cat", "/proc/self/status"], user=user)
    assert code == 0, err
    theirs, _, _ = await run_crun(backend, ctx, h, ["cat", "/proc/self/status"], user=user)
    got = status_fields(mine)
    assert got == status_fields(theirs)
    assert got["NoNewPrivs"] == "1" and got["Seccomp"] == "2"
    caps = got["CapBnd"]
    assert got["CapEff"] == (caps if user.uid == 0 else "0000000000000000")
    assert got["Uid"].split() == [str(user.uid)] * 4 and got["Gid"].split() == [str(user.gid)] * 4
    # RLIMIT_NOFILE is the container's (what crun gave its init).
    mine, _, _ = await run_entered(helper, ctx, h, ["grep", "Max open files", "/proc/self/limits"], user=user)
    init = [x for x in Path(f"/proc/{h.pid}/limits").read_text().splitlines() if "Max open files" in x]
    assert mine.decode().splitlines() == init


ON_HOST = ["unshare ok", "setns EBADF", "mount ENOENT", "getpid ok", "tiocsti ENOTTY", "fionread ok"]
IN_SANDBOX = ["unshare EPERM", "setns EPERM", "mount EPERM", "getpid ok", "tiocsti EPERM", "fionread ok"]


async def test_the_seccomp_filter_is_the_containers(
    helper: Path, probe: Path, made: Made, backend: ContainerBackend, tmp_path: Path
) -> None:
    ctx, h = await sandbox(made)
    out, err, code = await run_entered(helper, ctx, h, ["probe", "syscalls"])
    assert code == 0, err
    assert out.decode().splitlines() == IN_SANDBOX
    # The probe tells the filter apart: on the host (no filter) the same calls go through.
    # (In a mount namespace of its own all the same: nothing it does may reach the host's.)
    host = await run_host(["unshare", "--mount", "--propagation", "private", str(probe), "syscalls"])
    assert host.stdout.decode().splitlines() == ON_HOST
    # Byte for byte the BPF program crun compiled for this container from the same profile.
    crun = (backend.state_dir / ctx.sandbox_id / "seccomp.bpf").read_bytes()
    dumped = (await run_host([str(helper), "--dump-seccomp", "--seccomp-rules", enter.SECCOMP_RULES])).stdout
    assert dumped == crun
    assert enter.seccomp_program(helper).read_bytes() == crun, "what every spawn loads"
    # A helper without the compiled program next to it compiles the profile itself, to the same.
    bare = tmp_path / "bare" / "dsec-enter"
    bare.parent.mkdir()
    shutil.copy2(helper, bare)
    out, _, _ = await run_entered(bare, ctx, h, ["probe", "syscalls"])
    assert out.decode().splitlines() == IN_SANDBOX


async def test_uid_gid_cwd_argv_and_environment_are_as_asked(helper: Path, made: Made) -> None:
    ctx, h = await sandbox(made)
    out, err, code = await run_entered(
        helper, ctx, h, ["sh", "-c", "id -u; id -g; id -G; pwd"], user=ALICE, cwd="/home/alice"
    )
    assert code == 0, err
    assert out.decode().split() == ["1000", "1000", "1000", "/home/alice"]
    env = {"PATH": "/bin", "A": "with spaces and = signs", "EMPTY": "", "UNI": "h\u00e9"}
    out, _, _ = await run_entered(helper, ctx, h, ["probe", "env"], env=env)
    assert out.split(b"\0")[:-1] == [f"{k}={v}".encode() for k, v in env.items()]
    args = ["", "two words", "-x", "--", "\u00fcml"]
    out, _, _ = await run_entered(helper, ctx, h, ["probe", "argv", *args], env=env)
    assert out.split(b"\0")[:-1] == [a.encode() for a in args]
    # No fd of the edge or of the helper reaches the command: only its stdio (and ls's own).
    out, _, _ = await run_entered(helper, ctx, h, ["ls", "/proc/self/fd"])
    assert out.split() == [b"0", b"1", b"2", b"3"]


async def test_a_user_cannot_enter_a_directory_it_may_not(helper: Path, made: Made) -> None:
    ctx, h = await sandbox(made)
    _, err, code = await run_entered(helper, ctx, h, ["pwd"], user=ALICE, cwd="/private")
    assert code == 126 and b"/private" in err
    out, _, code = await run_entered(helper, ctx, h, ["pwd"], user=ROOT, cwd="/private")
    assert (code, out) == (0, b"/private\n")


async def test_a_best_effort_sandboxs_commands_run_under_sched_idle(helper: Path, made: Made) -> None:
    ctx, h = await sandbox(made, cpu_class="be")
    proc = await entered(helper, ctx, h, ["sleep", "30"])
    try:
        assert os.sched_getscheduler(await command_pid(proc)) == os.SCHED_IDLE
    finally:
        kill_tree(proc.pid)
        await proc.wait()
    ctx, h = await sandbox(made)
    proc = await entered(helper, ctx, h, ["sleep", "30"])
    try:
        assert os.sched_getscheduler(await command_pid(proc)) == os.SCHED_OTHER
    finally:
        kill_tree(proc.pid)
        await proc.wait()


# -- exit codes, stdio, signals, timeouts -------------------------------------------------------


async def test_exit_codes_and_deaths_by_signal_are_reported_as_crun_exec_reports_them(
    helper: Path, backend: ContainerBackend, made: Made
) -> None:
    ctx, h = await sandbox(made)
    for script in ("exit 0", "exit 3", "exit 255", "kill -9 $$", "kill -TERM $$", "kill -SEGV $$"):
        _, _, mine = await run_entered(helper, ctx, h, ["sh", "-c", script])
        _, _, theirs = await run_crun(backend, ctx, h, ["sh", "-c", script])
        assert mine == theirs, script
    # A missing or unrunnable program is the command's failure, as a shell reports it.
    _, err, code = await run_entered(helper, ctx, h, ["no-such-program"])
    assert code == 127 and b"no-such-program" in err
    _, _, code = await run_entered(helper, ctx, h, ["/not-a-program"])
    assert code == 126
    _, _, code = await run_entered(helper, ctx, h, ["true"], cwd="/no/such/dir")
    assert code == 127


async def test_stdin_stdout_and_stderr_are_pipes_of_the_edge(helper: Path, made: Made) -> None:
    ctx, h = await sandbox(made)
    data = os.urandom(1 << 20)
    out, err, code = await run_entered(helper, ctx, h, ["cat"], stdin=data)
    assert (code, out, err) == (0, data, b"")
    out, err, code = await run_entered(helper, ctx, h, ["sh", "-c", "echo out; echo err >&2; exit 4"])
    assert (code, out, err) == (4, b"out\n", b"err\n")
    # The helper holds no copy of stdin: the command sees EOF once the edge closes it.
    proc = await entered(helper, ctx, h, ["wc", "-c"])
    assert proc.stdin is not None
    proc.stdin.write(b"12345")
    proc.stdin.close()
    out, _ = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    assert out.strip() == b"5"


async def test_termination_signals_reach_the_command(helper: Path, made: Made) -> None:
    ctx, h = await sandbox(made)
    proc = await entered(
        helper, ctx, h, ["sh", "-c", 'trap "exit 42" TERM; echo ready; while :; do sleep 0.05; done']
    )
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.readline(), DEADLINE_S) == b"ready\n"
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), DEADLINE_S) == 42
    proc = await entered(helper, ctx, h, ["sleep", "30"])
    await command_pid(proc)
    proc.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(proc.wait(), DEADLINE_S) == 128 + signal.SIGINT


async def test_a_timeout_kills_the_whole_tree(helper: Path, made: Made) -> None:
    ctx, h = await sandbox(made)
    proc = await entered(helper, ctx, h, ["sh", "-c", "sleep 1000 & sleep 1000 & echo started; wait"])
    tree = await eventually(
        lambda: len(descendants(proc.pid)) == 3 and descendants(proc.pid), "sh and 2 sleeps"
    )
    events: list[ExecEvent] = [
        e async for e in run_streaming(proc, stdin=None, timeout=0.5, max_output=1 << 20, oom_kills=lambda: 0)
    ]
    result = events[-1].result
    assert result is not None and result.timed_out
    assert all(_dead(pid) for pid in [proc.pid, *tree])
    await eventually(lambda: not foreign_tasks(ctx.sandbox_id, h), "only the init's processes left")


async def test_killing_the_helper_alone_kills_its_command(helper: Path, made: Made) -> None:
    ctx, h = await sandbox(made)
    proc = await entered(helper, ctx, h, ["sleep", "1000"])
    child = await command_pid(proc)
    os.kill(proc.pid, signal.SIGKILL)
    await proc.wait()
    # Dead at once (PR_SET_PDEATHSIG); the host's init reaps the zombie at its own pace.
    await eventually(lambda: _dead(child), "the orphaned command dead")
    await eventually(lambda: not foreign_tasks(ctx.sandbox_id, h), "only the init's processes left")


def foreign_tasks(sandbox_id: str, handle: dict[str, Any]) -> set[int]:
    """Live processes in the sandbox's memory cgroup other than its init."""
    return {pid for pid in cgroups.pids(sandbox_id) if not _dead(pid)} - {handle.pid}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


# -- failures of the platform -------------------------------------------------------------------


async def test_a_recycled_or_dead_init_is_an_infra_failure(helper: Path, made: Made) -> None:
    ctx, h = await sandbox(made)
    with pytest.raises(InfraFailure, match="start time"):
        await entered(helper, ctx, h.model_copy(update={"start_time": int(h.start_time or 0) + 1}), ["true"])
    # A PID that now names another process (here: the test itself) is refused the same way.
    with pytest.raises(InfraFailure, match="not the sandbox's init"):
        await entered(helper, ctx, h.model_copy(update={"pid": os.getpid()}), ["true"])
    dead = await asyncio.create_subprocess_exec("true")
    await dead.wait()
    with pytest.raises(InfraFailure, match="gone"):
        await entered(helper, ctx, h.model_copy(update={"pid": dead.pid}), ["true"])
    await made.backend.destroy(ctx.sandbox_id, h, ctx.workdir)
    with pytest.raises(InfraFailure):
        await entered(helper, ctx, h, ["true"])
    # Called directly, the helper says why on stderr and exits 125, not with a command's code.
    spec = os.memfd_create("spec")
    os.write(spec, b"1\0true\0")
    argv = enter.helper_argv(helper, ctx.sandbox_id, h, cwd="/", user=ROOT, spec_fd=spec, status_fd=None)
    done = await run_host(argv, pass_fds=(spec,), check=False)
    os.close(spec)
    assert done.returncode == enter.EXIT_HELPER and b"dsec-enter: " in done.stderr


async def test_a_paused_sandbox_is_refused_at_once_not_waited_for(
    helper: Path, backend: ContainerBackend, made: Made
) -> None:
    ctx, h = await sandbox(made)
    await backend.freeze(ctx.sandbox_id, h)
    try:
        with pytest.raises(InfraFailure, match="paused"):
            await asyncio.wait_for(entered(helper, ctx, h, ["true"]), DEADLINE_S)
    finally:
        await backend.thaw(ctx.sandbox_id, h)
    assert (await run_entered(helper, ctx, h, ["true"]))[2] == 0


async def test_a_bad_command_is_refused_before_anything_starts(helper: Path, made: Made) -> None:
    ctx, h = await sandbox(made)
    with pytest.raises(InvalidRequest):
        await entered(helper, ctx, h, [])
    with pytest.raises(InvalidRequest):
        await entered(helper, ctx, h, ["echo", "a\0b"])
    with pytest.raises(InvalidRequest):
        await entered(helper, ctx, h, ["true"], env={"A=B": "c"})


def test_the_helper_is_built_once_per_source(tmp_path: Path) -> None:
    first = enter.build_helper(tmp_path / "bin")
    mtime = first.stat().st_mtime_ns
    assert enter.build_helper(tmp_path / "bin") == first
    assert first.stat().st_mtime_ns == mtime
    assert first.stat().st_mode & 0o777 == 0o700
    assert enter.seccomp_program(first).stat().st_size % 8 == 0
    stale = [
        tmp_path / "bin" / "dsec-enter-0000000000000000",
        tmp_path / "bin" / "dsec-enter-0000000000000000.bpf",
    ]
    for path in stale:
        path.write_bytes(b"old")
    first.unlink()
    assert enter.build_helper(tmp_path / "bin") == first
    assert not any(path.exists() for path in stale)
    assert sorted(p.name for p in (tmp_path / "bin").glob("dsec-enter-*")) == [
        first.name,
        first.name + ".bpf",
    ]
