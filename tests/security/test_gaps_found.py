"""Attacks that SUCCEED today: gaps in isolation found by the escape suite, kept as tests.

Each test asserts what should happen and is marked ``xfail(strict=True)`` with what happens
instead: the suite stays green while the gap is open, and turns red (XPASS) the moment a fix
lands, so whoever fixes it removes the marker and the test joins the suite for good.
"""

from __future__ import annotations

import base64

import pytest

from dsec import Sandbox
from tests.conftest import Sandboxes
from tests.security.test_session_end import OTHER_BACKENDS, PEEKERS, on_backend

# Replaces printf, which the driver loop calls to print a command's end marker, so that every
# later end marker of the session says exit code 0.
ZERO_PRINTF = (
    'printf() { if [ "$1" = \'\\0%s:%d\\0\' ]; then command printf "$1" "$2" 0; '
    'else command printf "$@"; fi; }'
)


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


@pytest.mark.xfail(
    strict=True,
    reason="GAP: every session shell runs as the sandbox's user and is dumpable, so a process of "
    "one session opens /proc/SHELL/fd/0 of another session's shell and writes commands into "
    "its command pipe ahead of the edge's: the other session's next result is what it chose "
    "(here exit code 0 through a shadowed printf). Closing it takes session shells whose fds "
    "the sandbox cannot open (non-dumpable, or a user of their own)",
)
async def test_a_process_cannot_write_into_another_sessions_command_pipe(sandbox: Sandbox) -> None:
    assert (await sandbox.run_shell("true", session="grader", timeout=60)).exit_code == 0
    # Two lines of framing around the function, then the end nonce: what the edge writes.
    payload = base64.b64encode(f"x\n{ZERO_PRINTF}\nx\ny\n".encode()).decode()
    inject = (
        "for p in /proc/[0-9]*; do "
        '  [ "${p#/proc/}" != "$$" ] && grep -qa __dsec_n "$p/cmdline" 2>/dev/null && other=${p#/proc/}; '
        "done; "
        f"echo {payload} | base64 -d > /proc/$other/fd/0 && echo injected"
    )
    r = await sandbox.run_shell(inject, session="agent", timeout=60)
    assert r.stdout == "injected\n", r
    r = await sandbox.run_shell("echo grading; (exit 3)", session="grader", timeout=60)
    assert (r.exit_code, r.stdout) == (3, "grading\n"), r


@pytest.mark.parametrize("backend", OTHER_BACKENDS)
@pytest.mark.xfail(
    strict=True,
    reason="GAP: a session shell under gVisor or in a microVM is not a process the edge sees in "
    "the host's /proc (the sentry's, the guest's), so only the end marker's secret nonce ends "
    "a command there: one that reads the nonce off its shell's command pipe ends its result "
    "early with an exit code it chose, and what it prints afterwards is the next command's "
    "(crun sandboxes: tests/security/test_session_end.py)",
)
async def test_a_command_that_reads_its_end_nonce_cannot_end_early_on_other_backends(
    make_sandbox: Sandboxes, backend: str
) -> None:
    sandbox = await on_backend(make_sandbox, backend)
    first = await sandbox.run_shell(f"{PEEKERS['shell']}; echo after; (exit 3)", session="s", timeout=60)
    assert first.exit_code == 3 and first.stdout.endswith("smuggled\nafter\n"), first
    second = await sandbox.run_shell("echo harness", session="s", timeout=60)
    assert second.stdout == "harness\n", second
