"""The default base layer: a minimal Debian with bash, coreutils, python3 (pip, venv), git,
procps, curl and CA certs.

Built once per store with debootstrap (about a minute, needs the network), then reused by tag.
The build is not reproducible (package downloads, dpkg timestamps), which is fine: each recipe
(suite and package list) is built once under a tag of its own (``debian:bookworm-<recipe>``),
immutable, so every node sharing the store sees the one image the first builder produced; the
plain tag (``debian:bookworm``) is moved to the current recipe's layer, so a changed package
list rebuilds once everywhere and sandboxes already running keep the layer they started on.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from dsec.images.mount import mounts_under, unmount_tree
from dsec.images.refs import parse_tag
from dsec.images.store import LayerStore
from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest
from dsec.protocol.models import LayerInfo

DEFAULT_MIRROR = "http://deb.debian.org/debian"
# procps (ps, free, top), curl, pip and venv: what a task's first commands reach for.
BASE_PACKAGES = (
    "bash",
    "coreutils",
    "python3",
    "git",
    "ca-certificates",
    "procps",
    "curl",
    "python3-pip",
    "python3-venv",
)
# What SandboxFusion-style dataset graders import around a python solution (HumanEval-style
# harnesses prepend numpy, PAL-math imports sympy; SandboxFusion's runtime image ships these and
# more): Debian bookworm's builds, so debootstrap installs them from the mirror it already uses,
# with no build sandbox and no PyPI over TLS. Not shipped: torch, tensorflow, rdkit, faiss (no
# grader imports them; they outweigh all of this together).
FNCALL_PYTHON_PACKAGES = (
    "python3-numpy",
    "python3-scipy",
    "python3-pandas",
    "python3-sympy",
    "python3-sklearn",
    "python3-matplotlib",
    "python3-networkx",
    "python3-bs4",
    "python3-lxml",
    "python3-psutil",
    "python3-tabulate",
    "python3-pytest",
    "python3-pil",
    "python3-gmpy2",
    "python3-requests",
    "python3-toml",
)
# The FnCall pools' default environment: the base plus compilers for c and cpp calls and the
# graders' python libraries.
TOOLCHAIN_REF = "debian:bookworm-cc"
TOOLCHAIN_PACKAGES = (*BASE_PACKAGES, "gcc", "g++", "libc6-dev", *FNCALL_PYTHON_PACKAGES)

# E2B's base template for E2B clients: the base plus sudo, and E2B's `user` account (uid 1000,
# home /home/user, passwordless sudo), whom commands run as by default.
E2B_BASE_REF = "e2b:base"
E2B_USER, E2B_UID = "user", 1000
# python-is-python3: E2B's base answers to `python` as well (E2B's own SDK tests call it so).
E2B_PACKAGES = (*BASE_PACKAGES, "sudo", "python-is-python3")
# Part of the E2B base's recipe tag: a change to add_e2b_user must change this.
E2B_RECIPE = "e2b-user-2"
# The hostname of every container sandbox (backends/container/oci.py): sudo resolves it.
SANDBOX_HOSTNAME = "sandbox"

Progress = Callable[[str], None]
Customize = Callable[[Path], None]


def _first_uri_deb822(text: str) -> str | None:
    for line in text.splitlines():
        if line.startswith("URIs:"):
            for uri in line.split()[1:]:
                if "security" not in uri:  # security suites carry no full package set
                    return uri
    return None


def _first_uri_one_line(text: str) -> str | None:
    for line in text.splitlines():
        words = line.split()
        if not words or words[0] != "deb":
            continue
        rest = words[1:]
        if rest and rest[0].startswith("["):  # "deb [arch=amd64 signed-by=...] URI suite"
            while rest and not rest[0].endswith("]"):
                rest = rest[1:]
            rest = rest[1:]
        if rest and "security" not in rest[0]:
            return rest[0]
    return None


def default_mirror(
    deb822: Path = Path("/etc/apt/sources.list.d/debian.sources"),
    one_line: Path = Path("/etc/apt/sources.list"),
) -> str:
    """The host's own Debian mirror (it is known to be reachable from here), else deb.debian.org."""
    for path, parse in ((deb822, _first_uri_deb822), (one_line, _first_uri_one_line)):
        try:
            uri = parse(path.read_text())
        except OSError:
            continue
        if uri:
            return uri
    return DEFAULT_MIRROR


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _debootstrap(suite: str, target: Path, mirror: str, say: Progress, packages: tuple[str, ...]) -> None:
    tool = shutil.which("debootstrap")
    if tool is None:
        raise InfraFailure(
            "debootstrap not found: install the debootstrap package", reason=InfraReason.image_build
        )
    cmd = [
        tool,
        "--variant=minbase",
        f"--include={','.join(packages)}",
        suite,
        os.fspath(target),
        mirror,
    ]
    say(" ".join(cmd))
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LC_ALL": "C"}
    env["DEBIAN_FRONTEND"] = "noninteractive"
    tail: deque[str] = deque(maxlen=40)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, text=True
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            say(line.rstrip())
        rc = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: do not leave it writing into a tree we delete
            proc.kill()
            proc.wait()
    if rc != 0:
        log = "\n".join(tail)
        raise InfraFailure(
            f"debootstrap {suite} from {mirror} failed (exit {rc}):\n{log}", reason=InfraReason.image_build
        )


