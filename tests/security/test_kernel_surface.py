"""Escapes through the kernel's interfaces: privileged system calls, device nodes, /proc and
/sys files that reach host-global state, and readers that try to crash the node by reading
every kernel file there is."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dsec import DSecClient, Sandbox
from tests.conftest import Sandboxes
from tests.security.conftest import Witness, assert_host_process_untouched, assert_node_healthy, probe

# x86_64 numbers; the arguments are harmless even if a call were allowed (NULL pointers, no
# flags that act), so a wrong "success" shows up as a result, not as damage.
SYSCALLS = r"""
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x20000, 0x10000000, 0x40000000, 0x20000000
calls = {
    "mount": (165, 0, 0, 0, 0, 0),
    "umount2": (166, 0, 0),
    "unshare(NEWNS)": (272, CLONE_NEWNS),
    "unshare(NEWUSER)": (272, CLONE_NEWUSER),
    "unshare(NEWNET)": (272, CLONE_NEWNET),
    "unshare(NEWPID)": (272, CLONE_NEWPID),
    "setns": (308, 0, 0),
    "init_module": (175, 0, 0, 0),
    "finit_module": (313, 0, 0, 0),
    "delete_module": (176, 0, 0),
    "kexec_load": (246, 0, 0, 0, 0),
    "kexec_file_load": (320, 0, 0, 0, 0, 0),
    "bpf": (321, 0, 0, 0),
    "perf_event_open": (298, 0, 0, -1, -1, 0),
    "keyctl": (250, 0, 0, 0, 0, 0),
    "add_key": (248, 0, 0, 0, 0, 0),
    "request_key": (249, 0, 0, 0, 0),
    "open_by_handle_at": (304, 0, 0, 0),
    "name_to_handle_at": (303, 0, 0, 0, 0, 0),
    "pivot_root": (155, 0, 0),
    "swapon": (167, 0, 0),
    "swapoff": (168, 0),
    "reboot": (169, 0, 0, 0, 0),
    "syslog": (103, 3, 0, 0),
    "iopl": (172, 3),
    "ioperm": (173, 0, 1024, 1),
    "settimeofday": (164, 0, 0),
    "clock_settime": (227, 0, 0),
    "acct": (163, 0),
    "quotactl": (179, 0, 0, 0, 0),
    "userfaultfd": (323, 0),
    "fsopen": (430, 0, 0),
    "fsmount": (432, 0, 0, 0),
    "fspick": (433, 0, 0, 0),
    "open_tree": (428, 0, 0, 0),
    "move_mount": (429, 0, 0, 0, 0, 0),
    "mount_setattr": (442, 0, 0, 0, 0, 0),
    "lookup_dcookie": (212, 0, 0, 0),
    "vhangup": (153,),
    "nfsservctl": (180, 0, 0, 0),
    "uselib": (134, 0),
    "clone(NEWNS)": (56, CLONE_NEWNS | 17, 0, 0, 0, 0),
    "clone(NEWNET)": (56, CLONE_NEWNET | 17, 0, 0, 0, 0),
}
out = {}
for name, (nr, *args) in calls.items():
    r, e = syscall(nr, *args)
    if r == 0 and name.startswith("clone"):
        os._exit(0)  # the child of an unexpected success: the parent reports it
    out[name] = e if r < 0 else f"returned {r}"
print(json.dumps(out))
"""


async def test_privileged_syscalls_fail(sandbox: Sandbox, witness: Witness) -> None:
    out = await probe(sandbox, SYSCALLS)
    allowed = {name: v for name, v in out.items() if v not in ("EPERM", "ENOSYS")}
    assert allowed == {}, allowed
    await witness.assert_intact()
    # The same through the tools an agent would reach for.
    r = await sandbox.run_shell(
        "mount -t tmpfs x /mnt; echo rc=$?; umount /proc; echo rc=$?; unshare -U true; echo rc=$?;"
        " mount -o remount,rw /sys; echo rc=$?; swapoff -a; echo rc=$?",
        timeout=60,
    )
    assert r.stdout.count("rc=") == 5 and "rc=0" not in r.stdout, r


async def test_no_device_nodes_reach_hardware(sandbox: Sandbox) -> None:
    body = r"""
