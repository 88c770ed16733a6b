"""The seccomp profile of container sandboxes: an allowlist, with argument rules.

Every system call a sandbox may make is named in :data:`ALLOWED_SYSCALLS` (or has an argument
rule below); anything else fails. crun compiles the profile (:func:`seccomp_profile`, in the
OCI config) for the sandbox's init, and ``dsec-enter`` loads the same program for every process
the edge starts (:func:`compiled_rules` is the profile as crun reads it, the helper's input;
``tests/backends/test_enter.py`` checks that both compile to the same bytes).

Errors, chosen so that software takes the path it takes on a kernel or filesystem that lacks
the feature rather than failing loudly:

- **ENOSYS** for every call not on the list (``defaultErrnoRet``): what a kernel without that
  call answers, so libc and runtimes fall back (glibc for ``clone3``, ``fchmodat2`` and calls
  newer than this list; libuv and liburing when ``io_uring_setup`` is missing). A default of
  EPERM (Docker's) breaks those fallbacks, which is why runc patches its programs to answer
  ENOSYS for calls newer than its profile; crun does not, so the default itself is ENOSYS.
- **EPERM** for what a sandbox is forbidden rather than lacks (:data:`DENIED_SYSCALLS`: module
  loading, kexec, bpf, perf, the mount family, keyrings, namespaces, clocks...), as the kernel
  says it to a process without the capability; tools print "Operation not permitted".
- **ENOTTY** for the filesystem ioctls denied by :data:`DENIED_IOCTL_TYPES` and
  :data:`DENIED_IOCTLS`: what a filesystem without that ioctl answers, so ``cp --reflink=auto``,
  systemd's and libarchive's file-flag code fall back quietly.

Only the native x86_64 ABI is in the filter: a 32-bit (i386, ``int 0x80``) or x32 call is a
bad architecture to the program and kills the thread (SIGSYS). Docker lets both in as
sub-architectures; nothing a sandbox runs is 32-bit, and each ABI is one more syscall table to
get right.

32-bit arguments (an ioctl's command, a socket's family, a personality) are compared on their
low 32 bits only (``SCMP_CMP_MASKED_EQ`` with mask 0xffffffff): the kernel ignores the high
half of an ``int``, and a plain 64-bit compare would let ``cmd | 1 << 32`` through as another
value while the kernel runs ``cmd``.
"""

from __future__ import annotations

from typing import Any

EPERM = 1
ENOTTY = 25
ENOSYS = 38
LOW32 = 0xFFFFFFFF

