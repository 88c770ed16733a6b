"""``dsec project ...``: nested projects, each with quotas bounding its subtree."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from dsec.cli._common import _client_call, console

project_app = typer.Typer(
    help="Projects: nested, each with quotas bounding its subtree.", no_args_is_help=True
)

QUOTA_KEYS = ("sandboxes", "cpu_cores", "memory_mib")
Sandboxes = Annotated[int | None, typer.Option(help="max concurrent sandboxes in the subtree")]
Cores = Annotated[float | None, typer.Option(help="max CPU cores in the subtree")]
Memory = Annotated[int | None, typer.Option(help="max memory (MiB) in the subtree")]
Storage = Annotated[int | None, typer.Option(help="max bytes of layers (MiB) the subtree owns")]
_MIB = 1 << 20


@project_app.command("create")
def project_create(
    parent: str,
    name: str,
    sandboxes: Sandboxes = None,
    cpus: Cores = None,
    memory_mib: Memory = None,
    storage_mib: Storage = None,
) -> None:
    """Create PARENT/NAME (quotas may not exceed the parent's)."""
    info = _client_call(
        lambda c: c.create_project(
            parent, name, sandboxes=sandboxes, cpu_cores=cpus, memory_mib=memory_mib, storage_mib=storage_mib
        )
    )
    console.print(f"created {info['id']}")


@project_app.command("quota")
def project_quota(
    project: str,
    sandboxes: Sandboxes = None,
    cpus: Cores = None,
    memory_mib: Memory = None,
    storage_mib: Storage = None,
) -> None:
    """Set a sub-project's quotas (a key can never raise its own)."""
    _client_call(
        lambda c: c.set_quota(
            project, sandboxes=sandboxes, cpu_cores=cpus, memory_mib=memory_mib, storage_mib=storage_mib
        )
    )
    console.print(f"quota of {project} set")


@project_app.command("ls")
def project_ls(under: Annotated[str | None, typer.Argument()] = None) -> None:
    """Projects under UNDER (default: your key's), with quotas and usage."""
    projects = _client_call(lambda c: c.list_projects(under))
    table = Table("project", "sandboxes", "cpu cores", "memory MiB", "layers MiB")
    for p in projects:
        cells = [f"{p['usage'][k]} / {'-' if p['quota'][k] is None else p['quota'][k]}" for k in QUOTA_KEYS]
        stored, cap = p["usage"].get("storage_bytes") or 0, p["quota"].get("storage_mib")
        cells.append(f"{stored / _MIB:.1f} / {'-' if cap is None else cap}")
        table.add_row(p["id"], *cells)
    console.print(table)
