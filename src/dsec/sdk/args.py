"""Per-backend create arguments, with the paper's field names."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsec.protocol.models import ContainerSpec, Hardware, MicroVMSpec, NetworkRules, VMSpec, invalid_request


class DSecContainerRunArgs(BaseModel):
    """Arguments of :meth:`DSecClient.run_container`. Give ``container_image`` or ``layers``."""

    model_config = ConfigDict(extra="forbid")

    container_image: str | None = None
    layers: list[str] | None = None
    memory_limit_mb: int = 1024
    cpu_cores_limit: float = 1.0
    cpu_class: Literal["ls", "be"] = "ls"  # be: best effort (SCHED_IDLE, low CPU shares)
    pids_limit: int = 1024
    runtime: Literal["crun", "gvisor"] = "crun"  # gvisor: gVisor's user-space kernel, for hostile code
    disk_limit_mb: int | None = None  # cap on the writable layer; past it writes fail with EDQUOT
    ttl_running_stop: float | None = None
    max_lifetime_s: float | None = None
    pause_after_idle_s: float | None = None  # idle seconds before it pauses itself
    lease_s: float | None = None  # a job lease (needs labels["job"]); renew with client.renew_lease
    lease_grace_s: float = 3600  # how long a lapsed lease's sandboxes stay paused before reclaim
    network_rules: NetworkRules = Field(default_factory=dict)
    init_user: str = "root"
    workdir: str | None = None  # absolute: where commands start when they name no cwd (default: home)
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    hardware: Hardware = Field(default_factory=Hardware)  # arch, GPUs, node labels to run on
    allow_setuid: bool = False  # setuid programs (sudo) work: no no_new_privs; crun only
    tmpfs: dict[str, int] = Field(default_factory=dict)  # path -> MiB, memory-backed; crun only
    volumes: dict[str, str] = Field(default_factory=dict)  # path -> volume ID (create_volume); crun only
    # host -> headers the node's egress sets on the sandbox's HTTP(S) requests to it; values may
    # name egress_secrets as ${secrets.<name>} (never shown by any read of the sandbox)
    egress_headers: dict[str, dict[str, str]] = Field(default_factory=dict)
    egress_secrets: dict[str, str] = Field(default_factory=dict)

    def to_spec(self) -> ContainerSpec:
        """Validate against the wire model now, so bad input fails before any request."""
        try:
            return self._spec()
        except ValidationError as exc:
            raise invalid_request(exc) from None

    def _spec(self) -> ContainerSpec:
        return ContainerSpec(**self._common())

    def _common(self) -> dict[str, Any]:
        return dict(
            image=self.container_image,
            layers=self.layers,
            memory_limit_mb=self.memory_limit_mb,
            cpu_cores_limit=self.cpu_cores_limit,
            cpu_class=self.cpu_class,
            pids_limit=self.pids_limit,
            runtime=self.runtime,
            disk_limit_mb=self.disk_limit_mb,
            ttl_running_stop=self.ttl_running_stop,
            max_lifetime_s=self.max_lifetime_s,
            pause_after_idle_s=self.pause_after_idle_s,
            lease_s=self.lease_s,
            lease_grace_s=self.lease_grace_s,
            network_rules=self.network_rules,
            init_user=self.init_user,
            workdir=self.workdir,
            env=self.env,
            labels=self.labels,
            hardware=self.hardware,
            allow_setuid=self.allow_setuid,
            tmpfs=self.tmpfs,
            volumes=self.volumes,
            egress_headers=self.egress_headers,
            egress_secrets=self.egress_secrets,
        )


class DSecMicroVMRunArgs(DSecContainerRunArgs):
    """Arguments of :meth:`DSecClient.run_microvm`: a container's, plus the writable disk's size.

    The sandbox boots its own kernel over the same layers (``container_image`` or ``layers``);
    every call that works on a container works on it."""

    disk_mb: int = 4096

    def _spec(self) -> ContainerSpec:
        return MicroVMSpec(**self._common(), disk_mb=self.disk_mb)


class DSecVMRunArgs(DSecContainerRunArgs):
    """Arguments of :meth:`DSecClient.run_vm`: a full VM whose root disk (``disk_mb``) is built
    from the same layers, with a display (``Sandbox.screenshot``) and keyboard/mouse input."""

    disk_mb: int = 4096
    # An imported image (`dsec vm-image import`) booted by its own bootloader, instead of layers.
    disk_image: str | None = None

    def _spec(self) -> ContainerSpec:
        return VMSpec(**self._common(), disk_mb=self.disk_mb, disk_image=self.disk_image)
