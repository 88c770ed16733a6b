"""`build_layer`: run a Dockerfile subset in a build sandbox and commit what it changed.

The driver lives in the SDK and uses only public sandbox calls (exec, upload, commit), so a
build is exactly as isolated as any sandbox, and its progress streams to the caller step by
step.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import shlex
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dsec.images.dockerfile import BuildPlan, Step, parse, resolve_workdir
from dsec.protocol.errors import BuildFailed, InvalidRequest
from dsec.protocol.models import CommandResult, LayerInfo, NetworkRules
from dsec.sdk.args import DSecContainerRunArgs

if TYPE_CHECKING:
    from dsec.sdk.client import DSecClient, Sandbox


@dataclass(frozen=True)
class BuildEvent:
    """Progress of a build: a step starting (``output`` empty) or output of the running step."""

    step: int  # 1-based; 0 for set-up, total + 1 for the commit
    total: int
    description: str
    output: bytes = b""


def _context_paths(context: Path, sources: tuple[str, ...], line: int) -> list[Path]:
    root = context.resolve()
    out = []
    for src in sources:
        rel = src.lstrip("/")
        matches = sorted(root.glob(rel)) if any(c in src for c in "*?[") else [root / rel]
        if not matches:
            raise InvalidRequest(f"Dockerfile line {line}: COPY source {src!r} matches nothing in {context}")
        for path in matches:
            real = path.resolve()
            if real != root and root not in real.parents:
                raise InvalidRequest(f"Dockerfile line {line}: COPY source {src!r} is outside the context")
            if not path.exists():
                raise InvalidRequest(
                    f"Dockerfile line {line}: COPY source {src!r} does not exist in {context}"
                )
            out.append(path)
    return out


def _pack(paths: list[Path], into_dir: bool, dest_name: str, archive: Path) -> None:
    with tarfile.open(archive, "w") as tar:
        for path in paths:
            if path.is_dir():
                for child in sorted(path.iterdir()):  # a directory's contents, as docker does
                    tar.add(child, arcname=child.name)
            else:
                tar.add(path, arcname=path.name if into_dir else dest_name)


class Builder:
    def __init__(
        self,
        client: DSecClient,
        plan: BuildPlan,
        context: Path,
        *,
        progress: Callable[[BuildEvent], None] | None,
        step_timeout: float,
    ) -> None:
        self.client, self.plan, self.context = client, plan, context
        self.progress = progress or (lambda event: None)
        self.step_timeout = step_timeout
        self.env: dict[str, str] = {}
        self.workdir = "/"
        self.granted: NetworkRules = {}
        self.network_on = True

    async def run(self, ref: str, args: DSecContainerRunArgs, exclude: list[str]) -> LayerInfo:
        total = len(self.plan.steps)
        self.progress(BuildEvent(0, total, f"build sandbox on {' + '.join(self.plan.base)}"))
        self.granted = dict(args.network_rules)
        sandbox = await self.client.run_container(
            args.model_copy(update={"layers": self.plan.base, "container_image": None})
        )
        self.network_on = True
        try:
            for number, step in enumerate(self.plan.steps, 1):
                self.progress(BuildEvent(number, total, step.describe()))
                await self._step(sandbox, number, total, step)
            self.progress(BuildEvent(total + 1, total, f"commit {ref}"))
            return await sandbox.commit(ref, exclude=exclude)
        finally:
            await sandbox.stop()

    async def _step(self, sandbox: Sandbox, number: int, total: int, step: Step) -> None:
        if step.kind == "ENV":
            self.env.update(dict(pair.split("=", 1) for pair in step.args))
        elif step.kind == "WORKDIR":
            self.workdir = resolve_workdir(self.workdir, step.args[0])
            await sandbox.mkdir(self.workdir)
        elif step.kind == "RUN":
            await self._network(sandbox, on=step.network == "default")
            await self._run(sandbox, number, total, step, ["/bin/sh", "-c", step.args[0]])
        else:
            await self._copy(sandbox, number, total, step)

    async def _network(self, sandbox: Sandbox, *, on: bool) -> None:
        """The build's grants for this step, or none (``RUN --network=none``): changed live, and
        only when a step needs it otherwise than the one before."""
        if on == self.network_on or not any(self.granted.values()):
            return
        await sandbox.set_network_rules(self.granted if on else dict.fromkeys(self.granted, False))
        self.network_on = on

    async def _run(self, sandbox: Sandbox, number: int, total: int, step: Step, argv: list[str]) -> None:
        tail = bytearray()
        result: CommandResult | None = None
        async for item in sandbox.exec_stream(
            argv, env=self.env, cwd=self.workdir, timeout=self.step_timeout
        ):
            if isinstance(item, CommandResult):
                result = item
            else:
                tail = (tail + item.data)[-4000:]
                self.progress(BuildEvent(number, total, step.describe(), item.data))
        assert result is not None
        if result.timed_out or result.exit_code != 0:
            why = "timed out" if result.timed_out else f"exited with {result.exit_code}"
            raise BuildFailed(
                f"Dockerfile line {step.line}: {step.describe()} {why}:\n{tail.decode(errors='replace')}"
            )

    async def _copy(self, sandbox: Sandbox, number: int, total: int, step: Step) -> None:
        *sources, dest = step.args
        paths = await asyncio.to_thread(_context_paths, self.context, tuple(sources), step.line)
        into_dir = dest.endswith("/") or len(paths) > 1 or any(p.is_dir() for p in paths)
        target = resolve_workdir(self.workdir, dest)
        target_dir = target if into_dir else posixpath.dirname(target)
        with tempfile.TemporaryDirectory() as tmp:
            archive = Path(tmp) / "copy.tar"
            await asyncio.to_thread(_pack, paths, into_dir, posixpath.basename(target), archive)
            staged = f"/tmp/.dsec-copy-{os.getpid()}-{number}.tar"
            await sandbox.upload(archive, staged, mode=0o600)
        await sandbox.mkdir(target_dir)
        q = shlex.quote
        untar = f"tar --no-same-owner -xf {q(staged)} -C {q(target_dir)}; rc=$?; rm -f {q(staged)}; exit $rc"
        await self._run(sandbox, number, total, step, ["/bin/sh", "-c", untar])


async def build_layer(
    client: DSecClient,
    dockerfile: str,
    context: Path,
    ref: str,
    *,
    base: list[str] | None,
    exclude: list[str] | None,
    args: DSecContainerRunArgs,
    progress: Callable[[BuildEvent], None] | None,
    step_timeout: float,
) -> LayerInfo:
    plan = parse(dockerfile, base=base)
    return await Builder(client, plan, context, progress=progress, step_timeout=step_timeout).run(
        ref, args, exclude or []
    )
