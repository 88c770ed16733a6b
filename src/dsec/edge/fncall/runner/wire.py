"""The runner's end of the wire: FnTask lines in (validated here), FnResult shapes out.

The runner never imports dsec (the sandbox's python3 has neither it nor pydantic), so it
checks every task again itself, as the last line of defence, against the same bounds as
``dsec.protocol.fncall`` (``tests/fncall/test_models.py`` keeps the two equal).
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

LANGUAGES = ("python", "bash", "c", "cpp")
SOURCE = {"python": "main.py", "bash": "main.sh", "c": "main.c", "cpp": "main.cpp"}
RUN_ARGV: dict[str, list[str] | None] = {"python": None, "bash": ["bash", "main.sh"], "c": ["./main"]}
RUN_ARGV["cpp"] = RUN_ARGV["c"]
RESERVED = frozenset([*SOURCE.values(), "main"])  # input files may not take these names
# field: (type, default, min, max); dsec.protocol.fncall.FnTask declares the same (a test checks).
BOUNDS: dict[str, tuple[type, float, float, float]] = {
    "compile_timeout_s": (float, 30.0, 0.1, 3600.0),
    "run_timeout_s": (float, 10.0, 0.1, 3600.0),
    "memory_limit_mb": (int, 256, 32, 16384),  # null: no address-space limit (NULLABLE)
    "max_output_bytes": (int, 1 << 20, 1, 64 << 20),
}
NULLABLE = frozenset({"memory_limit_mb"})
MAX_CODE = 1 << 20  # bytes of UTF-8
MAX_STDIN = 16 << 20
MAX_EXPECTED = 16 << 20
MAX_FILES = 4096  # input files, and paths to fetch
MAX_FILES_BYTES = 32 << 20  # all input files together, decoded
MAX_FETCH_BYTES = 32 << 20  # all fetched files together
MAX_PATH = 512
MAX_LINE = 64 << 20
# Absolute paths: not under these (dsec.protocol.fncall.SYSTEM_DIRS says why; a test keeps them equal).
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


class TaskError(ValueError):
    """The task line is not a valid FnTask."""


@dataclasses.dataclass
class Task:
    language: str
    code: str
    stdin: bytes
    files: dict[str, bytes]
    fetch_files: list[str]
    expected_stdout: str | None
    compile_timeout_s: float
    run_timeout_s: float
    memory_limit_mb: int | None
    max_output_bytes: int


def check_path(p: object, workdir: str = "/tmp/fncall") -> str:
    if not isinstance(p, str) or not 0 < len(p) <= MAX_PATH or "\0" in p:
        raise TaskError(f"bad path {p!r}: give a path of 1-{MAX_PATH} characters")
    parts = p[1:].split("/") if p.startswith("/") else p.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise TaskError(f"bad path {p!r}: empty, '.' and '..' components are refused")
    if p.startswith("/"):
        system = parts[0] in SYSTEM_DIRS and not p.startswith(OPEN_SYSTEM_DIRS)
        if len(parts) < 2 or system or (p + "/").startswith(workdir + "/"):
            raise TaskError(f"bad path {p!r}: absolute paths in system directories are refused")
    return p


def _text(obj: dict[str, Any], name: str, default: str | None, limit: int) -> Any:
    v = obj.get(name, default)
    if v is not None and (not isinstance(v, str) or len(v.encode()) > limit):
        raise TaskError(f"{name} must be a string of at most {limit} bytes")
    return v


def parse_task(obj: Any) -> Task:
    """Validate a decoded task line; mirrors FnTask, as the last line of defence."""
    if not isinstance(obj, dict):
        raise TaskError("a task is a JSON object")
    unknown = set(obj) - {"language", "code", "stdin", "files", "fetch_files", "expected_stdout", *BOUNDS}
    if unknown:
        raise TaskError(f"unknown fields {sorted(unknown)}")
    if obj.get("language") not in LANGUAGES:
        raise TaskError(f"language must be one of {', '.join(LANGUAGES)}")
    limits: dict[str, Any] = {}
    for name, (typ, default, lo, hi) in BOUNDS.items():
        v = obj.get(name, default)
        if v is None and name in NULLABLE:
            limits[name] = None
            continue
        ok_type = (int, float) if typ is float else int
        if isinstance(v, bool) or not isinstance(v, ok_type) or not lo <= v <= hi:
            raise TaskError(f"{name} must be a {typ.__name__} in [{lo}, {hi}]")
        limits[name] = v
    files_in, fetch = obj.get("files", {}), obj.get("fetch_files", [])
    if not isinstance(files_in, dict) or len(files_in) > MAX_FILES:
        raise TaskError(f"files must map at most {MAX_FILES} paths to base64 contents")
    if not isinstance(fetch, list) or len(fetch) > MAX_FILES:
        raise TaskError(f"fetch_files must list at most {MAX_FILES} paths")
    files: dict[str, bytes] = {}
    for path, data in files_in.items():
        if not isinstance(data, str):
            raise TaskError(f"files[{path!r}] must be base64 text")
        files[check_path(path)] = base64.b64decode(data, validate=True)
    if sum(map(len, files.values())) > MAX_FILES_BYTES:
        raise TaskError(f"input files exceed {MAX_FILES_BYTES} bytes")
    for path in files:
        parts = path.split("/")
        if any("/".join(parts[:i]) in files or "/".join(parts[:i]) in RESERVED for i in range(1, len(parts))):
            raise TaskError(f"file {path!r} would sit under another file")
        if path in RESERVED:
            raise TaskError(f"file {path!r} would replace the program ({', '.join(sorted(RESERVED))})")
    return Task(
        language=obj["language"],
        code=_text(obj, "code", None, MAX_CODE),
        stdin=_text(obj, "stdin", "", MAX_STDIN).encode(),
        files=files,
        fetch_files=[check_path(p) for p in fetch],
        expected_stdout=_text(obj, "expected_stdout", None, MAX_EXPECTED),
        **limits,
    )


def result(status: str, message: str = "", clean: bool = False) -> dict[str, Any]:
    """An FnResult with nothing run yet; the call fills in what happened."""
    res: dict[str, Any] = dict.fromkeys(("exit_code", "signal", "judged"))
    res.update(dict.fromkeys(("compile_time_s", "run_time_s", "cpu_time_s"), 0.0))
    res.update(dict.fromkeys(("stdout_truncated", "stderr_truncated"), False))
    res.update(
        status=status, stdout="", stderr=message, files={}, fetch_errors={}, max_rss_kib=0, clean=clean
    )
    return res
