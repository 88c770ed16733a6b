"""Start processes in container sandboxes by entering their namespaces: no ``crun exec``.

``crun exec`` reads the runtime's global state and the host's mount table, so its cost grows
with the sandboxes on a node (11 ms alone, 97 ms next to 9,000). ``dsec-enter``, a small
static C program (``dsec_enter.c``, which documents every step), only touches the
sandbox's own init and cgroups: it checks the init by PID *and* start time, joins the
sandbox's cgroups, ``setns``-es into its namespaces, forks, drops to the user with the
container's capabilities, no-new-privs, seccomp filter and ``RLIMIT_NOFILE``, and execs.

The helper is compiled by :func:`build_helper` into the node's data directory (gcc, libc6-dev
and libseccomp-dev, all from Debian; :mod:`dsec.native.build`), keyed by a hash of its source
and of the container's seccomp profile, so a change builds a new binary and a running one is
never overwritten.
Next to it goes the profile compiled into a seccomp program (``<helper>.bpf``, what crun
compiles for each container), which every spawn loads instead of compiling it again.

:func:`spawn_entered` behaves as :meth:`ContainerBackend.spawn` did over ``crun exec``: same
arguments, the same kind of process back (stdio pipes, its own session and process group, the
exit code or ``128+N`` for a death by signal N), and a missing program is the command's own
failure (exit 127, or 126 when it cannot be run or its cwd entered). What differs is that a
failure of the platform (the sandbox is gone, a cgroup or namespace cannot be joined) raises
:class:`InfraFailure` from the spawn itself, read from a close-on-exec status pipe, instead of
looking like a command that exited non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import subprocess
from pathlib import Path

from dsec import _linux
from dsec.backends.base import Spawned, User
from dsec.backends.container import cgroups, oci, seccomp
from dsec.backends.container.command_cgroup import CommandCgroup, EnteredCommand
from dsec.backends.container.handle import ContainerHandle
from dsec.backends.container.session_shell import SessionShell
from dsec.executor.fdwait import PipeReader
from dsec.executor.process import kill_tree
from dsec.native import build, spawner
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest

SOURCE = Path(__file__).with_name("dsec_enter.c")
NAME = "dsec-enter"
CC = build.CC
LIBS = ("-lseccomp",)
EXIT_HELPER = 125  # the helper failed, not the command (its message is on the status pipe)
STARTUP_TIMEOUT_S = 30.0  # from spawn to the command's exec: only a frozen sandbox takes long

_CAPS_ARG = ",".join(oci.CAPABILITIES)
# The container's seccomp profile as crun compiles it: what the helper compiles the same way.
SECCOMP_RULES = seccomp.compiled_rules(seccomp.seccomp_profile())
# The binary is keyed by the profile too: what --seccomp-rules passes and the .bpf holds.
PROGRAM = build.Program(NAME, SOURCE, libs=LIBS, keyed=(SECCOMP_RULES,), packages="libseccomp-dev")


def seccomp_program(helper: Path) -> Path:
    """The container's seccomp profile compiled once by :func:`build_helper`, next to ``helper``."""
    return helper.with_name(helper.name + ".bpf")


def helper_path(bin_dir: Path) -> Path:
    """Where :func:`build_helper` puts the helper for the current source."""
    return PROGRAM.path(bin_dir)


def build_helper(bin_dir: Path) -> Path:
    """Compile ``dsec-enter`` into ``bin_dir`` (:meth:`Program.build`: once per source and
    seccomp profile) with its seccomp program beside it; returns its path."""
    return PROGRAM.build(bin_dir, finish=_dump_seccomp)


def _dump_seccomp(binary: Path, out: Path) -> None:
    dumped = subprocess.run(
        [str(binary), "--dump-seccomp", "--seccomp-rules", SECCOMP_RULES], capture_output=True, check=False
    )
    if dumped.returncode != 0 or not dumped.stdout:
        msg = f"{NAME} cannot compile the seccomp profile: {dumped.stderr.decode(errors='replace')}"
        raise InfraFailure(msg, reason=InfraReason.runtime)
    bpf = seccomp_program(out)
    bpf.with_suffix(".tmp").write_bytes(dumped.stdout)
    bpf.with_suffix(".tmp").replace(bpf)


