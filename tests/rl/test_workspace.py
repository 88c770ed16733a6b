"""dsec.rl.workspace: a workspace at base A of A -> B -> C holds nothing from B, C or beside them.

The source repository has every usual way back to the future: later commits on the branch, a
side branch, an annotated tag at C, a lightweight tag at A, a stash made after C, a remote with
a remote-tracking ref, and a note. Each test checks the result with git itself, the way an agent
inside the sandbox would look.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec.protocol.errors import InfraFailure, InvalidRequest
from dsec.rl import workspace
from dsec.rl.workspace import future_objects, prepare_workspace

SOLUTION = b"SOLUTION-7f3a9c: return a + b  # the answer only C has\n"
STASHED = b"STASH-51c0de: work in progress after C\n"
NOTE = "NOTE-0b5e55: the fix is in C"

# Files of A's tree, with a binary file (CR, NUL, high bytes) and an executable script to check
# the checkout is byte for byte and keeps modes.
A_FILES: dict[str, bytes] = {
    "README.md": b"calc\n",
    "calc.py": b"def add(a, b):\n    raise NotImplementedError\n",
    "tests/test_calc.py": b"from calc import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n",
    "data/blob.bin": bytes(range(256)) + b"\r\n\x00end\r\n",
    "run.sh": b"#!/bin/sh\nexec python3 -m pytest\n",
}


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        GIT_CONFIG_NOSYSTEM="1",
        GIT_AUTHOR_NAME="Task Author",
        GIT_AUTHOR_EMAIL="author@example.invalid",
        GIT_COMMITTER_NAME="Task Author",
        GIT_COMMITTER_EMAIL="author@example.invalid",
        LC_ALL="C",
    )
    return env


class Git:
    def __init__(self, home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.env = _env(home)

    def run(self, cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        proc = subprocess.run(["git", *args], cwd=cwd, env=self.env, capture_output=True, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"git {args} failed: {proc.stderr.decode(errors='replace')}")
        return proc

    def __call__(self, cwd: Path, *args: str) -> str:
        return self.run(cwd, *args).stdout.decode().strip()


@dataclass
class Source:
    path: Path
    parent: str  # P, A's parent: history before base must survive
    a: str
    b: str
    c: str
    side: str
    stash: str
    tag_object: str
    note_commit: str
    solution_blob: str

    def future(self, git: Git) -> dict[str, str]:
        """Every object an agent must not be able to read, by a name for error messages."""
        stash_parents = git(self.path, "rev-list", "--parents", "-n1", self.stash).split()[1:]
        note_blob = git(self.path, "rev-parse", f"{self.note_commit}:{self.a}")
        return {
            "B": self.b,
            "C": self.c,
            "side": self.side,
            "stash": self.stash,
            **{f"stash parent {i}": p for i, p in enumerate(stash_parents) if p != self.c},
            "annotated tag": self.tag_object,
            "note commit": self.note_commit,
            "note blob": note_blob,
            "solution blob": self.solution_blob,
            "B's tree": git(self.path, "rev-parse", f"{self.b}^{{tree}}"),
        }


def _write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def _commit(git: Git, repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def build_source(git: Git, repo: Path, *object_format: str) -> Source:
    git(repo.parent, "init", "-q", "-b", "main", *object_format, str(repo))
    _write(repo, {"README.md": b"calc\n"})
    parent = _commit(git, repo, "P: start")
    _write(repo, A_FILES)
    (repo / "run.sh").chmod(0o755)
    a = _commit(git, repo, "A: the task")
    _write(
        repo,
        {"calc.py": b"def add(a, b):\n    return a + 0  # B, halfway\n", "tests/test_more.py": b"x = 1\n"},
    )
    b = _commit(git, repo, "B: halfway")
    git(repo, "checkout", "-q", "-b", "side")
    _write(repo, {"side.txt": b"side branch secret\n"})
    side = _commit(git, repo, "S: side")
    git(repo, "checkout", "-q", "main")
    _write(repo, {"solution.py": SOLUTION})
    c = _commit(git, repo, "C: the fix")
    git(repo, "tag", "-a", "-m", "release", "v1", c)
    git(repo, "tag", "base", a)
    _write(repo, {"calc.py": STASHED, "untracked.txt": b"untracked stash content\n"})
    git(repo, "stash", "push", "-q", "-u", "-m", "wip")
    git(repo, "remote", "add", "origin", "https://example.invalid/calc.git")
    git(repo, "update-ref", "refs/remotes/origin/main", c)
    git(repo, "notes", "add", "-m", NOTE, a)
    return Source(
        path=repo,
        parent=parent,
        a=a,
        b=b,
        c=c,
        side=side,
        stash=git(repo, "rev-parse", "refs/stash"),
        tag_object=git(repo, "rev-parse", "refs/tags/v1"),
        note_commit=git(repo, "rev-parse", "refs/notes/commits"),
        solution_blob=git(repo, "rev-parse", f"{c}:solution.py"),
    )


@pytest.fixture(scope="module")
def git(tmp_path_factory: pytest.TempPathFactory) -> Git:
    return Git(tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def source(git: Git, tmp_path_factory: pytest.TempPathFactory) -> Source:
    return build_source(git, tmp_path_factory.mktemp("src") / "calc")


@pytest.fixture(scope="module")
def prepared(source: Source, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workspace at A, prepared once for the read-only checks."""
    dest = tmp_path_factory.mktemp("dest") / "root"
    assert prepare_workspace(source.path, source.a, dest) == dest
    return dest / "workspace"


