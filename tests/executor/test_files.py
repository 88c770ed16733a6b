"""Tests of dsec.executor.files: confined file operations in a sandbox root seen from the host.

``root`` plays the sandbox (``/proc/<pid>/root`` in production) and ``host`` a directory of the
host holding secrets the sandbox must never reach, however it plants symlinks.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dsec.executor.files import SandboxFiles
from dsec.protocol.errors import Conflict, DSecError, FileNotFound, InfraFailure, InvalidRequest
from dsec.protocol.models import FileType

SECRET = b"host secret: do not leak\n"
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root (chown, mknod, chroot, mounts)")
MiB = 1 << 20


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "sandbox"
    r.mkdir()
    return r


@pytest.fixture
def host(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A host directory outside the sandbox: a secret file and a secret directory."""
    h = tmp_path_factory.mktemp("host")
    (h / "secret.txt").write_bytes(SECRET)
    (h / "dir").mkdir()
    (h / "dir" / "keep.txt").write_bytes(SECRET)
    (h / "dir" / "sub").mkdir()
    (h / "dir" / "sub" / "keep2.txt").write_bytes(SECRET)
    return h


@pytest.fixture
def files(root: Path) -> SandboxFiles:
    return SandboxFiles(root, uid=os.getuid(), gid=os.getgid())


def inside(root: Path, host_path: Path) -> Path:
    """Where the host's absolute path ``host_path`` lands when resolved inside the sandbox."""
    return root / str(host_path).lstrip("/")


def host_snapshot(h: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(h)): (p.read_bytes() if p.is_file() else None) for p in sorted(h.rglob("*"))}


# ------------------------------------------------------------------------------------------ round trips


def test_text_round_trip(files: SandboxFiles, root: Path) -> None:
    text = "héllo wörld\nsecond line ✓\n"
    files.write_bytes("/tmp/hello.txt", text.encode())
    assert (root / "tmp" / "hello.txt").read_text(encoding="utf-8") == text
    assert files.read_bytes("/tmp/hello.txt", 1000).decode() == text
    st = files.stat("/tmp/hello.txt")
    assert st.type is FileType.file
    assert st.size == len(text.encode())
    assert st.mode == 0o644
    assert st.name == "hello.txt" and st.path == "/tmp/hello.txt"


def test_binary_round_trip_all_byte_values(files: SandboxFiles, root: Path) -> None:
    data = bytes(range(256)) * 3
    files.write_bytes("/bin.dat", data, mode=0o600)
    assert (root / "bin.dat").read_bytes() == data
    assert files.read_bytes("/bin.dat", len(data)) == data
    with files.open_read("/bin.dat") as f:
        assert f.read() == data
    assert stat.S_IMODE((root / "bin.dat").stat().st_mode) == 0o600


def test_empty_file_round_trip(files: SandboxFiles) -> None:
    files.write_bytes("/empty", b"")
    assert files.read_bytes("/empty", 0) == b""
    assert files.stat("/empty").size == 0


def test_stream_64_mib_in_1_mib_chunks(files: SandboxFiles, root: Path) -> None:
    base = os.urandom(MiB)
    sent = hashlib.sha256()
    with files.open_write("/data/big.bin") as w:
        for i in range(64):
            chunk = i.to_bytes(4, "big") + base[4:]
            sent.update(chunk)
            assert w.write(chunk) == MiB
            if i == 31:
                # half-way: nothing is visible at the target path yet
                assert not files.exists("/data/big.bin")
        assert w.tell() == 64 * MiB
    assert (root / "data" / "big.bin").stat().st_size == 64 * MiB
    assert files.stat("/data/big.bin").size == 64 * MiB
    assert [e.name for e in files.list_dir("/data")] == ["big.bin"]  # no temp file left behind

    got = hashlib.sha256()
    n_chunks = 0
    with files.open_read("/data/big.bin") as r:
        while chunk := r.read(MiB):
            assert len(chunk) <= MiB
            got.update(chunk)
            n_chunks += 1
    assert n_chunks == 64
    assert got.hexdigest() == sent.hexdigest()


