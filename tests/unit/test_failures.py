"""Fault classification: a trainer masks infra failures and learns from the agent's own."""

from __future__ import annotations

import pytest

from dsec.protocol.errors import (
    CapacityExhausted,
    CommandTimeout,
    Forbidden,
    InfraFailure,
    InvalidRequest,
    QuotaExceeded,
    SandboxNotFound,
    SessionLost,
)
from dsec.protocol.models import CommandResult
from dsec.rl.failures import fault_of, mask


@pytest.mark.parametrize(
    ("outcome", "fault"),
    [
        (InfraFailure("edge down", reason="edge_unreachable"), "infra"),
        (InfraFailure("unknown outcome", reason="interrupted"), "infra"),
        (SessionLost("shell died"), "infra"),
        (CapacityExhausted("full"), "infra"),
        (QuotaExceeded("budget"), "infra"),
        (SandboxNotFound("gone", reason="stale_epoch"), "infra"),
        (ConnectionResetError(), "infra"),
        (CommandTimeout("too slow"), "agent"),
        (InvalidRequest("bad"), "caller"),
        (Forbidden("no"), "caller"),
        (CommandResult(exit_code=1), "agent"),
        (CommandResult(exit_code=None, timed_out=True), "agent"),
        (CommandResult(exit_code=137, oom_killed=True), "agent"),
        (CommandResult(exit_code=0), "none"),
    ],
)
def test_fault_of(outcome: BaseException | CommandResult, fault: str) -> None:
    assert fault_of(outcome) == fault
    assert mask(outcome) == (fault == "infra")
