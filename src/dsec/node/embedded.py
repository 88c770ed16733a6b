"""The embedded single-node DSec: apiserver, placement, watcher and one edge in one process.

SQLite for state, a local directory for layers, everything under one data directory. A
cluster runs the same parts as separate processes (a later step); nothing here is special to
the embedded mode except that the apiserver reaches its only edge by a function call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from dsec.apiserver.app import ApiServer
from dsec.apiserver.e2b import E2BOptions
from dsec.apiserver.e2b.front import DEFAULT_TEMPLATE
from dsec.apiserver.e2b.tokens import secret_from_file
from dsec.apiserver.layer_access import LayerLimits
from dsec.apiserver.vm_images import vm_image_store
from dsec.backends.base import Backend
from dsec.backends.container.backend import ContainerBackend
from dsec.backends.microvm.backend import MicroVMBackend
from dsec.backends.microvm.qemu import Accel
from dsec.backends.vm.backend import FullVMBackend
from dsec.edge.config import EdgeConfig
from dsec.edge.edge import Edge
from dsec.edge.link import LocalEdgeLink
from dsec.iam import IamStore, open_iam_store
from dsec.images.blobstore import SharedMountBlobStore
from dsec.images.mounts import LayerMounts
from dsec.images.store import LayerStore
from dsec.observe.audit import AuditLog
from dsec.placement.placement import Placement, Watcher
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.http import listen
from dsec.sdk.config import read_config_file, write_client_config

log = logging.getLogger("dsec.up")

DEFAULT_DATA_DIR = Path("/var/lib/dsec")


@dataclass
class NodeConfig:
    data_dir: Path = DEFAULT_DATA_DIR
    host: str = "127.0.0.1"
    port: int = 8642
    node: str = "local"
    layer_dir: Path | None = None  # the layer store; None: <data_dir>/layers
    shared_layer_dir: Path | None = None  # a shared filesystem mounted on every node (overrides layer_dir)
    init_shared: bool = False  # make shared_layer_dir a new store (only for its first node)
    config_file: Path | None = None  # where the URL and admin key go; None: the SDK default
    iam_url: str | None = None  # postgresql://... for a shared IAM; None: <data_dir>/iam.sqlite
    edge: dict[str, Any] = field(default_factory=dict)  # EdgeConfig overrides (tests)
    microvm: bool = False  # also run microVM sandboxes (QEMU; the guest kit is built at start)
    microvm_accel: str | None = None  # "kvm" or "tcg"; None: detected at start
    # How (micro)VMs reach their guest agent: "auto" (vsock where the host has vhost-vsock,
    # else virtio-serial), "vsock" (creates fail without it) or "serial".
    agent_channel: str = "auto"
    vm: bool = False  # also run full VMs (q35 with a display; Debian's full kernel is fetched)
    # Where guest kits (kernels, initramfs) are built; None: <data_dir>/guest-kit. Kits are
    # keyed by their inputs and built under a lock, so nodes of one host may share the folder
    # (a node started on a fresh data dir then skips two kernel unpacks and initramfs builds).
    guest_kit_dir: Path | None = None
    e2b_template: str = DEFAULT_TEMPLATE  # what E2B's templateID "base" means here
    e2b_domain: str | None = None  # sandbox hosts are PORT-ID.<this> (E2B's get_host)
    layer_limits: LayerLimits = field(default_factory=LayerLimits)  # caps on one layer import
    audit_log: Path | None = None  # admin actions, one JSON line each; None: <data_dir>/audit.log


def open_layer_store(config: NodeConfig) -> LayerStore:
    """The node's layer store: a local directory, or a shared mount every node sees.

    On a shared store, imports and builds work in a local scratch directory and copy the
    finished layer in once: the shared filesystem sees whole-file writes only.
    """
    if config.shared_layer_dir is not None:
        blobs = SharedMountBlobStore(config.shared_layer_dir, create=config.init_shared)
        return LayerStore.over(blobs, scratch=config.data_dir / "layer-scratch")
    return LayerStore(config.layer_dir or config.data_dir / "layers")


def vm_backends(config: NodeConfig, store: LayerStore) -> list[Backend]:
    """The VM backends ``config`` asks for: microVMs, full VMs, both or neither."""
    out: list[Backend] = []
    micro = microvm_backend(
        config.data_dir, store, config.microvm_accel, config.agent_channel, config.guest_kit_dir
    )
    if config.microvm:
        out.append(micro)
    if config.vm:
        accel = micro.accel if config.microvm_accel else None
        images = vm_image_store(store)
        out.append(
            FullVMBackend(
                config.data_dir,
                accel=accel,
                kit_dir=config.guest_kit_dir,
                vm_images=images,
                layer_exists=store.blobs.exists,
                agent_channel=config.agent_channel,
            )
        )
    return out


def microvm_backend(
    data_dir: Path,
    store: LayerStore,
    accel: str | None,
    agent_channel: str = "auto",
    kit_dir: Path | None = None,
) -> MicroVMBackend:
    """The microVM backend of a node whose layers are in ``store``."""

    def layer_file(digest: str) -> Path:
        if store.split_info(digest) is not None:
            raise InvalidRequest(
                f"layer {digest[:19]} is split (metadata + data read in place): microVMs attach"
                " single-file layers only, for now"
            )
        return store.blob_path(digest)

    chosen: Accel | None = None
    if accel == "kvm":
        chosen = "kvm"
    elif accel == "tcg":
        chosen = "tcg"
    elif accel is not None:
        raise InvalidRequest(f"microVM accelerator {accel!r}: say kvm or tcg (or nothing: detect)")
    return MicroVMBackend(
        data_dir, accel=chosen, layer_file=layer_file, agent_channel=agent_channel, kit_dir=kit_dir
    )


class EmbeddedNode:
    def __init__(self, config: NodeConfig, backend: Backend | None = None) -> None:
        self.config = config
        data = config.data_dir
        self.store = open_layer_store(config)
        self.mounts = LayerMounts(data / "mnt")
        self.backend = backend or ContainerBackend(data, node=config.node)
        self.more_backends = vm_backends(config, self.store)
        self.edge = Edge(
            EdgeConfig(data_dir=data, node=config.node, **config.edge),
            self.backend,
            self.store,
            self.mounts,
            more_backends=self.more_backends,
        )
        self.link = LocalEdgeLink(self.edge)
        self.watcher = Watcher({config.node: self.link})
        self.placement = Placement(self.watcher)
        self._runner: web.AppRunner | None = None
        self.iam: IamStore  # opened by start(): a PostgreSQL store connects asynchronously
        self.api: ApiServer
        self.url = ""
        self.api_key = ""

    async def start(self) -> None:
        """Serve; a start that fails part-way closes what it had started (LXCFS, mounts,
        cgroups, the IAM store), so nothing of the node is left behind."""
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        self.iam = await open_iam_store(self.config.iam_url or str(self.config.data_dir / "iam.sqlite"))
        # Kept in the data directory: envd tokens stay valid across `dsec up` restarts.
        e2b = E2BOptions(
            secret_from_file(self.config.data_dir / "e2b-token-secret"),
            self.config.e2b_template,
            self.config.e2b_domain,
        )
        self.api = ApiServer(
            {self.config.node: self.link},
            self.placement,
            self.store,
            self.iam,
            e2b=e2b,
            layer_limits=self.config.layer_limits,
            audit=AuditLog(self.config.audit_log or self.config.data_dir / "audit.log"),
        )
        await self.edge.start(self._register)
        await self.watcher.start()
        self._runner, self.url = await listen(self.api.app(), self.config.host, self.config.port)
        self.api_key = await self._admin_key()
        self.api.tenancy.start(self.api.edges)
        write_client_config(self.url, self.api_key, self.config.config_file)

    async def _register(self, claimed: int | None) -> int:
        # The same registry as a cluster's, so the node's epoch follows the same rule.
        return (await self.iam.register_node(self.config.node, "local:", claimed)).epoch

    async def _admin_key(self) -> str:
        # Reuse the key in the config file if this node issued it, so clients survive restarts.
        key = read_config_file(self.config.config_file).get("api_key")
        if key and await self.iam.is_valid(key):
            return key
        return await self.iam.issue_key(admin=True, name="dsec up")

    async def close(self, *, stop_sandboxes: bool = False) -> None:
        """Stop serving. Sandboxes keep running unless asked (a restart re-adopts them)."""
        if self._runner is not None:
            await self._runner.cleanup()
        if hasattr(self, "api"):  # start() may have failed before it was built
            await self.api.tenancy.close()
            self.api.audit.close()
        await self.watcher.close()
        await self.edge.close(stop_sandboxes=stop_sandboxes)
        if not self.edge.list_sandboxes():
            self.mounts.unmount_all()
            for backend in (self.backend, *self.more_backends):
                await backend.release_node()
        if hasattr(self, "iam"):
            await self.iam.close()
        self.store.close()
