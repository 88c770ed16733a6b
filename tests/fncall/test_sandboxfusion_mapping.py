"""SandboxFusion's request and answer, mapped onto FnCall and back: the reward-changing cases of
issue 29 without a node (``tests/e2e/test_sandboxfusion.py`` runs them for real)."""

from __future__ import annotations

from typing import Any

import pytest

from dsec.apiserver.sandboxfusion import OUTPUT_CAP, RunCodeRequest, Unsupported, from_result, to_task
from dsec.edge.fncall.runner import wire as runner
from dsec.protocol.fncall import FnResult


def result(**kw: Any) -> FnResult:
    return FnResult.model_validate({**runner.result("ok", clean=True), "exit_code": 0, **kw})


def test_minus_one_is_no_per_call_memory_limit_and_a_value_is_one() -> None:
    assert to_task(RunCodeRequest(code="", language="python")).memory_limit_mb is None
    assert to_task(RunCodeRequest(code="", language="python", memory_limit_MB=512)).memory_limit_mb == 512


def test_what_sandboxfusion_accepts_within_dsecs_bounds_is_taken() -> None:
    files = {f"/data/{i}.in": "" for i in range(100)}
    task = to_task(
        RunCodeRequest(code="", language="python", files=files, fetch_files=["/mnt/b"], run_timeout=600)
    )
    assert (len(task.files), task.fetch_files, task.run_timeout_s) == (100, ["/mnt/b"], 600)
    assert task.max_output_bytes == OUTPUT_CAP


@pytest.mark.parametrize(
    "request_fields",
    [{"fetch_files": ["/etc/shadow"]}, {"files": {"/usr/bin/python3": ""}}, {"run_timeout": 3601}],
)
def test_what_dsec_refuses_says_why(request_fields: dict[str, Any]) -> None:
    with pytest.raises(Unsupported):
        to_task(RunCodeRequest(code="", language="python", **request_fields))


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_truncated_output_is_a_sandbox_error_never_a_success(stream: str) -> None:
    cut = result(status="output_truncated", stdout="x" * 10, **{f"{stream}_truncated": True})
    answer = from_result(cut)
    assert answer.status == "SandboxError" and answer.run_result is not None
    assert answer.run_result.status == "Error"
    assert f"{stream} passed" in answer.message and "not judged" in answer.message


def test_a_timeout_has_no_return_code_and_a_signal_is_negative() -> None:
    timed_out = from_result(result(status="timeout", exit_code=None, signal=9))
    assert timed_out.run_result is not None
    assert (timed_out.status, timed_out.run_result.status, timed_out.run_result.return_code) == (
        "Failed",
        "TimeLimitExceeded",
        None,
    )
    killed = from_result(result(status="runtime_error", exit_code=None, signal=11))
    assert killed.run_result is not None and (killed.status, killed.run_result.return_code) == ("Failed", -11)


def test_wrong_answer_is_success_for_sandboxfusion_which_judges_nothing_itself() -> None:
    assert from_result(result(status="wrong_answer")).status == "Success"
