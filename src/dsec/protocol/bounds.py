"""Bounds every wire model shares: what a number may be, and which strings may reach the OS.

Past these a request used to fail deep in a node as a 500 (issue 25): an SQL integer overflow,
a NUL cut off by a C string, a uid the kernel reads as "unchanged".
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

USER_RE = re.compile(r"^(?:[a-z_][a-z0-9_-]{0,31}|[0-9]{1,10})$")
# uid_t is 32 bits and (uid_t)-1 means "unchanged" to setuid/chown: a sandbox of that uid ran
# nothing (exec failed with 125) and its files were written as uid 0.
MAX_UID = (1 << 32) - 2
# Output a command may return, per call. The edge holds it in memory (JSON, then base64 on the
# stream): 256 MiB asked for raised the node's peak RSS by 745 MiB. 64 MiB matches FnCall's cap.
MAX_OUTPUT_BYTES = 64 << 20
MAX_PATH_LEN = 4096  # PATH_MAX
# Seconds any timer may be set to: a year (DeadlineRequest's bound); farther is "never" anyway.
MAX_TIMER_S = 366 * 86400.0


def no_nul(value: str) -> str:
    """A string that may reach the OS (a path, argv, cwd): C strings end at NUL, so one inside
    would be cut there (or raise deep in the edge as a 500)."""
    if "\0" in value:
        raise ValueError("must not contain a NUL character")
    return value


def valid_user(value: str) -> str:
    """A user name (as /etc/passwd has them) or a numeric uid the kernel accepts."""
    if not USER_RE.match(value) or (value.isdigit() and int(value) > MAX_UID):
        raise ValueError(f"invalid user {value!r}: a user name, or a uid from 0 to {MAX_UID}")
    return value


def absolute(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError("must be an absolute path")
    return value


OsStr = Annotated[str, AfterValidator(no_nul)]
OsPath = Annotated[str, Field(max_length=MAX_PATH_LEN), AfterValidator(no_nul)]
AbsPath = Annotated[OsPath, AfterValidator(absolute)]
UserName = Annotated[str, AfterValidator(valid_user)]
Ref = Annotated[str, Field(max_length=1024), AfterValidator(no_nul)]  # a layer or image reference


def no_nul_env(env: dict[str, str]) -> dict[str, str]:
    for k, val in env.items():
        if not k or "=" in k or "\0" in k or "\0" in val:
            raise ValueError(f"invalid environment variable {k!r}")
    return env
