"""``dsec layer ...`` (immutable EROFS layers: import, build, tag, gc) and ``dsec image ...``
(OCI images imported as ordered lists of layers)."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Column, Table

from dsec.cli._common import _client_call, _fail, console, err_console
from dsec.protocol.errors import DSecError
from dsec.sdk.client import DSecClient

layer_app = typer.Typer(help="Layers: immutable, content-addressed EROFS images.", no_args_is_help=True)
image_app = typer.Typer(help="Images: ordered lists of layers under one name:version.", no_args_is_help=True)


@layer_app.command("import")
def layer_import(
    path: Annotated[Path, typer.Argument(exists=True, help="a directory or a tar archive")],
    name: Annotated[str, typer.Option("--name", help="name:version of the new layer")],
) -> None:
    """Import a directory or tar archive as an immutable EROFS layer."""
    with err_console.status(f"importing {path} as {name} (pack, upload, mkfs.erofs)"):
        info = _client_call(lambda c: c.import_layer(path, name))
    console.print_json(json.dumps(info.model_dump(mode="json")))


@layer_app.command("workspace")
def layer_workspace(
    repo: Annotated[Path, typer.Argument(help="a local git repository (working tree or bare)")],
    base: Annotated[str, typer.Argument(help="the task's base commit (sha, branch or tag)")],
    name: Annotated[str, typer.Option("--name", help="name:version of the new layer")],
    subdir: Annotated[str, typer.Option(help="where the workspace sits in the sandbox")] = "workspace",
) -> None:
    """A task workspace layer: the repository at BASE, with no way back to later commits."""
    from dsec.rl.workspace import prepare_workspace

    with tempfile.TemporaryDirectory(prefix="dsec-workspace-") as tmp:
        try:
            prepare_workspace(repo, base, Path(tmp) / "layer", subdir=subdir)
        except DSecError as exc:
            raise _fail(exc) from None
        with err_console.status(f"importing the workspace as {name}"):
            info = _client_call(lambda c: c.import_layer(Path(tmp) / "layer", name))
    console.print_json(json.dumps(info.model_dump(mode="json")))


@layer_app.command("build")
def layer_build(
    context: Annotated[Path, typer.Argument(exists=True, file_okay=False, help="directory COPY reads from")],
    name: Annotated[str, typer.Option("--name", help="name:version of the new layer")],
    file: Annotated[Path | None, typer.Option("-f", "--file", help="default: CONTEXT/Dockerfile")] = None,
    exclude: Annotated[list[str] | None, typer.Option(help="more paths to scrub (glob per part)")] = None,
    verbose: Annotated[bool, typer.Option("-v", help="show the steps' output")] = False,
    network: Annotated[
        str,
        typer.Option(
            help="network permissions of the build, comma-separated (e.g. pypi,debian); pypi@2025-06-01:"
            " releases uploaded before that day only; none by default"
        ),
    ] = "",
) -> None:
    """Build a layer from a Dockerfile subset (FROM, RUN, COPY, ENV, WORKDIR)."""
    from dsec.sdk.build import BuildEvent

    dockerfile = file or context / "Dockerfile"

    def show(event: BuildEvent) -> None:
        if event.output:
            if verbose:
                sys.stdout.write(event.output.decode(errors="replace"))
            return
        where = (
            "set-up"
            if event.step == 0
            else "commit"
            if event.step > event.total
            else f"{event.step}/{event.total}"
        )
        console.print(f"[bold cyan]{escape(f'[{where}]')}[/bold cyan] {escape(event.description)}")

    from dsec.netpolicy.grants import parse

    rules = parse(network)
    info = _client_call(
        lambda c: c.build_layer(
            dockerfile, context, name, exclude=exclude, progress=show, network_rules=rules
        )
    )
    console.print_json(json.dumps(info.model_dump(mode="json")))


@layer_app.command("tag")
def layer_tag(
    target: Annotated[str, typer.Argument(help="a layer reference or digest")],
    ref: Annotated[str, typer.Argument(help="name:version to point at it")],
) -> None:
    """Point NAME:VERSION at a layer (the only way a tag ever moves)."""
    layers = _client_call(lambda c: c.retag(ref, target))
    console.print(f"{ref} -> {', '.join(x.digest[:19] for x in layers)}")


@layer_app.command("public")
def layer_public(ref: Annotated[str, typer.Argument(help="a layer or image reference")]) -> None:
    """Let every project use a layer or image (admin keys; otherwise only its owner's subtree)."""
    layers = _client_call(lambda c: c.mark_public(ref))
    console.print(f"{ref} is public: {', '.join(x.digest[:19] for x in layers)}")


@layer_app.command("rm")
def layer_rm(refs: list[str]) -> None:
    """Remove tags; the layers go at the next `dsec layer gc` if nothing else uses them."""

    async def untag_all(c: DSecClient) -> None:
        for ref in refs:
            await c.untag(ref)
            console.print(f"untagged {ref}")

    _client_call(untag_all)


@layer_app.command("gc")
def layer_gc(
    grace_s: Annotated[float | None, typer.Option(help="spare layers younger than this")] = None,
) -> None:
    """Delete stored layers that no tag names and no sandbox uses."""
    removed = _client_call(lambda c: c.gc_layers(grace_s=grace_s))
    console.print(f"removed {len(removed)} layer blobs")


@layer_app.command("verify")
def layer_verify(ref: str) -> None:
    """Re-hash a layer's stored bytes (refused with 'corrupt' if they changed)."""
    info = _client_call(lambda c: c.verify_layer(ref))
    console.print(f"{info.digest} ok ({info.size / 1e6:.1f} MB)")


@layer_app.command("ls")
def layer_ls() -> None:
    """List the layers of this DSec."""
    layers = _client_call(lambda c: c.layers())
    # Names never wrap (scripts grep them); the network column only when a layer was built with one.
    networked = any(layer.network for layer in layers)
    columns = ["network"] if networked else []
    table = Table("digest", "size", Column("names", no_wrap=True), "created", *columns)
    for layer in layers:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(layer.created_at))
        size = f"{layer.size / 1e6:.1f} MB"
        network = [", ".join(layer.network)] if networked else []
        table.add_row(layer.digest[:19], size, ", ".join(layer.names), created, *network)
    console.print(table)


@image_app.command("import")
def image_import(
    path: Annotated[Path, typer.Argument(exists=True, help="docker save tar, OCI layout dir or tarball")],
    name: Annotated[str, typer.Option("--name", help="name:version of the new image")],
    merge_below_mb: Annotated[float, typer.Option(help="merge consecutive layers smaller than this")] = 0,
    image: Annotated[str | None, typer.Option(help="which image, if the archive holds several")] = None,
) -> None:
    """Import an OCI image (no registry needed: `docker save` or `skopeo copy` output)."""
    from rich.progress import Progress

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("upload", total=None)

        def show(stage: str, done: int, total: int) -> None:
            bar.update(task, description=stage, completed=done, total=max(total, 1))

        layers = _client_call(
            lambda c: c.import_image(path, name, merge_below_mb=merge_below_mb, image=image, progress=show)
        )
    table = Table("#", "digest", "size")
    for i, layer in enumerate(layers, 1):
        table.add_row(str(i), layer.digest[:19], f"{layer.size / 1e6:.1f} MB")
    console.print(table)
    console.print(f"image {name}: {len(layers)} layers")
