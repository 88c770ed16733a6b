"""The seccomp allowlist (backends/container/seccomp.py) from inside real sandboxes: every denied
family fails with its documented errno, the checks cannot be dodged through the high half of a
32-bit argument or another ABI, and ordinary work (shells, Python with threads, subprocesses and
sockets, package-manager file operations, gcc) still runs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from dsec import Sandbox
from dsec.images.base import TOOLCHAIN_PACKAGES, TOOLCHAIN_REF, ensure_base_layer
from dsec.images.store import LayerStore
from tests.conftest import DATA_DIR, Sandboxes
from tests.security.conftest import PRELUDE, Witness, probe

# x86_64 numbers. Arguments are harmless even if a call went through (NULL pointers, nothing
# that acts), so a wrong "success" shows up as a result, not as damage.
SYSCALLS = r"""
calls = {
    # forbidden: EPERM
    "init_module": (175, 0, 0, 0), "finit_module": (313, -1, 0, 0), "delete_module": (176, 0, 0),
    "kexec_load": (246, 0, 0, 0, 0), "kexec_file_load": (320, -1, -1, 0, 0, 0),
    "bpf": (321, 0, 0, 0), "perf_event_open": (298, 0, 0, -1, -1, 0),
    "mount": (165, 0, 0, 0, 0, 0), "umount2": (166, 0, 0), "fsopen": (430, 0, 0),
    "open_tree": (428, -1, 0, 0), "keyctl": (250, 0, 0, 0, 0, 0), "add_key": (248, 0, 0, 0, 0, 0),
    "request_key": (249, 0, 0, 0, 0), "userfaultfd": (323, 0), "unshare": (272, 0x10000000),
    "setns": (308, -1, 0), "quotactl_fd": (443, -1, 0, 0, 0), "sethostname": (170, 0, 0),
    # never needed, not on the list: ENOSYS, as from a kernel without them
    "io_uring_setup": (425, 1, 0), "io_uring_enter": (426, -1, 0, 0, 0, 0, 0),
    "fanotify_init": (300, 0, 0), "kcmp": (312, 1, 1, 0, 0, 0), "pidfd_getfd": (438, -1, 0, 0),
    "process_madvise": (440, -1, 0, 0, 0, 0), "modify_ldt": (154, 0, 0, 0),
    "mbind": (237, 0, 0, 0, 0, 0, 0), "clone3": (435, 0, 0),
    "no such call (1000)": (1000,),
    # on the list: they work
    "getpid": (39,), "memfd_create": (319, ctypes.addressof(ctypes.create_string_buffer(b"m")), 0),
}
out = {}
for name, (nr, *args) in calls.items():
    r, e = syscall(nr, *args)
    out[name] = e if r < 0 else "ok"
# socket(2) by family: the sandbox's own network stack, not vsock (the host's) or AF_ALG.
import socket
for name, family in (("AF_INET", 2), ("AF_INET6", 10), ("AF_UNIX", 1), ("AF_NETLINK", 16),
                     ("AF_VSOCK", 40), ("AF_ALG", 38), ("AF_VSOCK | 1 << 32", 40 | 1 << 32)):
    r, e = syscall(41, family, socket.SOCK_DGRAM if family != 16 else socket.SOCK_RAW, 0)
    out["socket " + name] = e if r < 0 else "ok"
