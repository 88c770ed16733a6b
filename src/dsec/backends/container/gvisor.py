"""gVisor container sandboxes (``runtime="gvisor"``): runsc instead of crun, for hostile code.

The sandbox's processes run on gVisor's user-space kernel (the *sentry*); the host kernel sees
only the sentry, its ptrace stubs and the *gofer* that serves the root file system. The rest of
the container backend stays as it is: the same bundle and overlay root (runsc's gofer writes
through to the overlay's upper directory, so pack, changes and disk quotas read the same
place), the same cgroups (runsc puts sentry and gofer in ``/dsec/<bucket>/<id>``: memory accounting,
page-out, OOM counts and the freezer work unchanged).

What differs is everything that entered the sandbox's namespaces: processes inside are not host
processes, so they start through ``runsc exec`` (:class:`GVisorProcess` relays their stdio and
exit code, and kills them through runsc), and the host reaches the files through the gofer's
root (``/proc/<gofer>/root``), with ``--file-access=shared`` so the sentry revalidates what
the host changed.

Network: a sandbox created without network rules runs ``--network=none`` (netstack with
loopback only). One created with rules starts ``--network=sandbox`` in a network namespace the
edge made with its veth link already in it (``CreateContext.link``): netstack copies the
namespace's interfaces, addresses and routes once, at start, and takes the addresses off the
host side, so the edge's nftables grants on the veth's host end apply as to a crun sandbox's.

Terminals: the sentry's own devpts is out of the host's reach, so a PTY process gets a host
pseudo-terminal, which runsc imports as its terminal (see :meth:`GVisor.spawn`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

from dsec import _linux
from dsec.backends.base import GuestLink, User
from dsec.backends.container import oci
from dsec.netpolicy import links
from dsec.protocol.errors import InfraFailure, InvalidRequest

log = logging.getLogger("dsec.backends.container.gvisor")
RUNSC = "runsc"
_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
PROBE_DEADLINE_S = 5.0  # a platform that has not run `true` by then does not work here (PVM: hangs)
EXEC_NOT_STARTED = 127  # runsc could not start the command (missing program, bad cwd): a shell's 127
_probed: dict[str, dict[str, Any]] = {}  # per runsc binary (path, size, mtime): one probe per process
_background: set[asyncio.Task[None]] = set()


def _binary_key(path: str) -> str:
    st = os.stat(path)
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


class GVisor:
    """runsc for one node: whether it works here (probed once), and the sandboxes it runs."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.runsc = shutil.which(RUNSC)
        self.state_dir = data_dir / "run" / "runsc"
        self.scratch = data_dir / "run" / "runsc-exec"  # FIFOs for exec'd processes' PIDs
        self.platform: str | None = None
        self.why_not: str | None = "not probed yet"

    # -- availability -------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self.platform is not None

    def require(self) -> None:
        if self.platform is None:
            raise InvalidRequest(f"runtime='gvisor' is not available on this node: {self.why_not}")

    async def probe(self, runtime_dir: Path) -> None:
        """Find a platform on which runsc runs ``true``: KVM when /dev/kvm works for it, else
        ptrace. Cached in the data directory and per process, keyed by the runsc binary."""
        if self.runsc is None:
            self.platform, self.why_not = None, "runsc is not installed (Debian package runsc)"
            return
        key = _binary_key(self.runsc)
        cache = self.data_dir / "gvisor.json"
        answer = _probed.get(key)
        if answer is None:
            with contextlib.suppress(OSError, ValueError):
                stored = json.loads(cache.read_text())
                if stored.get("key") == key:
                    answer = stored
        if answer is None:
            answer = {"key": key, "platform": None, "why_not": "no platform ran a sandbox"}
            candidates = (["kvm"] if os.access("/dev/kvm", os.R_OK | os.W_OK) else []) + ["ptrace"]
            errors = []
            for platform in candidates:
                error = await self._try_platform(platform, runtime_dir)
                if error is None:
                    answer.update(platform=platform, why_not=None)
                    break
                errors.append(f"{platform}: {error}")
            if answer["platform"] is None:
                answer["why_not"] = "; ".join(errors)
            with contextlib.suppress(OSError):
                cache.write_text(json.dumps(answer))
            log.info("gVisor: platform %s (%s)", answer["platform"], answer["why_not"] or "works")
        _probed[key] = answer
        self.platform, self.why_not = answer["platform"], answer["why_not"]

    async def _try_platform(self, platform: str, runtime_dir: Path) -> str | None:
        assert self.runsc is not None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix="gvisor-probe-", dir=self.data_dir))
        sid = f"probe-{probe.name.rsplit('-', 1)[-1]}"
        state = probe / "state"
        base = [self.runsc, "--root", str(state)]
        try:
            (probe / "rootfs").mkdir()
            shutil.copy2(runtime_dir / "busybox", probe / "rootfs" / "busybox")
            config = {
                "ociVersion": "1.0.2",
                "process": {"user": {"uid": 0, "gid": 0}, "args": ["/busybox", "true"], "cwd": "/"},
                "root": {"path": str(probe / "rootfs")},
                "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
            }
            (probe / "config.json").write_text(json.dumps(config))
            argv = [*base, f"--platform={platform}", "--network=none", "--ignore-cgroups"]
            proc = await asyncio.create_subprocess_exec(
                *argv,
                "run",
                "--bundle",
                str(probe),
                sid,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                env=_ENV,
                start_new_session=True,
            )
            try:
                async with asyncio.timeout(PROBE_DEADLINE_S):
                    _, err = await proc.communicate()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                return f"no answer in {PROBE_DEADLINE_S:.0f}s"
            if proc.returncode != 0:
                return f"exit {proc.returncode}: {err.decode(errors='replace').strip()[-300:]}"
            return None
        finally:
            await _run_quietly([*base, "delete", "--force", sid])
            shutil.rmtree(probe, ignore_errors=True)

    # -- sandboxes ----------------------------------------------------------------------------

    def _base(self) -> list[str]:
        assert self.runsc is not None
        return [self.runsc, "--root", str(self.state_dir)]

    def run_argv(
        self, *, bundle: Path, log_file: Path, pid_file: Path, sandbox_id: str, link: GuestLink | None
    ) -> list[str]:
        self.require()
        if link is not None:
            _check_fresh(link)
        return [
            *self._base(),
            f"--platform={self.platform}",
            # With a link: netstack over the interfaces of the namespace the spec names (its
            # veth). Without: loopback only, and no link can be added later.
            "--network=sandbox" if link is not None else "--network=none",
            # Writes go through the gofer to our overlay's upper directory, not to a sentry-side
            # overlay in memory: pack, changes and disk_limit_mb read the upper directory.
            "--overlay2=none",
            # The host writes files too (the file API): the sentry must not trust its caches.
            "--file-access=shared",
            "--log",
            str(log_file),
            "run",
            "--detach",
            "--bundle",
            str(bundle),
            "--pid-file",
            str(pid_file),
            sandbox_id,
        ]

    @staticmethod
    def adapt_config(config: dict[str, Any], rootfs: Path, link: GuestLink | None) -> dict[str, Any]:
        """crun's config for runsc: without seccomp (the sentry filters its own syscalls; runsc
        applies an OCI profile only with --oci-seccomp), /tmp bound to the root's own /tmp,
        since runsc mounts a tmpfs over an empty /tmp that is not a mount of the spec (and
        writes there would never reach the upper directory), and, with a ``link``, the
        network namespace that holds it."""
        linux = {k: v for k, v in config["linux"].items() if k != "seccomp"}
        if link is not None:
            linux["namespaces"] = [
                {"type": "network", "path": link.netns} if ns["type"] == "network" else ns
                for ns in linux["namespaces"]
            ]
        mounts = list(config["mounts"])
        mounts.append(
            {
                "destination": "/tmp",
                "type": "bind",
                "source": str(rootfs / "tmp"),
                "options": ["rbind", "rw", "nosuid", "nodev"],
            }
        )
        return {**config, "linux": linux, "mounts": mounts}

    def handle_extra(self, sandbox_id: str) -> dict[str, Any]:
        """What the edge keeps beyond crun's handle: the gofer, whose root is the sandbox's."""
        gofer = int(self._state(sandbox_id).get("goferPid") or 0)
        if gofer <= 0:
            raise InfraFailure(f"runsc reports no gofer for {sandbox_id}", reason="runtime")
        return {"runtime": "gvisor", "gofer_pid": gofer, "gofer_start_time": _linux.proc_start_time(gofer)}

    def _state_file(self, sandbox_id: str) -> Path:
        return self.state_dir / f"{sandbox_id}_sandbox:{sandbox_id}.state"

    def _state(self, sandbox_id: str) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self._state_file(sandbox_id).read_text())
            return data
        except (OSError, ValueError) as exc:
            raise InfraFailure(f"runsc state of {sandbox_id}: {exc}", reason="runtime") from exc

    def knows(self, sandbox_id: str) -> bool:
        return self._state_file(sandbox_id).exists()

    def known(self) -> list[str]:
        if not self.state_dir.is_dir():
            return []
        return [p.name.split("_sandbox:", 1)[0] for p in self.state_dir.glob("*_sandbox:*.state")]

    async def delete(self, sandbox_id: str) -> None:
        if self.runsc is not None and self.knows(sandbox_id):
            await _run_quietly([*self._base(), "delete", "--force", sandbox_id])

    # -- processes ----------------------------------------------------------------------------

    async def spawn(
        self,
        sandbox_id: str,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: User,
        stdin: int = asyncio.subprocess.PIPE,
        raise_signal: bool = False,
        tty: int | None = None,
    ) -> GVisorProcess:
        """``argv`` in the sandbox through ``runsc exec``, which relays its stdio (the pipes the
        edge holds) and its exit code; returns once the command runs (or failed to start: then
        it has exited with 127 and runsc's message on its stderr).

        ``tty``: the slave of a host pseudo-terminal, the command's stdio. runsc hands it to
        the sentry as the command's terminal (size, modes and input are the host's line
        discipline), and, holding it as its own controlling terminal (``setsid --ctty``),
        passes on what that terminal signals (^C, ^Z, SIGWINCH) to the foreground process
        group inside."""
        if self.runsc is None:
            raise InfraFailure("runsc is not installed", reason="runtime")
        process = json.dumps(_process_spec(argv, env, cwd, user, terminal=tty is not None)).encode()
        self.scratch.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.scratch))
        spec_fd = os.memfd_create("dsec-gvisor-process", os.MFD_CLOEXEC)
        try:
            # The PID file is a FIFO: runsc's write of it says the command started, no polling.
            fifo = tmp / "pid"
            os.mkfifo(fifo, 0o600)
            pid_r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                os.write(spec_fd, process)  # the command and its environment: not on a command line
                # A session of its own either way: the edge's process group tests and kills see runsc.
                proc = await asyncio.create_subprocess_exec(
                    *(["setsid", "--ctty"] if tty is not None else []),
                    *self._base(),
                    "exec",
                    "--process",
                    f"/proc/self/fd/{spec_fd}",
                    "--internal-pid-file",
                    str(fifo),
                    sandbox_id,
                    stdin=stdin if tty is None else tty,
                    stdout=asyncio.subprocess.PIPE if tty is None else tty,
                    stderr=asyncio.subprocess.PIPE if tty is None else tty,
                    env=_ENV,
                    pass_fds=(spec_fd,),
                    start_new_session=tty is None,  # setsid(1) makes it, then takes the terminal
                )
                inner = await _pid_or_exit(pid_r, proc)
            finally:
                os.close(pid_r)
        finally:
            os.close(spec_fd)
            shutil.rmtree(tmp, ignore_errors=True)
        return GVisorProcess(self, sandbox_id, proc, inner, raise_signal=raise_signal)

    async def signal(self, sandbox_id: str, pid: int, sig: int, *, tree: bool) -> None:
        """``sig`` to ``pid`` (a PID inside) and, with ``tree``, to every descendant, through
        runsc (the host cannot signal what lives in the sentry). A SIGKILL of a tree repeats
        until no descendant is left (a process may fork meanwhile)."""
        for _ in range(5 if tree and sig == signal.SIGKILL else 1):
            victims = [pid, *(await self._descendants(sandbox_id, pid) if tree else [])]
            await asyncio.gather(
                *(
                    _run_quietly([*self._base(), "kill", "--pid", str(v), sandbox_id, str(int(sig))])
                    for v in victims
                )
            )
            if not tree or len(victims) == 1:
                return

    async def _descendants(self, sandbox_id: str, pid: int) -> list[int]:
        proc = await asyncio.create_subprocess_exec(
            *self._base(),
            "ps",
            sandbox_id,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=_ENV,
        )
        out, _ = await proc.communicate()
        children: dict[int, list[int]] = {}
        for line in out.decode(errors="replace").splitlines()[1:]:
            fields = line.split()  # UID PID PPID ... CMD: the command, last, cannot shift these
            if len(fields) >= 3 and fields[1].isdigit() and fields[2].isdigit():
                children.setdefault(int(fields[2]), []).append(int(fields[1]))
        found, stack = [], [pid]
        while stack:
            for child in children.get(stack.pop(), []):
                found.append(child)
                stack.append(child)
        return found