import stat
out = {"dev": sorted(os.listdir("/dev")), "mknod": {}, "open": {}}
for name, kind, major, minor in (
    ("sda", stat.S_IFBLK, 8, 0), ("vda", stat.S_IFBLK, 253, 0), ("loop0", stat.S_IFBLK, 7, 0),
    ("mem", stat.S_IFCHR, 1, 1), ("kmsg", stat.S_IFCHR, 1, 11), ("port", stat.S_IFCHR, 1, 4),
    ("kvm", stat.S_IFCHR, 10, 232), ("tun", stat.S_IFCHR, 10, 200), ("fuse", stat.S_IFCHR, 10, 229),
):
    try:
        os.mknod(f"/tmp/{name}", 0o600 | kind, os.makedev(major, minor))
        out["mknod"][name] = "created"
    except OSError as e:
        out["mknod"][name] = err(e)
for path in ("/dev/mem", "/dev/kmem", "/dev/port", "/dev/kmsg", "/dev/vda", "/dev/sda", "/dev/loop0",
             "/dev/loop-control", "/dev/kvm", "/dev/fuse", "/dev/net/tun", "/dev/core", "/dev/cpu/0/msr",
             "/dev/btrfs-control", "/dev/hwrng", "/proc/kcore", "/proc/kmsg", "/proc/kpageflags"):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        out["open"][path] = "opened:" + str(len(os.read(fd, 64)))
        os.close(fd)
    except OSError as e:
        out["open"][path] = err(e)
print(json.dumps(out))
"""
    out = await probe(sandbox, body)
    safe = {"core", "fd", "full", "null", "ptmx", "pts", "random", "stderr", "stdin", "stdout", "tty"}
    assert set(out["dev"]) <= safe | {"urandom", "zero", "shm", "mqueue"}, out["dev"]
    assert set(out["mknod"].values()) == {"EPERM"}, out["mknod"]
    # Absent, or present and empty (the masked kernel files read as nothing).
    bad = {p: v for p, v in out["open"].items() if v not in ("ENOENT", "EPERM", "EACCES", "opened:0")}
    assert bad == {}, out["open"]


# Each target gets the value it already holds (read on the host), so even a wrong success would
# change nothing; the sysrq trigger gets "h" (print help: harmless) were it reachable at all.
WRITE_TARGETS = [
    "/proc/sys/kernel/core_pattern",
    "/proc/sys/kernel/modprobe",
    "/proc/sys/kernel/panic",
    "/proc/sys/kernel/hostname",
    "/proc/sys/vm/overcommit_memory",
    "/proc/sys/vm/swappiness",
    "/proc/sys/fs/protected_symlinks",
    "/proc/sys/kernel/randomize_va_space",
    "/sys/kernel/mm/ksm/run",
    "/sys/kernel/mm/transparent_hugepage/enabled",
    "/sys/kernel/uevent_helper",
    "/sys/module/printk/parameters/time",
]


def _host_value(path: str) -> str | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    if "[" in text:  # "always [madvise] never": the selected word
        return text.split("[", 1)[1].split("]", 1)[0]
    return text.strip()


async def test_proc_sys_and_sysrq_writes_fail(sandbox: Sandbox) -> None:
    before = {p: _host_value(p) for p in WRITE_TARGETS}
    body = r"""
targets = json.loads(sys.stdin.read())
out = {}
for path, value in list(targets.items()) + [("/proc/sysrq-trigger", "h"), ("/proc/sys/vm/drop_caches", "1")]:
    try:
        with open(path, "w") as f:
            f.write((value or "") + "\n")
        out[path] = "written"
    except OSError as e:
        out[path] = err(e)