print(json.dumps(out))
"""

ERRNOS = {
    **dict.fromkeys(
        "init_module finit_module delete_module kexec_load kexec_file_load bpf perf_event_open "
        "mount umount2 fsopen open_tree keyctl add_key request_key userfaultfd unshare setns "
        "quotactl_fd sethostname".split(),
        "EPERM",
    ),
    **dict.fromkeys(
        "io_uring_setup io_uring_enter fanotify_init kcmp pidfd_getfd process_madvise modify_ldt "
        "mbind clone3".split(),
        "ENOSYS",
    ),
    "no such call (1000)": "ENOSYS",
    "getpid": "ok",
    "memfd_create": "ok",
    "socket AF_INET": "ok",
    "socket AF_INET6": "ok",
    "socket AF_UNIX": "ok",
    "socket AF_NETLINK": "ok",
    "socket AF_VSOCK": "ENOSYS",
    "socket AF_ALG": "ENOSYS",
    "socket AF_VSOCK | 1 << 32": "ENOSYS",  # the kernel reads an int: the filter does too
}


async def test_denied_families_fail_with_their_errno(sandbox: Sandbox, witness: Witness) -> None:
    assert await probe(sandbox, SYSCALLS) == ERRNOS
    await witness.assert_intact()


# Another ABI, with its own system call numbers: i386 (int 0x80 from 64-bit code: `mov eax, 20
# (getpid); int 0x80; ret`) and x32 (getpid with bit 30 set). Neither is in the filter: the
# thread is killed (SIGSYS), whatever the call.
ABIS = r"""
import mmap, subprocess
if sys.argv[1] == "i386":
    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    m.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))
    print(ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))())
elif sys.argv[1] == "x32":
    print(syscall(0x40000000 | 39))
else:
    out = {}
    for abi in ("i386", "x32"):
        r = subprocess.run([sys.executable, "-c", sys.argv[2], abi], capture_output=True, text=True)
        out[abi] = [r.returncode, r.stdout.strip()]
    print(json.dumps(out))
"""


async def test_other_abis_are_killed(sandbox: Sandbox) -> None:
    assert await probe(sandbox, ABIS, "both", PRELUDE + ABIS) == {"i386": [-31, ""], "x32": [-31, ""]}
    # On the host (no filter) the same i386 call answers.
    r = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", PRELUDE + ABIS, "i386"], capture_output=True, text=True
    )
    assert r.returncode == 0 and int(r.stdout) > 0, r


# ioctl(2) by command. Terminal injection and line disciplines: EPERM, also with the high half
# of the command set (the kernel reads 32 bits). Filesystem and block ioctls: ENOTTY, on a
# host file (/.dsec is a read-only bind of the node's runtime tmpfs) and on a file of
# the writable layer (overlayfs, which passes flags, FIEMAP and clones to the node's disk).
IOCTLS = r"""
import fcntl, pty, termios
libc.ioctl.restype = ctypes.c_int
libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
buf = ctypes.create_string_buffer(4096)
ctypes.c_uint64.from_buffer(buf, 8).value = 2**64 - 1  # struct fiemap: fm_length, all of it

def ioctl(fd, cmd):
    ctypes.set_errno(0)
    r = libc.ioctl(fd, cmd, buf)
    return "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]

FS = {
    "FS_IOC_GETFLAGS": 0x80086601, "FS_IOC_SETFLAGS": 0x40086602, "FS_IOC_FIEMAP": 0xC020660B,
    "FIBMAP": 1, "EXT4_IOC_MOVE_EXT": 0xC028660F, "XFS_IOC_SWAPEXT": 0xC0C0586D,
    "FS_IOC_FSGETXATTR": 0x801C581F, "FS_IOC_FSSETXATTR": 0x401C5820, "FICLONE": 0x40049409,
    "FIDEDUPERANGE": 0xC0189436, "BLKGETSIZE64": 0x80081272, "FS_IOC_FIEMAP | 1 << 32": 0xC020660B | 1 << 32,
}
if sys.argv[1] == "host":  # only what reads: on the host these calls would act
    FS = {name: FS[name] for name in ("FS_IOC_GETFLAGS", "FS_IOC_FIEMAP")}
out = {}
for path in sys.argv[2:]:
    fd = os.open(path, os.O_RDONLY)
    out[path] = {name: ioctl(fd, cmd) for name, cmd in FS.items()}
if sys.argv[1] == "sandbox":
    master, slave = pty.openpty()
    r, w = os.pipe()
    out["tty"] = {
        "TIOCSTI": ioctl(slave, 0x5412), "TIOCSTI | 1 << 32": ioctl(slave, 0x5412 | 1 << 32),
        "TIOCLINUX": ioctl(slave, 0x541C), "TIOCSETD": ioctl(slave, 0x5423),
        "TCGETS": ioctl(slave, termios.TCGETS), "TIOCGWINSZ": ioctl(slave, termios.TIOCGWINSZ),
        "FIONREAD": ioctl(r, termios.FIONREAD), "FIONBIO": ioctl(r, termios.FIONBIO),
    }