# What ordinary workloads use: shells and coreutils, Python, Node, Go and Java runtimes, gcc,
# git, pip and apt (which drops to the _apt user), threads, ptrace-based debuggers, file
# watches, SysV and POSIX IPC, AIO. Docker's default list under the capabilities a sandbox has
# (chroot: CAP_SYS_CHROOT; ptrace and process_vm_*: contained by the pid namespace and
# no-new-privs, the escape suite checks it), minus:
#   - io_uring_*: a large, fast-moving kernel surface with a long CVE record (Docker, ChromeOS
#     and Android turned it off); ENOSYS makes liburing and libuv fall back to epoll;
#   - fanotify_mark (fanotify_init needs CAP_SYS_ADMIN), modify_ldt, *_thread_area and the
#     epoll_*_old stubs (32-bit and dead interfaces), kcmp, pidfd_getfd and process_madvise
#     (Docker gates them on CAP_SYS_PTRACE), mbind/set_mempolicy (CAP_SYS_NICE in Docker);
#     get_mempolicy stays: libnuma and the JVM query it;
#   - what DENIED_SYSCALLS names (clock_adjtime, name_to_handle_at: Docker allows both).
# Plus calls newer than Docker's list that libc may use: fchmodat2, cachestat,
# map_shadow_stack, futex_wake/wait/requeue. Argument-filtered calls (clone, socket, ioctl,
# personality) are not here: their rules follow.
ALLOWED_SYSCALLS = [
    # files and directories
    "access", "chdir", "chmod", "chown", "chroot", "close", "close_range", "copy_file_range",
    "creat", "dup", "dup2", "dup3", "faccessat", "faccessat2", "fadvise64", "fallocate",
    "fchdir", "fchmod", "fchmodat", "fchmodat2", "fchown", "fchownat", "fcntl", "fdatasync",
    "fgetxattr", "flistxattr", "flock", "fremovexattr", "fsetxattr", "fstat", "fstatfs", "fsync",
    "ftruncate", "futimesat", "getcwd", "getdents", "getdents64", "getxattr", "lchown",
    "lgetxattr", "link", "linkat", "listxattr", "llistxattr", "lremovexattr", "lseek",
    "lsetxattr", "lstat", "mkdir", "mkdirat", "mknod", "mknodat", "newfstatat", "open", "openat",
    "openat2", "pread64", "preadv", "preadv2", "pwrite64", "pwritev", "pwritev2", "read",
    "readahead", "readlink", "readlinkat", "readv", "removexattr", "rename", "renameat",
    "renameat2", "rmdir", "sendfile", "setxattr", "splice", "stat", "statfs", "statx", "symlink",
    "symlinkat", "sync", "sync_file_range", "syncfs", "tee", "truncate", "umask", "unlink",
    "unlinkat", "utime", "utimensat", "utimes", "vmsplice", "write", "writev", "cachestat",
    # waiting for events
    "epoll_create", "epoll_create1", "epoll_ctl", "epoll_pwait", "epoll_pwait2", "epoll_wait",
    "eventfd", "eventfd2", "inotify_add_watch", "inotify_init", "inotify_init1",
    "inotify_rm_watch", "pipe", "pipe2", "poll", "ppoll", "pselect6", "select", "signalfd",
    "signalfd4", "timerfd_create", "timerfd_gettime", "timerfd_settime",
    # asynchronous I/O (libaio: databases), not io_uring
    "io_cancel", "io_destroy", "io_getevents", "io_pgetevents", "io_setup", "io_submit",
    # sockets (socket(2) itself: by family, below)
    "accept", "accept4", "bind", "connect", "getpeername", "getsockname", "getsockopt",
    "listen", "recvfrom", "recvmmsg", "recvmsg", "sendmmsg", "sendmsg", "sendto",
    "setsockopt", "shutdown", "socketpair",
    # memory
    "brk", "get_mempolicy", "madvise", "membarrier", "memfd_create", "memfd_secret", "mincore",
    "mlock", "mlock2", "mlockall", "mmap", "mprotect", "mremap", "msync", "munlock",
    "munlockall", "munmap", "pkey_alloc", "pkey_free", "pkey_mprotect", "remap_file_pages",
    # processes, threads and signals (clone(2): by flags, below)
    "arch_prctl", "execve", "execveat", "exit", "exit_group", "fork", "futex", "futex_requeue",
    "futex_wait", "futex_waitv", "futex_wake", "get_robust_list", "getpgid", "getpgrp",
    "getpid", "getppid", "getsid", "gettid", "kill", "map_shadow_stack", "pause",
    "pidfd_open", "pidfd_send_signal", "prctl", "process_mrelease", "process_vm_readv",
    "process_vm_writev", "ptrace", "restart_syscall", "rseq", "rt_sigaction", "rt_sigpending",
    "rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait",
    "rt_tgsigqueueinfo", "set_robust_list", "set_tid_address", "setpgid", "setsid",
    "sigaltstack", "tgkill", "tkill", "vfork", "wait4", "waitid",
    # credentials (within the capabilities the sandbox has)
    "capget", "capset", "getegid", "geteuid", "getgid", "getgroups", "getresgid", "getresuid",
    "getuid", "setfsgid", "setfsuid", "setgid", "setgroups", "setregid", "setresgid",
    "setresuid", "setreuid", "setuid",
    # scheduling, limits, time, system information
    "alarm", "adjtimex", "clock_getres", "clock_gettime", "clock_nanosleep", "getcpu",
    "getitimer", "getpriority", "getrandom", "getrlimit", "getrusage", "gettimeofday",
    "ioprio_get", "ioprio_set", "nanosleep", "prlimit64", "sched_get_priority_max",
    "sched_get_priority_min", "sched_getaffinity", "sched_getattr", "sched_getparam",
    "sched_getscheduler", "sched_rr_get_interval", "sched_setaffinity", "sched_setattr",
    "sched_setparam", "sched_setscheduler", "sched_yield", "setitimer", "setpriority",
    "setrlimit", "sysinfo", "time", "timer_create", "timer_delete", "timer_getoverrun",
    "timer_gettime", "timer_settime", "times", "uname",
    # SysV and POSIX IPC (the sandbox has its own IPC namespace)
    "msgctl", "msgget", "msgrcv", "msgsnd", "semctl", "semget", "semop", "semtimedop", "shmat",
    "shmctl", "shmdt", "shmget", "mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive",
    "mq_timedsend", "mq_unlink",
    # sandboxing oneself further (browsers, build tools): only ever narrows
    "landlock_add_rule", "landlock_create_ruleset", "landlock_restrict_self", "seccomp",
]  # fmt: skip

