"""Task workspaces cut from a git repository at a base commit, with no way back to the future.

A coding task is "make the repository at commit X do Y", and the commits after X usually contain
the answer. An agent handed a clone would find it with ``git log --all``, a tag, a stash, a
reflog, a remote-tracking ref, or simply an unreachable object still sitting in a pack
(``git fsck --unreachable`` lists them). Deleting those things from a clone is a blacklist and
blacklists miss something; so :func:`prepare_workspace` builds a *new* repository and fetches
only the base commit into it. Git's pack protocol then sends exactly the objects reachable from
that commit and nothing else, whatever refs, packs or hooks the source holds.

:func:`future_objects` checks the result from the other side (every object stored minus every
object reachable from the base) and :func:`prepare_workspace` refuses to hand over a workspace
where it finds anything, in case a later git, an alternates file or a config default changes
what lands in the object store.

Git runs with an environment built from scratch: no system or user config (an ``url.insteadOf``
or a ``core.hooksPath`` on the host must not change what is fetched or run), no inherited
``GIT_DIR``-style variables, no prompts, C locale so messages are stable, never via a shell.
Needs git 2.29 or later (``fetch --no-write-fetch-head``, ``init --initial-branch``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest

__all__ = ["future_objects", "prepare_workspace"]

_SHA_RE = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")

# Files in a git dir that name a commit besides HEAD. A fresh fetch writes none of them (we pass
# --no-write-fetch-head and never merge or reset), but if one appeared it would point past base.
_STRAY_FILES = (
    "FETCH_HEAD",
    "ORIG_HEAD",
    "MERGE_HEAD",
    "CHERRY_PICK_HEAD",
    "REVERT_HEAD",
    "BISECT_LOG",
    "AUTO_MERGE",
    "shallow",
)

# Options for every git command that writes to the new repository: no reflogs (they would
# outlive the refs they log), and no automatic gc or maintenance racing our own.
_QUIET_WRITES = (
    "-c",
    "core.logAllRefUpdates=false",
    "-c",
    "gc.auto=0",
    "-c",
    "maintenance.auto=false",
)


class _Git:
    """The git executable, run with the controlled environment and an empty HOME."""

    def __init__(self, exe: str, scratch: Path) -> None:
        self.exe = exe
        self.home = scratch / "home"
        self.template = scratch / "template"  # empty: `git init` copies no sample hooks
        self.home.mkdir()
        self.template.mkdir()
        self.env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "HOME": str(self.home),
            "XDG_CONFIG_HOME": str(self.home / ".config"),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_ATTR_NOSYSTEM": "1",
            "GIT_TERMINAL_PROMPT": "0",
            "LANG": "C",
            "LC_ALL": "C",
        }

    def run(self, *args: str, cwd: Path, ceiling: Path | None = None) -> subprocess.CompletedProcess[str]:
        env = dict(self.env)
        if ceiling is not None:
            # Discovery must not climb out of the path we were given: a directory inside some
            # other repository's working tree is not a repository.
            env["GIT_CEILING_DIRECTORIES"] = str(ceiling)
        proc = subprocess.run(
            [self.exe, *args], cwd=cwd, env=env, capture_output=True, check=False, stdin=subprocess.DEVNULL
        )
        return subprocess.CompletedProcess(
            proc.args,
            proc.returncode,
            proc.stdout.decode("utf-8", "replace"),
            proc.stderr.decode("utf-8", "replace"),
        )

    def out(self, *args: str, cwd: Path, what: str) -> str:
        """stdout of a command that must succeed; InvalidRequest naming ``what`` otherwise."""
        proc = self.run(*args, cwd=cwd)
        if proc.returncode != 0:
            raise InvalidRequest(f"{what} failed: {_tail(proc.stderr)}")
        return proc.stdout


@contextmanager
def _git() -> Iterator[_Git]:
    path = os.environ.get("PATH", os.defpath)
    exe = shutil.which("git", path=path)
    if exe is None:
        raise InvalidRequest(f"git is not installed: no `git` executable on PATH ({path})")
    with tempfile.TemporaryDirectory(prefix="dsec-git-") as scratch:
        yield _Git(exe, Path(scratch))


def _tail(stderr: str, limit: int = 500) -> str:
    text = stderr.strip() or "(no output)"
    return text if len(text) <= limit else "..." + text[-limit:]


def prepare_workspace(
    repo: str | os.PathLike[str],
    base: str,
    dest: str | os.PathLike[str],
    *,
    subdir: str = "workspace",
    branch: str = "main",
) -> Path:
    """Create ``dest/<subdir>/``: a git repository holding ``base`` of ``repo`` and nothing later.

    ``repo`` is a local repository (working tree or bare); ``base`` any commit-ish it resolves
    (sha, branch, tag, ``main~3``). The result is a non-bare repository whose only ref is
    ``refs/heads/<branch>`` at the base commit, checked out there with a clean status, storing
    only objects reachable from base: no remotes, tags, stash, notes, reflogs or hooks, and no
    user identity in its config (that belongs to the image the agent runs in).

    ``dest`` must be absent or an empty directory; ``subdir`` a relative path without ``..``
    (it may be nested, e.g. ``work/repo``). Returns ``dest``. Bad input (git missing, not a
    repository, unknown base, non-empty dest, bad subdir or branch) raises InvalidRequest and
    leaves nothing behind.
    """
    parts = _subdir_parts(subdir)
    if not base or "\0" in base:
        raise InvalidRequest(f"base must name a commit, got {base!r}")
    src = Path(repo).absolute()
    dest_path = Path(dest).absolute()
    with _git() as git:
        _check_branch(git, branch)
        src_git_dir, sha, object_format = _resolve_base(git, src, base, repo)
        created = _claim_dest(dest_path)
        try:
            target = dest_path.joinpath(*parts)
            target.mkdir(parents=True)
            _build(git, src_git_dir, sha, object_format, target, branch)
        except BaseException:
            # A half-built workspace must not be mistaken for a finished one.
            shutil.rmtree(dest_path if created else dest_path / parts[0], ignore_errors=True)
            raise
    return dest_path


def future_objects(workspace_git_dir: Path, base_sha: str) -> list[str]:
    """Ids of objects stored in the repository that are not reachable from ``base_sha``, sorted.

    ``workspace_git_dir`` is the git dir (``.git``) of a prepared workspace; its working tree is
    accepted too. Objects in alternates count as stored, since the agent could read them. An
    empty list means no commit, tree or blob from after (or beside) base can be read there.
    """
    if not _SHA_RE.fullmatch(base_sha):
        raise InvalidRequest(f"base_sha must be a full hex object id, got {base_sha!r}")
    git_dir = Path(workspace_git_dir).absolute()
    if (git_dir / ".git").is_dir():
        git_dir = git_dir / ".git"
    if not git_dir.is_dir():
        raise InvalidRequest(f"git dir {workspace_git_dir} does not exist")
    with _git() as git:
        return _future_objects(git, git_dir, base_sha)


def _future_objects(git: _Git, git_dir: Path, base_sha: str) -> list[str]:
    gd = f"--git-dir={git_dir}"
    stored = git.out(
        gd,
        "cat-file",
        "--batch-all-objects",
        "--batch-check=%(objectname)",
        cwd=git_dir,
        what="listing objects",
    )
    reachable = git.out(
        gd, "rev-list", "--objects", "--end-of-options", base_sha, cwd=git_dir, what=f"walking {base_sha}"
    )
    # rev-list prints "<id> <path>" for trees and blobs; the id is all we need.
    seen = {line.split(" ", 1)[0] for line in reachable.splitlines() if line}
    return sorted({line for line in stored.splitlines() if line} - seen)


def _subdir_parts(subdir: str) -> tuple[str, ...]:
    raw = PurePosixPath(subdir)
    if not subdir or raw.is_absolute() or "\0" in subdir:
        raise InvalidRequest(f"subdir must be a relative path, got {subdir!r}")
    if ".." in raw.parts or not raw.parts:
        raise InvalidRequest(f"subdir must name a directory below dest without '..', got {subdir!r}")
    return raw.parts


def _check_branch(git: _Git, branch: str) -> None:
    # check-ref-format accepts a full ref whose last component starts with "-" or is "HEAD";
    # `git branch` refuses both, and so do we.
    ok = bool(branch) and not branch.startswith("-") and branch != "HEAD" and "\0" not in branch
    if ok:
        ok = git.run("check-ref-format", f"refs/heads/{branch}", cwd=git.home).returncode == 0
    if not ok:
        raise InvalidRequest(f"branch {branch!r} is not a valid git branch name")


def _resolve_base(git: _Git, src: Path, base: str, repo: object) -> tuple[Path, str, str]:
    """The source's git dir, the base commit's full id, and the object format (sha1/sha256)."""
    if not src.exists():
        raise InvalidRequest(f"repository {repo} does not exist")
    if not src.is_dir():
        raise InvalidRequest(f"repository {repo} is not a directory")
    real = src.resolve()
    proc = git.run("rev-parse", "--absolute-git-dir", cwd=real, ceiling=real.parent)
    if proc.returncode != 0:
        raise InvalidRequest(f"{repo} is not a git repository: {_tail(proc.stderr)}")
    git_dir = Path(proc.stdout.strip())
    proc = git.run("rev-parse", "--show-object-format", cwd=git_dir)
    object_format = proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else "sha1"
    proc = git.run("rev-parse", "--verify", "--quiet", "--end-of-options", f"{base}^{{commit}}", cwd=git_dir)
    sha = proc.stdout.strip()
    if proc.returncode != 0 or not _SHA_RE.fullmatch(sha):
        raise InvalidRequest(f"base {base!r} does not name a commit in repository {repo}")
    return git_dir, sha, object_format


def _claim_dest(dest: Path) -> bool:
    """Check ``dest`` is absent or an empty directory; create it. True if we created it."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise InvalidRequest(f"dest {dest} exists and is not a directory")
    if dest.is_dir():
        if any(dest.iterdir()):
            raise InvalidRequest(f"dest {dest} is not empty")
        return False
    dest.mkdir(parents=True)
    return True


