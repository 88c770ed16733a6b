"""The ``dsec`` command."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import typer
from rich.markup import escape
from rich.table import Table

from dsec.apiserver.embedded import NodeConfig
from dsec.cli._common import _client_call, _fail, console, err_console
from dsec.cli._node_options import (
    AccelOption,
    AdmissionOption,
    AgentChannelOption,
    EgressOption,
    MicroVMOption,
    SwapOption,
    VMOption,
    _admission,
    _egress,
    _swap,
)
from dsec.cli.sandbox import job_app, sandbox_app
from dsec.cli.vm_images import vm_image_app
from dsec.images.store import LayerStore
from dsec.protocol.errors import DSecError, InvalidRequest
from dsec.sdk.client import DSecClient

T = TypeVar("T")

app = typer.Typer(
    help="DSec: sandboxes for agentic RL.", no_args_is_help=True, pretty_exceptions_enable=False
)
layer_app = typer.Typer(help="Layers: immutable, content-addressed EROFS images.", no_args_is_help=True)
app.add_typer(layer_app, name="layer")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(job_app, name="job")
app.add_typer(vm_image_app, name="vm-image")
project_app = typer.Typer(
    help="Projects: nested, each with quotas bounding its subtree.", no_args_is_help=True
)
key_app = typer.Typer(
    help="API keys: each belongs to a project and sees only its subtree.", no_args_is_help=True
)
app.add_typer(project_app, name="project")
app.add_typer(key_app, name="key")
image_app = typer.Typer(help="Images: ordered lists of layers under one name:version.", no_args_is_help=True)
app.add_typer(image_app, name="image")
node_app = typer.Typer(help="Nodes: the edges of this DSec (admin keys).", no_args_is_help=True)
app.add_typer(node_app, name="node")

PoolSize = Annotated[int, typer.Option(min=0, help="warm sandboxes of the default FnCall pool (0: none)")]
PoolsFile = Annotated[
    Path | None, typer.Option(help="JSON list of FnCall pools (name, image, size, languages, preload...)")
]
E2BTemplate = Annotated[
    str,
    typer.Option(envvar="DSEC_E2B_TEMPLATE", help="the layers E2B's default template ('base') means"),
]
DataDir = Annotated[
    Path, typer.Option("--data-dir", envvar="DSEC_DATA_DIR", help="all node state lives here")
]


@app.command()
def up(
    data_dir: DataDir = Path("/var/lib/dsec"),
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8642,
    node: Annotated[str, typer.Option(help="this node's name (part of every sandbox ID)")] = "local",
    base: Annotated[bool, typer.Option(help="build the default base layer first if missing")] = True,
    layer_dir: Annotated[
        Path | None, typer.Option(help="local layer store (default <data-dir>/layers)")
    ] = None,
    shared_layers: Annotated[
        Path | None, typer.Option(help="layer store on a shared filesystem mounted on every node")
    ] = None,
    init_shared: Annotated[bool, typer.Option(help="make --shared-layers a new, empty store")] = False,
    iam: Annotated[
        str | None,
        typer.Option(envvar="DSEC_IAM_URL", help="postgresql://... (default: <data-dir>/iam.sqlite)"),
    ] = None,
    fncall_pool_size: PoolSize = 2,
    fncall_pools: PoolsFile = None,
    swap: SwapOption = "file:4096",
    egress: EgressOption = None,
    admission: AdmissionOption = "",
    microvm: MicroVMOption = True,
    vm: VMOption = True,
    microvm_accel: AccelOption = None,
    agent_channel: AgentChannelOption = "auto",
    e2b_template: E2BTemplate = "debian:bookworm",
) -> None:
    """Run the embedded single-node DSec in the foreground (Ctrl-C stops serving;
    running sandboxes keep running and are re-adopted by the next `dsec up`)."""
    from dsec.apiserver.embedded import EmbeddedNode, open_layer_store

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    node_cfg = NodeConfig(
        data_dir=data_dir,
        host=host,
        port=port,
        node=node,
        layer_dir=layer_dir,
        shared_layer_dir=shared_layers,
        init_shared=init_shared,
        iam_url=iam,
        edge={
            "fncall_pools": _fncall_pools(fncall_pools, fncall_pool_size),
            "swap": _swap(swap),
            "egress": _egress(egress),
            **_admission(admission),
        },
        microvm=microvm,
        vm=vm,
        microvm_accel=microvm_accel,
        agent_channel=agent_channel,
        e2b_template=e2b_template,
    )
    if base:
        _ensure_base(open_layer_store(node_cfg))

    async def serve() -> None:
        emb = EmbeddedNode(node_cfg)
        await emb.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        from dsec.sdk.config import config_path

        console.print(f"[green]DSec is up[/green] at {emb.url} (node {node}, data in {data_dir})")
        console.print(f"  config for the SDK and CLI: {node_cfg.config_file or config_path()}")
        console.print("  connect:  python -c 'from dsec import DSec; print(DSec().list())'")
        console.print(f"  or set DSEC_URL={emb.url} DSEC_API_KEY=<the key in that file>")
        await stop.wait()
        console.print("stopping (sandboxes keep running; `dsec up` again re-adopts them)")
        await emb.close()

    try:
        asyncio.run(serve())
    except DSecError as exc:
        raise _fail(exc) from None


SecretFile = Annotated[Path | None, typer.Option(help="cluster secret file (else $DSEC_CLUSTER_SECRET)")]


async def _serve_until_signalled(started: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    console.print(started)
    await stop.wait()


@app.command("edge")
def edge_cmd(
    node: Annotated[str, typer.Option(help="this node's name (part of every sandbox ID)")],
    apiserver: Annotated[
        list[str], typer.Option(help="an apiserver URL to register through (repeat: any one will do)")
    ],
    data_dir: DataDir = Path("/var/lib/dsec"),
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8643,
    advertise_url: Annotated[
        str | None, typer.Option(help="URL apiservers reach this edge on (default: http://HOST:PORT)")
    ] = None,
    shared_layers: Annotated[Path | None, typer.Option(help="the cluster's shared layer store")] = None,
    heartbeat: Annotated[float, typer.Option(help="seconds between re-registrations")] = 5.0,
    label: Annotated[
        list[str] | None, typer.Option(help="key=value: a node label sandboxes can ask for (repeat)")
    ] = None,
    fncall_pool_size: PoolSize = 0,
    fncall_pools: PoolsFile = None,
    swap: SwapOption = "file:4096",
    egress: EgressOption = None,
    admission: AdmissionOption = "",
    microvm: MicroVMOption = True,
    vm: VMOption = True,
    microvm_accel: AccelOption = None,
    agent_channel: AgentChannelOption = "auto",
    secret_file: SecretFile = None,
) -> None:
    """Run one node's edge: it registers with the cluster through an apiserver and serves it."""
    from dsec.apiserver.cluster import EdgeNode
    from dsec.edge.server import read_cluster_secret

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if host in ("0.0.0.0", "::") and advertise_url is None:
        raise _fail(InvalidRequest(f"--host {host} listens everywhere: give --advertise-url too"))
    labels = dict(item.partition("=")[::2] for item in label or [])
    if any(not k or not v for k, v in labels.items()):
        raise _fail(InvalidRequest(f"--label takes key=value, got {label}"))
    cfg = NodeConfig(
        data_dir=data_dir,
        host=host,
        port=port,
        node=node,
        shared_layer_dir=shared_layers,
        edge={
            "node_labels": labels,
            "fncall_pools": _fncall_pools(fncall_pools, fncall_pool_size),
            "swap": _swap(swap),
            "egress": _egress(egress),
            **_admission(admission),
        },
        microvm=microvm,
        vm=vm,
        microvm_accel=microvm_accel,
        agent_channel=agent_channel,
    )

    async def serve() -> None:
        edge = EdgeNode(
            cfg,
            read_cluster_secret(secret_file),
            apiserver,
            advertise_url=advertise_url,
            heartbeat_s=heartbeat,
        )
        url = await edge.start()
        await _serve_until_signalled(
            f"[green]edge {node} is up[/green] at {url} (epoch {edge.edge.epoch}, data in {data_dir})"
        )
        await edge.close()

    try:
        asyncio.run(serve())
    except DSecError as exc:
        raise _fail(exc) from None