def _spec(argv: list[str], env: dict[str, str]) -> bytes:
    """argv and environment as the helper reads them: NUL-terminated, argc first."""
    if not argv:
        raise InvalidRequest("an empty command")
    items = [str(len(argv)).encode(), *(os.fsencode(a) for a in argv)]
    for key, value in env.items():
        if not key or "=" in key:
            raise InvalidRequest(f"bad environment variable name {key!r}")
        items.append(os.fsencode(key) + b"=" + os.fsencode(value))
    if any(b"\0" in item for item in items):
        raise InvalidRequest("a NUL byte in the command or its environment")
    return b"".join(item + b"\0" for item in items)


def helper_argv(
    helper: Path,
    sandbox_id: str,
    handle: ContainerHandle,
    *,
    cwd: str,
    user: User,
    spec_fd: int,
    status_fd: int | None,
) -> list[str]:
    """The helper's command line (nothing secret: the command itself goes on ``spec_fd``)."""
    argv = [
        str(helper),
        "--pid",
        str(handle.pid),
        "--start-time",
        str(handle.start_time or 0),
        "--cgroup",
        cgroups.rel(sandbox_id),
        "--uid",
        str(user.uid),
        "--gid",
        str(user.gid),
        "--cwd",
        cwd,
        "--caps",
        _CAPS_ARG,
        *_seccomp_args(helper),
        "--spec-fd",
        str(spec_fd),
    ]
    if status_fd is not None:
        argv += ["--status-fd", str(status_fd)]
    if handle.cpu_class == "be":
        argv.append("--idle")
    if handle.core_cookie:  # set at start (LS, node with core scheduling): join it
        argv.append("--share-core-cookie")
    if entrances_isolated():
        argv.append("--own-domain")
    if handle.allow_setuid:  # the sandbox opted in (ContainerSpec.allow_setuid)
        argv.append("--allow-setuid")
    return argv


@functools.cache
def entrances_isolated() -> bool:
    """Whether each process the edge starts in a sandbox gets a Landlock domain of its own, so
    that none can trace, or open the /proc fds of, one another started (dsec_enter.c,
    --own-domain). Landlock ABI 2 (Linux 5.19) at least: under ABI 1 any domain denies
    renames across directories."""
    return _linux.landlock_abi() >= 2


@functools.lru_cache(maxsize=16)
def _seccomp_args(helper: Path) -> tuple[str, ...]:
    bpf = seccomp_program(helper)
    # A helper not made by build_helper compiles the profile itself (~0.5 ms more per spawn).
    return ("--seccomp-bpf", str(bpf)) if bpf.exists() else ("--seccomp-rules", SECCOMP_RULES)


async def _read_to_eof(fd: int) -> bytes:
    """Everything written to the non-blocking pipe ``fd`` until its last writer closes it."""
    loop = asyncio.get_running_loop()
    chunks: list[bytes] = []
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        try:
            while chunk := os.read(fd, 4096):
                chunks.append(chunk)
        except BlockingIOError:
            return
        except OSError as exc:
            if not done.done():
                done.set_exception(exc)
            return
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
    return b"".join(chunks)


async def spawn_entered(
    sandbox_id: str,
    handle: ContainerHandle,
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    user: User,
    helper: Path,
) -> asyncio.subprocess.Process:
    """Start ``argv`` in the container sandbox as :meth:`ContainerBackend.spawn` does, through
    ``helper`` (from :func:`build_helper`). Returns once the command was exec'd (or failed as
    a command: exit 127/126); raises :class:`InfraFailure` when the sandbox could not be
    entered (gone, a PID that is no longer its init, a cgroup or namespace refused)."""
    proc, _ = await _enter(sandbox_id, handle, argv, env=env, cwd=cwd, user=user, helper=helper)
    return proc


