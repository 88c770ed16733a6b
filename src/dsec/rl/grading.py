"""Clean-room grading: judge an agent's work where the agent never was.

The agent's sandbox is not trusted to grade itself, and neither is anything it wrote. So
:func:`grade`

1. reads what the agent changed from the host side (``Sandbox.changes``: the overlay's upper
   directory, which nothing inside the sandbox can hide or forge);
2. starts a fresh sandbox (the *room*) from the task's original layers plus the hidden-tests
   layer the agent never had, and reads the hidden tests' manifest there
   (:mod:`dsec.rl.manifest`: the expected test IDs, FAIL_TO_PASS and PASS_TO_PASS);
3. sorts each change (:mod:`dsec.rl.tamper`): source changes in the workspace are applied;
   changes to test configuration, start-up hooks, the runner or the interpreter are *tamper
   flags* and are not applied; test files the agent wrote (new ones, or tests added to a visible
   test file) or deleted are not applied either, but only reported (``added_tests``,
   ``deleted_tests``): writing a regression test is honest work, a deletion that is not applied
   gains nothing, and only the manifest's tests from the hidden layer run; what
   ``pip install -e .`` left in site-packages is ignored (:mod:`dsec.rl.tamper`);
4. copies the applied changes in (:mod:`dsec.rl.transfer`: capped, names as bytes, links as
   the edge read them on the host) and scans their Python for references to the runner's internals,
   exit handlers, process exit and the like (:mod:`dsec.rl.suspicious`);
5. runs the manifest's tests with an interpreter and runner isolated from the workspace, each
   outcome leaving through a channel the tested code cannot rewrite after the fact
   (:mod:`dsec.rl.runner`);
6. scores the manifest's IDs only: an ID that did not report ``passed`` (failed, errored,
   skipped, never ran, the process died first) is a failure, an ID the manifest does not name is
   a forged report, and there is no fallback to an exit status or a result file.

If the room dies under the grader (stopped by someone else, reclaimed, its node lost), ``grade``
raises ``InfraFailure(reason="grading_sandbox_lost")``: a trainer masks that episode instead of
learning a 0 the agent did not earn.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, Field, PlainSerializer

from dsec.protocol.errors import DSecError, FileNotFound, InfraFailure, InfraReason, InvalidRequest
from dsec.protocol.models import Change, ChangeKind, CommandResult, FileType, SandboxState
from dsec.rl.manifest import MANIFEST_PATH, Manifest, parse_manifest
from dsec.rl.runner import plan_run, read_channel
from dsec.rl.suspicious import scan_change
from dsec.rl.tamper import HIDDEN_TEST, RUNNER, TEST_FILE, judge_all
from dsec.rl.transfer import CopyLimits, copy_changes
from dsec.sdk.args import DSecContainerRunArgs
from dsec.sdk.client import DSecClient, Sandbox

__all__ = ["CopyLimits", "GradeResult", "Suspicious", "TamperFlag", "TestCase", "grade"]

_OUTPUT_CAP = 16 << 20
Outcome = Literal["passed", "failed", "error", "skipped", "xfailed", "xpassed", "missing"]
_OUTCOMES = {"passed", "failed", "error", "skipped", "xfailed", "xpassed"}
_NEVER_REPORTED = "never reported: not run, or the run ended first"
SHADOW = "a new module named like one of the standard library or the test runner"
# Importable names of the runner and its dependencies, besides the standard library's.
_RUNNER_MODULES = frozenset({"pytest", "_pytest", "py", "pluggy", "iniconfig", "packaging", "pygments"})
FORGED = "a test ID the manifest does not name was reported (a forged report)"


def _shown(path: str) -> str:
    """A file name as JSON text: the agent's bytes that are not UTF-8 as ``\\xNN`` escapes
    (names are surrogateescape ``str`` in memory, which JSON encoders refuse)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


Name = Annotated[str, PlainSerializer(_shown, when_used="json")]


