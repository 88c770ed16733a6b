"""gVisor container sandboxes (``runtime="gvisor"``): runsc instead of crun, for hostile code.

The sandbox's processes run on gVisor's user-space kernel (the *sentry*); the host kernel sees
only the sentry, its ptrace stubs and the *gofer* that serves the root file system. The rest of
the container backend stays as it is: the same bundle and overlay root (runsc's gofer writes
through to the overlay's upper directory, so pack, changes and disk quotas read the same
place), the same cgroups (runsc puts sentry and gofer in ``/<node's parent>/<bucket>/<id>``:
memory accounting, page-out, OOM counts and the freezer work unchanged).

What differs is everything that entered the sandbox's namespaces: processes inside are not host
processes, so they start through ``runsc exec`` (:mod:`.gvisor_exec`: it relays their stdio
and exit code, and they are killed through runsc), and the host reaches the files through the gofer's
root (``/proc/<gofer>/root``), with ``--file-access=shared`` so the sentry revalidates what
the host changed.

Network: a sandbox created without network rules runs ``--network=none`` (netstack with
loopback only). One created with rules starts ``--network=sandbox`` in a network namespace the
edge made with its veth link already in it (``CreateContext.link``): netstack copies the
namespace's interfaces, addresses and routes once, at start, and takes the addresses off the
host side, so the edge's nftables grants on the veth's host end apply as to a crun sandbox's.

Terminals: the sentry's own devpts is out of the host's reach, so a PTY process gets a host
pseudo-terminal, which runsc imports as its terminal (see :func:`.gvisor_exec.spawn`).
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

from dsec.backends.base import GuestLink
from dsec.backends.container import oci
from dsec.netpolicy import links
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest

log = logging.getLogger("dsec.backends.container.gvisor")
RUNSC = "runsc"
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
PROBE_DEADLINE_S = 5.0  # a platform that has not run `true` by then does not work here (PVM: hangs)
_probed: dict[str, dict[str, Any]] = {}  # per runsc binary (path, size, mtime): one probe per process
# Which platform runs runsc is the host's property: every node of this boot shares one answer
# (/run is emptied at boot), so a node started on a fresh data dir skips the probe (7 s here,
# most of it the KVM platform failing on a PVM host).
HOST_CACHE = Path("/run/dsec/gvisor-probe.json")


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
        for stored_at in (cache, HOST_CACHE):
            if answer is None:
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    stored = json.loads(stored_at.read_text())
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
            with contextlib.suppress(OSError):
                HOST_CACHE.parent.mkdir(parents=True, exist_ok=True)
                part = HOST_CACHE.with_name(f"{HOST_CACHE.name}.{os.getpid()}")
                part.write_text(json.dumps(answer))
                part.replace(HOST_CACHE)  # whole or not at all for a node reading it meanwhile
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
                env=ENV,
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
            await run_quietly([*base, "delete", "--force", sid])
            shutil.rmtree(probe, ignore_errors=True)

    # -- sandboxes ----------------------------------------------------------------------------

    def base_argv(self) -> list[str]:
        """runsc with this node's state directory: what every command on its sandboxes starts with."""
        assert self.runsc is not None
        return [self.runsc, "--root", str(self.state_dir)]

    def run_argv(
        self, *, bundle: Path, log_file: Path, pid_file: Path, sandbox_id: str, link: GuestLink | None
    ) -> list[str]:
        self.require()
        if link is not None:
            _check_fresh(link)
        return [
            *self.base_argv(),
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
        applies an OCI profile only with --oci-seccomp), a mount namespace and the init's
        plain arguments (dsec-rootfs only makes crun's namespace), /tmp bound to the root's own /tmp,
        since runsc mounts a tmpfs over an empty /tmp that is not a mount of the spec (and
        writes there would never reach the upper directory), and, with a ``link``, the
        network namespace that holds it."""
        linux = {k: v for k, v in config["linux"].items() if k != "seccomp"}
        # runsc makes the sandbox's mount namespace itself (crun's config leaves it to dsec-rootfs).
        linux["namespaces"] = [
            {"type": "network", "path": link.netns} if ns["type"] == "network" and link is not None else ns
            for ns in linux["namespaces"]
        ] + [{"type": "mount"}]
        mounts = list(config["mounts"])
        mounts.append(
            {
                "destination": "/tmp",
                "type": "bind",
                "source": str(rootfs / "tmp"),
                "options": ["rbind", "rw", "nosuid", "nodev"],
            }
        )
        process = {**config["process"], "args": [oci.INIT]}  # runsc's init keeps the root it starts in
        return {**config, "process": process, "linux": linux, "mounts": mounts}

    def gofer_pid(self, sandbox_id: str) -> int:
        """The sandbox's gofer, whose root is the sandbox's (0: runsc reports none)."""
        return int(self._state(sandbox_id).get("goferPid") or 0)

    def _state_file(self, sandbox_id: str) -> Path:
        return self.state_dir / f"{sandbox_id}_sandbox:{sandbox_id}.state"

    def _state(self, sandbox_id: str) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self._state_file(sandbox_id).read_text())
            return data
        except (OSError, ValueError) as exc:
            raise InfraFailure(f"runsc state of {sandbox_id}: {exc}", reason=InfraReason.runtime) from exc

    def knows(self, sandbox_id: str) -> bool:
        return self._state_file(sandbox_id).exists()

    def known(self) -> list[str]:
        if not self.state_dir.is_dir():
            return []
        return [p.name.split("_sandbox:", 1)[0] for p in self.state_dir.glob("*_sandbox:*.state")]

    async def delete(self, sandbox_id: str) -> None:
        if self.runsc is not None and self.knows(sandbox_id):
            await run_quietly([*self.base_argv(), "delete", "--force", sandbox_id])


def _check_fresh(link: GuestLink) -> None:
    """runsc moves the addresses of the namespace it is given into netstack, and its own test
    against the host's namespace is hidden from it (native/rootfs.py): the edge makes sure."""
    if link.netns is None or links.is_hosts_netns(link.netns):
        raise InfraFailure(
            f"refusing to start netstack in {link.netns!r}: not a namespace of its own",
            reason=InfraReason.network,
        )


async def run_quietly(argv: list[str], timeout_s: float = 30.0) -> int | None:
    """Run a runsc control command; None if it hung (a sentry that a freezer stopped cannot
    answer until thawed)."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        env=ENV,
    )
    try:
        async with asyncio.timeout(timeout_s):
            return await proc.wait()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None
