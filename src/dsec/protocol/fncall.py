"""Wire models of FnCall: one short stateless call into a warm pool sandbox, and its outcome.

The edge validates an ``FnTask`` here and sends it, as one JSON line, to the runner in a pool
sandbox (``dsec/edge/fncall/runner/``), which answers with one ``FnResult`` line. The
runner is stdlib-only and re-checks the same bounds (``runner.wire.BOUNDS`` and friends; a test
keeps both sides equal).

``FnResult.status``, exactly. ``internal_error`` and ``compile_error`` end a call without a
run; of the others, the first in this list that applies wins:

- ``internal_error``: the platform failed, not the code: the task line was invalid, or the
  runner could not set the call up or lost its zygote. ``stderr`` says why. Nothing is known
  about the code, so a trainer should mask the call out rather than score it.
- ``compile_error``: c/cpp only: the compiler exited non-zero or ran past
  ``compile_timeout_s``; ``stderr`` holds its diagnostics, ``exit_code`` its status.
- ``timeout``: the program was still running at ``run_timeout_s`` (wall clock) and its process
  tree was killed, or it used up its CPU-time limit (``ceil(run_timeout_s) + 1`` seconds).
- ``memory_exceeded``: the program failed (non-zero exit or a signal) for lack of memory. The
  limit is an address-space rlimit (RLIMIT_AS), so allocations fail rather than the kernel
  killing; detected are: a ``MemoryError`` that escaped Python code; a known out-of-memory
  signature in the last 8 KiB of stderr (``std::bad_alloc``, ``MemoryError``, ``[Cc]annot
  allocate`` as in ``Cannot allocate memory`` and bash's ``xmalloc: cannot allocate N bytes``,
  ``[Oo]ut of memory``); a SIGKILL not sent by the runner with a peak RSS of at least 90% of
  ``memory_limit_mb`` (an OOM kill), or any SIGKILL not sent by the runner when
  ``memory_limit_mb`` is None (the pool sandbox's cgroup killed it). Not detected: C code that
  ignores a failed ``malloc`` and crashes (a ``runtime_error`` with ``signal`` 11).
- ``runtime_error``: any other non-zero exit status or death by a signal.
- ``output_truncated``: exited 0, but stdout or stderr passed ``max_output_bytes``; the rest was
  read and dropped. Never a pass, also not when the kept part matches.
- ``wrong_answer``: exited 0 with complete output, ``expected_stdout`` was given and stdout does
  not match it (lines compared without trailing whitespace; trailing blank lines ignored).
- ``ok``: exited 0, output complete, and stdout matched ``expected_stdout`` when one was given.

The runner, not the program, compares stdout, after the program and everything it started
are dead; so ``sys.exit(0)`` or ``os._exit(0)`` in user code cannot turn a wrong output into
a pass, and ``judged`` (set only when ``expected_stdout`` is given) is true exactly when the
status is ``ok``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_CODE_BYTES = 1 << 20
MAX_STDIN_BYTES = 16 << 20
MAX_EXPECTED_BYTES = 16 << 20
MAX_FILES = 4096  # SandboxFusion has no bound; an RL grader sends one file per test case
MAX_FILES_BYTES = 32 << 20
MAX_PATH = 512
# The program's own file names in the call directory: input files may not take them.
RESERVED_NAMES = frozenset({"main.py", "main.sh", "main.c", "main.cpp", "main"})
# Absolute paths (SandboxFusion's files and fetch_files take them) may not lie under these
# top-level directories of the pool sandbox: its system, the runner's own directory, and
# pseudo-filesystems. /dev/shm and /var/tmp are the exceptions: calls own what they make there.
SYSTEM_DIRS = frozenset(
    {
        "proc",
        "sys",
        "dev",
        ".dsec",
        "etc",
        "usr",
        "bin",
        "sbin",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "boot",
        "run",
        "var",
    }
)
OPEN_SYSTEM_DIRS = ("/dev/shm/", "/var/tmp/")
RUNNER_WORKDIR = "/tmp/fncall"
MAX_TIMEOUT_S = 3600.0  # a call holds one pool sandbox for its whole time

Language = Literal["python", "bash", "c", "cpp"]
Status = Literal[
    "ok",
    "compile_error",
    "runtime_error",
    "timeout",
    "memory_exceeded",
    "output_truncated",
    "wrong_answer",
    "internal_error",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_path(p: str) -> str:
    if not 0 < len(p) <= MAX_PATH or "\0" in p:
        raise ValueError(f"bad path {p!r}: give a path of 1-{MAX_PATH} characters")
    parts = p[1:].split("/") if p.startswith("/") else p.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"bad path {p!r}: empty, '.' and '..' components are refused")
    if p.startswith("/"):
        system = parts[0] in SYSTEM_DIRS and not p.startswith(OPEN_SYSTEM_DIRS)
        if len(parts) < 2 or system or (p + "/").startswith(RUNNER_WORKDIR + "/"):
            raise ValueError(
                f"bad path {p!r}: an absolute path must lie in a directory below /, outside the pool"
                f" sandbox's system directories /{', /'.join(sorted(SYSTEM_DIRS))} (/dev/shm and"
                f" /var/tmp are open) and {RUNNER_WORKDIR}"
            )
    return p


def _utf8_at_most(v: str | None, limit: int, name: str) -> str | None:
    if v is not None and len(v.encode()) > limit:
        raise ValueError(f"{name} is longer than {limit} bytes of UTF-8")
    return v


class FnTask(_Model):
    """One call: a program, its input, and what to bring back.

    ``stdin`` is text (sent as UTF-8); binary input goes in ``files``. ``files`` maps paths
    relative to the call's working directory to base64 contents; ``fetch_files`` names paths
    (same rules) to read back after the run. Absolute paths (outside ``SYSTEM_DIRS``) are
    made in the pool sandbox, which runs one call at a time, for this call only: missing
    directories are created for the call and an existing one the call cannot write is opened
    to it (sticky) until the call ends; then everything the call made there is removed and
    the directory restored. An absolute path is fetched only if the call's uid owns it.
    The program itself is ``main.py``, ``main.sh``, ``main.c`` or ``main.cpp`` (compiled to
    ``main``) in the call's directory.
    """

    language: Language
    code: str
    stdin: str = ""
    files: dict[str, str] = Field(default_factory=dict, max_length=MAX_FILES)
    fetch_files: list[str] = Field(default_factory=list, max_length=MAX_FILES)
    compile_timeout_s: float = Field(default=30.0, ge=0.1, le=MAX_TIMEOUT_S)
    run_timeout_s: float = Field(default=10.0, ge=0.1, le=MAX_TIMEOUT_S, description="wall clock")
    memory_limit_mb: int | None = Field(
        default=256, ge=32, le=16384, description="address space, MiB; None: only the pool sandbox's memory"
    )
    max_output_bytes: int = Field(default=1 << 20, ge=1, le=64 << 20, description="per stream")
    expected_stdout: str | None = Field(default=None, description="judge: compare stdout to this")

    @field_validator("code")
    @classmethod
    def _code(cls, v: str) -> str:
        return _utf8_at_most(v, MAX_CODE_BYTES, "code") or ""

    @field_validator("stdin")
    @classmethod
    def _stdin(cls, v: str) -> str:
        return _utf8_at_most(v, MAX_STDIN_BYTES, "stdin") or ""

    @field_validator("expected_stdout")
    @classmethod
    def _expected(cls, v: str | None) -> str | None:
        return _utf8_at_most(v, MAX_EXPECTED_BYTES, "expected_stdout")

    @field_validator("fetch_files")
    @classmethod
    def _fetch(cls, v: list[str]) -> list[str]:
        return [_check_path(p) for p in v]

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        total = 0
        for path, data in v.items():
            _check_path(path)
            try:
                total += len(base64.b64decode(data, validate=True))
            except binascii.Error as exc:
                raise ValueError(f"files[{path!r}] is not valid base64") from exc
            parts = path.split("/")
            parents = {"/".join(parts[:i]) for i in range(1, len(parts))}
            if path in RESERVED_NAMES or parents & (set(v) | RESERVED_NAMES):
                raise ValueError(f"file {path!r} would replace the program or sit under another file")
        if total > MAX_FILES_BYTES:
            raise ValueError(f"input files exceed {MAX_FILES_BYTES} bytes")
        return v

    @classmethod
    def with_files(cls, files: dict[str, bytes], **kw: object) -> FnTask:
        """Build a task from raw file contents (encodes them)."""
        encoded = {p: base64.b64encode(d).decode() for p, d in files.items()}
        return cls.model_validate({**kw, "files": encoded})


class FnResult(_Model):
    """The outcome of one call (see the module docstring for ``status``)."""

    status: Status
    exit_code: int | None = Field(description="the program's (on compile_error: the compiler's)")
    signal: int | None = Field(description="the signal that ended the program, if one did")
    stdout: str = Field(description="the first max_output_bytes, decoded as UTF-8 with replacement")
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    files: dict[str, str] = Field(default_factory=dict, description="fetched: path -> base64")
    fetch_errors: dict[str, str] = Field(
        default_factory=dict,
        description="fetch_files not returned, and why: missing, not a regular file, a symlink, too large",
    )
    judged: bool | None = Field(default=None, description="None without expected_stdout")
    compile_time_s: float = 0.0
    run_time_s: float = Field(default=0.0, description="wall clock")
    cpu_time_s: float = 0.0
    max_rss_kib: int = 0
    clean: bool = Field(description="cleanup proved the sandbox clean; false: recycle it")

    @model_validator(mode="after")
    def _judged_means_ok(self) -> FnResult:
        if self.judged and self.status != "ok":
            raise ValueError("judged is true only for an ok call")
        return self

    def file_bytes(self, path: str) -> bytes:
        return base64.b64decode(self.files[path])


class FnRunnerReady(_Model):
    """The runner's first line: it imported ``preloaded`` and serves calls (or could not start)."""

    ready: bool
    preloaded: list[str] = Field(default_factory=list)
    private_net: bool = Field(default=False, description="each call gets its own network namespace")
    call_uid: int | None = None
    mergeable_bytes: int = Field(default=0, description="memory marked for KSM (runner --mergeable)")
    fixed_layout: bool = Field(default=False, description="laid out as the pool's other runners")
    error: str | None = None