class TestCase(BaseModel):
    name: str
    outcome: Outcome
    group: Literal["FAIL_TO_PASS", "PASS_TO_PASS"]
    message: str = ""


class TamperFlag(BaseModel):
    path: Name
    kind: ChangeKind | None  # None: not a file change (a forged report)
    reason: str


class Dropped(BaseModel):
    path: Name
    reason: str


class Suspicious(BaseModel):
    path: Name
    line: int
    col: int
    what: str
    why: str


class GradeResult(BaseModel):
    reward: float
    passed: int = 0
    failed: int = 0
    tests: list[TestCase] = Field(default_factory=list)  # one per manifest ID, in its order
    tamper: list[TamperFlag] = Field(default_factory=list)  # zero the reward (zero_on_tamper)
    suspicious: list[Suspicious] = Field(default_factory=list)  # zero the reward when strict
    added_tests: list[Name] = Field(default_factory=list)  # test files the agent wrote: not applied
    deleted_tests: list[Name] = Field(default_factory=list)  # test paths the agent removed: not applied
    dropped: list[Dropped] = Field(default_factory=list)  # not applied, and why (no penalty)
    applied: list[Name] = Field(default_factory=list)  # paths copied into the clean room
    ignored: list[Name] = Field(default_factory=list)
    extra: list[str] = Field(default_factory=list)  # reported IDs the manifest does not name
    exit_code: int | None = None
    timed_out: bool = False
    runner_finished: bool = False  # the runner reached its end (False: it exited or died early)
    output: str = ""  # the test run's output (tail)

    @property
    def tampered(self) -> bool:
        return bool(self.tamper)


def score(
    manifest: Manifest,
    outcomes: dict[str, tuple[str, str]],
    reward: Literal["fraction", "all"],
) -> tuple[float, list[TestCase]]:
    """The reward for ``outcomes`` over the manifest's IDs only.

    ``all``: 1.0 when every FAIL_TO_PASS and PASS_TO_PASS test passed, else 0. ``fraction``:
    0 if any PASS_TO_PASS test did not pass (a regression, or a run that never got there),
    else the share of FAIL_TO_PASS tests that passed (1.0 when there are none): doing nothing
    scores 0, not the share of tests that already passed."""
    tests = []
    for group, ids in (("FAIL_TO_PASS", manifest.fail_to_pass), ("PASS_TO_PASS", manifest.pass_to_pass)):
        for test_id in ids:
            outcome, message = outcomes.get(test_id, ("missing", _NEVER_REPORTED))
            if outcome not in _OUTCOMES and outcome != "missing":
                outcome, message = "error", f"unknown outcome {outcome!r}"
            tests.append(TestCase(name=test_id, outcome=outcome, group=group, message=message))
    ok = {t.name for t in tests if t.outcome == "passed"}
    if reward == "all":
        return float(len(ok) == len(tests)), tests
    if not all(i in ok for i in manifest.pass_to_pass):
        return 0.0, tests
    if not manifest.fail_to_pass:
        return 1.0, tests
    return sum(i in ok for i in manifest.fail_to_pass) / len(manifest.fail_to_pass), tests