def test_relative_paths_resolve_against_cwd(files: SandboxFiles, root: Path) -> None:
    files.write_bytes("notes.txt", b"n", cwd="/home/agent")
    assert (root / "home" / "agent" / "notes.txt").read_bytes() == b"n"
    assert files.read_bytes("../agent/./notes.txt", 10, cwd="/home/agent") == b"n"
    assert files.stat("agent/notes.txt", cwd="/home").path == "/home/agent/notes.txt"


# ---------------------------------------------------------------------------- list / stat / mkdir / rm


def test_list_dir_and_stat(files: SandboxFiles, root: Path) -> None:
    (root / "d").mkdir()
    (root / "d" / "b.txt").write_bytes(b"12345")
    (root / "d" / "a_dir").mkdir()
    (root / "d" / "c_link").symlink_to("b.txt")
    (root / "d" / "z").write_bytes(b"")
    entries = files.list_dir("/d")
    assert [e.name for e in entries] == ["a_dir", "b.txt", "c_link", "z"]
    by_name = {e.name: e for e in entries}
    assert by_name["a_dir"].type is FileType.dir
    assert by_name["b.txt"].type is FileType.file and by_name["b.txt"].size == 5
    assert by_name["c_link"].type is FileType.symlink  # not followed
    assert by_name["b.txt"].path == "/d/b.txt"
    assert by_name["b.txt"].uid == os.getuid()

    # stat has lstat semantics for the final component
    assert files.stat("/d/c_link").type is FileType.symlink
    assert files.stat("/d/c_link").size == len("b.txt")
    root_stat = files.stat("/")
    assert root_stat.type is FileType.dir and root_stat.name == "/" and root_stat.path == "/"
    assert [e.name for e in files.list_dir("/")] == ["d"]


def test_list_dir_follows_symlink_to_dir_inside_root(files: SandboxFiles, root: Path) -> None:
    (root / "real").mkdir()
    (root / "real" / "f").write_bytes(b"x")
    (root / "alias").symlink_to("/real")
    assert [e.path for e in files.list_dir("/alias")] == ["/alias/f"]


def test_list_dir_max_entries(files: SandboxFiles, root: Path) -> None:
    for i in range(5):
        (root / f"f{i}").write_bytes(b"")
    assert len(files.list_dir("/", max_entries=5)) == 5
    with pytest.raises(InvalidRequest, match="more than the limit"):
        files.list_dir("/", max_entries=4)


def test_mkdir(files: SandboxFiles, root: Path) -> None:
    files.mkdir("/a/b/c")
    assert (root / "a" / "b" / "c").is_dir()
    files.mkdir("/a/b/c")  # parents=True is mkdir -p: existing is fine
    files.mkdir("/a/solo", parents=False, mode=0o700)
    assert stat.S_IMODE((root / "a" / "solo").stat().st_mode) == 0o700
    with pytest.raises(Conflict):
        files.mkdir("/a/solo", parents=False)
    with pytest.raises(FileNotFound, match="/x/y"):
        files.mkdir("/x/y", parents=False)
    assert not (root / "x").exists()
    (root / "file").write_bytes(b"")
    with pytest.raises(InvalidRequest):
        files.mkdir("/file")
    with pytest.raises(InvalidRequest):
        files.mkdir("/file/sub")


def test_mkdir_mode_is_exact_despite_umask(files: SandboxFiles, root: Path) -> None:
    old = os.umask(0o077)
    try:
        files.mkdir("/m/n", mode=0o775)
        files.write_bytes("/m/n/f", b"x", mode=0o664)
    finally:
        os.umask(old)
    assert stat.S_IMODE((root / "m").stat().st_mode) == 0o775
    assert stat.S_IMODE((root / "m" / "n").stat().st_mode) == 0o775
    assert stat.S_IMODE((root / "m" / "n" / "f").stat().st_mode) == 0o664