def test_source_has_every_way_back(git: Git, source: Source) -> None:
    # Guards the other tests: they prove nothing if the source lacked what they look for.
    refs = git(source.path, "for-each-ref", "--format=%(refname)").split()
    assert {"refs/heads/main", "refs/heads/side", "refs/tags/v1", "refs/tags/base"} <= set(refs)
    assert {"refs/stash", "refs/remotes/origin/main", "refs/notes/commits"} <= set(refs)
    for name, sha in source.future(git).items():
        assert git.run(source.path, "cat-file", "-e", sha, check=False).returncode == 0, name
    assert SOLUTION in git.run(source.path, "log", "--all", "-p").stdout


def test_head_is_base_on_the_only_branch(git: Git, source: Source, prepared: Path) -> None:
    assert git(prepared, "rev-parse", "HEAD") == source.a
    assert git(prepared, "symbolic-ref", "HEAD") == "refs/heads/main"
    assert git(prepared, "for-each-ref", "--format=%(refname)") == "refs/heads/main"
    assert git(prepared, "rev-parse", "--is-bare-repository") == "false"
    assert git(prepared, "log", "--all", "--format=%H").split() == [source.a, source.parent]
    assert git(prepared, "status", "--porcelain", "--untracked-files=all") == ""


def test_future_objects_are_gone(git: Git, source: Source, prepared: Path) -> None:
    for name, sha in source.future(git).items():
        assert git.run(prepared, "cat-file", "-e", sha, check=False).returncode != 0, name
    assert future_objects(prepared / ".git", source.a) == []


def test_the_solution_is_not_findable(git: Git, prepared: Path) -> None:
    assert SOLUTION not in git.run(prepared, "log", "--all", "-p").stdout
    assert b"SOLUTION-7f3a9c" not in git.run(prepared, "log", "--all", "-p", "--reflog").stdout
    fsck = git.run(prepared, "fsck", "--unreachable", "--dangling", "--no-reflogs", "--lost-found")
    assert fsck.stdout.strip() == b""
    lost = prepared / ".git" / "lost-found"
    assert not lost.exists() or not any(p.is_file() for p in lost.rglob("*"))
    # Every object's content, whatever git would or would not show of it.
    contents = git.run(prepared, "cat-file", "--batch-all-objects", "--batch").stdout
    for secret in (b"SOLUTION-7f3a9c", b"STASH-51c0de", b"NOTE-0b5e55", b"side branch secret", b"halfway"):
        assert secret not in contents, secret


def test_no_remotes_tags_stash_notes_logs_or_hooks(git: Git, prepared: Path) -> None:
    git_dir = prepared / ".git"
    assert git(prepared, "remote") == ""
    assert git(prepared, "tag") == ""
    assert git(prepared, "stash", "list") == ""
    assert git(prepared, "notes", "list") == ""
    assert not (git_dir / "logs").exists()
    assert git(prepared, "reflog", "--all") == ""
    for name in ("FETCH_HEAD", "ORIG_HEAD", "shallow", "objects/info/alternates"):
        assert not (git_dir / name).exists(), name
    assert not (git_dir / "hooks").exists() or list((git_dir / "hooks").iterdir()) == []
    packed = git_dir / "packed-refs"
    if packed.exists():
        entries = [ln for ln in packed.read_text().splitlines() if not ln.startswith("#")]
        assert [ln.split()[1] for ln in entries] == ["refs/heads/main"]
    config = git(prepared, "config", "--local", "--list")
    assert "user." not in config and "remote." not in config


def test_working_tree_is_base_byte_for_byte(prepared: Path) -> None:
    on_disk = {
        str(p.relative_to(prepared)): p.read_bytes()
        for p in prepared.rglob("*")
        if p.is_file() and ".git" not in p.relative_to(prepared).parts
    }
    assert on_disk == A_FILES
    assert os.access(prepared / "run.sh", os.X_OK)
    assert not os.access(prepared / "calc.py", os.X_OK)


def test_future_objects_sees_what_a_clone_would_leak(git: Git, source: Source) -> None:
    # The helper must be able to fail: on the source itself everything later is "future".
    found = set(future_objects(source.path, source.a))
    assert set(source.future(git).values()) <= found
    assert source.a not in found and source.parent not in found
    assert future_objects(source.path / ".git", source.c).count(source.side) == 1


