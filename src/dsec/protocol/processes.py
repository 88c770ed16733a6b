"""Wire models of long-lived processes and directory watches inside a sandbox.

A *process* here is what outlives the request that started it (E2B's background commands,
PTYs, a dev server): the edge keeps its pipes (or its pseudo-terminal's master) and its output
goes to whoever is attached. Attaching never replays what was printed before; starting a
process attaches the starter atomically, so a foreground caller never misses a byte.
Detaching (closing the event stream) leaves the process running; only a signal ends it.

``exec`` (:class:`~dsec.protocol.models.ExecRequest`) stays the right call for a command whose
caller waits for it: closing its stream kills it, and it is recorded with its output.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from dsec.protocol.bounds import OsPath, OsStr, UserName, no_nul_env


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", ser_json_bytes="base64", val_json_bytes="base64", allow_inf_nan=False
    )


class PtySize(_Model):
    rows: int = Field(ge=1, le=4096)
    cols: int = Field(ge=1, le=4096)


class ProcessStart(_Model):
    argv: list[OsStr] = Field(min_length=1, max_length=4096)
    env: Annotated[dict[str, str], AfterValidator(no_nul_env)] = Field(default_factory=dict)
    cwd: OsPath | None = Field(default=None, description="default: the sandbox's workdir, else user's home")
    user: UserName | None = Field(default=None, description="default: init_user")
    tag: str | None = Field(default=None, max_length=256, description="a name to find it by")
    pty: PtySize | None = Field(default=None, description="run on a pseudo-terminal of this size")
    stdin: bool = Field(default=True, description="keep stdin open for input (else /dev/null)")
    timeout: float | None = Field(default=None, gt=0, le=86400, description="killed after this")


class ProcessInfo(_Model):
    pid: int = Field(description="its PID inside the sandbox (unique among its live processes)")
    argv: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str
    tag: str | None = None
    pty: bool = False
    running: bool = True
    exit_code: int | None = None


class ProcessEvent(_Model):
    """``start`` (first, always), then ``out``/``err`` (pipes) or ``pty`` (a terminal's bytes),
    then ``end`` (last) with the exit code, or ``-N`` and ``signal`` for a death by signal N."""

    t: Literal["start", "out", "err", "pty", "end"]
    pid: int
    data: bytes | None = None
    exit_code: int | None = None
    signal: int | None = None
    error: str | None = Field(default=None, description="why it ended, when not by itself")


class ProcessInput(_Model):
    data: bytes = Field(max_length=1 << 20)


class ProcessSignal(_Model):
    signal: int = Field(ge=1, le=64)


WatchKind = Literal["start", "create", "write", "remove", "rename", "chmod"]


class WatchEvent(_Model):
    """``start`` once the watch is in place, then one event per change below the directory;
    ``name`` is relative to the watched directory."""

    t: WatchKind
    name: str = ""
