"""``dsec sandbox ...`` (one sandbox, or all of a label) and ``dsec job ...`` (a trainer's job)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from typing import Annotated

import typer
from rich.table import Table

from dsec.cli._common import _client_call, _fail, console, err_console
from dsec.cli.terminal import attach, window_size
from dsec.protocol.errors import DSecError, InvalidRequest
from dsec.protocol.models import CommandResult, LeaseResult, SandboxInfo, TrajectoryEntry
from dsec.sdk.args import DSecContainerRunArgs
from dsec.sdk.client import DSecClient, Sandbox

sandbox_app = typer.Typer(help="Sandboxes on this DSec.", no_args_is_help=True)
job_app = typer.Typer(help="Jobs: every sandbox with label job=NAME, cluster-wide.", no_args_is_help=True)
Labels = Annotated[list[str] | None, typer.Option("--label", help="key=value (repeat)")]
Ids = Annotated[list[str] | None, typer.Argument(help="sandbox IDs (or give --label)")]


def _labels(items: list[str] | None) -> dict[str, str]:
    labels = dict(item.partition("=")[::2] for item in items or [])
    if any(not k or not v for k, v in labels.items()):
        raise _fail(InvalidRequest(f"labels are key=value, got {items}"))
    return labels


@sandbox_app.command("ls")
def sandbox_ls(label: Labels = None) -> None:
    """List running and paused sandboxes."""
    labels = _labels(label)
    sandboxes = _client_call(lambda c: c.list(labels))
    table = Table("state", "project", "labels")
    table.add_column("id", no_wrap=True, min_width=40)  # IDs are copied from here: never fold one
    for sb in sandboxes:
        shown = json.dumps(sb.info.labels) if sb.info.labels else ""
        table.add_row(sb.info.state.value, sb.info.project, shown, sb.id)
    console.print(table)


@sandbox_app.command("create")
def sandbox_create(
    image: Annotated[str, typer.Argument(help="layer name:version or digest")],
    memory_mb: int = 1024,
    cpus: float = 1.0,
    ttl: Annotated[float | None, typer.Option(help="idle seconds before reclaim")] = None,
    shell: Annotated[
        bool, typer.Option("--shell", help="then open a shell in it; stopped when the shell ends")
    ] = False,
    keep: Annotated[bool, typer.Option("--keep", help="with --shell: leave it running after")] = False,
) -> None:
    """Create a container sandbox and print its ID (with --shell: on stderr, then a shell)."""
    args = DSecContainerRunArgs(
        container_image=image, memory_limit_mb=memory_mb, cpu_cores_limit=cpus, ttl_running_stop=ttl
    )
    if not shell:
        console.print(_client_call(lambda c: c.run_container(args)).id)
        return

    async def make_and_enter(c: DSecClient) -> int:
        sb = await c.run_container(args)
        err_console.print(f"sandbox {sb.id}" + (" (kept after the shell)" if keep else ""))
        try:
            return await _shell(sb, None)
        finally:
            if not keep:
                await asyncio.shield(sb.stop())

    raise typer.Exit(code=_client_call(make_and_enter))


async def _shell(sb: Sandbox, argv: list[str] | None) -> int:
    rows, cols = window_size(sys.stdout.fileno())
    env = {"TERM": os.environ["TERM"]} if os.environ.get("TERM") else {}
    async with await sb.open_pty(argv, rows=rows, cols=cols, env=env) as pty:
        code = await attach(pty, sys.stdin.fileno(), sys.stdout.fileno())
    if pty.error:
        err_console.print(f"[red]the shell ended:[/red] {pty.error}")
    return code


@sandbox_app.command("shell")
def sandbox_shell(
    sandbox_id: str,
    command: Annotated[
        list[str] | None, typer.Argument(help="program and arguments (default: a login shell)")
    ] = None,
) -> None:
    """An interactive terminal in a sandbox; exits with the shell's exit code (^D ends it)."""

    async def run(c: DSecClient) -> int:
        return await _shell(await c.get(sandbox_id), command or None)

    raise typer.Exit(code=_client_call(run))


