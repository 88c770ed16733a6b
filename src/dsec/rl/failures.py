"""Whose fault was it? Classify what a trainer sees, so infrastructure noise is masked out of
rewards instead of being learned from.

``infra``: the platform failed the episode (an edge died or restarted, a node was full, a
sandbox was lost, a step's outcome is unknown). Mask the episode, or retry it.
``agent``: the agent's own actions caused it (its command failed, ran out of time or memory,
produced too much output). This is signal: keep it in the reward.
``caller``: the trainer itself is wrong (bad arguments, a key without access). Fix the trainer.

Work the platform cut short raises ``InfraFailure`` with a reason from
:class:`dsec.protocol.errors.InfraReason` (``stopped``, ``reclaimed``, ``node_lost``,
``grading_sandbox_lost``): ``infra``. What the submission caused inside a grading run (a hang
past the timeout, an exit before the tests reported) is in the grade itself, scored as failed
tests: ``agent``.
"""

from __future__ import annotations

from typing import Literal

from dsec.protocol.errors import (
    CapacityExhausted,
    CommandTimeout,
    DSecError,
    InfraFailure,
    QuotaExceeded,
    SandboxNotFound,
)
from dsec.protocol.models import CommandResult

Fault = Literal["infra", "agent", "caller", "none"]


def fault_of(outcome: BaseException | CommandResult) -> Fault:
    """Classify an exception raised by a DSec call, or a command's result."""
    if isinstance(outcome, CommandResult):
        failed = outcome.exit_code != 0 or outcome.timed_out or outcome.oom_killed
        return "agent" if failed else "none"
    if isinstance(outcome, InfraFailure | CapacityExhausted | QuotaExceeded):
        return "infra"  # the platform could not serve (quota: the trainer's budget, not the agent)
    if isinstance(outcome, SandboxNotFound):
        # Nothing inside a sandbox can end it: a sandbox gone mid-episode was lost by the
        # platform (a node re-registered, a lease ran out while the trainer was away).
        return "infra"
    if isinstance(outcome, CommandTimeout):
        return "agent"
    if isinstance(outcome, DSecError):
        return "caller"
    return "infra"  # not DSec's error tree: the network, the client process


def mask(outcome: BaseException | CommandResult) -> bool:
    """Whether an episode that ended this way should be left out of the rewards."""
    return fault_of(outcome) == "infra"