def _check_fresh(link: GuestLink) -> None:
    """runsc moves the addresses of the namespace it is given into netstack, and its own test
    against the host's namespace is hidden from it (rootfs.py): the edge makes sure."""
    if link.netns is None or links.is_hosts_netns(link.netns):
        raise InfraFailure(
            f"refusing to start netstack in {link.netns!r}: not a namespace of its own", reason="network"
        )


def _process_spec(
    argv: list[str], env: dict[str, str], cwd: str, user: User, *, terminal: bool = False
) -> dict[str, Any]:
    if not argv:
        raise InvalidRequest("an empty command")
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidRequest(f"bad environment variable {key!r}")
    if any("\0" in a for a in argv):
        raise InvalidRequest("a NUL byte in the command")
    caps = list(oci.CAPABILITIES)
    # As an exec of a non-root user: the bounding set only, nothing effective.
    capabilities = (
        {"bounding": caps, "effective": caps, "permitted": caps} if user.uid == 0 else {"bounding": caps}
    )
    return {
        "args": argv,
        "env": [f"{k}={v}" for k, v in env.items()],
        "cwd": cwd,
        "user": {"uid": user.uid, "gid": user.gid},
        "terminal": terminal,
        "noNewPrivileges": True,
        "capabilities": capabilities,
    }


