"""The ``dsec`` command: its subcommand groups (one module each), and the commands that run
DSec itself (``up``, ``edge``, ``apiserver``, ``base``) and list its nodes."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from dsec.cli._common import _client_call, _fail, console
from dsec.cli._node_options import (
    DEFAULT_DISK_LIMIT_MB,
    AccelOption,
    AdmissionOption,
    AgentChannelOption,
    DefaultDiskOption,
    EgressOption,
    KsmOption,
    LayerLimitsOption,
    LogFormatOption,
    LogLevelOption,
    MicroVMOption,
    SwapOption,
    VMOption,
    _admission,
    _egress,
    _layer_limits,
    _logs,
    _swap,
)
from dsec.cli.down import down
from dsec.cli.keys import key_app
from dsec.cli.layers import image_app, layer_app
from dsec.cli.projects import project_app
from dsec.cli.sandbox import job_app, sandbox_app
from dsec.cli.vm_images import vm_image_app
from dsec.cli.volumes import volume_app
from dsec.images.store import LayerStore
from dsec.node.embedded import NodeConfig
from dsec.protocol.errors import DSecError, InvalidRequest

app = typer.Typer(
    help="DSec: sandboxes for agentic RL.", no_args_is_help=True, pretty_exceptions_enable=False
)
app.add_typer(layer_app, name="layer")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(job_app, name="job")
app.add_typer(vm_image_app, name="vm-image")
app.add_typer(project_app, name="project")
app.add_typer(key_app, name="key")
app.add_typer(image_app, name="image")
app.add_typer(volume_app, name="volume")
app.command("down")(down)  # cli/down.py
node_app = typer.Typer(help="Nodes: the edges of this DSec (admin keys).", no_args_is_help=True)
app.add_typer(node_app, name="node")

PoolSize = Annotated[int, typer.Option(min=0, help="warm sandboxes of the default FnCall pool (0: none)")]
PoolsFile = Annotated[
    Path | None, typer.Option(help="JSON list of FnCall pools (name, image, size, languages, preload...)")
]
E2BTemplate = Annotated[
    str,
    typer.Option(
        envvar="DSEC_E2B_TEMPLATE",
        help="the layers E2B's default template ('base') means (e2b:base: debian:bookworm until built)",
    ),
]
E2BDomain = Annotated[
    str | None,
    typer.Option(
        envvar="DSEC_E2B_DOMAIN",
        help="E2B sandbox hosts are PORT-ID.<this domain> (a wildcard DNS record to the apiserver):"
        " what get_host(port) returns; without it, ports are reached by E2b-Sandbox-Id/-Port headers",
    ),
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
    ksm: KsmOption = True,
    egress: EgressOption = None,
    admission: AdmissionOption = "",
    default_disk_limit_mb: DefaultDiskOption = DEFAULT_DISK_LIMIT_MB,
    layer_limits: LayerLimitsOption = "",
    microvm: MicroVMOption = True,
    vm: VMOption = True,
    microvm_accel: AccelOption = None,
    agent_channel: AgentChannelOption = "auto",
    e2b_template: E2BTemplate = "e2b:base",
    e2b_domain: E2BDomain = None,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "json",
    audit_log: Annotated[
        Path | None, typer.Option(help="admin actions, one JSON line each (default <data-dir>/audit.log)")
    ] = None,
) -> None:
    """Run the embedded single-node DSec in the foreground (Ctrl-C stops serving;
    running sandboxes keep running and are re-adopted by the next `dsec up`)."""
    from dsec.node.embedded import EmbeddedNode, open_layer_store

    _logs(log_level, log_format)
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
            "ksm": ksm,
            "egress": _egress(egress),
            "default_disk_limit_mb": default_disk_limit_mb or None,
            **_admission(admission),
        },
        microvm=microvm,
        vm=vm,
        microvm_accel=microvm_accel,
        agent_channel=agent_channel,
        e2b_template=e2b_template,
        e2b_domain=e2b_domain,
        layer_limits=_layer_limits(layer_limits),
        audit_log=audit_log,
    )
    if base:
        _ensure_base(open_layer_store(node_cfg))

    async def serve() -> None:
        from dsec.sdk.config import config_path

        emb = EmbeddedNode(node_cfg)

        def up() -> str:
            return (
                f"[green]DSec is up[/green] at {emb.url} (node {node}, data in {data_dir})\n"
                f"  config for the SDK and CLI: {node_cfg.config_file or config_path()}\n"
                "  connect:  python -c 'from dsec import DSec; print(DSec().list())'\n"
                f"  or set DSEC_URL={emb.url} DSEC_API_KEY=<the key in that file>"
            )

        if await _serve_until_signalled(emb.start(), up):
            console.print("stopping (sandboxes keep running; `dsec up` again re-adopts them)")
            await emb.close()

    try:
        asyncio.run(serve())
    except DSecError as exc:
        raise _fail(exc) from None


SecretFile = Annotated[Path | None, typer.Option(help="cluster secret file (else $DSEC_CLUSTER_SECRET)")]


async def _serve_until_signalled(start: Awaitable[object], banner: Callable[[], str]) -> bool:
    """Start, print ``banner()`` and serve until SIGINT or SIGTERM; False if the signal came
    while starting. The signals are caught from before the start: a node stopped while it
    starts (a scaler that gives up on it, Ctrl-C) has its start cancelled, and the start gives
    back what it had taken, where the default action killed it with its LXCFS and mounts left."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.ensure_future(start)
    signalled = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([starting, signalled], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            console.print("stopped while starting: what it had taken is given back")
            return False
        starting.result()  # a start that failed raises here (it has closed what it started)
        console.print(banner())
        await signalled
        return True
    finally:
        starting.cancel()
        signalled.cancel()


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
    ksm: KsmOption = True,
    egress: EgressOption = None,
    admission: AdmissionOption = "",
    default_disk_limit_mb: DefaultDiskOption = DEFAULT_DISK_LIMIT_MB,
    microvm: MicroVMOption = True,
    vm: VMOption = True,
    microvm_accel: AccelOption = None,
    agent_channel: AgentChannelOption = "auto",
    secret_file: SecretFile = None,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "json",
) -> None:
    """Run one node's edge: it registers with the cluster through an apiserver and serves it."""
    from dsec.edge.server import read_cluster_secret
    from dsec.node.cluster import EdgeNode

    _logs(log_level, log_format)
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
            "ksm": ksm,
            "egress": _egress(egress),
            "default_disk_limit_mb": default_disk_limit_mb or None,
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

        def up() -> str:
            epoch = edge.edge.epoch
            return f"[green]edge {node} is up[/green] at {edge.url} (epoch {epoch}, data in {data_dir})"

        if await _serve_until_signalled(edge.start(), up):
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
    e2b_template: E2BTemplate = "e2b:base",
    node_lost_after: Annotated[
        float,
        typer.Option(
            min=1.0,
            max=86_400.0,
            help="seconds without a heartbeat after which a node is lost: work on its sandboxes"
            " answers InfraFailure node_lost (keep it above the edges' --heartbeat and clock skew)",
        ),
    ] = 30.0,
    layer_limits: LayerLimitsOption = "",
    e2b_domain: E2BDomain = None,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "json",
    audit_log: Annotated[
        Path | None, typer.Option(help="admin actions, one JSON line each (default <scratch>/audit.log)")
    ] = None,
    overflow: Annotated[
        Path | None,
        typer.Option(
            help="JSON or TOML file of other DSec clusters creates go to past a utilisation threshold"
            " (targets: name, url, api_key_file, weight, max_sandboxes; threshold, default 0.8)"
        ),
    ] = None,
    scaling: Annotated[
        Path | None,
        typer.Option(
            help="JSON or TOML file: start nodes under sustained load and stop idle ones"
            " (provider local-netns or libvirt, threshold, sustain_s, idle_s, max_nodes, labels...;"
            " docs/overflow.md). Give it to one apiserver of the cluster"
        ),
    ] = None,
) -> None:
    """Run a stateless apiserver over the edges that register with the cluster (run several)."""
    from dsec.apiserver.scaling import release_provider
    from dsec.edge.server import read_cluster_secret
    from dsec.images.blobstore import SharedMountBlobStore
    from dsec.node.cluster import ApiServerConfig, ClusterApiServer

    _logs(log_level, log_format)

    limits = _layer_limits(layer_limits)  # a bad value stops here, before anything starts
    bursts = None if overflow is None else _overflow_config(overflow)
    scale = None if scaling is None else _scaling(scaling, port, secret_file, scratch, shared_layers)

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
            node_lost_after,
            limits,
            e2b_domain,
            audit_log or scratch / "audit.log",
            overflow=bursts,
            scaling=None if scale is None else scale[0],
            node_provider=None if scale is None else scale[1],
        )
        server = ClusterApiServer(cfg)
        try:

            def up() -> str:
                return f"[green]apiserver is up[/green] at {server.url} ({len(server.links)} edges)"

            if await _serve_until_signalled(server.start(), up):
                await server.close()
        finally:
            if scale is not None:
                await release_provider(scale[1])

    try:
        asyncio.run(serve())
    except (DSecError, ValueError) as exc:
        raise _fail(exc if isinstance(exc, DSecError) else DSecError(str(exc))) from None