def _build(git: _Git, src_git_dir: Path, sha: str, object_format: str, target: Path, branch: str) -> None:
    git.out(
        "init",
        "--quiet",
        f"--template={git.template}",
        f"--initial-branch={branch}",
        f"--object-format={object_format}",
        str(target),
        cwd=target,
        what="git init",
    )
    # Protocol v2 lets a client ask for any object by id, v0 only for advertised refs: pinning it
    # lets us fetch the bare commit without creating a ref in the source.
    git.out(
        *_QUIET_WRITES,
        "-c",
        "protocol.version=2",
        "fetch",
        "--quiet",
        "--no-tags",
        "--no-write-fetch-head",
        "--no-recurse-submodules",
        str(src_git_dir),
        sha,
        cwd=target,
        what=f"fetching {sha}",
    )
    git.out(*_QUIET_WRITES, "update-ref", f"refs/heads/{branch}", sha, cwd=target, what="setting the branch")
    git.out(*_QUIET_WRITES, "checkout", "--quiet", "--force", branch, cwd=target, what="checking out base")
    git.out(*_QUIET_WRITES, "gc", "--quiet", "--prune=now", cwd=target, what="git gc")

    git_dir = target / ".git"
    shutil.rmtree(git_dir / "logs", ignore_errors=True)
    for name in _STRAY_FILES:
        (git_dir / name).unlink(missing_ok=True)
    hooks = git_dir / "hooks"
    if hooks.exists():
        shutil.rmtree(hooks)
        hooks.mkdir()
    _verify(git, target, sha, branch)