# Absent from the list already; named so that they fail with EPERM ("you may not") rather than
# ENOSYS, as they did when this was a deny list, and so that the intent is written down.
# Capabilities block most of these too; seccomp is the second wall.
DENIED_SYSCALLS = [
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "create_module",
    "delete_module",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "get_kernel_syms",
    "init_module",
    "ioperm",
    "iopl",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "mount",
    "mount_setattr",
    "move_mount",
    "name_to_handle_at",
    "nfsservctl",
    "open_by_handle_at",
    "open_tree",
    "perf_event_open",
    "pivot_root",
    "quotactl",
    "quotactl_fd",
    "reboot",
    "request_key",
    "setdomainname",  # the sandbox has its own UTS namespace, but not CAP_SYS_ADMIN
    "sethostname",
    "setns",
    "settimeofday",
    "swapoff",
    "swapon",
    "syslog",
    "umount2",
    "unshare",
    "uselib",
    "userfaultfd",
    "vhangup",
]

# clone(2) with any of these is refused like unshare(2): a new user namespace would give the
# child every capability there (raw sockets, nf_tables...). clone is allowed when none is set
# (one masked compare, Docker's rule); when one is, the rule of that flag answers EPERM (one
# rule per flag, as a masked compare cannot say "any of"). The two sets of rules are disjoint,
# so their order in the program does not matter.
CLONE_NAMESPACE_FLAGS = [
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
]

# socket(2) families a sandbox may open: an allowlist, as the rarely used families (RDS, TIPC,
# CAN, X.25, AF_ALG...) are where socket privilege escalations came from, their modules loaded
# on first use. AF_VSOCK is not namespaced: it would reach the host's vsock services. AF_PACKET
# stays so that its refusal is the kernel's (EPERM without CAP_NET_RAW). Any other: ENOSYS.
SOCKET_FAMILIES = {
    1: "AF_UNIX",
    2: "AF_INET",
    10: "AF_INET6",
    16: "AF_NETLINK",  # ip(8), glibc's getifaddrs; the sandbox's own network namespace
    17: "AF_PACKET",
}

# socket(2) protocols refused in any family. NETLINK_KOBJECT_UEVENT: the kernel broadcasts
# every device event of the host (hotplug, `change@/devices/virtual/mem/null`...) to each
# network namespace owned by the initial user namespace, a sandbox's included, and any user
# may listen. In the other allowed families 15 is nothing a sandbox can open (AF_INET/AF_INET6:
# a raw protocol, which needs CAP_NET_RAW; AF_UNIX: only 0; AF_PACKET: an ethertype in network
# order, and CAP_NET_RAW again), so one compare of argument 2 says it. libseccomp tests the
# higher argument first: this runs before the family allows above.
DENIED_SOCKET_PROTOCOLS = {15: "NETLINK_KOBJECT_UEVENT"}