def _overflow_config(path: Path) -> Any:
    from dsec.apiserver.overflow import OverflowConfig

    try:
        return OverflowConfig.load(path)
    except (OSError, ValueError) as exc:
        raise _fail(DSecError(f"--overflow: {exc}")) from None


def _scaling(
    path: Path, port: int, secret_file: Path | None, scratch: Path, shared_layers: Path
) -> tuple[Any, Any]:
    """The scaling policy and the provider it names, before anything starts."""
    from dsec.apiserver.scaling import ScalingConfig, build_provider
    from dsec.edge.server import read_cluster_secret

    try:
        config = ScalingConfig.load(path)  # a ValueError names the file and the field
    except (OSError, ValueError) as exc:
        raise _fail(DSecError(f"--scaling: {exc}")) from None
    try:
        secret = read_cluster_secret(secret_file)
        provider = build_provider(
            config,
            port=port,
            secret=secret,
            secret_file=secret_file,
            scratch=scratch,
            shared_layers=shared_layers,
        )
    except DSecError as exc:
        raise _fail(DSecError(f"--scaling {path}: {exc}")) from None
    return config, provider


def _fncall_pools(path: Path | None, default_size: int) -> list[Any]:
    from dsec.edge.fncall.pool import default_pool, load_pools

    if path is None:
        return [default_pool(default_size)] if default_size else []
    try:
        return list(load_pools(path.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise _fail(InvalidRequest(f"--fncall-pools {path}: {exc}")) from None


def _ensure_base(store: LayerStore) -> None:
    from dsec.images import base

    builds = (
        ("debian:bookworm", base.BASE_PACKAGES, None, ""),
        (base.TOOLCHAIN_REF, base.TOOLCHAIN_PACKAGES, None, ""),
        (base.E2B_BASE_REF, base.E2B_PACKAGES, base.add_e2b_user, base.E2B_RECIPE),  # E2B's `base`
    )
    for ref, packages, customize, recipe in builds:
        started = time.monotonic()
        with console.status(f"base layer {ref} (debootstrap on first run, 1-2 min)"):
            info = base.ensure_base_layer(
                store,
                ref,
                progress=lambda msg: console.log(msg),
                packages=packages,
                customize=customize,
                recipe=recipe,
            )
        console.print(f"base layer {ref} = {info.digest[:19]} ({time.monotonic() - started:.1f}s)")


@app.command("base")
def base_cmd(data_dir: DataDir = Path("/var/lib/dsec")) -> None:
    """Build the base layers (Debian bookworm, with compilers for FnCall, E2B's base) if missing."""
    try:
        _ensure_base(LayerStore(data_dir / "layers"))
    except DSecError as exc:
        raise _fail(exc) from None


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