@sandbox_app.command("sh")
def sandbox_sh(sandbox_id: str, command: str, session: str = "default") -> None:
    """Run a shell command in a sandbox and print its output."""

    async def run(c: DSecClient) -> CommandResult:
        sb = await c.get(sandbox_id)
        return await sb.run_shell(command, session=session)

    result = _client_call(run)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    raise typer.Exit(code=result.exit_code if result.exit_code is not None else 124)


@sandbox_app.command("stop")
def sandbox_stop(
    sandbox_ids: Annotated[list[str] | None, typer.Argument()] = None,
    label: Annotated[
        list[str] | None, typer.Option(help="stop every sandbox with these key=value labels")
    ] = None,
) -> None:
    """Stop sandboxes by ID, or all of a job by label (their files and processes are gone)."""
    if label:
        labels = _labels(label)
        stopped = _client_call(lambda c: c.stop_all(labels))
        console.print(f"stopped {len(stopped)} sandboxes")
        return

    async def run(c: DSecClient) -> None:
        for sid in sandbox_ids or []:
            sb = await c.get(sid)
            with contextlib.suppress(DSecError):
                await sb.stop()
        return None

    _client_call(run)


def _pause_or_resume(action: str, sandbox_ids: list[str] | None, label: list[str] | None) -> None:
    async def run(c: DSecClient) -> list[SandboxInfo]:
        if label:
            return await (c.pause_all if action == "pause" else c.resume_all)(_labels(label))
        out = []
        for sid in sandbox_ids or []:
            sb = await c.get(sid)
            out.append(await (sb.pause() if action == "pause" else sb.resume()))
        return out

    for info in _client_call(run):
        console.print(f"{info.id} {info.state.value}")


@sandbox_app.command("pause")
def sandbox_pause(sandbox_ids: Ids = None, label: Labels = None) -> None:
    """Pause sandboxes (frozen, memory pushed out of RAM); any later request resumes one."""
    _pause_or_resume("pause", sandbox_ids, label)


@sandbox_app.command("resume")
def sandbox_resume(sandbox_ids: Ids = None, label: Labels = None) -> None:
    """Resume paused sandboxes now (memory prefetched, then thawed)."""
    _pause_or_resume("resume", sandbox_ids, label)


@sandbox_app.command("log")
def sandbox_log(
    sandbox_id: str, after: int = 0, as_json: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """What the sandbox was asked to do and what came of it (its trajectory, oldest first)."""

    async def run(c: DSecClient) -> list[TrajectoryEntry]:
        return await (await c.get(sandbox_id)).trajectory(after=after)

    entries = _client_call(run)
    if as_json:
        for e in entries:
            print(e.model_dump_json())
        return
    table = Table("seq", "kind", "status", "key", "request")
    for e in entries:
        table.add_row(str(e.seq), e.kind, e.status, e.key or "", json.dumps(e.request)[:80])
    console.print(table)


@job_app.command("renew")
def job_renew(job: str, lease: Annotated[float, typer.Option(help="seconds from now")] = 600) -> None:
    """Renew a job's lease on every node (sandboxes created with lease_s and label job=JOB)."""
    result: LeaseResult = _client_call(lambda c: c.renew_lease(job, lease))
    console.print(f"job {job}: {result.sandboxes} sandboxes leased for {lease:g} s more")


@job_app.command("pause")
def job_pause(job: str) -> None:
    """Pause every sandbox of the job (a preempted trainer); each resumes on its next request."""
    console.print(f"paused {len(_client_call(lambda c: c.pause_all({'job': job})))} sandboxes")


@job_app.command("resume")
def job_resume(job: str) -> None:
    console.print(f"resumed {len(_client_call(lambda c: c.resume_all({'job': job})))} sandboxes")


@job_app.command("stop")
def job_stop(job: str) -> None:
    """Stop every sandbox of the job."""
    console.print(f"stopped {len(_client_call(lambda c: c.stop_all({'job': job})))} sandboxes")
