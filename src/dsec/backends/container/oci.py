"""OCI runtime-spec bundles for container sandboxes.

The config is built, not templated: isolation choices are code that tests can read back. The
rootfs is prepared by the backend (overlayfs over EROFS layers) in a mount namespace of its
own, so the runtime only mounts the sandbox's filesystems under it and chroots.
"""

from __future__ import annotations

import os
from typing import Any

from dsec.backends.base import DEFAULT_PATH, User
from dsec.backends.container import nodefs
from dsec.backends.container.seccomp import seccomp_profile
from dsec.protocol.models import ContainerSpec

# Docker's default set without NET_RAW (no raw sockets for port scans), MKNOD (no devices) and
# AUDIT_WRITE: the audit log is the host's (one for the node, only the initial namespaces have
# one), so with it a sandbox could write records there. libpam and sudo take its EPERM for
# "audit not in use" and go on.
CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_SETFCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
]

# Every filesystem instance a sandbox mounts registers a kernel shrinker that every memory
# cgroup then pays for, so a node's kernel memory grows with the square of its sandboxes. A
# sandbox therefore mounts only proc, a tmpfs /dev and devpts of its own; /sys and masked
# directories are read-only binds of one empty directory (a bind creates no instance).
MASKED_DIRS = ["/proc/acpi", "/proc/asound", "/proc/scsi"]

MASKED_PATHS = [
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/kpagecgroup",
    "/proc/kpageflags",
    "/proc/kpagecount",
    "/proc/sysrq-trigger",
    "/proc/vmallocinfo",
]

READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"]

# PID 1 of every sandbox: dsec-init (native/dsec_init.c), static, from the node's runtime
# directory (bind-mounted read-only at /.dsec): one process that reaps orphans and never exits
# on its own, so a sandbox survives edge restarts and needs nothing from its image.
INIT = "/.dsec/dsec-init"


EMPTY_DIR = "empty"  # in the runtime directory: what masked directories show
# In the runtime directory: /sys with only the file LXCFS answers (an empty file to bind over).
SYS_SKELETON = "sys"


def _empty_bind(destination: str, runtime_dir: str) -> dict[str, Any]:
    return {
        "destination": destination,
        "type": "bind",
        "source": f"{runtime_dir}/{EMPTY_DIR}",
        "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
    }


def _lxcfs_binds(lxcfs: str) -> list[dict[str, Any]]:
    """LXCFS's files over the kernel's: each read answers with the reader's cgroup limits."""
    files = [(f"/proc/{name}", f"{lxcfs}/proc/{name}") for name in nodefs.LXCFS_PROC_FILES]
    files.append((f"/sys/{nodefs.CPU_ONLINE}", f"{lxcfs}/sys/{nodefs.CPU_ONLINE}"))
    opts = ["bind", "ro", "nosuid", "nodev", "noexec"]
    return [{"destination": dst, "type": "bind", "source": src, "options": opts} for dst, src in files]


# cgroup v1 weights: best-effort gets the minimum, so under contention it yields ~500:1.
CPU_SHARES = {"ls": 1024, "be": 2}
# The kernel's default CFS period: not written, because every write of cpu.cfs_period_us or
# cpu.cfs_quota_us walks every cpu cgroup on the node (tg_set_cfs_bandwidth checks the whole
# tree): perf at 3,000 held sandboxes, ~1 ms per write. Only the quota is set.
CPU_PERIOD_US = 100_000


def cpu_quota(spec: ContainerSpec) -> int:
    """The sandbox's ``cpu.cfs_quota_us`` (microseconds of CPU per period)."""
    return max(1000, int(spec.cpu_cores_limit * CPU_PERIOD_US))


def build_config(
    *,
    sandbox_id: str,
    spec: ContainerSpec,
    user: User,
    rootfs: str,
    runtime_dir: str,
    cgroup_path: str,
    nofile: int = 65536,
    resolv_conf: str | None = None,
    cpu_quota_set: bool = False,
    lxcfs: str | None = None,
    volume_mounts: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``cpu_quota_set``: the sandbox's cgroups are a spare's that has its quota already
    (spares.py), so crun is not told to write it. ``lxcfs``: the node's LXCFS mount
    (nodefs.py), whose files then stand for /proc's and /sys's CPU and memory views."""
    memory = spec.memory_limit_mb * 1024 * 1024
    caps = list(CAPABILITIES)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            # The root it keeps comes over fd 3 once dsec-rootfs has made it (native/dsec_init.c).
            "args": [INIT, "--new-root-on", "3"],
            "env": [f"PATH={DEFAULT_PATH}"],
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps, "inheritable": []},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}],
            "noNewPrivileges": True,
        },
        "root": {"path": rootfs, "readonly": False},
        "hostname": "sandbox",
        "mounts": [
            {
                "destination": "/proc",
                "type": "proc",
                "source": "proc",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
            },
            # No sysfs: nothing there is a sandbox's own business except its network devices,
            # which /proc/net shows too.
            (
                {**_empty_bind("/sys", runtime_dir), "source": f"{runtime_dir}/{SYS_SKELETON}"}
                if lxcfs
                else _empty_bind("/sys", runtime_dir)
            ),
            *(_empty_bind(d, runtime_dir) for d in MASKED_DIRS if os.path.isdir(d)),
            # The spec's own: memory-backed, so charged to the sandbox's memory cgroup.
            *(
                {
                    "destination": path,
                    "type": "tmpfs",
                    "source": "tmpfs",
                    "options": ["nosuid", "nodev", "mode=1777", f"size={mb}m"],
                }
                for path, mb in spec.tmpfs.items()
            ),
            # Shared volumes: a tenant's files, so neither setuid programs nor device nodes work.
            *(
                {
                    "destination": path,
                    "type": "bind",
                    "source": source,
                    "options": ["bind", "rw", "nosuid", "nodev"],
                }
                for path, source in (volume_mounts or {}).items()
            ),
            *(_lxcfs_binds(lxcfs) if lxcfs else []),
            {
                "destination": "/.dsec",
                "type": "bind",
                "source": runtime_dir,
                "options": ["bind", "ro", "nosuid", "nodev"],
            },
            # A bind, not a new filesystem instance: it costs the kernel no shrinker per sandbox.
            *(
                [
                    {
                        "destination": "/etc/resolv.conf",
                        "type": "bind",
                        "source": resolv_conf,
                        "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
                    }
                ]
                if resolv_conf
                else []
            ),
        ],
        "linux": {
            # No mount namespace of crun's: dsec-rootfs --own-root makes its own namespace the
            # container's, so crun chroots rather than pivot_root, whose walk over every host
            # task grew each create with the node (native/dsec_rootfs.c). runsc adds one.
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts")],
            "cgroupsPath": cgroup_path,
            "resources": {
                "devices": [{"allow": False, "access": "rwm"}],
                # swap == limit: with swap present, memory.limit_in_bytes alone caps only RAM.
                "memory": {"limit": memory, "swap": memory},
                "cpu": {
                    **({} if cpu_quota_set else {"quota": cpu_quota(spec)}),
                    "shares": CPU_SHARES[spec.cpu_class],
                },
                "pids": {"limit": spec.pids_limit},
            },
            "maskedPaths": MASKED_PATHS,
            "readonlyPaths": READONLY_PATHS,
            "seccomp": seccomp_profile(),
        },
        "annotations": {"io.dsec.sandbox": sandbox_id},
    }
