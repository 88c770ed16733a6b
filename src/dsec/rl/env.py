"""A gym-style environment over one DSec sandbox, built to survive its trainer.

``reset`` creates the episode's sandbox under the job's lease (labels ``job`` and
``episode``), or, if a sandbox of that episode still exists (the trainer was killed and
restarted), reattaches to it. ``step`` runs a shell command with the idempotency key
``<episode>:<step>``: a restarted policy that replays its actions from the start gets the
recorded results of the steps already taken, and no command runs twice. The special action
:data:`SUBMIT` ends the episode with a clean-room grade (:func:`dsec.rl.grading.grade`).

Everything is async; the tuple shapes follow Gymnasium (``reset -> (obs, info)``,
``step -> (obs, reward, terminated, truncated, info)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dsec.protocol.errors import InvalidRequest
from dsec.rl.grading import GradeResult, grade
from dsec.rl.manifest import MANIFEST_PATH
from dsec.sdk.args import DSecContainerRunArgs
from dsec.sdk.client import DSecClient, Sandbox

SUBMIT = "submit"


@dataclass(frozen=True)
class Task:
    """One task: the layers an agent starts from and the hidden tests that judge it."""

    task_id: str
    layers: list[str]  # base image first, then the workspace
    tests: list[str]  # the hidden-tests layer(s): never in the agent's sandbox
    workdir: str = "/workspace"
    prompt: str = ""
    manifest: str = MANIFEST_PATH  # in the hidden layer: expected test IDs and runner settings
    memory_limit_mb: int = 512
    strict: bool = True  # a submission reaching for the runner's internals scores 0


class Step(NamedTuple):
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


@dataclass
class SandboxEnv:
    client: DSecClient
    task: Task
    job: str
    episode: str
    lease_s: float | None = 600.0
    max_steps: int = 64
    step_timeout: float = 120.0
    sandbox: Sandbox | None = None
    steps: int = 0
    reattached: bool = False
    grade_result: GradeResult | None = None
    _labels: dict[str, str] = field(default_factory=dict)

    async def reset(self) -> tuple[str, dict[str, Any]]:
        self._labels = {"job": self.job, "episode": self.episode, "task": self.task.task_id[:200]}
        self.steps = 0
        self.grade_result = None
        existing = await self.client.list(labels={"job": self.job, "episode": self.episode})
        if existing:
            # The oldest is the episode's own; others with its labels are forks, left alone.
            self.sandbox = min(existing, key=lambda sb: sb.info.created_at)
            self.reattached = True
        else:
            self.sandbox = await self.client.run_container(
                DSecContainerRunArgs(
                    layers=self.task.layers,
                    labels=self._labels,
                    lease_s=self.lease_s,
                    memory_limit_mb=self.task.memory_limit_mb,
                )
            )
            self.reattached = False
        info = {"sandbox_id": self.sandbox.id, "reattached": self.reattached}
        return self.task.prompt, info

    async def step(self, action: str) -> Step:
        if self.sandbox is None:
            raise InvalidRequest("call reset() before step()")
        key = f"{self.episode}:{self.steps}"
        self.steps += 1
        if action == SUBMIT:
            self.grade_result = await grade(
                self.client,
                self.sandbox,
                tests=self.task.tests,
                task_layers=self.task.layers,
                workdir=self.task.workdir,
                manifest=self.task.manifest,
                strict=self.task.strict,
            )
            g = self.grade_result
            summary = f"{g.passed} passed, {g.failed} failed" + (" (tampered)" if g.tampered else "")
            summary += " (suspicious)" if g.suspicious else ""
            return Step(summary, g.reward, True, False, {"grade": g})
        result = await self.sandbox.run_shell(
            f"cd {self.task.workdir} && {action}", timeout=self.step_timeout, idempotency_key=key
        )
        observation = result.stdout + result.stderr + f"[exit {result.exit_code}]"
        truncated = self.steps >= self.max_steps
        return Step(observation, 0.0, False, truncated, {"result": result})

    async def close(self) -> None:
        if self.sandbox is not None:
            await self.sandbox.stop()
            self.sandbox = None