def test_from_a_bare_repository_by_tag(git: Git, source: Source, tmp_path: Path) -> None:
    bare = tmp_path / "calc.git"
    git(tmp_path, "clone", "-q", "--bare", str(source.path), str(bare))
    dest = tmp_path / "out"
    prepare_workspace(bare, "base", dest, subdir="work/repo", branch="task")
    ws = dest / "work" / "repo"
    assert git(ws, "rev-parse", "HEAD") == source.a
    assert git(ws, "for-each-ref", "--format=%(refname)") == "refs/heads/task"
    assert git(ws, "status", "--porcelain") == ""
    assert git(ws, "tag") == ""
    assert (ws / "calc.py").read_bytes() == A_FILES["calc.py"]
    assert sorted(p.name for p in dest.iterdir()) == ["work"]


def test_base_by_relative_name_into_an_empty_dest(git: Git, source: Source, tmp_path: Path) -> None:
    dest = tmp_path / "empty"
    dest.mkdir()
    prepare_workspace(str(source.path), "v1~2", str(dest))
    assert git(dest / "workspace", "rev-parse", "HEAD") == source.a


def test_sha256_repository(git: Git, tmp_path: Path) -> None:
    src = build_source(git, tmp_path / "src256", "--object-format=sha256")
    prepare_workspace(src.path, src.a, tmp_path / "out")
    ws = tmp_path / "out" / "workspace"
    assert git(ws, "rev-parse", "--show-object-format") == "sha256"
    assert git(ws, "rev-parse", "HEAD") == src.a
    for name, sha in src.future(git).items():
        assert git.run(ws, "cat-file", "-e", sha, check=False).returncode != 0, name


@pytest.mark.parametrize(
    ("base", "message"),
    [
        ("no-such-branch", "'no-such-branch' does not name a commit"),
        ("0" * 40, "does not name a commit"),
        ("HEAD:calc.py", "does not name a commit"),  # a blob, not a commit
        ("--all", "does not name a commit"),
        ("", "base must name a commit"),
    ],
)
def test_unknown_base(source: Source, tmp_path: Path, base: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        prepare_workspace(source.path, base, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_not_a_repository(source: Source, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(InvalidRequest, match="is not a git repository"):
        prepare_workspace(plain, "main", tmp_path / "out")
    # A directory inside a working tree is not the repository either.
    with pytest.raises(InvalidRequest, match="tests is not a git repository"):
        prepare_workspace(source.path / "tests", "main", tmp_path / "out")
    with pytest.raises(InvalidRequest, match="does not exist"):
        prepare_workspace(tmp_path / "missing", "main", tmp_path / "out")
    with pytest.raises(InvalidRequest, match="is not a directory"):
        prepare_workspace(source.path / "README.md", "main", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_dest_must_be_absent_or_empty(source: Source, tmp_path: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(InvalidRequest, match="is not empty"):
        prepare_workspace(source.path, source.a, full)
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(InvalidRequest, match="is not a directory"):
        prepare_workspace(source.path, source.a, file)


@pytest.mark.parametrize("subdir", ["", ".", "/abs", "../up", "a/../../b"])
def test_bad_subdir(source: Source, tmp_path: Path, subdir: str) -> None:
    with pytest.raises(InvalidRequest, match="subdir"):
        prepare_workspace(source.path, source.a, tmp_path / "out", subdir=subdir)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("branch", ["", "-x", "HEAD", "a..b", "bad name", "x.lock", "a/"])
def test_bad_branch(source: Source, tmp_path: Path, branch: str) -> None:
    with pytest.raises(InvalidRequest, match="branch"):
        prepare_workspace(source.path, source.a, tmp_path / "out", branch=branch)
    assert not (tmp_path / "out").exists()


def test_git_missing(source: Source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(InvalidRequest, match="git is not installed"):
        prepare_workspace(source.path, source.a, tmp_path / "out")
    with pytest.raises(InvalidRequest, match="git is not installed"):
        future_objects(source.path, source.a)


def test_failed_verification_leaves_nothing(
    source: Source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stands in for a git that leaves an object behind: the workspace must not be handed over.
    monkeypatch.setattr(workspace, "_future_objects", lambda *_: ["f" * 40])
    with pytest.raises(InfraFailure, match="not reachable from base"):
        prepare_workspace(source.path, source.a, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(InfraFailure):
        prepare_workspace(source.path, source.a, existing, subdir="a/b")
    assert existing.is_dir() and list(existing.iterdir()) == []


def test_future_objects_bad_input(source: Source, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="full hex object id"):
        future_objects(source.path, "main")
    with pytest.raises(InvalidRequest, match="does not exist"):
        future_objects(tmp_path / "nope", source.a)