print(json.dumps(out))
"""


async def test_filesystem_and_terminal_ioctls_are_refused(sandbox: Sandbox) -> None:
    await sandbox.write_file("/root/file", b"x" * 65536)
    out = await probe(sandbox, IOCTLS, "sandbox", "/.dsec/dsec-init", "/root/file")
    assert out.pop("tty") == {
        "TIOCSTI": "EPERM",
        "TIOCSTI | 1 << 32": "EPERM",
        "TIOCLINUX": "EPERM",
        "TIOCSETD": "EPERM",
        "TCGETS": "ok",
        "TIOCGWINSZ": "ok",
        "FIONREAD": "ok",
        "FIONBIO": "ok",
    }
    assert out == {path: dict.fromkeys(out[path], "ENOTTY") for path in ("/.dsec/dsec-init", "/root/file")}
    # The filter answers, not the filesystem: on the host, the same file answers for itself.
    host = DATA_DIR / "node" / "runtime" / "dsec-init"
    r = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", PRELUDE + IOCTLS, "host", str(host)],
        capture_output=True,
        text=True,
    )
    # (The runtime directory is the node's tmpfs: flags read, FIEMAP is "not supported", and
    # neither is the filter's ENOTTY.)
    assert json.loads(r.stdout.splitlines()[-1]) == {
        str(host): {"FS_IOC_GETFLAGS": "ok", "FS_IOC_FIEMAP": "ENOTSUP"}
    }
    # What a user sees: what lsattr says on a filesystem without file flags (it maps ENOTTY).
    r2 = await sandbox.run_shell("lsattr /root/file; echo rc=$?", timeout=60)
    assert "Operation not supported While reading flags" in r2.stderr and r2.stdout == "rc=1\n", r2


@pytest.fixture(scope="module")
def toolchain() -> str:
    with LayerStore(DATA_DIR / "layers") as store:
        ensure_base_layer(store, TOOLCHAIN_REF, packages=TOOLCHAIN_PACKAGES)
    return TOOLCHAIN_REF


WORKLOAD_PY = r"""
import asyncio, concurrent.futures, ctypes, hashlib, json, mmap, os, shutil, signal, socket
import subprocess, tempfile, threading

out = {}
# threads and a thread pool
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    out["threads"] = sum(pool.map(lambda i: len(hashlib.sha256(bytes(i)).digest()), range(64)))
# subprocesses, fork + wait, signals
out["subprocess"] = subprocess.run(["sh", "-c", "echo $((2 + 3))"], capture_output=True, text=True).stdout
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
p = subprocess.Popen(["sleep", "60"]); p.send_signal(signal.SIGTERM); out["signal"] = p.wait()
# loopback sockets: TCP, UDP, IPv6, Unix, and asyncio on epoll
srv = socket.create_server(("127.0.0.1", 0))
def serve():
    c, _ = srv.accept(); c.sendall(c.recv(100).upper()); c.close()
threading.Thread(target=serve).start()
with socket.create_connection(srv.getsockname()) as c:
    c.sendall(b"tcp"); out["tcp"] = c.recv(100).decode()
u1, u2 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM), socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
u1.bind(("::1", 0)); u2.sendto(b"udp6", u1.getsockname()); out["udp6"] = u1.recv(100).decode()
a, b = socket.socketpair(); a.sendall(b"unix"); out["unix"] = b.recv(100).decode()
async def echo():
    server = await asyncio.start_server(lambda r, w: (w.write(b"aio"), w.close()), "127.0.0.1", 0)
    r, w = await asyncio.open_connection(*server.sockets[0].getsockname())
    data = await r.read(); w.close(); server.close(); return data.decode()