def _remove_entries(directory: Path, pattern: str = "*") -> None:
    if not directory.is_dir() or directory.is_symlink():
        return
    for entry in directory.glob(pattern):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _write_fresh(path: Path, content: str) -> None:
    # unlink first: a symlink in the new tree must not make us write to the host's file.
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(content)


def slim_rootfs(root: Path) -> None:
    """Drop what a fresh debootstrap leaves that no sandbox needs, and the host's own settings."""
    _remove_entries(root / "var/cache/apt/archives", "*.deb")
    _remove_entries(root / "var/cache/apt/archives/partial")
    _remove_entries(root / "var/cache/apt", "*.bin")
    _remove_entries(root / "var/lib/apt/lists", "*_*")  # keep lock and partial/
    _remove_entries(root / "var/lib/apt/lists/partial")
    _remove_entries(root / "var/cache/debconf", "*-old")
    _remove_entries(root / "var/lib/dpkg", "*-old")
    _remove_entries(root / "tmp")
    _remove_entries(root / "var/tmp")
    # Keep /var/log's directories (dpkg and apt expect them), drop the install logs.
    for dirpath, _dirs, files in os.walk(root / "var/log"):
        for name in files:
            os.unlink(os.path.join(dirpath, name))
    # debootstrap copies the host's resolv.conf and hostname; sandboxes get their own.
    if (root / "etc").is_dir():
        _write_fresh(root / "etc/resolv.conf", "")
        _write_fresh(root / "etc/hostname", "localhost\n")


def _remove_work_dir(work: Path) -> None:
    # A failed debootstrap can leave /proc and /sys mounted in the target; rmtree must never
    # walk into them (it would try to delete the host's files through them).
    unmount_tree(work)
    if mounts_under(work):
        raise InfraFailure(f"cannot remove {work}: mounts remain below it", reason=InfraReason.storage)
    shutil.rmtree(work, ignore_errors=True)


def _rewrite(path: Path, text: str) -> None:
    """``path`` with new content and its old mode and owners (/etc/shadow is 0640 root:shadow)."""
    st = path.lstat()
    _write_fresh(path, text)
    os.chown(path, st.st_uid, st.st_gid)
    os.chmod(path, stat.S_IMODE(st.st_mode))


def _append(path: Path, line: str) -> None:
    text = path.read_text()
    _rewrite(path, text + ("" if text.endswith("\n") or not text else "\n") + line + "\n")