def test_remove(files: SandboxFiles, root: Path) -> None:
    (root / "f").write_bytes(b"x")
    files.remove("/f")
    assert not (root / "f").exists()

    (root / "empty").mkdir()
    files.remove("/empty")
    assert not (root / "empty").exists()

    (root / "tree" / "a" / "b").mkdir(parents=True)
    (root / "tree" / "a" / "b" / "f").write_bytes(b"x")
    (root / "tree" / "g").write_bytes(b"y")
    with pytest.raises(InvalidRequest, match="not empty"):
        files.remove("/tree")
    assert (root / "tree" / "a" / "b" / "f").exists()
    files.remove("/tree", recursive=True)
    assert not (root / "tree").exists()

    with pytest.raises(InvalidRequest, match="root"):
        files.remove("/", recursive=True)
    with pytest.raises(InvalidRequest, match="root"):
        files.remove("/a/../..", recursive=True)
    assert root.is_dir()


def test_remove_symlink_removes_link_not_target(files: SandboxFiles, root: Path) -> None:
    (root / "target").mkdir()
    (root / "target" / "f").write_bytes(b"x")
    (root / "link").symlink_to("target")
    files.remove("/link", recursive=True)
    assert not (root / "link").is_symlink()
    assert (root / "target" / "f").read_bytes() == b"x"


def test_recursive_remove_never_touches_host(files: SandboxFiles, root: Path, host: Path) -> None:
    before = host_snapshot(host)
    t = root / "tree"
    (t / "sub" / "deeper").mkdir(parents=True)
    (t / "file").write_bytes(b"x")
    (t / "sub" / "abs_to_host_dir").symlink_to(host / "dir")
    (t / "sub" / "abs_to_host_file").symlink_to(host / "secret.txt")
    (t / "sub" / "deeper" / "rel_to_host").symlink_to(os.path.relpath(host / "dir", t / "sub" / "deeper"))
    (t / "sub" / "to_slash").symlink_to("/")
    # the relative symlink really does reach the host dir when followed naively:
    assert (t / "sub" / "deeper" / "rel_to_host" / "keep.txt").read_bytes() == SECRET
    files.remove("/tree", recursive=True)
    assert not t.exists()
    assert host_snapshot(host) == before
    # and a top-level symlink to the host dir: only the link goes
    (root / "hostlink").symlink_to(host / "dir")
    files.remove("/hostlink", recursive=True)
    assert not (root / "hostlink").is_symlink()
    assert host_snapshot(host) == before


def test_remove_through_symlinked_parent_stays_inside(files: SandboxFiles, root: Path, host: Path) -> None:
    before = host_snapshot(host)
    (root / "hl").symlink_to(host / "dir")
    with pytest.raises(FileNotFound):
        files.remove("/hl/keep.txt")
    with pytest.raises(FileNotFound):
        files.remove("/hl/sub", recursive=True)
    assert host_snapshot(host) == before


# ----------------------------------------------------------------------------------- escape attempts


def test_absolute_symlink_to_host_file_read(files: SandboxFiles, root: Path, host: Path) -> None:
    (root / "leak").symlink_to(host / "secret.txt")
    with pytest.raises(FileNotFound):
        files.read_bytes("/leak", 1000)
    with pytest.raises(FileNotFound):
        files.open_read("/leak")
    # the same absolute path, planted inside the sandbox, is what the link means there
    decoy = inside(root, host / "secret.txt")
    decoy.parent.mkdir(parents=True)
    decoy.write_bytes(b"sandbox copy")
    assert files.read_bytes("/leak", 1000) == b"sandbox copy"
    with files.open_read("/leak") as f:
        assert f.read() == b"sandbox copy"