# personality(2) values: Docker's (Linux, PER_LINUX32, UNAME26 and their combination, and the
# query 0xffffffff) plus ADDR_NO_RANDOMIZE, which gdb and `setarch -R` set for the process
# they start. Others (READ_IMPLIES_EXEC, MMAP_PAGE_ZERO...) weaken the sandbox's own memory.
PERSONALITIES = [0x0, 0x8, 0x20000, 0x20008, 0x40000, 0xFFFFFFFF]

# ioctl(2) command families (the type byte, bits 8-15) that only filesystems and block devices
# implement: they reach the host's filesystems (/.dsec and /etc/resolv.conf are binds of host
# ext4 files; the writable layer is overlayfs on the node's filesystem, which passes file
# flags, FIEMAP and clones down to it). ENOTTY, as from a filesystem without them.
DENIED_IOCTL_TYPES = {
    0x66: "'f': FS_IOC_GETFLAGS/SETFLAGS (immutable, append-only, no-CoW...), FS_IOC_FIEMAP "
    "(physical block layout), EXT4_IOC_MOVE_EXT and the other ext4 ioctls, fscrypt keys and "
    "policies, fs-verity",
    0x58: "'X': XFS_IOC_SWAPEXT and the XFS ioctls, FS_IOC_FSSETXATTR (flags, project ids), "
    "FIFREEZE/FITHAW, FITRIM",
    0x94: "btrfs's: subvolumes, snapshots, FICLONE/FICLONERANGE (reflinks) and FIDEDUPERANGE; "
    "copy_file_range(2) remains, and `cp --reflink=auto` falls back to it",
    0x12: "block devices (BLK*): a sandbox has none, so none of these has a use",
    0xF5: "f2fs's (atomic writes, garbage collection, moving ranges)",
}
DENIED_IOCTLS = {
    0x00000001: ("FIBMAP: a file's block numbers on the host's disk", ENOTTY),
    # Terminals: push input into a terminal's queue, as if typed (a process sharing its
    # terminal with a shell outside would type commands into it), console-only functions, and
    # line disciplines (which load modules: n_hdlc, n_gsm had exploitable races).
    0x00005412: ("TIOCSTI", EPERM),
    0x0000541C: ("TIOCLINUX", EPERM),
    0x00005423: ("TIOCSETD", EPERM),
}


def _errno(value: int) -> dict[str, Any]:
    return {"action": "SCMP_ACT_ERRNO", "errnoRet": value}


def _low32(index: int, value: int) -> dict[str, Any]:
    return {"index": index, "value": LOW32, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}


def _ioctl_rules() -> list[dict[str, Any]]:
    """Denied commands, then ioctl allowed for every other. A catch-all allow would override the
    conditional denials (libseccomp keeps only the unconditional rule of a call), so the allow
    compares the fd, a condition always true (``fd >= 0`` as an unsigned 64-bit value).
    libseccomp orders the conditions on one call by argument, the higher first, so the
    command's tests (argument 1) run before the fd's (argument 0): a denied command never
    reaches the allow. tests/security/test_seccomp.py checks the outcome in a sandbox."""
    families = [
        {
            "names": ["ioctl"],
            **_errno(ENOTTY),
            "args": [{"index": 1, "value": 0xFF00, "valueTwo": kind << 8, "op": "SCMP_CMP_MASKED_EQ"}],
        }
        for kind in DENIED_IOCTL_TYPES
    ]
    single = [
        {"names": ["ioctl"], **_errno(err), "args": [_low32(1, cmd)]}
        for cmd, (_, err) in DENIED_IOCTLS.items()
    ]
    fd_always = {"index": 0, "value": 0, "op": "SCMP_CMP_GE"}
    allow = {"names": ["ioctl"], "action": "SCMP_ACT_ALLOW", "args": [fd_always]}
    return [*families, *single, allow]