@app.command("apiserver")
def apiserver_cmd(
    iam: Annotated[
        str, typer.Option(envvar="DSEC_IAM_URL", help="postgresql://... shared by all apiservers")
    ],
    shared_layers: Annotated[Path, typer.Option(help="the cluster's shared layer store")],
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8642,
    secret_file: SecretFile = None,
    scratch: Annotated[Path, typer.Option(help="local directory for imports and builds")] = Path(
        "/var/lib/dsec/apiserver-scratch"
    ),
    watch_interval: Annotated[
        float, typer.Option(help="seconds between reads of the registry and polls of the edges")
    ] = 1.0,
    placement_k: Annotated[int, typer.Option(min=1, help="power of k choices")] = 2,
    e2b_template: E2BTemplate = "debian:bookworm",
) -> None:
    """Run a stateless apiserver over the edges that register with the cluster (run several)."""
    from dsec.apiserver.cluster import ApiServerConfig, ClusterApiServer
    from dsec.edge.server import read_cluster_secret
    from dsec.images.blobstore import SharedMountBlobStore

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def serve() -> None:
        store = LayerStore.over(SharedMountBlobStore(shared_layers), scratch=scratch)
        cfg = ApiServerConfig(
            read_cluster_secret(secret_file),
            store,
            iam,
            host,
            port,
            watch_interval,
            placement_k,
            e2b_template,
        )
        server = ClusterApiServer(cfg)
        url = await server.start()
        await _serve_until_signalled(f"[green]apiserver is up[/green] at {url} ({len(server.links)} edges)")
        await server.close()

    try:
        asyncio.run(serve())
    except (DSecError, ValueError) as exc:
        raise _fail(exc if isinstance(exc, DSecError) else DSecError(str(exc))) from None


