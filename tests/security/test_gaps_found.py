"""Attacks that SUCCEED today: gaps in isolation found by the escape suite, kept as tests.

Each test asserts what should happen and is marked ``xfail(strict=True)`` with what happens
instead: the suite stays green while the gap is open, and turns red (XPASS) the moment a fix
lands, so whoever fixes it removes the marker and the test joins the suite for good.
"""

from __future__ import annotations

import pytest

from dsec import Sandbox


@pytest.mark.xfail(
    strict=True,
    reason="GAP: a session command can read its end-marker nonce ($__dsec_n, a variable of the "
    "shell that evals it) and print the marker itself: its recorded result ends early with the "
    "exit code it chose (0 for a command that exits 3); what it prints afterwards is dropped or "
    "lands in the NEXT command's result, and so does its real end marker",
)
async def test_a_command_cannot_forge_its_own_end_marker(sandbox: Sandbox) -> None:
    forge = (
        "printf '\\0%s:0\\0' \"$__dsec_n\"; printf '\\0%s\\0' \"$__dsec_n\" >&2; "
        "echo smuggled; echo smuggled-err >&2; (exit 3)"
    )
    first = await sandbox.run_shell(forge, session="s", timeout=60)
    second = await sandbox.run_shell("echo harness", session="s", timeout=60)
    # What the edge recorded must be what happened: exit 3 and "smuggled" for the first
    # command, exactly "harness" for the second.
    recorded = [e.result for e in (await sandbox.trajectory())[-2:]]
    assert (first.exit_code, second.stdout) == (3, "harness\n"), (first, second, recorded)
    assert "smuggled" in first.stdout, (first, second)