def seccomp_profile() -> dict[str, Any]:
    """The ``linux.seccomp`` section of a sandbox's OCI config."""
    ns_mask = 0
    for flag in CLONE_NAMESPACE_FLAGS:
        ns_mask |= flag
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": ENOSYS,
        "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": [
            {"names": ALLOWED_SYSCALLS, "action": "SCMP_ACT_ALLOW"},
            {"names": DENIED_SYSCALLS, **_errno(EPERM)},
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "value": ns_mask, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
            },
            *(
                {
                    "names": ["clone"],
                    **_errno(EPERM),
                    "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
                }
                for flag in CLONE_NAMESPACE_FLAGS
            ),
            # clone3 passes its flags in memory, out of a filter's reach: ENOSYS makes libc fall
            # back to clone(2), where the rules above apply. (The default answers the same; the
            # rule says it on purpose.)
            {"names": ["clone3"], **_errno(ENOSYS)},
            *(
                {"names": ["socket"], "action": "SCMP_ACT_ALLOW", "args": [_low32(0, family)]}
                for family in SOCKET_FAMILIES
            ),
            *(
                {"names": ["socket"], **_errno(EPERM), "args": [_low32(2, proto)]}
                for proto in DENIED_SOCKET_PROTOCOLS
            ),
            *(
                {"names": ["personality"], "action": "SCMP_ACT_ALLOW", "args": [_low32(0, p)]}
                for p in PERSONALITIES
            ),
            *_ioctl_rules(),
        ],
    }


# -- the profile as crun compiles it, for dsec-enter ------------------------------------------

_ACT_ALLOW = 0x7FFF0000
_ACT_ERRNO = 0x00050000
_OPS = {"NE": 1, "LT": 2, "LE": 3, "EQ": 4, "GE": 5, "GT": 6, "MASKED_EQ": 7}


def _action(name: str, errno_ret: int) -> int:
    if name == "SCMP_ACT_ALLOW":
        return _ACT_ALLOW
    if name == "SCMP_ACT_ERRNO":
        return _ACT_ERRNO | (errno_ret & 0xFFFF)
    raise ValueError(f"dsec-enter does not compile seccomp action {name}")


def compiled_rules(profile: dict[str, Any]) -> str:
    """``profile`` as the libseccomp calls crun makes for it (libcrun_generate_seccomp), one per
    line for ``dsec-enter --seccomp-rules``: ``default ACTION``, ``arch NAME``, then ``rule
    ACTION SYSCALL [ARG OP DATUM_A DATUM_B]...``. crun's reading, followed to the letter so that
    both programs are byte-identical: errnoRet defaults to EPERM, a rule whose action is the
    default one is skipped, and a rule comparing one argument twice becomes one rule per
    comparison (libseccomp cannot AND two tests of an argument). Names libseccomp does not know
    are skipped by the helper, as by crun."""
    default = _action(profile["defaultAction"], profile.get("defaultErrnoRet", EPERM))
    lines = [f"default {default:#x}"]
    for arch in profile.get("architectures", []):
        lines.append(f"arch {arch.removeprefix('SCMP_ARCH_').lower()}")
    for entry in profile["syscalls"]:
        action = _action(entry["action"], entry.get("errnoRet", EPERM))
        if action == default:
            continue
        args = [
            (a["index"], _OPS[a["op"].removeprefix("SCMP_CMP_")], a.get("value", 0), a.get("valueTwo", 0))
            for a in entry.get("args") or []
        ][:6]
        indexes = [a[0] for a in args]
        groups = [[a] for a in args] if len(set(indexes)) < len(indexes) else [args]
        for name in entry["names"]:
            for group in groups:
                cmps = "".join(f" {i} {op} {a:#x} {b:#x}" for i, op, a, b in group)
                lines.append(f"rule {action:#x} {name}{cmps}")
    return "\n".join(lines) + "\n"
