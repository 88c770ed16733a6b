"""The guest kit: a kernel and an initramfs of our own, built on the host, nothing installed.

* Kernel: Debian's cloud kernel package (the image ``linux-image-cloud-amd64`` points at in
  the newest version apt knows: bookworm-backports' 6.12 where setup.sh added that source),
  fetched with ``apt-get download`` and unpacked with ``dpkg -x`` into the kit directory; no
  install into /boot, no initramfs-tools. Its virtio, EROFS and overlay drivers are modules.
* Initramfs: static busybox (from busybox-static), the few modules the guest needs (with a
  ``modules.dep`` made by ``depmod -b``; one the kernel package lacks is left out), our ``init``
  script, and the guest agent compiled here with ``gcc -static`` (no Python in the guest).
  Written as a newc cpio by this module.

A kit is keyed by the kernel version and a hash of everything that goes into the initramfs, so
a changed agent rebuilds it and a kit in use is never changed in place.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import io
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cmp_to_key
from pathlib import Path

from dsec.protocol.errors import InfraFailure, InfraReason

log = logging.getLogger("dsec.microvm")

GUEST_DIR = Path(__file__).parent / "guest"
# cloud: small, virtio only (microVMs). generic: Debian's full kernel, with a VESA framebuffer
# built in (the full VMs' display) and ext4 as a module.
FLAVOURS = {"cloud": "linux-image-cloud-amd64", "generic": "linux-image-amd64"}
# Flavours that take the newest kernel of any source (not apt's candidate): microVMs want
# bookworm-backports' 6.12, whose Landlock ABI 6 scopes signals (docs/decisions.md).
NEWEST_FLAVOURS = frozenset({"cloud"})
BUSYBOX = Path("/bin/busybox")
# Loaded by init, in this order (dependencies come from modules.dep); a module a kernel has
# built in is simply not found.
MODULES = (
    "virtio_mmio", "virtio_pci", "virtio_blk", "virtio_console",
    "crc32c_generic",  # what libcrc32c (erofs, ext4) asks the crypto API for, by name
    "erofs", "overlay", "ext4", "evdev",
    "virtio_input",  # a full VM's absolute pointer (virtio tablet)
    "virtio_net",  # the network card of a VM created with network rules
    # The agent's channel where the host has vhost-vsock (dsec.channel=vsock); the transport
    # pulls in vsock and the common virtio part through modules.dep.
    "vsock", "vmw_vsock_virtio_transport",
)  # fmt: skip
# The kernel's command line (qemu.py adds what varies per VM). Part of the kit's key, as init
# is: a template saved by a guest booted with another line would be restored as it was.
# nohibernate: /dev/snapshot (opened by root without any capability) would otherwise read the
# guest's memory and restore an image of the guest's choosing over its kernel and agent.
CMDLINE = "console=ttyS0 quiet panic=-1 loglevel=3 random.trust_cpu=on nohibernate"
_APPLETS = (
    "sh", "mount", "umount", "mkdir", "modprobe", "insmod", "cat", "ls", "sleep", "poweroff", "echo",
    "ip", "rm",
)  # fmt: skip


@dataclass(frozen=True)
class GuestKit:
    kernel: Path  # vmlinuz
    initramfs: Path
    kernel_version: str
    # Its config has Landlock (ABI >= 2) among the LSMs: the agent gives each process it
    # spawns a domain of its own (guest/agent.c own_domain).
    landlock: bool = False

    @property
    def key(self) -> str:
        return self.initramfs.stem


def _run(argv: list[str], cwd: Path | None = None) -> str:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise InfraFailure(
            f"{' '.join(argv)} failed: {done.stderr.strip()[-800:]}", reason=InfraReason.guest_kit
        )
    return done.stdout


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # two edges (or a test and an edge) build it once
        yield
    finally:
        os.close(fd)


def _kernel_package(meta: str, newest: bool) -> str:
    """The versioned image package a meta package points at (linux-image-6.1.0-57-cloud-amd64):
    apt's candidate, or with ``newest`` the one of the meta package's newest version in any
    source apt knows (bookworm-backports has pin 100, so it is never the candidate)."""
    if not newest:
        out = _run(["apt-cache", "depends", meta])
        for line in out.splitlines():
            line = line.strip()
            if line.startswith("Depends:") and "linux-image-" in line:
                return line.split()[1]
        raise InfraFailure(f"apt knows no image package behind {meta}", reason=InfraReason.guest_kit)
    versions: dict[str, str] = {}  # the meta package's version -> its image package
    for record in _run(["apt-cache", "show", meta]).split("\n\n"):
        fields = {k: v for k, _, v in (line.partition(": ") for line in record.splitlines()) if v}
        image = fields.get("Depends", "").split(" ", 1)[0].rstrip(",")
        if "Version" in fields and image.startswith("linux-image-"):
            versions[fields["Version"]] = image
    if not versions:
        raise InfraFailure(f"apt knows no image package behind {meta}", reason=InfraReason.guest_kit)
    return versions[max(versions, key=cmp_to_key(_compare_versions))]


def _compare_versions(a: str, b: str) -> int:
    """Debian's version order, as dpkg has it (6.12.95-1~bpo12+1 > 6.1.192-3)."""
    if a == b:
        return 0
    done = subprocess.run(["dpkg", "--compare-versions", a, "gt", b], capture_output=True, check=False)
    return 1 if done.returncode == 0 else -1