async def spawn_command(
    sandbox_id: str,
    handle: ContainerHandle,
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    user: User,
    helper: Path,
) -> EnteredCommand:
    """:func:`spawn_entered` in a cgroup of its own (:class:`CommandCgroup`), where the host
    has cgroup2: a kill of its tree ends all it started."""
    cgroup = CommandCgroup.new(sandbox_id)
    try:
        proc, _ = await _enter(
            sandbox_id, handle, argv, env=env, cwd=cwd, user=user, helper=helper, own_cgroup=cgroup
        )
    except BaseException:
        if cgroup is not None:
            cgroup.remove()
        raise
    return EnteredCommand(proc, cgroup)


async def spawn_held(
    sandbox_id: str,
    handle: ContainerHandle,
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    user: User,
    helper: Path,
    tty: int | None = None,
    stdin: bool = True,
) -> Spawned:
    """As :func:`spawn_entered`, for a process that outlives a request: ``tty`` is the slave
    of a pseudo-terminal (the command's stdio and controlling terminal), else the edge gets
    pipes (``stdin=False``: /dev/null). A death by signal N is returncode -N, never 128+N."""
    flags = ["--raise-signal", *(["--tty"] if tty is not None else [])]
    if tty is not None:
        stdio: tuple[int, int, int] = (tty, tty, tty)
    else:
        stdio = (asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL, *_PIPES)
    proc, pids = await _enter(
        sandbox_id, handle, argv, env=env, cwd=cwd, user=user, helper=helper, flags=flags, stdio=stdio
    )
    assert pids is not None
    ns = pids.get("ns")
    if ns is None:  # pragma: no cover - the child writes it first thing
        kill_tree(proc.pid)
        await proc.wait()
        raise InfraFailure(f"{NAME} did not report the PID of its command", reason=InfraReason.runtime)
    return Spawned(proc, ns, pids.get("host"))


async def spawn_session(
    sandbox_id: str,
    handle: ContainerHandle,
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    user: User,
    helper: Path,
    own_cgroup: bool = False,
) -> SessionShell:
    """As :func:`spawn_entered`, for a session shell that idles between commands, at 2 of the
    edge's fds and 1 process (RLIMIT_NOFILE is 20,000 here and not raisable; each process on
    the host lengthens the kernel's walks over every task): stdout and stderr stay pipes the edge reads
    (a socket would make ``> /dev/stdout`` fail with ENXIO); the shell keeps the write end of
    its own stdin at fd 9 (``--hold-stdin``), which the edge opens per command; the helper
    forks the shell as the edge's own child and exits, and no pidfd watches the shell while it
    idles (:class:`dsec.executor.process.RestingChild`). ``own_cgroup``: the shell and all it
    starts in a :class:`CommandCgroup`, which its kill ends."""
    cgroup = CommandCgroup.new(sandbox_id) if own_cgroup else None
    stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
    # stdout and stderr: plain pipes the edge reads on demand (PipeReader), not asyncio's
    # transports, which would stay registered and hold ~14 objects a pipe while the shell idles.
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        pipe = os.fstat(stdin_w).st_ino
        helper_proc, pids = await _enter(
            sandbox_id,
            handle,
            argv,
            env=env,
            cwd=cwd,
            user=user,
            helper=helper,
            flags=[],
            stdio=(stdin_r, out_w, err_w),
            hold_stdin=stdin_w,
            own_cgroup=cgroup,
        )
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        if cgroup is not None:
            cgroup.remove()
        raise
    finally:
        for fd in (stdin_r, stdin_w, out_w, err_w):
            os.close(fd)
    stdout, stderr = PipeReader(out_r), PipeReader(err_r)
    shell = pids.get("host") if pids else None
    if shell is None:  # pragma: no cover - the helper writes it right after the fork
        kill_tree(helper_proc.pid)
        stdout.close()
        stderr.close()
        raise InfraFailure(f"{NAME} did not report the PID of the session shell", reason=InfraReason.runtime)
    await helper_proc.wait()  # it exits right after reporting the fork
    return SessionShell(shell, helper_proc.pid, pipe, stdout, stderr, cgroup=cgroup)