print(json.dumps(out))
"""
    out = await probe(sandbox, body, stdin=json.dumps(before))
    assert "written" not in out.values(), out
    assert set(out.values()) <= {"EROFS", "ENOENT", "EACCES", "EPERM"}, out
    assert {p: _host_value(p) for p in WRITE_TARGETS} == before


@pytest.mark.slow
async def test_reading_every_proc_and_sys_file_leaves_the_node_fine(
    client: DSecClient,
    make_sandbox: Sandboxes,
    witness: Witness,
    host_process: subprocess.Popen[bytes],
) -> None:
    """grep -r over /proc and /sys, then a bounded read of every file there: the reader may
    fail or be OOM-killed (a /proc/<pid>/pagemap is one endless line), the node and its
    neighbours may not."""
    reader = await make_sandbox(memory_limit_mb=256)
    grep = "grep -rs --binary-files=text -l no-such-string-anywhere /proc /sys"
    r = await reader.run_shell(f"timeout -s KILL 60 {grep}; echo rc=$?", timeout=120)
    assert not r.timed_out and "rc=" in r.stdout, r
    # Without pagemap the same walk runs to its end: every other file was read.
    r = await reader.run_shell(f"timeout -s KILL 60 {grep} --exclude=pagemap; echo rc=$?", timeout=120)
    assert not r.timed_out and r.stdout.splitlines()[-1] in ("rc=0", "rc=1", "rc=2"), r
    # The first 64 KiB of each file, pagemaps included (tasks' duplicates aside).
    r = await reader.run_shell(
        "timeout -s KILL 60 sh -c \"find /proc /sys -type f 2>/dev/null | grep -v -e '/proc/[0-9]*/task/'"
        " | xargs -d '\\n' -n 64 head -q -c 65536 > /dev/null 2>&1\"; echo rc=$?",
        timeout=120,
    )
    assert not r.timed_out and r.stdout.splitlines()[-1] in ("rc=0", "rc=123"), r
    assert (await reader.run_shell("echo still", timeout=60)).stdout == "still\n"
    await witness.assert_intact()
    assert_host_process_untouched(host_process)
    await assert_node_healthy(client, make_sandbox)


# clone(2) with namespace flags, as fork: the child reports what it got and exits.
CLONE = r"""
import socket
CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x40000000, 17
out = {}
for label, flags in (("user", CLONE_NEWUSER), ("user+net", CLONE_NEWUSER | CLONE_NEWNET)):
    r, w = os.pipe()
    pid, e = syscall(56, flags | SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]
        got = {"cap_eff": caps}
        try:
            socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()
            got["raw_socket"] = "ok"
        except OSError as exc:
            got["raw_socket"] = err(exc)
        try:
            nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
            nl.bind((0, 0))
            got["nfnetlink"] = "ok"
        except OSError as exc:
            got["nfnetlink"] = err(exc)
        os.write(w, json.dumps(got).encode())
        os._exit(0)
    os.close(w)
    if pid > 0:
        os.waitpid(pid, 0)
        out[label] = json.loads(os.read(r, 4096))
    else:
        out[label] = e
    os.close(r)
print(json.dumps(out))
"""


# clone3(2) as glibc calls it for threads: a struct clone_args on the heap.
CLONE3 = r"""
import ctypes, threading, subprocess
args = (ctypes.c_uint64 * 11)()
args[0] = 0x10000000  # CLONE_NEWUSER
args[4] = 17  # exit_signal SIGCHLD
pid, e = syscall(435, ctypes.addressof(args), ctypes.sizeof(args))
if pid == 0:
    os._exit(0)
if pid > 0:
    os.waitpid(pid, 0)
seen = []
t = threading.Thread(target=lambda: seen.append(1)); t.start(); t.join()
forked = subprocess.run(["true"]).returncode
print(json.dumps({"clone3": e if pid < 0 else "ok", "thread": seen == [1], "fork": forked}))
"""


async def test_clone_into_new_namespaces_is_refused(sandbox: Sandbox) -> None:
    """Found by this suite: seccomp denied unshare(2) but not clone(2) with CLONE_NEWUSER, and
    the child had every capability in its new user namespace (raw sockets, nf_tables)."""
    assert await probe(sandbox, CLONE) == {"user": "EPERM", "user+net": "EPERM"}
    # clone3 cannot be filtered by its flags: it is refused as absent, and libc falls back to
    # clone(2) for threads and processes, which keep working.
    assert await probe(sandbox, CLONE3) == {"clone3": "ENOSYS", "thread": True, "fork": 0}
