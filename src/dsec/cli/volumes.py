"""``dsec volume ...``: shared volumes, a project's files kept across sandboxes (README)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from dsec.cli._common import _client_call, console

volume_app = typer.Typer(
    help="Shared volumes: a project's files, kept across sandboxes.", no_args_is_help=True
)


@volume_app.command("create")
def volume_create(
    name: str,
    size_mb: Annotated[int, typer.Option(help="the most it holds, MiB")] = 10240,
    project: Annotated[str | None, typer.Option(help="default: the key's")] = None,
) -> None:
    """Make volume NAME on the node placement picks; prints its ID."""
    print(_client_call(lambda c: c.create_volume(name, size_mb=size_mb, project=project)).id)


@volume_app.command("ls")
def volume_ls() -> None:
    """The volumes the key sees, on every node."""
    table = Table("name", "project", "MiB used / size", "created")
    table.add_column("volume id", no_wrap=True, min_width=30)  # IDs are copied from here: never fold one
    for v in _client_call(lambda c: c.list_volumes()):
        made = time.strftime("%Y-%m-%d %H:%M", time.localtime(v.created_at))
        used = "?" if v.used_bytes is None else str(v.used_bytes >> 20)
        table.add_row(v.name, v.project, f"{used} / {v.size_mb}", made, v.id)
    console.print(table)


@volume_app.command("rm")
def volume_rm(volume_id: str) -> None:
    """Delete a volume and its files (refused while a sandbox mounts it)."""
    _client_call(lambda c: c.delete_volume(volume_id))
    console.print(f"deleted {volume_id}")


@volume_app.command("put")
def volume_put(volume_id: str, local: Path, path: str) -> None:
    """Write LOCAL's content to PATH in the volume (replaced whole; parents made)."""
    data = local.read_bytes()
    entry = _client_call(lambda c: c.write_volume_file(volume_id, path, data))
    console.print(f"{entry.path}: {entry.size} bytes")


@volume_app.command("cat")
def volume_cat(volume_id: str, path: str) -> None:
    """Print a file of the volume (its bytes, as they are)."""
    sys.stdout.buffer.write(_client_call(lambda c: c.read_volume_file(volume_id, path)))
