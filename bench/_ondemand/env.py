"""A "remote" blob store on this machine: sshfs to an OpenSSH server in a private network namespace.

    host netns                                 |  netns dsec-odb-<pid>
    sshfs -> ssh -> <veth>h 10.213.N.1  ====== |  <veth>n 10.213.N.2:2222  relay (+delay each way)
                                               |     -> 127.0.0.1:2222  sshd (internal-sftp -R,
                                               |        chrooted to the served directory)
    sshfs (bulk) -> ssh ---------------------- |  10.213.N.2:2223  the same sshd, no relay

Everything is created with names derived from our PID and torn down in reverse order by an
ExitStack: the sshfs mount, every process in the namespace (found by the namespace's inode, so
sshd's per-connection children too: all of them are ours), the namespace and with it the veth
pair. Children get PR_SET_PDEATHSIG so they also die if the bench is SIGKILLed; what a SIGKILL
still leaves behind (the namespace, a dead FUSE mount) is reaped by :func:`reap_stale` on the
next run. The only address ever contacted is the namespace's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dsec.images.mount import find_mount, unmount_tree

NETNS_PREFIX = "dsec-odb-"
WORKDIR_PREFIX = "dsec-odbench-"
PORT = 2222  # the relay (delayed); sshd listens on it on the namespace's loopback
DIRECT_PORT = 2223  # sshd itself, on the namespace's veth address (no delay)
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def run(*cmd: str, timeout: float = 30) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pids_in_netns(ns: str) -> list[int]:
    try:
        ino = os.stat(f"/run/netns/{ns}").st_ino
    except FileNotFoundError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == ino:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def _kill_netns_processes(ns: str) -> None:
    """SIGTERM, then SIGKILL, each process (by PID) living in our namespace ``ns``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_in_netns(ns)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and _pids_in_netns(ns):
            time.sleep(0.05)


def _delete_netns(ns: str) -> None:
    _kill_netns_processes(ns)
    if os.path.exists(f"/run/netns/{ns}"):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)


def reap_stale(tmp_root: Path) -> list[str]:
    """Remove what an earlier run killed with SIGKILL left: its namespace, mounts, work dir."""
    done = []
    if os.path.isdir("/run/netns"):
        for ns in os.listdir("/run/netns"):
            if ns.startswith(NETNS_PREFIX) and ns[len(NETNS_PREFIX) :].isdigit():
                if not _pid_alive(int(ns[len(NETNS_PREFIX) :])):
                    _delete_netns(ns)
                    done.append(f"netns {ns}")
    for d in tmp_root.glob(WORKDIR_PREFIX + "*"):
        pid = d.name[len(WORKDIR_PREFIX) :]
        if pid.isdigit() and not _pid_alive(int(pid)):
            unmount_tree(d)
            subprocess.run(["rm", "-rf", "--one-file-system", str(d)], check=False, timeout=600)
            done.append(f"workdir {d}")
    return done


def _free_subnet() -> int:
    used = run("ip", "-4", "-o", "addr") + run("ip", "-4", "route")
    for n in range(1, 255):
        if f"10.213.{n}." not in used:
            return n
    raise RuntimeError("no free 10.213.N.0/30 subnet for the bench's veth pair")


def _wait_for(
    pred: Callable[[], bool], what: str, proc: subprocess.Popen[bytes] | None, timeout: float = 15
) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready after {timeout} s")
        time.sleep(0.02)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@dataclass
class RemoteStore:
    mountpoint: Path  # the served directory, through sshfs and the delay relay
    # The same server without the relay: eager pulls copy through it. A bulk copy is bound by
    # bandwidth (here: ssh's crypto on 2 cores), not latency, so this only spares the baseline
    # the relay's CPU cost, i.e. it favours eager.
    bulk_mountpoint: Path
    netns: str
    veth: str  # host side
    server_ip: str
    delay_ms: float

    def rx_bytes(self) -> int:
        """Bytes that came from the store over the network (the host veth's receive counter)."""
        return int(Path(f"/sys/class/net/{self.veth}/statistics/rx_bytes").read_text())

    def tx_bytes(self) -> int:
        return int(Path(f"/sys/class/net/{self.veth}/statistics/tx_bytes").read_text())


