"""RL co-design: a gym-style environment, clean-room grading, honest task workspaces, and
failure classification. Leases, pause/resume, trajectories, pack_diff and fork are calls of the
SDK itself (``DSecClient.renew_lease``, ``Sandbox.pause``, ``Sandbox.trajectory``...)."""

from dsec.rl.env import SUBMIT, SandboxEnv, Step, Task
from dsec.rl.failures import fault_of, mask
from dsec.rl.grading import GradeResult, grade
from dsec.rl.manifest import MANIFEST_PATH, Manifest
from dsec.rl.workspace import prepare_workspace

__all__ = [
    "MANIFEST_PATH",
    "SUBMIT",
    "GradeResult",
    "Manifest",
    "SandboxEnv",
    "Step",
    "Task",
    "fault_of",
    "grade",
    "mask",
    "prepare_workspace",
]