def _verify(git: _Git, target: Path, sha: str, branch: str) -> None:
    """Re-check the finished workspace; a failure here is our bug, not the caller's input."""
    git_dir = target / ".git"
    problems: list[str] = []
    refs = git.out("for-each-ref", "--format=%(refname)", cwd=target, what="listing refs").split()
    if refs != [f"refs/heads/{branch}"]:
        problems.append(f"refs {refs}")
    head = git.out("rev-parse", "--symbolic-full-name", "HEAD", cwd=target, what="reading HEAD").strip()
    if head != f"refs/heads/{branch}":
        problems.append(f"HEAD is {head!r}")
    if git.out("rev-parse", "HEAD", cwd=target, what="reading HEAD").strip() != sha:
        problems.append("HEAD is not the base commit")
    future = _future_objects(git, git_dir, sha)
    if future:
        problems.append(f"{len(future)} objects not reachable from base, e.g. {future[:3]}")
    if (git_dir / "objects" / "info" / "alternates").exists():
        problems.append("an alternates file")
    if git.out("remote", cwd=target, what="listing remotes").strip():
        problems.append("remotes")
    # Status also refreshes the index's stat data, so the agent's first status is fast and clean.
    dirty = git.out("status", "--porcelain", cwd=target, what="git status")
    if dirty.strip():
        problems.append(f"working tree differs from base: {_tail(dirty, 200)}")
    if problems:
        raise InfraFailure(
            f"prepared workspace {target} failed verification: {'; '.join(problems)}",
            reason=InfraReason.workspace,
        )
