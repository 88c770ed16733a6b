"""SandboxFusion's ``/run_code`` schema, mapped onto FnCall.

Request fields: ``code``, ``language``, ``compile_timeout``, ``run_timeout``,
``memory_limit_MB`` (-1, what SandboxFusion's client sends unless told: no per-call limit, only
the pool sandbox's memory, as SandboxFusion applies none), ``stdin``, ``files`` (path -> base64, or null to
skip), ``fetch_files``. Response: ``status`` (``Success`` when every step exited 0,
``Failed`` when one did not or ran out of time, ``SandboxError`` when the platform failed or
the request cannot run here), ``message``, ``compile_result`` and ``run_result`` (each
``status`` ``Finished``/``TimeLimitExceeded``/``Error``, ``execution_time``, ``return_code``,
``stdout``, ``stderr``), ``executor_pod_name`` and ``files`` (fetched, base64).

Output: each stream keeps its first ``OUTPUT_CAP`` bytes. A result cut there is never
``Success``: it answers ``SandboxError`` with ``run_result.status`` ``Error`` and a message
saying the output was truncated and nothing was judged, which verl's reward code scores as a
sandbox error (-1, not a wrong answer) and SandboxFusion's client raises on.

Not supported (answered as ``SandboxError`` naming the reason): languages other than
python, bash, c and cpp; ``..`` paths, and absolute paths in the pool sandbox's system
directories (``dsec.protocol.fncall.SYSTEM_DIRS``), in ``files``/``fetch_files``; more
than 4096 files; timeouts over an hour; ``/run_jupyter`` and the online-judge endpoints. Unknown
request fields are ignored, as SandboxFusion itself does. A signal's death is reported as a
negative ``return_code`` (Python's convention, which SandboxFusion inherits).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsec.protocol.fncall import FnResult, FnTask
from dsec.protocol.models import invalid_request

# The largest outputs RL graders expect (docs/decisions.md, issue 29): code_contests' heaviest
# problems print ~10^6 numbers (<= ~11 MB); LiveCodeBench, HumanEval and MBPP print far less.
OUTPUT_CAP = 32 << 20
_LANGUAGES = {"python": "python", "python3": "python", "bash": "bash", "c": "c", "cpp": "cpp"}


class RunCodeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    code: str
    language: str
    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CommandRunResult(BaseModel):
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


class Unsupported(ValueError):
    """The request is valid SandboxFusion but cannot run on DSec (answered as SandboxError)."""


def to_task(req: RunCodeRequest) -> FnTask:
    language = _LANGUAGES.get(req.language)
    if language is None:
        raise Unsupported(f"language {req.language!r} is not supported here: use one of {sorted(_LANGUAGES)}")
    fields: dict[str, object] = {
        "language": language,
        "code": req.code,
        "stdin": req.stdin or "",
        "files": {p: data for p, data in req.files.items() if data is not None},
        "fetch_files": req.fetch_files,
        "compile_timeout_s": req.compile_timeout,
        "run_timeout_s": req.run_timeout,
        "memory_limit_mb": req.memory_limit_MB if req.memory_limit_MB > 0 else None,
        "max_output_bytes": OUTPUT_CAP,
    }
    try:
        return FnTask.model_validate(fields)
    except ValidationError as exc:
        raise Unsupported(str(invalid_request(exc))) from exc


def from_result(r: FnResult, node: str | None = None) -> RunCodeResponse:
    if r.status == "internal_error":
        return RunCodeResponse(status="SandboxError", message=r.stderr, executor_pod_name=node)
    rc = r.exit_code if r.signal is None else -r.signal
    if r.status == "compile_error":
        failed = CommandRunResult(
            status="TimeLimitExceeded" if r.exit_code is None else "Finished",
            execution_time=r.compile_time_s,
            return_code=r.exit_code,
            stdout="",
            stderr=r.stderr,
        )
        return RunCodeResponse(status="Failed", compile_result=failed, executor_pod_name=node)
    compiled = None
    if r.compile_time_s:
        compiled = CommandRunResult(status="Finished", execution_time=r.compile_time_s, return_code=0)
    if r.status == "output_truncated":
        cut = [
            name
            for name, was_cut in (("stdout", r.stdout_truncated), ("stderr", r.stderr_truncated))
            if was_cut
        ]
        why = (
            f"output truncated: {' and '.join(cut)} passed {OUTPUT_CAP} bytes; the run exited 0 but was"
            " not judged (the kept part may differ from the whole)"
        )
        ran = CommandRunResult(
            status="Error", execution_time=r.run_time_s, return_code=rc, stdout=r.stdout, stderr=r.stderr
        )
        return RunCodeResponse(
            status="SandboxError",
            message=why,
            compile_result=compiled,
            run_result=ran,
            executor_pod_name=node,
        )
    ran = CommandRunResult(
        status="TimeLimitExceeded" if r.status == "timeout" else "Finished",
        execution_time=r.run_time_s,
        return_code=None if r.status == "timeout" else rc,  # as SandboxFusion: a killed run has none
        stdout=r.stdout,
        stderr=r.stderr,
    )
    ok = r.status in ("ok", "wrong_answer") and rc == 0
    message = "memory limit exceeded" if r.status == "memory_exceeded" else ""
    return RunCodeResponse(
        status="Success" if ok else "Failed",
        message=message,
        compile_result=compiled,
        run_result=ran,
        executor_pod_name=node,
        files=r.files,
    )