def _fncall_pools(path: Path | None, default_size: int) -> list[Any]:
    from dsec.backends.fncall.pool import PoolConfig, load_pools

    if path is None:
        return [PoolConfig(size=default_size)] if default_size else []
    try:
        return list(load_pools(path.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise _fail(InvalidRequest(f"--fncall-pools {path}: {exc}")) from None


def _ensure_base(store: LayerStore) -> None:
    from dsec.images.base import BASE_PACKAGES, TOOLCHAIN_PACKAGES, TOOLCHAIN_REF, ensure_base_layer

    for ref, packages in (("debian:bookworm", BASE_PACKAGES), (TOOLCHAIN_REF, TOOLCHAIN_PACKAGES)):
        started = time.monotonic()
        with console.status(f"base layer {ref} (debootstrap on first run, 1-2 min)"):
            info = ensure_base_layer(store, ref, progress=lambda msg: console.log(msg), packages=packages)
        console.print(f"base layer {ref} = {info.digest[:19]} ({time.monotonic() - started:.1f}s)")


@app.command("base")
def base_cmd(data_dir: DataDir = Path("/var/lib/dsec")) -> None:
    """Build the base layers (Debian bookworm, and with compilers for FnCall) if missing."""
    try:
        _ensure_base(LayerStore(data_dir / "layers"))
    except DSecError as exc:
        raise _fail(exc) from None


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

    info = _client_call(lambda c: c.build_layer(dockerfile, context, name, exclude=exclude, progress=show))
    console.print_json(json.dumps(info.model_dump(mode="json")))


QUOTA_KEYS = ("sandboxes", "cpu_cores", "memory_mib")
Sandboxes = Annotated[int | None, typer.Option(help="max concurrent sandboxes in the subtree")]
Cores = Annotated[float | None, typer.Option(help="max CPU cores in the subtree")]
Memory = Annotated[int | None, typer.Option(help="max memory (MiB) in the subtree")]


@project_app.command("create")
def project_create(
    parent: str, name: str, sandboxes: Sandboxes = None, cpus: Cores = None, memory_mib: Memory = None
) -> None:
    """Create PARENT/NAME (quotas may not exceed the parent's)."""
    info = _client_call(
        lambda c: c.create_project(parent, name, sandboxes=sandboxes, cpu_cores=cpus, memory_mib=memory_mib)
    )
    console.print(f"created {info['id']}")


@project_app.command("quota")
def project_quota(
    project: str, sandboxes: Sandboxes = None, cpus: Cores = None, memory_mib: Memory = None
) -> None:
    """Set a sub-project's quotas (a key can never raise its own)."""
    _client_call(lambda c: c.set_quota(project, sandboxes=sandboxes, cpu_cores=cpus, memory_mib=memory_mib))
    console.print(f"quota of {project} set")


@project_app.command("ls")
def project_ls(under: Annotated[str | None, typer.Argument()] = None) -> None:
    """Projects under UNDER (default: your key's), with quotas and usage."""
    projects = _client_call(lambda c: c.list_projects(under))
    table = Table("project", "sandboxes", "cpu cores", "memory MiB")
    for p in projects:
        cells = [f"{p['usage'][k]} / {'-' if p['quota'][k] is None else p['quota'][k]}" for k in QUOTA_KEYS]
        table.add_row(p["id"], *cells)
    console.print(table)


@key_app.command("issue")
def key_issue(project: str, admin: bool = False, name: str = "", e2b: bool = False) -> None:
    """Issue an API key for PROJECT (printed once: only its digest is kept); --e2b: an e2b_<hex>
    key for E2B's SDKs."""
    fmt: Literal["dsec", "e2b"] = "e2b" if e2b else "dsec"
    print(_client_call(lambda c: c.issue_key(project, admin=admin, name=name, format=fmt)))


@key_app.command("ls")
def key_ls(project: Annotated[str | None, typer.Argument()] = None) -> None:
    """Keys of PROJECT (their IDs, never the keys)."""
    keys = _client_call(lambda c: c.list_keys(project))
    table = Table("key id", "project", "admin", "name", "revoked")
    for k in keys:
        table.add_row(k["key_id"], k["project"], str(k["admin"]), k["name"], str(k["revoked"]))
    console.print(table)


@key_app.command("revoke")
def key_revoke(key_id: str) -> None:
    """Revoke a key by its ID."""
    revoked = _client_call(lambda c: c.revoke_key(key_id))
    console.print("revoked" if revoked else "no such key")


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


@layer_app.command("tag")
def layer_tag(
    target: Annotated[str, typer.Argument(help="a layer reference or digest")],
    ref: Annotated[str, typer.Argument(help="name:version to point at it")],
) -> None:
    """Point NAME:VERSION at a layer (the only way a tag ever moves)."""
    layers = _client_call(lambda c: c.retag(ref, target))
    console.print(f"{ref} -> {', '.join(x.digest[:19] for x in layers)}")


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
    table = Table("digest", "size", "names", "created")
    for layer in layers:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(layer.created_at))
        table.add_row(layer.digest[:19], f"{layer.size / 1e6:.1f} MB", ", ".join(layer.names), created)
    console.print(table)


@node_app.command("ls")
def node_ls() -> None:
    """List the registered nodes with their epoch, health and load."""
    nodes = _client_call(lambda c: c.nodes())
    table = Table("node", "epoch", "url", "healthy", "running", "capacity", "last seen")
    for n in nodes:
        seen = time.strftime("%H:%M:%S", time.localtime(n["last_seen"]))
        healthy = "yes" if n.get("healthy") else "[red]no[/red]"
        table.add_row(
            n["node"],
            str(n["epoch"]),
            n["url"],
            healthy,
            str(n.get("running", "-")),
            str(n.get("capacity", "-")),
            seen,
        )
    console.print(table)