def _is_flavour(name: str, flavour: str) -> bool:
    return ("-cloud-" in name) == (flavour == "cloud")


def _ensure_kernel(kit_dir: Path, flavour: str) -> tuple[Path, str]:
    """Unpack the kernel under ``kit_dir/kernel/<package>``; returns (root, version).

    The cloud flavour follows the newest image apt knows, so a node that gains
    bookworm-backports moves to its kernel (Landlock ABI 6: the agent's domains then scope
    signals) at its next start. Without apt's answer, or when the download fails (offline), a
    kernel unpacked before still serves; the generic flavour keeps the first it unpacked."""
    kernels = kit_dir / "kernel"
    existing = sorted(
        (
            p
            for p in kernels.glob("linux-image-*")
            if (p / ".complete").exists() and _is_flavour(p.name, flavour)
        ),
        key=lambda p: cmp_to_key(_compare_versions)(p.name.removeprefix("linux-image-")),
    )
    newest = flavour in NEWEST_FLAVOURS
    if existing and not newest:
        root = existing[-1]
    else:
        try:
            package = _kernel_package(FLAVOURS[flavour], newest)
            root = kernels / package
            if not (root / ".complete").exists():
                _download_kernel(kit_dir, package, root)
        except InfraFailure as e:
            if not existing:
                raise
            root = existing[-1]
            log.warning("guest kernel: keeping %s (%s)", root.name, e)
    versions = sorted(p.name for p in (root / "lib" / "modules").iterdir())
    if not versions:
        raise InfraFailure(f"no modules in {root}", reason=InfraReason.guest_kit)
    return root, versions[-1]


def _download_kernel(kit_dir: Path, package: str, root: Path) -> None:
    with tempfile.TemporaryDirectory(dir=kit_dir) as tmp:
        os.chmod(tmp, 0o755)  # apt drops privileges to _apt for the download
        _run(["apt-get", "download", "-q", package], cwd=Path(tmp))
        debs = list(Path(tmp).glob("*.deb"))
        if not debs:
            raise InfraFailure(f"apt-get download {package} left no .deb", reason=InfraReason.guest_kit)
        staging = Path(tmp) / "x"
        _run(["dpkg", "-x", str(debs[0]), str(staging)])
        root.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        shutil.move(str(staging), root)
    (root / ".complete").write_text(package + "\n")


def _compile_agent(out: Path) -> None:
    _run(["gcc", "-static", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(out), str(GUEST_DIR / "agent.c")])


def _module_files(kroot: Path, version: str) -> list[str]:
    """The module files (relative to the version dir) MODULES need, dependencies included."""
    moddir = kroot / "lib" / "modules" / version
    if not (moddir / "modules.dep").exists():
        _run(["depmod", "-b", str(kroot), version])
    deps: dict[str, list[str]] = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        name, _, rest = line.partition(":")
        deps[name] = rest.split()
    wanted: set[str] = set()
    for module in MODULES:
        match = [p for p in deps if Path(p).name.split(".ko")[0] == module]
        for path in match:
            wanted.add(path)
            wanted.update(deps[path])
    return sorted(wanted)


_CONSOLE = ("dev/console", stat.S_IFCHR | 0o600, b"")  # init's stdio before devtmpfs is mounted


def newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A cpio archive in the "newc" format the kernel unpacks: (name, mode, data) entries."""
    out = io.BytesIO()

    def put(name: str, mode: int, data: bytes, ino: int) -> None:
        encoded = name.encode() + b"\0"
        rdev = (5, 1) if (name, mode) == _CONSOLE[:2] else (0, 0)
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, *rdev, len(encoded), 0]
        out.write(b"070701" + b"".join(b"%08X" % f for f in fields) + encoded)
        out.write(b"\0" * (-(110 + len(encoded)) % 4))
        out.write(data)
        out.write(b"\0" * (-len(data) % 4))

    for ino, (name, mode, data) in enumerate(entries, start=1):
        put(name, mode, data, ino)
    put("TRAILER!!!", 0, b"", 0)
    return out.getvalue()


def _initramfs_entries(kroot: Path, version: str, agent: Path) -> list[tuple[str, int, bytes]]:
    dirs = ["bin", "dev", "proc", "sys", "mnt", "sysroot", "lib", "lib/modules", f"lib/modules/{version}"]
    entries: list[tuple[str, int, bytes]] = []
    mods = _module_files(kroot, version)
    for rel in mods:
        parts = Path(rel).parent.parts
        for i in range(1, len(parts) + 1):
            d = f"lib/modules/{version}/" + "/".join(parts[:i])
            if d not in dirs:
                dirs.append(d)
    entries += [(d, stat.S_IFDIR | 0o755, b"") for d in dirs]
    entries.append(("bin/busybox", stat.S_IFREG | 0o755, BUSYBOX.read_bytes()))
    entries += [(f"bin/{a}", stat.S_IFLNK | 0o777, b"busybox") for a in _APPLETS]
    moddir = kroot / "lib" / "modules" / version
    entries += [
        (f"lib/modules/{version}/{rel}", stat.S_IFREG | 0o644, (moddir / rel).read_bytes()) for rel in mods
    ]
    # A modules.dep for exactly these modules, as busybox modprobe reads it.
    dep_lines = []
    full = dict(
        line.partition(":")[::2] for line in (moddir / "modules.dep").read_text().splitlines() if line
    )
    for rel in mods:
        dep_lines.append(f"{rel}:{full.get(rel, '')}")
    entries.append(
        (f"lib/modules/{version}/modules.dep", stat.S_IFREG | 0o644, "\n".join(dep_lines).encode() + b"\n")
    )
    # Which of MODULES this kernel has built in (6.12's cloud kernel: virtio_console,
    # virtio_pci): busybox modprobe reads modules.builtin and answers success for those.
    builtin = moddir / "modules.builtin"
    names = set(MODULES)
    lines = builtin.read_text().splitlines() if builtin.exists() else []
    entries.append(
        (
            f"lib/modules/{version}/modules.builtin",
            stat.S_IFREG | 0o644,
            "".join(f"{line}\n" for line in lines if Path(line).name.split(".ko")[0] in names).encode(),
        )
    )
    entries.append(_CONSOLE)
    entries.append(("init", stat.S_IFREG | 0o755, (GUEST_DIR / "init").read_bytes()))
    entries.append(("agent", stat.S_IFREG | 0o755, agent.read_bytes()))
    return entries


def _inputs_hash(version: str) -> str:
    h = hashlib.sha256(version.encode())
    for name in ("agent.c", "init"):
        h.update((GUEST_DIR / name).read_bytes())
    h.update(Path(__file__).read_bytes())  # how the initramfs is laid out (modules.builtin)
    h.update(BUSYBOX.read_bytes())
    h.update(repr(MODULES).encode())
    h.update(CMDLINE.encode())
    return h.hexdigest()[:16]


def ensure_kit(kit_dir: Path, flavour: str = "cloud") -> GuestKit:
    """The kernel and initramfs under ``kit_dir``, built if missing (needs apt, gcc, depmod)."""
    if flavour not in FLAVOURS:
        raise InfraFailure(f"unknown guest kernel flavour {flavour!r}", reason=InfraReason.guest_kit)
    with _locked(kit_dir / ".lock"):
        kroot, version = _ensure_kernel(kit_dir, flavour)
        kernel = kroot / "boot" / f"vmlinuz-{version}"
        initramfs = kit_dir / f"initramfs-{_inputs_hash(version)}.img"
        if not initramfs.exists():
            with tempfile.TemporaryDirectory(dir=kit_dir) as tmp:
                agent = Path(tmp) / "agent"
                _compile_agent(agent)
                data = gzip.compress(newc(_initramfs_entries(kroot, version, agent)), compresslevel=1)
                part = Path(tmp) / "initramfs.img"
                part.write_bytes(data)
                os.replace(part, initramfs)
        return GuestKit(
            kernel=kernel, initramfs=initramfs, kernel_version=version, landlock=has_landlock(kroot, version)
        )


def has_landlock(kroot: Path, version: str) -> bool:
    """Whether the kernel unpacked at ``kroot`` enables Landlock with ABI >= 2 (Linux 5.19:
    renames across directories) by default: built in and in its default list of LSMs."""
    try:
        config = (kroot / "boot" / f"config-{version}").read_text()
    except OSError:
        return False
    lsm = next(
        (line.split("=", 1)[1].strip('"') for line in config.splitlines() if line.startswith("CONFIG_LSM=")),
        "",
    )
    numbers = tuple(int(n) for n in version.split("-")[0].split(".")[:2] if n.isdigit())
    return (
        "CONFIG_SECURITY_LANDLOCK=y" in config.splitlines()
        and "landlock" in lsm.split(",")
        and numbers >= (5, 19)
    )