_PIPES = (asyncio.subprocess.PIPE, asyncio.subprocess.PIPE)


async def _enter(
    sandbox_id: str,
    handle: ContainerHandle,
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    user: User,
    helper: Path,
    flags: list[str] | None = None,
    stdio: tuple[int, int, int] | None = None,
    hold_stdin: int | None = None,
    own_cgroup: CommandCgroup | None = None,
) -> tuple[asyncio.subprocess.Process, dict[str, int] | None]:
    """The helper started and its command exec'd; with ``flags`` (a held process) also the
    PIDs it reported on its pid pipe; ``hold_stdin``: an fd the helper keeps (--hold-stdin)."""
    spec = _spec(argv, env)
    spec_fd = os.memfd_create("dsec-enter-spec", os.MFD_CLOEXEC)
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    pid_r, pid_w = os.pipe2(os.O_CLOEXEC) if flags is not None else (-1, -1)
    try:
        view = memoryview(spec)
        while view:
            view = view[os.write(spec_fd, view) :]
        cmd = helper_argv(helper, sandbox_id, handle, cwd=cwd, user=user, spec_fd=spec_fd, status_fd=status_w)
        if flags is not None:
            cmd += [*flags, "--pid-fd", str(pid_w)]
        passed: tuple[int, ...] = (spec_fd, status_w) if pid_w < 0 else (spec_fd, status_w, pid_w)
        if hold_stdin is not None:
            cmd += ["--hold-stdin", str(hold_stdin)]
            passed += (hold_stdin,)
        if own_cgroup is not None:
            cmd += ["--own-cgroup", own_cgroup.path.name]
        stdin, stdout, stderr = stdio or (asyncio.subprocess.PIPE, *_PIPES)
        try:
            proc = await spawner.create_subprocess_exec(
                *cmd,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                env={},  # the command's environment travels in the spec, not through the helper
                pass_fds=passed,
                start_new_session=True,  # the edge kills the whole group on a timeout
            )
        except OSError as exc:
            raise InfraFailure(f"cannot start {helper}: {exc}", reason=InfraReason.runtime) from exc
    except BaseException:
        os.close(status_r)
        if pid_r >= 0:
            os.close(pid_r)
        raise
    finally:
        os.close(spec_fd)
        os.close(status_w)
        if pid_w >= 0:
            os.close(pid_w)
    try:
        os.set_blocking(status_r, False)
        if pid_r >= 0:
            os.set_blocking(pid_r, False)
        async with asyncio.timeout(STARTUP_TIMEOUT_S):
            message = await _read_to_eof(status_r)
            # Both ends wrote (or died) by now, or promptly: the parent writes right after fork.
            reported = await _read_to_eof(pid_r) if pid_r >= 0 and not message else None
    except BaseException as exc:
        # Timed out (frozen after all?) or cancelled: nothing of this spawn may stay behind.
        # (A frozen process dies only once thawed: do not wait for it forever.)
        kill_tree(proc.pid)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(proc.communicate()), 5.0)
        if isinstance(exc, TimeoutError):
            raise InfraFailure(
                f"entering sandbox {sandbox_id} took over {STARTUP_TIMEOUT_S:.0f}s",
                reason=InfraReason.runtime,
            ) from exc
        raise
    finally:
        os.close(status_r)
        if pid_r >= 0:
            os.close(pid_r)
    if message:
        await proc.communicate()  # it exits 125 right after its message
        text = message.decode(errors="replace").strip().removeprefix("dsec-enter: ")
        raise InfraFailure(
            f"cannot start a process in sandbox {sandbox_id}: {text}", reason=InfraReason.runtime
        )
    if reported is None:
        return proc, None
    pids = {}
    for line in reported.decode(errors="replace").splitlines():
        which, _, value = line.partition(" ")
        if which in ("host", "ns") and value.isdigit():
            pids[which] = int(value)
    return proc, pids