@contextlib.contextmanager
def remote_store(
    served: Path, workdir: Path, *, delay_ms: float, max_seconds: float
) -> Iterator[RemoteStore]:
    """Serve ``served`` (read-only) from a fresh namespace and mount it with sshfs."""
    for tool in ("/usr/sbin/sshd", "/usr/bin/sshfs", "/usr/bin/ssh-keygen"):
        if not os.access(tool, os.X_OK):
            raise RuntimeError(f"{tool} missing: apt-get install openssh-server openssh-client sshfs")
    pid = os.getpid()
    ns = f"{NETNS_PREFIX}{pid}"
    veth_h, veth_n = f"odb{pid}h", f"odb{pid}n"
    n = _free_subnet()
    host_ip, server_ip = f"10.213.{n}.1", f"10.213.{n}.2"
    sshdir = workdir / "ssh"
    sshdir.mkdir(mode=0o700)
    with contextlib.ExitStack() as stack:
        run("ip", "netns", "add", ns)
        stack.callback(_delete_netns, ns)  # also removes the veth pair
        run("ip", "link", "add", veth_h, "type", "veth", "peer", "name", veth_n, "netns", ns)
        stack.callback(subprocess.run, ["ip", "link", "del", veth_h], capture_output=True, check=False)
        run("ip", "addr", "add", f"{host_ip}/30", "dev", veth_h)
        run("ip", "link", "set", veth_h, "up")
        run("ip", "-n", ns, "addr", "add", f"{server_ip}/30", "dev", veth_n)
        run("ip", "-n", ns, "link", "set", veth_n, "up")
        run("ip", "-n", ns, "link", "set", "lo", "up")

        for key in ("host_key", "client_key"):
            run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dsec-odbench", "-f", str(sshdir / key))
        client_pub = (sshdir / "client_key.pub").read_text().strip()
        (sshdir / "authorized_keys").write_text(f'restrict,from="127.0.0.1,{host_ip}" {client_pub}\n')
        host_pub = (sshdir / "host_key.pub").read_text().split()
        (sshdir / "known_hosts").write_text(
            "".join(f"[{server_ip}]:{port} {host_pub[0]} {host_pub[1]}\n" for port in (PORT, DIRECT_PORT))
        )
        config = sshdir / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"ListenAddress 127.0.0.1:{PORT}",
                    f"ListenAddress {server_ip}:{DIRECT_PORT}",
                    f"HostKey {sshdir / 'host_key'}",
                    f"AuthorizedKeysFile {sshdir / 'authorized_keys'}",
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PidFile none",
                    "LogLevel INFO",
                    "AllowTcpForwarding no",
                    "X11Forwarding no",
                    "PermitTTY no",
                    f"ChrootDirectory {served}",
                    "ForceCommand internal-sftp -R",
                    "Subsystem sftp internal-sftp -R",
                    "",
                ]
            )
        )
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        sshd_log = open(workdir / "sshd.log", "wb")
        stack.callback(sshd_log.close)
        sshd = subprocess.Popen(
            ["ip", "netns", "exec", ns, "/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=sshd_log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
            start_new_session=True,  # Ctrl-C reaches only the bench, which stops us in order
        )
        stack.callback(_stop, sshd)
        _wait_for(lambda: b"Server listening" in (workdir / "sshd.log").read_bytes(), "sshd", sshd)

        relay = subprocess.Popen(
            [
                "ip", "netns", "exec", ns, sys.executable, str(Path(__file__).with_name("relay.py")),
                server_ip, str(PORT), "127.0.0.1", str(PORT), str(delay_ms), str(int(max_seconds)),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            preexec_fn=_die_with_parent,
            start_new_session=True,  # Ctrl-C reaches only the bench, which stops us in order
        )  # fmt: skip
        stack.callback(_stop, relay)
        assert relay.stdout is not None
        if relay.stdout.readline().strip() != b"ready":
            raise RuntimeError("delay relay did not start")

        ssh_opts = [
            f"IdentityFile={sshdir / 'client_key'}",
            "IdentitiesOnly=yes",
            f"UserKnownHostsFile={sshdir / 'known_hosts'}",
            "GlobalKnownHostsFile=/dev/null",
            "StrictHostKeyChecking=yes",
            "BatchMode=yes",
            "ServerAliveInterval=15",
        ]

        def mount_sshfs(mnt: Path, port: int) -> None:
            mnt.mkdir()
            log_path = workdir / f"sshfs-{port}.log"
            log = open(log_path, "wb")
            stack.callback(log.close)
            sshfs = subprocess.Popen(
                ["sshfs", "-f", "-F", "/dev/null", f"root@{server_ip}:/", str(mnt),
                 "-o", f"ro,port={port}," + ",".join(ssh_opts)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
                start_new_session=True,  # Ctrl-C reaches only the bench, which stops us in order
            )  # fmt: skip

            def stop_sshfs() -> None:
                unmount_tree(mnt)
                _stop(sshfs)

            stack.callback(stop_sshfs)
            try:
                _wait_for(
                    lambda: (e := find_mount(mnt)) is not None and e.fstype == "fuse.sshfs", "sshfs", sshfs
                )
            except RuntimeError as err:
                raise RuntimeError(f"{err}: {log_path.read_text(errors='replace').strip()[-2000:]}") from err

        mount_sshfs(workdir / "store", PORT)
        mount_sshfs(workdir / "store-bulk", DIRECT_PORT)
        yield RemoteStore(
            mountpoint=workdir / "store",
            bulk_mountpoint=workdir / "store-bulk",
            netns=ns,
            veth=veth_h,
            server_ip=server_ip,
            delay_ms=delay_ms,
        )
