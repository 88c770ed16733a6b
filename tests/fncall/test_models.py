"""FnTask/FnResult validation, and that the stdlib-only runner enforces the same bounds."""

from __future__ import annotations

import base64
from typing import Any, get_args

import pytest
from pydantic import ValidationError

from dsec.edge.fncall.runner import wire as runner
from dsec.protocol import fncall
from dsec.protocol.fncall import FnResult, FnTask


def task(**kw: Any) -> dict[str, Any]:
    return {"language": "python", "code": "print(1)", **kw}


@pytest.mark.parametrize(
    "bad",
    [
        {"language": "cobol"},
        {"files": {"../x": ""}},
        {"files": {"/etc/passwd": ""}},  # absolute paths: only outside the system directories
        {"files": {"/x": ""}},  # not straight under /
        {"fetch_files": ["/proc/1/environ"]},
        {"fetch_files": ["/tmp/fncall/call-1/x"]},  # the runner's own
        {"fetch_files": ["/mnt/../etc/shadow"]},
        {"files": {"a//b": ""}},
        {"files": {"a/./b": ""}},
        {"files": {"x": "not base64!"}},
        {"files": {"main.py": ""}},  # the program's own name
        {"files": {"main/x": ""}},  # under the compiled binary's name
        {"files": {"a": "", "a/b": ""}},  # a file cannot also be a directory
        {"files": {str(i): "" for i in range(fncall.MAX_FILES + 1)}},
        {"files": {"big": base64.b64encode(b"x" * (fncall.MAX_FILES_BYTES + 1)).decode()}},
        {"fetch_files": ["ok", "../../etc/shadow"]},
        {"code": "x" * (fncall.MAX_CODE_BYTES + 1)},
        {"code": "é" * (fncall.MAX_CODE_BYTES // 2 + 1)},  # bytes count, not characters
        {"run_timeout_s": 0},
        {"run_timeout_s": 3601},
        {"memory_limit_mb": 16},
        {"max_output_bytes": 0},
        {"surprise": True},
    ],
)
def test_bad_tasks_are_refused_by_the_model_and_by_the_runner(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        FnTask.model_validate(task(**bad))
    with pytest.raises(ValueError):
        runner.parse_task(task(**bad))


@pytest.mark.parametrize(
    "good",
    [
        {
            "files": {"/mnt/a": "", "/home/u/data/in": ""},
            "fetch_files": ["/mnt/b", "/dev/shm/x", "/var/tmp/y"],
        },
        {"memory_limit_mb": None},  # SandboxFusion's -1: only the pool sandbox's memory
        {"files": {str(i): "" for i in range(fncall.MAX_FILES)}, "run_timeout_s": 600},
    ],
)
def test_what_sandboxfusion_clients_send_is_a_valid_task(good: dict[str, Any]) -> None:
    model = FnTask.model_validate(task(**good))
    parsed = runner.parse_task(model.model_dump(mode="json"))
    assert (parsed.memory_limit_mb, parsed.fetch_files) == (model.memory_limit_mb, model.fetch_files)


def test_a_valid_task_means_the_same_on_both_sides() -> None:
    t = FnTask.with_files({"data/in.bin": b"\0\1"}, language="c", code="int main(){}", stdin="1 2\n")
    parsed = runner.parse_task(t.model_dump(mode="json"))
    assert parsed.files == {"data/in.bin": b"\0\1"} and parsed.stdin == b"1 2\n"
    assert (parsed.run_timeout_s, parsed.memory_limit_mb) == (t.run_timeout_s, t.memory_limit_mb)


def test_the_runner_bounds_match_the_model() -> None:
    fields = FnTask.model_fields
    for name, (_type, default, lo, hi) in runner.BOUNDS.items():
        meta = {type(m).__name__: m for m in fields[name].metadata}
        assert fields[name].default == default
        assert (meta["Ge"].ge, meta["Le"].le) == (lo, hi), name
    assert runner.RESERVED == fncall.RESERVED_NAMES
    assert (runner.SYSTEM_DIRS, runner.OPEN_SYSTEM_DIRS) == (fncall.SYSTEM_DIRS, fncall.OPEN_SYSTEM_DIRS)
    assert {n for n, f in fields.items() if f.annotation == int | None} == runner.NULLABLE
    assert set(runner.LANGUAGES) == set(get_args(fncall.Language))
    limits = ("MAX_CODE", "MAX_STDIN", "MAX_EXPECTED", "MAX_FILES", "MAX_FILES_BYTES", "MAX_PATH")
    model_limits = ("MAX_CODE_BYTES", "MAX_STDIN_BYTES", "MAX_EXPECTED_BYTES", "MAX_FILES", "MAX_FILES_BYTES")
    for ours, theirs in zip(limits, (*model_limits, "MAX_PATH"), strict=True):
        assert getattr(runner, ours) == getattr(fncall, theirs), ours


def test_every_runner_result_shape_is_a_valid_fn_result() -> None:
    FnResult.model_validate(runner.result("internal_error", "why"))
    with pytest.raises(ValidationError):  # a pass is only ever an ok call
        FnResult.model_validate({**runner.result("wrong_answer"), "judged": True})