out["asyncio"] = asyncio.run(echo())
# memory: memfd, shared mappings
fd = os.memfd_create("x"); os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096); m[:5] = b"memfd"; out["memfd"] = os.pread(fd, 5, 0).decode()
# package-manager file operations: a private temp tree, fsync + rename over, hard links,
# symlinks, ownership, modes, times, locks, and a child that drops to another user (as apt
# does to _apt) and writes where that user may
import fcntl
d = tempfile.mkdtemp()
with open(f"{d}/status-new", "w") as f:
    f.write("ok"); f.flush(); os.fsync(f.fileno())
os.rename(f"{d}/status-new", f"{d}/status")
os.link(f"{d}/status", f"{d}/hard"); os.symlink("status", f"{d}/soft")
os.chown(f"{d}/status", 65534, 65534); os.chmod(f"{d}/status", 0o640); os.utime(f"{d}/status", (1, 1))
with open(f"{d}/lock", "w") as lk:
    fcntl.lockf(lk, fcntl.LOCK_EX | fcntl.LOCK_NB); fcntl.flock(lk, fcntl.LOCK_EX | fcntl.LOCK_NB)
shutil.copytree(d, d + "-copy", symlinks=True)
os.chown(d, 65534, 65534)
pid = os.fork()
if pid == 0:
    os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
    open(f"{d}/by-nobody", "w").write("x"); os._exit(0 if os.geteuid() == 65534 else 1)
out["drop"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
out["files"] = sorted(os.listdir(d + "-copy"))
# inotify (file watches) through libc
libc = ctypes.CDLL(None, use_errno=True)
ino = libc.inotify_init1(os.O_NONBLOCK)
out["inotify"] = libc.inotify_add_watch(ino, d.encode(), 0x100) > 0  # IN_CREATE
print(json.dumps(out))
"""

WORKLOAD_C = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
static void *work(void *arg) { long *n = arg; for (long i = 0; i < 1000000; i++) *n += i & 1; return NULL; }
int main(void) {
    pthread_t t[4]; long n[4] = {0};
    for (int i = 0; i < 4; i++) pthread_create(&t[i], NULL, work, &n[i]);
    for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
    pid_t pid = fork();
    if (pid == 0) { execlp("true", "true", (char *)NULL); _exit(127); }
    int status; waitpid(pid, &status, 0);
    printf("%ld %d\n", n[0] + n[1] + n[2] + n[3], WEXITSTATUS(status));
    return 0;
}
"""


async def test_ordinary_workloads_still_run(make_sandbox: Sandboxes, toolchain: str) -> None:
    sb = await make_sandbox(container_image=toolchain)
    r = await sb.exec(["python3", "-c", WORKLOAD_PY], timeout=120)
    assert r.exit_code == 0, r
    got = json.loads(r.stdout.splitlines()[-1])
    assert got == {
        "threads": 64 * 32,
        "subprocess": "5\n",
        "fork": 7,
        "signal": -15,
        "tcp": "TCP",
        "udp6": "udp6",
        "unix": "unix",
        "asyncio": "aio",
        "memfd": "memfd",
        "drop": 0,
        "files": ["hard", "lock", "soft", "status"],
        "inotify": True,
    }
    await sb.write_file("/root/w.c", WORKLOAD_C)
    shell = (
        "set -e; cd /root; gcc -O2 -pthread -o w w.c; ./w;"
        # coreutils 9 tries a reflink (FICLONE, refused) and falls back to copying
        " head -c 1048576 /dev/urandom > big; cp big big2; cmp big big2; echo copied;"
        " cp -a /usr/include inc; tar cf - inc | tar xf - -C /tmp; echo tar;"
        " git init -q repo; cd repo; echo x > f; git add f;"
        " git -c user.name=a -c user.email=a@b commit -qm x; git log --oneline | wc -l;"
        " setarch $(uname -m) -R true; echo setarch; script -qc 'tty' /dev/null | grep -c /dev/pts;"
        " timeout 1 sleep 5 || echo timeout=$?; apt-get check -q >/dev/null; echo apt"
    )
    r = await sb.run_shell(shell, timeout=180)
    assert r.exit_code == 0, r
    assert r.stdout.split("\n") == [
        "2000000 0",
        "copied",
        "tar",
        "1",
        "setarch",
        "1",
        "timeout=124",
        "apt",
        "",
    ], r
