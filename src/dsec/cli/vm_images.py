"""``dsec vm-image ...``: users' own bootable disk images for full VMs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from dsec.cli._common import _client_call, console, err_console

vm_image_app = typer.Typer(help="Bootable disk images (qcow2 or raw) for full VMs.", no_args_is_help=True)


@vm_image_app.command("import")
def vm_image_import(
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="a qcow2 or raw disk image")],
    ref: Annotated[str, typer.Option("--ref", help="name:version of the image")],
) -> None:
    """Import a bootable disk image; VMs boot it with DSecVMRunArgs(disk_image=REF)."""
    with err_console.status(f"importing {path} as {ref} (upload, check, convert to qcow2)"):
        info = _client_call(lambda c: c.import_vm_image(path, ref))
    console.print_json(json.dumps(info.model_dump(mode="json")))


@vm_image_app.command("ls")
def vm_image_ls() -> None:
    """List the imported VM images."""
    images = _client_call(lambda c: c.vm_images())
    table = Table("ref", "digest", "stored", "disk", "created")
    for i in images:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(i.created_at))
        table.add_row(i.ref, i.digest[:19], f"{i.size / 1e6:.1f} MB", f"{i.virtual_size >> 20} MiB", created)
    console.print(table)