def test_absolute_symlink_to_host_file_write(files: SandboxFiles, root: Path, host: Path) -> None:
    before = host_snapshot(host)
    (root / "leak").symlink_to(host / "secret.txt")
    files.write_bytes("/leak", b"overwritten")
    assert host_snapshot(host) == before
    # the link itself was replaced by a regular file inside the sandbox
    assert not (root / "leak").is_symlink()
    assert (root / "leak").read_bytes() == b"overwritten"

    (root / "leak2").symlink_to(host / "secret.txt")
    with files.open_write("/leak2", append=True) as w:  # dangling inside the root: a new file
        w.write(b"appended")
    assert host_snapshot(host) == before
    assert (root / "leak2").read_bytes() == b"appended"
    # append through a link whose target exists inside the root extends that target
    decoy = inside(root, host / "secret.txt")
    decoy.parent.mkdir(parents=True)
    decoy.write_bytes(b"decoy:")
    (root / "leak3").symlink_to(host / "secret.txt")
    with files.open_write("/leak3", append=True) as w:
        w.write(b"more")
    assert decoy.read_bytes() == b"decoy:more"
    assert host_snapshot(host) == before


def test_symlinked_dir_to_host_write(files: SandboxFiles, root: Path, host: Path) -> None:
    before = host_snapshot(host)
    (root / "hostdir").symlink_to(host / "dir")
    with pytest.raises(DSecError):
        files.write_bytes("/hostdir/new.txt", b"pwned")
    with pytest.raises(DSecError):
        files.write_bytes("/hostdir/keep.txt", b"pwned")
    with pytest.raises(DSecError):
        files.mkdir("/hostdir/newdir")
    assert host_snapshot(host) == before
    # once the link's target exists inside the sandbox, the write lands there
    inside(root, host / "dir").mkdir(parents=True)
    files.write_bytes("/hostdir/keep.txt", b"inside")
    assert inside(root, host / "dir" / "keep.txt").read_bytes() == b"inside"
    assert host_snapshot(host) == before


def test_etc_to_slash_trick(files: SandboxFiles, root: Path, host: Path) -> None:
    """``/etc -> /`` in the sandbox: /etc/<host path> must mean <sandbox>/<host path>."""
    before = host_snapshot(host)
    (root / "etc").symlink_to("/")
    via = "/etc" + str(host / "secret.txt")
    with pytest.raises(FileNotFound):
        files.read_bytes(via, 1000)
    with pytest.raises(FileNotFound):
        files.stat(via)
    assert not files.exists(via)
    assert sorted(e.name for e in files.list_dir("/etc")) == ["etc"]  # the sandbox root
    files.write_bytes(via, b"written via /etc")  # parents are created inside the root
    assert inside(root, host / "secret.txt").read_bytes() == b"written via /etc"
    assert files.read_bytes(via, 1000) == b"written via /etc"
    files.remove(via)
    assert not inside(root, host / "secret.txt").exists()
    assert host_snapshot(host) == before


def test_dotdot_escape_attempts(files: SandboxFiles, root: Path, host: Path) -> None:
    before = host_snapshot(host)
    secret = str(host / "secret.txt")
    rel_from_root = os.path.relpath(host / "secret.txt", root)  # "../../.../secret.txt"
    assert (root / rel_from_root).read_bytes() == SECRET  # naive joining would leak

    for attempt in [
        "/" + "../" * 20 + secret.lstrip("/"),
        rel_from_root,
        "/tmp/../../../" + rel_from_root,
    ]:
        with pytest.raises(FileNotFound):
            files.read_bytes(attempt, 1000)
    with pytest.raises(FileNotFound):
        files.read_bytes("../" * 30 + secret.lstrip("/"), 1000, cwd="/home/agent")

    # a relative symlink full of ".." is clamped at the sandbox root as well
    (root / "up").symlink_to("../" * 30)
    (root / "hostrel").symlink_to(rel_from_root)
    with pytest.raises(FileNotFound):
        files.read_bytes("/up" + secret, 1000)
    with pytest.raises(FileNotFound):
        files.read_bytes("/hostrel", 1000)
    assert [e.name for e in files.list_dir("/up")] == [e.name for e in files.list_dir("/")]
    files.write_bytes("/hostrel", b"mine")
    files.write_bytes("/up" + secret, b"mine too")
    assert inside(root, host / "secret.txt").read_bytes() == b"mine too"
    assert host_snapshot(host) == before


