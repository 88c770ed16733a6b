"""Attacks that SUCCEED today: gaps in isolation found by the escape suite, kept as tests.

Each test asserts what should happen and is marked ``xfail(strict=True)`` with what happens
instead: the suite stays green while the gap is open, and turns red (XPASS) the moment a fix
lands, so whoever fixes it removes the marker and the test joins the suite for good.
"""

from __future__ import annotations

import pytest

from dsec import Sandbox
from tests.conftest import Sandboxes
from tests.security.test_escape_entrances import ZERO_PRINTF, assert_a_later_command_is_out_of_reach
from tests.security.test_session_end import GVISOR, assert_a_nonce_reader_cannot_end_early, on_backend


@pytest.mark.xfail(
    strict=True,
    reason="GAP: a session command runs in the shell that runs the session's driver loop: it can "
    "redefine the builtins the loop calls (bash lets a function shadow any builtin, even "
    "`builtin`) and so decide what later commands of the session report (here every exit code "
    "0). Closing it takes a driver the command cannot reach; until then a grader needs a "
    "session (or exec) of its own",
)
async def test_a_command_cannot_rewrite_the_results_of_later_commands_in_its_session(
    sandbox: Sandbox,
) -> None:
    assert (await sandbox.run_shell(ZERO_PRINTF, session="s", timeout=60)).exit_code == 0
    r = await sandbox.run_shell("echo grading; (exit 3)", session="s", timeout=60)
    assert (r.exit_code, r.stdout) == (3, "grading\n"), r


@pytest.mark.parametrize("backend", [GVISOR])
@pytest.mark.xfail(
    strict=True,
    reason="GAP: under gVisor a process the agent left running opens the /proc fds of a grader's "
    "later command (its stdout: it can write into the grader's output; gVisor itself limits "
    "ptrace to descendants and /proc/PID/mem). crun sandboxes and microVMs give each process "
    "the edge starts a Landlock domain of its own (tests/security/test_escape_entrances.py); "
    "gVisor has no Landlock (google/gvisor#13439)",
)
async def test_a_process_left_behind_cannot_reach_a_later_command_under_gvisor(
    make_sandbox: Sandboxes, backend: str
) -> None:
    await assert_a_later_command_is_out_of_reach(await on_backend(make_sandbox, backend))


@pytest.mark.parametrize("backend", [GVISOR])
@pytest.mark.xfail(
    strict=True,
    reason="GAP: a session shell under gVisor is not a process the edge sees in the host's /proc "
    "(the sentry's), so only the end marker's secret nonce ends a command there: one that "
    "reads the nonce off its shell's command pipe ends its result early with an exit code it "
    "chose, and what it prints afterwards is the next command's (crun sandboxes and microVMs "
    "watch the shell: tests/security/test_session_end.py)",
)
async def test_a_command_that_reads_its_end_nonce_cannot_end_early_under_gvisor(
    make_sandbox: Sandboxes, backend: str
) -> None:
    await assert_a_nonce_reader_cannot_end_early(await on_backend(make_sandbox, backend))
