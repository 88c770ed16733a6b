"""RL co-design: a gym-style environment, clean-room grading, honest task workspaces, and
failure classification. Leases, pause/resume, trajectories, pack_diff and fork are calls of the
SDK itself (``DSecClient.renew_lease``, ``Sandbox.pause``, ``Sandbox.trajectory``...)."""

from dsec.rl.env import SUBMIT, SandboxEnv, Step, Task
from dsec.rl.failures import fault_of, mask
from dsec.rl.grading import GradeResult, grade, parse_junit
from dsec.rl.workspace import prepare_workspace

__all__ = [
    "SUBMIT",
    "GradeResult",
    "SandboxEnv",
    "Step",
    "Task",
    "fault_of",
    "grade",
    "mask",
    "parse_junit",
    "prepare_workspace",
]