async def grade(
    client: DSecClient,
    sandbox: Sandbox,
    *,
    tests: Sequence[str],
    task_layers: Sequence[str] | None = None,
    workdir: str = "/workspace",
    manifest: str = MANIFEST_PATH,
    hidden_tests: Sequence[str] = (),
    extra_protected: Sequence[str] = (),
    allow_tamper: bool = False,
    zero_on_tamper: bool = True,
    strict: bool = True,
    reward: Literal["fraction", "all"] = "fraction",
    timeout: float | None = None,
    memory_limit_mb: int | None = None,
    limits: CopyLimits | None = None,
) -> GradeResult:
    """Grade ``sandbox``'s work on its task in a fresh sandbox (see the module docstring).

    ``tests``: the hidden-tests layer(s), stacked over ``task_layers`` (default: the agent's own
    layers, i.e. the task as it was handed out); they hold the manifest at ``manifest``.
    ``hidden_tests`` and ``extra_protected`` add to the paths the manifest protects.
    ``strict``: a suspicious reference in the applied code scores 0 (else it is only reported).
    ``reward``: see :func:`score`. ``timeout``: the test run's (default: the manifest's); a
    run past it fails the tests that had not reported, which is the agent's doing.
    """
    if not tests:
        raise InvalidRequest("grade needs the hidden-tests layer(s): tests=[...]")
    layers = list(task_layers) if task_layers is not None else list(sandbox.info.layers)
    changes = await sandbox.changes()
    room = await client.run_container(
        DSecContainerRunArgs(
            layers=[*layers, *tests],
            memory_limit_mb=memory_limit_mb or sandbox.info.memory_limit_mb,
            cpu_cores_limit=sandbox.info.cpu_cores_limit,
            labels={"dsec-grading-for": sandbox.id[-60:]},
        )
    )
    try:
        try:
            return await _grade_in(
                sandbox,
                room,
                changes,
                workdir=workdir,
                manifest_path=manifest,
                hidden_tests=hidden_tests,
                extra_protected=extra_protected,
                allow_tamper=allow_tamper,
                zero_on_tamper=zero_on_tamper,
                strict=strict,
                reward=reward,
                timeout=timeout,
                limits=limits or CopyLimits(),
            )
        except DSecError as exc:
            if not await _alive(room):
                raise _lost(room, exc) from exc
            raise
    finally:
        try:
            await room.stop()
        except DSecError:
            pass  # already gone: the error above (or the result) says what happened


async def _grade_in(
    agent: Sandbox,
    room: Sandbox,
    changes: list[Change],
    *,
    workdir: str,
    manifest_path: str,
    hidden_tests: Sequence[str],
    extra_protected: Sequence[str],
    allow_tamper: bool,
    zero_on_tamper: bool,
    strict: bool,
    reward: Literal["fraction", "all"],
    timeout: float | None,
    limits: CopyLimits,
) -> GradeResult:
    try:
        man = parse_manifest(await room.read_file(manifest_path))
    except FileNotFound as exc:
        raise InvalidRequest(f"the hidden-tests layer has no manifest at {manifest_path}") from exc
    result = GradeResult(reward=0.0)
    hidden = sorted({*hidden_tests, *man.files(workdir)})
    verdicts = judge_all(
        [c.path for c in changes], workdir=workdir, hidden_tests=hidden, extra_protected=extra_protected
    )
    to_apply = []
    for change, verdict in zip(changes, verdicts, strict=True):
        test_work = _test_work(change, verdict.reason, hidden) if verdict.action == "tamper" else None
        if test_work == "added":
            result.added_tests.append(change.path)  # the agent's own test: honest, inert here
        elif test_work == "deleted":
            result.deleted_tests.append(change.path)  # not applied: the task's copy runs
        elif test_work == "dir" or (verdict.reason == RUNNER and _made_a_dir(change)):
            result.ignored.append(change.path)  # a directory alone runs nothing
        elif verdict.action == "tamper":
            result.tamper.append(TamperFlag(path=change.path, kind=change.kind, reason=verdict.reason))
            if allow_tamper:
                to_apply.append(change)
        elif verdict.action == "apply" and _shadows(change, man, workdir):
            result.tamper.append(TamperFlag(path=change.path, kind=change.kind, reason=SHADOW))
        elif verdict.action == "apply":
            to_apply.append(change)
        else:
            result.ignored.append(change.path)

    copied = await copy_changes(agent, room, to_apply, limits)
    result.applied = copied.applied
    result.dropped = [Dropped(path=p, reason=why) for p, why in copied.dropped]
    for path, content in copied.contents.items():
        result.suspicious += [Suspicious(**vars(f)) for f in scan_change(path, content)]

    scratch = f"/tmp/dsec-grading-{secrets.token_hex(8)}"
    plan = plan_run(man, workdir=workdir, scratch=scratch)
    await room.mkdir(scratch, parents=True)
    if man.config is None:
        await room.write_file(plan.config_path, "[pytest]\n")
    ran = await room.exec(
        plan.argv,
        stdin=plan.stdin,
        cwd=workdir,
        timeout=timeout or man.timeout_s,
        max_output_bytes=_OUTPUT_CAP,
    )
    if not await _alive(room):
        raise _lost(room, None)
    _record_run(result, ran)
    channel = read_channel(ran.stdout, plan.nonce, set(man.ids))
    result.runner_finished = channel.done
    result.extra = channel.extra
    result.tamper += [TamperFlag(path=i, kind=None, reason=FORGED) for i in channel.extra]
    result.reward, result.tests = score(man, channel.outcomes, reward)
    result.passed = sum(t.outcome == "passed" for t in result.tests)
    result.failed = len(result.tests) - result.passed
    if (result.tamper and zero_on_tamper) or (result.suspicious and strict):
        result.reward = 0.0
    return result