def test_symlink_loop_is_invalid_request(files: SandboxFiles, root: Path) -> None:
    (root / "a").symlink_to("b")
    (root / "b").symlink_to("a")
    with pytest.raises(InvalidRequest, match="escapes the sandbox"):
        files.read_bytes("/a", 10)
    with pytest.raises(InvalidRequest):
        files.list_dir("/a/x")
    assert files.stat("/a").type is FileType.symlink  # lstat of the link itself is fine


def test_fifo_and_device_nodes_are_never_opened(files: SandboxFiles, root: Path) -> None:
    fifo = root / "fifo"
    os.mkfifo(fifo)
    result: list[BaseException | None] = []

    def attempt() -> None:
        try:
            files.read_bytes("/fifo", 100)
            result.append(None)
        except BaseException as e:
            result.append(e)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the reader that should never have opened the FIFO
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("reading a FIFO blocked: it was opened")
    assert isinstance(result[0], InvalidRequest) and "not a regular file" in str(result[0])
    with pytest.raises(InvalidRequest):
        files.open_read("/fifo")
    with pytest.raises(InvalidRequest):
        files.open_write("/fifo", append=True)
    with pytest.raises(InvalidRequest, match="is a directory"):
        files.open_read("/")
    if IS_ROOT:
        os.mknod(root / "zero", stat.S_IFCHR | 0o666, os.makedev(1, 5))
        with pytest.raises(InvalidRequest, match="not a regular file"):
            files.read_bytes("/zero", 100)


# ---------------------------------------------------------------------------- ownership, atomicity


@needs_root
def test_created_files_and_dirs_are_owned_by_sandbox_user(root: Path) -> None:
    files = SandboxFiles(str(root), uid=4242, gid=4343)
    (root / "pre").mkdir()
    files.write_bytes("/pre/new/deeper/f.txt", b"x")
    files.mkdir("/made/here")
    with files.open_write("/pre/streamed.bin") as w:
        w.write(b"y" * 1000)
    for p in ["pre/new", "pre/new/deeper", "pre/new/deeper/f.txt", "made", "made/here", "pre/streamed.bin"]:
        s = (root / p).lstat()
        assert (s.st_uid, s.st_gid) == (4242, 4343), p
    assert files.stat("/pre/new/deeper/f.txt").uid == 4242
    pre = (root / "pre").stat()
    assert (pre.st_uid, pre.st_gid) == (0, 0)  # existing directories keep their owner
    assert (root.stat().st_uid, root.stat().st_gid) == (0, 0)

    # an overwrite replaces the file: the new one is the sandbox user's too, with the new mode
    (root / "rootfile").write_bytes(b"old")
    os.chmod(root / "rootfile", 0o600)
    files.write_bytes("/rootfile", b"new", mode=0o640)
    s = (root / "rootfile").stat()
    assert (s.st_uid, s.st_gid, stat.S_IMODE(s.st_mode)) == (4242, 4343, 0o640)


def test_abort_leaves_nothing(files: SandboxFiles, root: Path) -> None:
    w = files.open_write("/up/load.bin")
    w.write(b"partial" * 1000)
    w.abort()
    w.abort()  # idempotent
    assert w.closed and not w.committed
    assert not files.exists("/up/load.bin")
    assert os.listdir(root / "up") == []
    with pytest.raises(InvalidRequest):
        w.write(b"more")
    with pytest.raises(InvalidRequest):
        w.commit()


def test_failed_upload_keeps_the_old_content(files: SandboxFiles, root: Path) -> None:
    files.write_bytes("/doc.txt", b"version 1")

    class Boom(Exception):
        pass

    with pytest.raises(Boom), files.open_write("/doc.txt") as w:
        w.write(b"version 2, half")
        assert (root / "doc.txt").read_bytes() == b"version 1"  # not visible before commit
        raise Boom
    assert files.read_bytes("/doc.txt", 100) == b"version 1"
    assert os.listdir(root) == ["doc.txt"]


