"""Clean-room grading: judge an agent's work where the agent never was.

The agent's sandbox is not trusted to grade itself: it may have edited the tests, planted a
``conftest.py`` that passes everything, patched the interpreter, or replaced ``/bin/bash``.
So :func:`grade`

1. reads what the agent changed from the host side (``Sandbox.changes``: the overlay's upper
   directory, which nothing inside the sandbox can hide or forge);
2. sorts each change (:mod:`dsec.rl.tamper`): source changes in the workspace are applied;
   changes to tests, test configuration, the runner or the interpreter are *tamper flags* and
   are not applied unless the caller allows them; anything else is ignored;
3. starts a fresh sandbox from the task's original layers plus a hidden-tests layer the agent's
   sandbox never had, and copies the applied changes in through the file API;
4. runs the test command there and reads per-test results from a JUnit XML file (what
   ``pytest --junitxml`` writes), falling back to the command's exit status;
5. returns a :class:`GradeResult` with a reward (0 whenever a tamper flag was raised, unless the
   caller asked otherwise) and stops the clean room.
"""

from __future__ import annotations

import contextlib
import shlex
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, Field

from dsec.protocol.errors import DSecError, FileNotFound, InvalidRequest
from dsec.protocol.models import ChangeKind, FileType
from dsec.rl.tamper import judge
from dsec.sdk.args import DSecContainerRunArgs
from dsec.sdk.client import DSecClient, Sandbox

_JUNIT_LIMIT = 16 << 20  # a results file larger than this is not a results file


class TestCase(BaseModel):
    name: str
    outcome: Literal["passed", "failed", "error", "skipped"]
    message: str = ""


class TamperFlag(BaseModel):
    path: str
    kind: ChangeKind
    reason: str


class GradeResult(BaseModel):
    reward: float
    passed: int = 0
    failed: int = 0
    tests: list[TestCase] = Field(default_factory=list)
    tamper: list[TamperFlag] = Field(default_factory=list)
    applied: list[str] = Field(default_factory=list)  # paths copied into the clean room
    ignored: list[str] = Field(default_factory=list)
    exit_code: int | None = None
    timed_out: bool = False
    output: str = ""  # the test command's output (tail)

    @property
    def tampered(self) -> bool:
        return bool(self.tamper)


def parse_junit(xml: bytes) -> list[TestCase]:
    """Per-test outcomes from a JUnit XML report (pytest, unittest-xml, JUnit)."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as exc:
        raise InvalidRequest(f"the test results are not JUnit XML: {exc}") from exc
    out = []
    for case in root.iter("testcase"):
        name = ".".join(p for p in (case.get("classname", ""), case.get("name", "")) if p)
        outcome: Literal["passed", "failed", "error", "skipped"] = "passed"
        message = ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag == "failure" else child.tag  # type: ignore[assignment]
                message = (child.get("message") or child.text or "")[:1000]
                break
        out.append(TestCase(name=name, outcome=outcome, message=message))
    return out


async def _copy_change(agent: Sandbox, room: Sandbox, path: str, kind: ChangeKind, ftype: FileType) -> None:
    if kind is ChangeKind.deleted:
        with contextlib.suppress(FileNotFound):
            await room.remove(path, recursive=True)
        return
    if ftype is FileType.dir:
        await room.mkdir(path, parents=True)
    elif ftype is FileType.file:
        st = await agent.stat(path)
        await room.write_file(path, await agent.read_file(path), mode=st.mode & 0o7777)
    elif ftype is FileType.symlink:
        # The file API does not follow or make links; readlink is the one thing run in the
        # agent's sandbox, and all it can give is a link target.
        target = (await agent.exec(["readlink", "-n", path])).stdout
        await room.exec(["ln", "-sfn", target, path])


async def grade(
    client: DSecClient,
    sandbox: Sandbox,
    *,
    tests: Sequence[str],
    command: str,
    task_layers: Sequence[str] | None = None,
    workdir: str = "/workspace",
    junit_path: str | None = "/tmp/dsec-junit.xml",
    hidden_tests: Sequence[str] = (),
    extra_protected: Sequence[str] = (),
    allow_tamper: bool = False,
    zero_on_tamper: bool = True,
    reward: Literal["fraction", "all"] = "fraction",
    timeout: float = 600,
    memory_limit_mb: int | None = None,
) -> GradeResult:
    """Grade ``sandbox``'s work on its task in a fresh sandbox (see the module docstring).

    ``tests``: the hidden-tests layer(s), stacked over ``task_layers`` (default: the agent's own
    layers, i.e. the task as it was handed out). ``command`` runs in ``workdir`` of the clean
    room and should write JUnit XML to ``junit_path`` (None: judge by exit status alone).
    ``reward``: the fraction of tests that passed, or 1.0 only if all did.
    """
    if not tests:
        raise InvalidRequest("grade needs the hidden-tests layer(s): tests=[...]")
    layers = list(task_layers) if task_layers is not None else list(sandbox.info.layers)
    result = GradeResult(reward=0.0)
    to_apply = []
    for change in await sandbox.changes():
        verdict = judge(
            change.path, workdir=workdir, hidden_tests=hidden_tests, extra_protected=extra_protected
        )
        if verdict.action == "tamper":
            result.tamper.append(TamperFlag(path=change.path, kind=change.kind, reason=verdict.reason))
        if verdict.action == "apply" or (verdict.action == "tamper" and allow_tamper):
            to_apply.append(change)
        elif verdict.action == "ignore":
            result.ignored.append(change.path)
    room = await client.run_container(
        DSecContainerRunArgs(
            layers=[*layers, *tests],
            memory_limit_mb=memory_limit_mb or sandbox.info.memory_limit_mb,
            cpu_cores_limit=sandbox.info.cpu_cores_limit,
            labels={"dsec-grading-for": sandbox.id[-60:]},
        )
    )
    try:
        for change in to_apply:
            await _copy_change(sandbox, room, change.path, change.kind, change.type)
            result.applied.append(change.path)
        ran = await room.run_shell(f"cd {shlex.quote(workdir)} && {command}", timeout=timeout)
        result.exit_code, result.timed_out = ran.exit_code, ran.timed_out
        result.output = (ran.stdout + ran.stderr)[-4000:]
        report = None
        if junit_path is not None:
            try:
                if (await room.stat(junit_path)).size <= _JUNIT_LIMIT:
                    report = await room.read_file(junit_path)
            except DSecError:
                report = None  # no report: the exit status decides
        if report is not None:
            result.tests = parse_junit(report)
        else:
            ok = ran.exit_code == 0 and not ran.timed_out
            result.tests = [TestCase(name="command", outcome="passed" if ok else "failed")]
    finally:
        await room.stop()
    counted = [t for t in result.tests if t.outcome != "skipped"]
    result.passed = sum(t.outcome == "passed" for t in counted)
    result.failed = len(counted) - result.passed
    if counted:
        share = result.passed / len(counted)
        result.reward = share if reward == "fraction" else float(share == 1.0)
    if result.tamper and zero_on_tamper:
        result.reward = 0.0
    return result