async def _pid_or_exit(fd: int, proc: asyncio.subprocess.Process) -> int | None:
    """The PID runsc writes into the FIFO ``fd``, or None when runsc exits without (the
    command never started)."""
    loop = asyncio.get_running_loop()
    reported: asyncio.Future[bytes] = loop.create_future()
    chunks: list[bytes] = []

    def readable() -> None:
        try:
            while chunk := os.read(fd, 64):
                chunks.append(chunk)
        except BlockingIOError:
            return
        except OSError:
            pass
        if not reported.done():
            reported.set_result(b"".join(chunks))

    loop.add_reader(fd, readable)
    exited: asyncio.Future[Any] = asyncio.ensure_future(proc.wait())
    try:
        await asyncio.wait([reported, exited], return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_reader(fd)
        if not exited.done():
            exited.cancel()
    text = reported.result().strip() if reported.done() else b""
    return int(text) if text.isdigit() else None


class GVisorProcess:
    """A process in a gVisor sandbox as the edge drives it (:class:`SandboxProcess`): stdio,
    ``pid`` and the process group are those of its ``runsc exec`` on the host, the exit code
    is the command's; killing and signalling go to the process inside, through runsc."""

    def __init__(
        self,
        gvisor: GVisor,
        sandbox_id: str,
        proc: asyncio.subprocess.Process,
        inner_pid: int | None,
        *,
        raise_signal: bool,
    ) -> None:
        self._gvisor = gvisor
        self._sandbox_id = sandbox_id
        self._proc = proc
        self.inner_pid = inner_pid
        self._raise_signal = raise_signal

    @property
    def stdin(self) -> asyncio.StreamWriter | None:
        return self._proc.stdin

    @property
    def stdout(self) -> asyncio.StreamReader | None:
        return self._proc.stdout

    @property
    def stderr(self) -> asyncio.StreamReader | None:
        return self._proc.stderr

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        code = self._proc.returncode
        if code is None:
            return None
        if self.inner_pid is None and code == 128:
            return EXEC_NOT_STARTED
        # runsc reports a death by signal N as 128+N (it cannot die of it itself); a held
        # process reports -N (an `exit 130` reads as SIGINT: runsc does not tell them apart).
        if self._raise_signal and 128 < code <= 128 + 64:
            return 128 - code
        return code

    async def wait(self) -> int:
        await self._proc.wait()
        code = self.returncode
        assert code is not None
        return code

    async def communicate(self, input: bytes | None = None) -> tuple[bytes, bytes]:
        out, err = await self._proc.communicate(input)
        return out, err

    def send_signal(self, sig: int, *, tree: bool = False) -> None:
        if self.inner_pid is None or self._proc.returncode is not None:
            return
        task = asyncio.get_running_loop().create_task(
            self._gvisor.signal(self._sandbox_id, self.inner_pid, sig, tree=tree)
        )
        _background.add(task)
        task.add_done_callback(_background.discard)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def kill_tree(self) -> None:
        """SIGKILL the process and its descendants inside; runsc exec then ends by itself."""
        self.send_signal(signal.SIGKILL, tree=True)


async def _run_quietly(argv: list[str], timeout_s: float = 30.0) -> int | None:
    """Run a runsc control command; None if it hung (a sentry that a freezer stopped cannot
    answer until thawed)."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        env=_ENV,
    )
    try:
        async with asyncio.timeout(timeout_s):
            return await proc.wait()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None