def _add_member(path: Path, group: str, member: str) -> None:
    """``member`` added to ``group``'s line of /etc/group or /etc/gshadow (last field)."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        fields = line.split(":")
        if fields[0] == group:
            fields[-1] = ",".join([m for m in fields[-1].split(",") if m] + [member])
            lines[i] = ":".join(fields)
    _rewrite(path, "\n".join(lines) + "\n")


def add_e2b_user(root: Path) -> None:
    """E2B's ``user`` in a debootstrapped tree: uid/gid 1000, home /home/user (from /etc/skel),
    bash, in group sudo, passwordless sudo (in a sandbox that allows setuid: ContainerSpec's
    allow_setuid). Written as useradd would, without running the tree's own tools (no chroot
    needed)."""
    etc = root / "etc"
    _append(etc / "passwd", f"{E2B_USER}:x:{E2B_UID}:{E2B_UID}::/home/{E2B_USER}:/bin/bash")
    _append(etc / "group", f"{E2B_USER}:x:{E2B_UID}:")
    _append(etc / "shadow", f"{E2B_USER}:*:19000:0:99999:7:::")  # no password: sudo asks none
    _append(etc / "gshadow", f"{E2B_USER}:!::")
    _add_member(etc / "group", "sudo", E2B_USER)
    _add_member(etc / "gshadow", "sudo", E2B_USER)
    (etc / "sudoers.d").mkdir(exist_ok=True)
    rule = etc / "sudoers.d" / E2B_USER
    # sudo's record of each command goes to the kernel's audit log, the host's: a sandbox has
    # no CAP_AUDIT_WRITE, so it would fail with a warning on stderr every time.
    _write_fresh(rule, f"Defaults !log_allowed\n{E2B_USER} ALL=(ALL:ALL) NOPASSWD: ALL\n")
    os.chmod(rule, 0o440)  # sudo ignores a rule file others may write
    # sudo resolves the hostname (a warning on stderr when it cannot); debootstrap writes no
    # /etc/hosts.
    _write_fresh(
        etc / "hosts",
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{SANDBOX_HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    )
    home = root / "home" / E2B_USER
    home.mkdir(parents=True, exist_ok=False)
    shutil.copytree(root / "etc/skel", home, dirs_exist_ok=True, symlinks=True)
    os.chmod(home, 0o755)
    for dirpath, dirs, files in os.walk(home):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirs + files)]:
            os.lchown(name, E2B_UID, E2B_UID)


def recipe_ref(ref: str, suite: str, packages: tuple[str, ...], extra: str = "") -> str:
    """The immutable tag of ``ref`` built from this suite and package list (and ``extra``, what
    a customization of the tree calls its version)."""
    name, version = parse_tag(ref)
    text = f"{suite}\n{' '.join(sorted(set(packages)))}" + (f"\n{extra}" if extra else "")
    recipe = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"{name}:{version}-{recipe}"


def _current(store: LayerStore, ref: str, built: str) -> LayerInfo | None:
    """``ref``'s layer when it is this recipe's build (made public), else None."""
    if not (store.has_tag(ref) and store.has_tag(built)):
        return None
    if store.resolve(ref).digest != store.resolve(built).digest:
        return None
    store.mark_public(built)
    return store.mark_public(ref)[0]


def ensure_base_layer(
    store: LayerStore,
    ref: str = "debian:bookworm",
    mirror: str | None = None,
    progress: Progress | None = None,
    *,
    suite: str = "bookworm",
    packages: tuple[str, ...] = BASE_PACKAGES,
    customize: Customize | None = None,
    recipe: str = "",
) -> LayerInfo:
    """Return the base layer ``ref``, building it with debootstrap first if the store lacks
    this recipe's build (:func:`recipe_ref`); ``ref`` is then moved to it.

    A base layer is public (every project may use it); one found from before layers had
    owners is marked public here. ``customize`` changes the tree before it is imported;
    ``recipe`` names that change (part of the recipe tag).
    """
    built = recipe_ref(ref, suite, packages, recipe)
    found = _current(store, ref, built)
    if found is not None:
        return found

    def say(msg: str) -> None:
        if progress is not None:
            progress(msg)

    # One builder per store: a second process waits, then finds the tag.
    with _file_lock(store.root / ".base-build.lock"):
        if store.has_tag(built):  # built already (another process, or a retag that failed)
            store.retag(ref, built)
            found = _current(store, ref, built)
            assert found is not None
            return found
        mirror = mirror or default_mirror()
        work = Path(tempfile.mkdtemp(prefix="base-", dir=store.tmp_dir))
        try:
            target = work / "rootfs"
            t0 = time.monotonic()
            _debootstrap(suite, target, mirror, say, packages)
            t1 = time.monotonic()
            say(f"debootstrap finished in {t1 - t0:.1f} s")
            # The target is still mounted-into if debootstrap left anything; clear that first.
            unmount_tree(target)
            slim_rootfs(target)
            if customize is not None:
                customize(target)
            try:
                store.import_path(target, built)
            except InvalidRequest:
                # Another node of a shared store finished first: its layer is as good as ours.
                if not store.has_tag(built):
                    raise
            store.retag(ref, built)
            info = _current(store, ref, built)
            assert info is not None
            took = time.monotonic() - t1
            say(f"imported {built} as {info.digest}: {info.size / 1e6:.1f} MB in {took:.1f} s")
            return info
        finally:
            _remove_work_dir(work)