def _test_work(change: Change, reason: str, hidden: Sequence[str]) -> str | None:
    """How a tamper verdict on a test path is honest work, if it is: ``added`` (a test file the
    agent wrote or edited), ``deleted`` (a test file or directory it removed), ``dir`` (a
    directory it made for its tests); None: not test work, a flag.

    None of these is applied, so none can change what the manifest's tests do: the grading
    sandbox has the task's visible tests and the hidden layer's files as they were, whatever the
    agent wrote or removed. Writing tests is what an honest agent should do, and deleting one
    (a stale visible test, a test file the agent replaced) gains nothing once it is not applied,
    so both are reported, not penalised. Replacing a hidden file by a directory or a link, or
    a test file by a link, stays a flag."""
    if reason not in (TEST_FILE, HIDDEN_TEST):
        return None
    if change.kind is ChangeKind.deleted:
        return "deleted"
    if change.type is FileType.file:
        return "added"
    if change.type is FileType.dir and change.path not in hidden:
        return "dir"
    return None


def _made_a_dir(change: Change) -> bool:
    """A directory the agent made in the runner's locations (``pip install`` makes
    ``/usr/local/lib/python3.X/dist-packages``): never copied, and empty of any effect; what the
    agent put in it is judged file by file."""
    return change.kind is ChangeKind.added and change.type is FileType.dir


def _shadows(change: Change, man: Manifest, workdir: str) -> bool:
    """A module or package the agent *added* right on the import path under a name the runner
    or the standard library uses (``pytest.py``, ``json/``). The grader's runner imports those
    from the image first, so the file is inert there; it is still an attempt, and flagged.
    Modified files are the task's own layout and never flagged."""
    if change.kind is not ChangeKind.added:
        return False
    taken = _RUNNER_MODULES | frozenset(sys.stdlib_module_names) | frozenset(man.plugins)
    for root in man.pythonpath if man.pythonpath is not None else [workdir]:
        if change.path.startswith(root.rstrip("/") + "/"):
            top, _, below = change.path[len(root.rstrip("/")) + 1 :].partition("/")
            name, _, suffix = top.partition(".")
            importable = bool(below) or change.type is FileType.dir or suffix.endswith(("py", "so"))
            if name in taken and importable:
                return True
    return False


def _record_run(result: GradeResult, ran: CommandResult) -> None:
    result.exit_code, result.timed_out = ran.exit_code, ran.timed_out
    result.output = ran.stderr[-4000:]  # stdout is the channel; the tests' own output is stderr


async def _alive(room: Sandbox) -> bool:
    try:
        info = await room.refresh()
    except DSecError:
        return False
    return info.state in (SandboxState.running, SandboxState.paused)


def _lost(room: Sandbox, cause: DSecError | None) -> InfraFailure:
    why = f": {cause}" if cause is not None else ""
    return InfraFailure(
        f"the grading sandbox {room.id} ended or vanished under the grader{why}",
        reason=InfraReason.grading_sandbox_lost,
    )