def test_dropped_writer_is_aborted(files: SandboxFiles, root: Path) -> None:
    w = files.open_write("/dropped.bin")
    w.write(b"x" * 100)
    assert len(os.listdir(root)) == 1  # the hidden temp file
    del w
    assert os.listdir(root) == []


def test_close_commits_and_commit_is_idempotent(files: SandboxFiles, root: Path) -> None:
    w = files.open_write("/c.txt")
    w.writelines([b"a", b"b", bytearray(b"c"), memoryview(b"d")])
    w.close()
    assert w.committed
    w.commit()
    w.abort()  # no effect after commit
    assert (root / "c.txt").read_bytes() == b"abcd"


def test_append(files: SandboxFiles, root: Path) -> None:
    with files.open_write("/log", append=True) as w:  # missing: created
        w.write(b"one\n")
    with files.open_write("/log", append=True) as w:
        w.write(b"two\n")
    assert files.read_bytes("/log", 100) == b"one\ntwo\n"
    w = files.open_write("/log", append=True)
    w.write(b"three, aborted\n")
    w.abort()
    assert (root / "log").read_bytes() == b"one\ntwo\n"


# ------------------------------------------------------------------------------------ error typing


def test_file_not_found_typing(files: SandboxFiles, root: Path) -> None:
    (root / "d").mkdir()
    calls = [
        lambda: files.stat("/d/missing"),
        lambda: files.list_dir("/d/missing"),
        lambda: files.read_bytes("/d/missing", 10),
        lambda: files.open_read("/d/missing"),
        lambda: files.remove("/d/missing"),
        lambda: files.remove("/d/missing", recursive=True),
    ]
    for call in calls:
        with pytest.raises(FileNotFound) as info:
            call()
        assert "/d/missing" in info.value.message
        assert info.value.code == "file_not_found" and info.value.status == 404
        assert not isinstance(info.value, InvalidRequest)
    with pytest.raises(FileNotFound, match="/nope/deeper/x"):
        files.read_bytes("/nope/deeper/x", 10)
    assert not files.exists("/d/missing")
    assert not files.exists("/nope/deeper/x")
    assert files.exists("/d")
    (root / "dangling").symlink_to("/nowhere")
    assert files.exists("/dangling")  # lstat semantics
    with pytest.raises(FileNotFound):
        files.read_bytes("/dangling", 10)


def test_wrong_types_are_invalid_requests(files: SandboxFiles, root: Path) -> None:
    (root / "dir").mkdir()
    (root / "file").write_bytes(b"0123456789")
    with pytest.raises(InvalidRequest, match="is a directory"):
        files.write_bytes("/dir", b"x")
    with pytest.raises(InvalidRequest, match="is a directory"):
        files.read_bytes("/dir", 10)
    with pytest.raises(InvalidRequest, match="is a directory"):
        files.open_write("/dir", append=True)
    with pytest.raises(InvalidRequest, match="directory"):
        files.write_bytes("/", b"x")
    with pytest.raises(InvalidRequest, match="not a directory"):
        files.list_dir("/file")
    with pytest.raises(InvalidRequest, match="not a directory"):
        files.read_bytes("/file/x", 10)
    with pytest.raises(InvalidRequest, match="not a directory"):
        files.stat("/file/x")
    with pytest.raises(InvalidRequest):
        files.write_bytes("/file/x", b"x")
    assert (root / "file").read_bytes() == b"0123456789"
    with pytest.raises(InvalidRequest, match="limit"):
        files.read_bytes("/file", 9)
    assert files.read_bytes("/file", 10) == b"0123456789"
    with pytest.raises(InvalidRequest):
        files.read_bytes("/file", -1)
    assert os.listdir(root / "dir") == []


@pytest.mark.parametrize(
    ("path", "cwd"),
    [
        ("", "/"),
        ("a\0b", "/"),
        ("/" + "a" * 4096, "/"),
        ("/" + "é" * 2048, "/"),  # 4096 bytes when encoded, plus the slash
        ("x", "relative/cwd"),
        ("x", ""),
        ("x", "/tmp\0"),
        ("/" + "n" * 300, "/"),  # a component longer than NAME_MAX
    ],
)
def test_bad_paths_are_rejected(files: SandboxFiles, path: str, cwd: str) -> None:
    for call in (
        lambda: files.stat(path, cwd=cwd),
        lambda: files.write_bytes(path, b"x", cwd=cwd),
        lambda: files.exists(path, cwd=cwd),
        lambda: files.mkdir(path, cwd=cwd),
    ):
        with pytest.raises(InvalidRequest):
            call()


def test_missing_root_is_infra_failure(tmp_path: Path) -> None:
    files = SandboxFiles(tmp_path / "gone")
    with pytest.raises(InfraFailure):
        files.stat("/")
    with pytest.raises(InfraFailure):
        files.write_bytes("/x", b"")


# ------------------------------------------------------------ the real thing: /proc/<pid>/root


@pytest.fixture
def chrooted(root: Path) -> Iterator[int]:
    """A process chrooted into ``root``, so that ``/proc/<pid>/root`` is the sandbox root."""
    code = (
        "import os, sys, time; os.chroot(sys.argv[1]); os.chdir('/'); "
        "print('ready', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            pytest.skip("cannot chroot a helper process")
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@needs_root
def test_proc_pid_root_of_chrooted_process(chrooted: int, root: Path, host: Path) -> None:
    before = host_snapshot(host)
    files = SandboxFiles(f"/proc/{chrooted}/root", uid=1000, gid=1000)
    (root / "marker").write_bytes(b"inside")
    (root / "leak").symlink_to(host / "secret.txt")
    (root / "etc").symlink_to("/")
    assert sorted(e.name for e in files.list_dir("/")) == ["etc", "leak", "marker"]
    assert files.read_bytes("/etc/etc/marker", 100) == b"inside"
    with pytest.raises(FileNotFound):
        files.read_bytes("/leak", 100)
    with pytest.raises(FileNotFound):
        files.read_bytes("/../../../.." + str(host / "secret.txt"), 100)
    files.write_bytes("/leak", b"replaced")
    files.write_bytes("/etc" + str(host / "dir" / "keep.txt"), b"planted")
    assert (root / "leak").read_bytes() == b"replaced"
    assert inside(root, host / "dir" / "keep.txt").read_bytes() == b"planted"
    assert (root / "leak").stat().st_uid == 1000
    top = "/" + host.parts[1]  # e.g. /tmp: the planted copy of the host's tree
    files.remove("/etc" + top, recursive=True)
    assert not (root / top.lstrip("/")).exists()
    assert host_snapshot(host) == before


@pytest.fixture
def with_procfs(root: Path) -> Iterator[Path]:
    """``root`` with the host's procfs bind-mounted at ``root/proc``, in a private mount namespace
    held by a helper; yields the sandbox root as seen through ``/proc/<helper>/root``."""
    (root / "proc").mkdir()
    script = f'mount --bind /proc "{root}/proc" && echo ready && exec sleep 600'
    try:
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        pytest.skip("unshare(1) is not available")
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            pytest.skip("cannot create a mount namespace")
        yield Path(f"/proc/{proc.pid}/root{root}")
    finally:
        proc.kill()
        proc.wait()


@needs_root
def test_magic_links_are_refused(with_procfs: Path, root: Path, host: Path) -> None:
    before = host_snapshot(host)
    files = SandboxFiles(with_procfs)
    assert (with_procfs / "proc" / "self").is_symlink()  # procfs really is there
    with pytest.raises(InvalidRequest, match="kernel views"):  # and the file API serves none of it
        files.stat("/proc/self")
    secret = str(host / "secret.txt")
    for attempt in ["/proc/self/root" + secret, "/proc/self/cwd/x", f"/proc/{os.getpid()}/root" + secret]:
        with pytest.raises(InvalidRequest, match="escapes the sandbox"):
            files.read_bytes(attempt, 100)
    # another process's link may already be refused by the ptrace access check (EACCES)
    with pytest.raises(InvalidRequest):
        files.read_bytes("/proc/1/root" + secret, 100)
    (root / "esc").symlink_to("/proc/self/root")
    with pytest.raises(InvalidRequest, match="escapes the sandbox"):
        files.read_bytes("/esc" + secret, 100)
    with pytest.raises(InvalidRequest, match="escapes the sandbox"):
        files.write_bytes("/esc" + secret, b"pwned")
    with pytest.raises(InvalidRequest, match="escapes the sandbox"):
        files.list_dir("/esc/")
    assert host_snapshot(host) == before


@needs_root
def test_kernel_file_systems_are_refused(with_procfs: Path, root: Path) -> None:
    """Every operation on a path on procfs is refused, whichever way the path gets there
    (the plain path, a symlink, the mount point itself, a recursive remove from above it)."""
    files = SandboxFiles(with_procfs)
    (root / "data").mkdir()
    (root / "data" / "f").write_bytes(b"x")
    (root / "data" / "init").symlink_to("/proc/1")
    ops: dict[str, Callable[[], object]] = {
        "list": lambda: files.list_dir("/proc/1/fd"),
        "list via symlink": lambda: files.list_dir("/data/init"),
        "stat": lambda: files.stat("/proc/1/status"),
        "stat mount point": lambda: files.stat("/proc"),
        "exists": lambda: files.exists("/proc/1/nothing"),
        "read via symlink": lambda: files.read_bytes("/data/init/status", 1 << 20),
        "write": lambda: files.write_bytes("/proc/sys/x", b""),
        "mkdir": lambda: files.mkdir("/proc/1/x"),
        "move": lambda: files.move("/data/f", "/proc/f"),
        "remove": lambda: files.remove("/proc/1/x"),
        "remove tree": lambda: files.remove("/proc", recursive=True),
    }
    refused = {}
    for what, op in ops.items():
        try:
            op()
            refused[what] = "served"
        except InvalidRequest as e:
            refused[what] = str(e.reason)
    assert refused == dict.fromkeys(ops, "kernel_fs")
    assert files.read_bytes("/data/f", 10) == b"x" and files.stat("/data/init").type is FileType.symlink


# ------------------------------------------------------------------------------------------ move


def test_move_renames_files_and_directories(files: SandboxFiles, root: Path) -> None:
    files.write_bytes("/a/one.txt", b"1")
    files.mkdir("/b")
    files.move("/a/one.txt", "/b/two.txt")
    assert (root / "b" / "two.txt").read_bytes() == b"1" and not (root / "a" / "one.txt").exists()
    files.move("/b", "/c")
    assert (root / "c" / "two.txt").read_bytes() == b"1" and not (root / "b").exists()
    files.write_bytes("/old.txt", b"new")
    files.write_bytes("/c/two.txt", b"replaced")
    files.move("/old.txt", "/c/two.txt")  # rename(2): a file replaces a file
    assert (root / "c" / "two.txt").read_bytes() == b"new"
    with pytest.raises(FileNotFound):
        files.move("/no/such", "/x")
    with pytest.raises(InvalidRequest):
        files.move("/", "/elsewhere")


def test_move_never_leaves_or_enters_the_root_through_symlinks(
    files: SandboxFiles, root: Path, host: Path
) -> None:
    before = host_snapshot(host)
    (root / "out").symlink_to(host / "dir")  # a planted link to a host directory
    (root / "mine.txt").write_bytes(b"sandbox")
    # Through the link as a parent: resolved inside the root, where /<host>/dir does not exist.
    with pytest.raises(FileNotFound):
        files.move("/mine.txt", "/out/stolen.txt")
    with pytest.raises(FileNotFound):
        files.move("/out/keep.txt", "/taken.txt")
    files.move("/out", "/renamed")  # the final link itself is moved, not what it points to
    assert (root / "renamed").is_symlink() and host_snapshot(host) == before
