"""Wire models shared by SDK, apiserver and edge.

Request models validate at the API edge: anything out of range fails here with a 4xx before
any node does work. Sandbox specs are chosen by their ``type`` field so later backends
(``fncall``, ``microvm``, ``vm``) slot in beside ``container`` without touching the routes.
"""

from __future__ import annotations

import base64
import datetime
import posixpath
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dsec.protocol.bounds import (
    MAX_OUTPUT_BYTES,
    MAX_TIMER_S,
    AbsPath,
    OsPath,
    OsStr,
    Ref,
    UserName,
    no_nul_env,
)
from dsec.protocol.egress_headers import EgressHeaders, EgressSecrets, filled
from dsec.protocol.errors import DSecError, InvalidRequest
from dsec.protocol.files import Change as Change
from dsec.protocol.files import ChangeKind as ChangeKind
from dsec.protocol.files import FileStat as FileStat
from dsec.protocol.files import FileType as FileType
from dsec.protocol.iam import KeyCreate as KeyCreate
from dsec.protocol.iam import ProjectCreate as ProjectCreate
from dsec.protocol.iam import QuotaModel as QuotaModel
from dsec.protocol.iam import QuotaUpdate as QuotaUpdate

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")
_SESSION_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


RESERVED_LABEL_PREFIX = "dsec."
PROJECT_LABEL = "dsec.project"  # set by the apiserver: the project a sandbox belongs to
DEFAULT_PROJECT = "root"
JOB_LABEL = "job"  # the label a job lease is kept under


class _Model(BaseModel):
    # No inf/nan: every float on the wire is a number (1e400 parses as infinity otherwise).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GrantOptions(_Model):
    """A network permission granted with options (``{"pypi": {"before": "2025-06-01"}}``):
    ``before`` hides every release uploaded on or after that day from the node's package
    registry proxy, and opens the registry only through that proxy."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    before: datetime.date | None = Field(default=None, description="releases uploaded before this day only")

    @field_validator("before")
    @classmethod
    def _plausible(cls, v: datetime.date | None) -> datetime.date | None:
        if v is not None and not datetime.date(1990, 1, 1) <= v <= datetime.date(2200, 1, 1):
            raise ValueError(f"a cutoff date between 1990-01-01 and 2200-01-01, not {v}")
        return v


# A permission by name (or an address or range, netpolicy.config.address_of): on, off, or on
# with options. Bounded: a name is at most 63 characters, a range 18, a node offers a few dozen.
Grant = bool | GrantOptions
MAX_NETWORK_RULES = 256
MAX_TMPFS = 8
# What a tmpfs may not cover: the runtime's own mounts (/.dsec holds the sandbox's init).
_TMPFS_FORBIDDEN = ("/proc", "/sys", "/dev", "/.dsec")


def _mount_point(path: str, what: str) -> None:
    """A path a sandbox mount may take: normalized, not / and not over the runtime's own."""
    # normpath keeps a leading "//" (POSIX leaves it to the system): "//proc" is /proc to crun.
    if posixpath.normpath(path) != path or path == "/" or path.startswith("//"):
        raise ValueError(f"{what} {path!r}: a normalized absolute path other than /")
    if any(path == d or path.startswith(d + "/") for d in _TMPFS_FORBIDDEN):
        raise ValueError(f"{what} {path!r}: not over {', '.join(_TMPFS_FORBIDDEN)}")


NetworkRules = Annotated[
    dict[Annotated[str, Field(min_length=1, max_length=64)], Grant], Field(max_length=MAX_NETWORK_RULES)
]


class SandboxState(StrEnum):
    creating = "creating"
    running = "running"
    paused = "paused"  # frozen, memory pushed out; any request resumes it
    stopping = "stopping"
    stopped = "stopped"
    failed = "failed"


class LayerInfo(_Model):
    digest: str
    size: int
    names: list[str] = Field(default_factory=list)
    created_at: float
    format: Literal["single", "split"] | None = Field(
        default=None,
        description="single: one EROFS image; split: META + data blob read in place (size counts both)",
    )
    data_digest: str | None = Field(default=None, description="a split layer's data blob")
    network: list[str] = Field(
        default_factory=list,
        description="network permissions held by the build or sandbox that made it (pypi, pypi@2025-06-01)",
    )


class Hardware(_Model):
    """What a sandbox needs of the node it runs on.

    Placement only considers nodes that offer all of it; the edge refuses a create it does not
    fit (the edge has the final word). ``node_labels`` match labels an operator gave the node
    (``dsec edge --label zone=a``). CPU and memory limits are not matched against node sizes:
    they are caps, and nodes overcommit them (most sandboxes use a fraction of what they ask).
    """

    arch: Literal["x86_64", "aarch64"] | None = None
    gpus: int = Field(default=0, ge=0, le=64)
    node_labels: dict[str, str] = Field(default_factory=dict)

    def unmet(self, offer: Mapping[str, Any]) -> str | None:
        """Why a node offering ``offer`` (its ``hardware`` stats) cannot host this, or None."""
        if self.arch is not None and offer.get("arch") != self.arch:
            return f"needs arch {self.arch}, the node is {offer.get('arch')}"
        if self.gpus > int(offer.get("gpus", 0)):
            return f"needs {self.gpus} GPUs, the node has {offer.get('gpus', 0)}"
        labels = offer.get("labels", {})
        for k, v in self.node_labels.items():
            if labels.get(k) != v:
                return f"needs node label {k}={v}"
        return None


class ContainerSpec(_Model):
    """What a caller asks for when it creates a container sandbox."""

    type: Literal["container"] = "container"
    image: Ref | None = Field(default=None, description="a layer name:version, or digest")
    layers: list[Ref] | None = Field(default=None, description="base first, then workspace, toolkits")
    memory_limit_mb: int = Field(default=1024, ge=16, le=1024 * 1024)
    cpu_cores_limit: float = Field(default=1.0, gt=0, le=1024)
    cpu_class: Literal["ls", "be"] = Field(
        default="ls",
        description="ls: latency-sensitive; be: best-effort (SCHED_IDLE, low CPU shares: it runs "
        "on what latency-sensitive sandboxes leave)",
    )
    pids_limit: int = Field(default=1024, ge=16, le=1 << 22)
    runtime: Literal["crun", "gvisor"] = Field(
        default="crun",
        description="gvisor: the sandbox runs on gVisor's user-space kernel (runsc), a stronger wall "
        "for hostile code at the price of slower starts and syscalls; needs a node that has it",
    )
    disk_limit_mb: int | None = Field(
        default=None,
        ge=16,
        le=1024 * 1024,
        description="hard cap on the sandbox's writable layer (its writes, in MiB); past it writes "
        "fail inside with EDQUOT. None: no cap of its own",
    )
    ttl_running_stop: float | None = Field(
        default=None, gt=0, le=MAX_TIMER_S, description="idle seconds before reclaim"
    )
    max_lifetime_s: float | None = Field(default=None, gt=0, le=MAX_TIMER_S)
    pause_after_idle_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_TIMER_S,
        description="idle seconds before the sandbox pauses itself (resumes on use)",
    )
    lease_s: float | None = Field(
        default=None,
        gt=0,
        le=7 * 86400,
        description="a job lease (needs the 'job' label): unless renewed, the job's sandboxes pause",
    )
    lease_grace_s: float = Field(
        default=3600, ge=0, le=7 * 86400, description="how long a lapsed lease's sandboxes stay paused"
    )
    network_rules: NetworkRules = Field(default_factory=dict)
    init_user: UserName = "root"
    workdir: AbsPath | None = Field(
        default=None,
        description="where a process, exec or shell session starts when it names no cwd "
        "(it must exist then); default: its user's home",
    )
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    hardware: Hardware = Field(default_factory=Hardware)
    tmpfs: dict[AbsPath, int] = Field(
        default_factory=dict,
        description="memory-backed directories, path -> size in MiB (mode 1777, empty at every "
        "start): what is written there counts against memory_limit_mb and is in no layer or "
        "snapshot made of the sandbox. crun containers only",
    )
    volumes: dict[AbsPath, str] = Field(
        default_factory=dict,
        description="shared volumes (protocol/volumes.py) mounted read-write, nosuid and nodev: "
        "path -> volume ID, the project's own (or its subtree's). The sandbox is placed on the "
        "volumes' node. crun containers only",
    )
    egress_headers: EgressHeaders = Field(
        default_factory=dict,
        description="host -> headers the node's egress sets on every HTTPS request of the "
        "sandbox to that host, plain HTTP getting those that name no secret "
        "(protocol/egress_headers.py); values may name egress_secrets as ${secrets.<name>}. The "
        "host must be reached by name (a permission naming its domain, or its own domain rule)",
    )
    egress_secrets: EgressSecrets = Field(
        default_factory=dict,
        description="name -> value filled into egress_headers at the edge; never shown by any read",
    )
    allow_setuid: bool = Field(
        default=False,
        description="processes start without no_new_privs, so setuid programs work (sudo to root "
        "inside); root that way has what a root command has (capabilities, seccomp filter, "
        "cgroup), nothing more. crun containers only",
    )

    @model_validator(mode="after")
    def _setuid_on_crun(self) -> ContainerSpec:
        # gVisor's runsc and a VM's guest agent start processes their own way (no dsec-enter).
        if self.allow_setuid and (self.type != "container" or self.runtime != "crun"):
            raise ValueError("allow_setuid applies to crun containers only")
        # runsc puts a /tmp of its own over the spec's mounts; a VM's disk is its guest's.
        if self.tmpfs and (self.type != "container" or self.runtime != "crun"):
            raise ValueError("tmpfs applies to crun containers only")
        if self.volumes and (self.type != "container" or self.runtime != "crun"):
            raise ValueError("volumes apply to crun containers only")
        if set(self.volumes) & set(self.tmpfs):
            raise ValueError("a path is either a tmpfs or a volume mount")
        return self

    @model_validator(mode="after")
    def _secrets_named(self) -> ContainerSpec:
        filled(self.egress_headers, self.egress_secrets)  # every secret named is given, in bounds
        return self

    @field_validator("volumes")
    @classmethod
    def _volumes(cls, v: dict[str, str]) -> dict[str, str]:
        from dsec.protocol.volumes import MAX_VOLUME_MOUNTS, VolumeId  # it imports this module

        if len(v) > MAX_VOLUME_MOUNTS:
            raise ValueError(f"at most {MAX_VOLUME_MOUNTS} volume mounts")
        nodes = set()
        for path, vid in v.items():
            _mount_point(path, "volume")
            try:
                nodes.add(VolumeId.parse(vid).node)
            except DSecError:
                raise ValueError(f"volume {path!r}: {vid[:80]!r} is no volume ID") from None
        if len(nodes) > 1:
            raise ValueError(
                f"the volumes are on different nodes ({', '.join(sorted(nodes))}): "
                "one sandbox mounts one node's"
            )
        return v

    @field_validator("tmpfs")
    @classmethod
    def _tmpfs(cls, v: dict[str, int]) -> dict[str, int]:
        if len(v) > MAX_TMPFS:
            raise ValueError(f"at most {MAX_TMPFS} tmpfs directories")
        for path, mb in v.items():
            _mount_point(path, "tmpfs")
            if not 1 <= mb <= 1024 * 1024:
                raise ValueError(f"tmpfs {path!r}: size must be 1 to 1048576 MiB")
        return v

    @model_validator(mode="after")
    def _one_environment(self) -> ContainerSpec:
        if (self.image is None) == (self.layers is None):
            raise ValueError("give exactly one of image or layers")
        if self.layers is not None and not 1 <= len(self.layers) <= 64:
            raise ValueError("layers must name 1 to 64 layers")
        if self.lease_s is not None and not self.labels.get(JOB_LABEL):
            raise ValueError(f"lease_s needs a {JOB_LABEL!r} label: a lease is renewed per job")
        return self

    def required_capabilities(self) -> list[str]:
        """Capabilities (of the node's backend for this type) a node must report as true."""
        return ["gvisor"] if self.runtime == "gvisor" else []

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        trusted = bool(info.context and info.context.get("trusted"))  # DSec's own records
        for k, val in v.items():
            if k.startswith(RESERVED_LABEL_PREFIX) and not trusted:
                raise ValueError(
                    f"label {k!r}: labels starting with {RESERVED_LABEL_PREFIX!r} are set by DSec"
                )
            if not _LABEL_KEY_RE.match(k) or len(val) > 256:
                raise ValueError(f"invalid label {k!r}: keys are 1-63 of A-Za-z0-9._/-, values <= 256")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return no_nul_env(v)

    def layer_refs(self) -> list[str]:
        return [self.image] if self.image is not None else list(self.layers or [])


class _VirtualMachineSpec(ContainerSpec):
    @field_validator("runtime")
    @classmethod
    def _own_kernel(cls, v: str) -> str:
        if v != "crun":
            raise ValueError("runtime applies to containers: a VM runs its own kernel already")
        return v

    @field_validator("disk_limit_mb")
    @classmethod
    def _disk_mb_instead(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("a VM's disk is capped by disk_mb (its size), not disk_limit_mb")
        return v


class MicroVMSpec(_VirtualMachineSpec):
    """A sandbox with its own kernel (QEMU microvm): the same layers, limits and labels as a
    container, plus the size of its writable disk."""

    type: Literal["microvm"] = "microvm"  # type: ignore[assignment]
    disk_mb: int = Field(default=4096, ge=64, le=1 << 20, description="the writable disk (sparse)")


class VMSpec(_VirtualMachineSpec):
    """A full VM (QEMU q35): its root is a disk image built from the layers (copy-on-write per
    sandbox over a shared base), with a display (screenshot) and keyboard/mouse input."""

    type: Literal["vm"] = "vm"  # type: ignore[assignment]
    disk_mb: int = Field(default=4096, ge=256, le=1 << 20, description="the root disk")
    disk_image: Ref | None = Field(
        default=None,
        description="boot a user's imported VM image (name:version, `dsec vm-image import`) "
        "through its own bootloader, instead of a disk built from layers",
    )

    @model_validator(mode="after")
    def _one_environment(self) -> VMSpec:  # (replaces ContainerSpec's: no layers is allowed here)
        given = [x is not None for x in (self.image, self.layers, self.disk_image)]
        if sum(given) != 1:
            raise ValueError("give exactly one of image, layers or disk_image")
        if self.layers is not None and not 1 <= len(self.layers) <= 64:
            raise ValueError("layers must name 1 to 64 layers")
        if self.lease_s is not None and not self.labels.get(JOB_LABEL):
            raise ValueError(f"lease_s needs a {JOB_LABEL!r} label: a lease is renewed per job")
        return self


class LocalForkRequest(_Model):
    """Edge-internal: whole copies of a VM under IDs the apiserver chose and reserved."""

    ids: list[str] = Field(min_length=1, max_length=256)
    labels: dict[str, str] | None = None


class InputEvent(_Model):
    """Keyboard or mouse input for a full VM. ``key``: ``keys`` pressed together (QEMU qcodes:
    "a", "ret", "ctrl", "alt", "f1"...); ``text``: typed character by character; ``move``: the
    mouse by (x, y) pixels, relative; ``point``: the pointer to pixel (x, y) of the screen,
    absolute (the VM's tablet); ``click``: a mouse button where the pointer is."""

    type: Literal["key", "text", "move", "point", "click"]
    keys: list[Annotated[str, Field(max_length=32)]] | None = Field(default=None, max_length=8)
    text: str | None = Field(default=None, max_length=10_000)
    x: int | None = Field(default=None, ge=-4096, le=4096)
    y: int | None = Field(default=None, ge=-4096, le=4096)
    button: Literal["left", "right", "middle"] = "left"


class InputRequest(_Model):
    events: list[InputEvent] = Field(min_length=1, max_length=1000)


def _spec_type(value: Any) -> str:
    # A spec without "type" is a container, as it was before there were other types.
    if isinstance(value, dict):
        return str(value.get("type", "container"))
    return str(getattr(value, "type", "container"))


SandboxSpec = Annotated[
    Annotated[ContainerSpec, Tag("container")]
    | Annotated[MicroVMSpec, Tag("microvm")]
    | Annotated[VMSpec, Tag("vm")],
    Discriminator(_spec_type),
]
_SPEC: TypeAdapter[ContainerSpec | MicroVMSpec | VMSpec] = TypeAdapter(SandboxSpec)


def parse_spec(data: bytes | str | dict[str, Any], *, trusted: bool = False) -> ContainerSpec:
    """A spec of any sandbox type, chosen by its ``type``; ``trusted``: DSec's own records,
    which may carry reserved labels."""
    context = {"trusted": trusted}
    if isinstance(data, dict):
        return _SPEC.validate_python(data, context=context)
    return _SPEC.validate_json(data, context=context)


class CreateRequest(_Model):
    spec: SandboxSpec
    project: str | None = Field(default=None, description="project to bill; default: the key's project")
    timeout: float = Field(default=120, gt=0, le=3600)


class BatchCreateRequest(CreateRequest):
    count: int = Field(ge=1, le=1000, description="sandboxes of this spec, created all or none")


DeadlineAction = Literal["stop", "pause"]


class SandboxInfo(_Model):
    id: str
    state: SandboxState
    backend: str
    node: str
    layers: list[str]
    labels: dict[str, str]  # the caller's labels; DSec's own (dsec.*) are not repeated here
    project: str = DEFAULT_PROJECT
    init_user: str
    memory_limit_mb: int
    cpu_cores_limit: float
    created_at: float
    last_active_at: float
    stop_reason: str | None = None
    paused_at: float | None = None
    pause_reason: str | None = None  # requested, idle, lease_lapsed, admission, memory_pressure
    network_rules: NetworkRules = Field(default_factory=dict)
    egress_headers: dict[str, dict[str, str]] = Field(default_factory=dict)  # as given: no secret
    refs: list[str] = Field(default_factory=list, description="the image or layers as the caller named them")
    deadline_at: float | None = Field(default=None, description="when the reaper acts (set_deadline)")
    deadline_s: float | None = None
    on_deadline: DeadlineAction | None = None


class DeadlineRequest(_Model):
    """Stop or pause the sandbox ``timeout_s`` seconds from now (``None``: no deadline).

    A sandbox paused by its deadline gets ``timeout_s`` again when it resumes.
    """

    timeout_s: float | None = Field(gt=0, le=366 * 86400)
    on_timeout: DeadlineAction = "stop"


class NetworkRulesRequest(_Model):
    """The sandbox's network permissions from now on (names the node's operator configured),
    and its egress headers and their secrets when ``egress_headers`` is given (None: kept)."""

    network_rules: NetworkRules
    egress_headers: EgressHeaders | None = None
    egress_secrets: EgressSecrets = Field(default_factory=dict)

    @model_validator(mode="after")
    def _secrets_given(self) -> NetworkRulesRequest:
        if self.egress_headers is None and self.egress_secrets:
            raise ValueError("egress_secrets come with the egress_headers that name them")
        filled(self.egress_headers or {}, self.egress_secrets)
        return self


BulkAction = Literal["stop", "pause", "resume"]


class BulkResult(_Model):
    """A bulk call's outcome: the sandboxes it acted on, what failed (ID -> why), which nodes
    did not answer (their matching sandboxes were not touched)."""

    action: BulkAction
    done: list[SandboxInfo] = Field(default_factory=list)
    failed: dict[str, str] = Field(default_factory=dict)
    unreachable_nodes: list[str] = Field(default_factory=list)


class LeaseRequest(_Model):
    lease_s: float = Field(gt=0, le=7 * 86400)


class LeaseResult(_Model):
    """A renewal: how many of the job's sandboxes it covers, which nodes did not answer."""

    job: str
    expires_at: float
    sandboxes: int = 0
    unreachable_nodes: list[str] = Field(default_factory=list)


class TrajectoryEntry(_Model):
    """One request a sandbox received and what came of it, as the edge recorded it."""

    seq: int
    kind: str  # shell, exec, write, remove, mkdir, pause, resume, pack, stop
    key: str | None = None  # the request's idempotency key
    request: dict[str, Any] = Field(default_factory=dict)
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None  # the DSec wire error it failed with
    status: Literal["running", "done", "failed", "interrupted"]
    started_at: float
    finished_at: float | None = None


class ForkRequest(_Model):
    count: int = Field(ge=1, le=256)
    labels: dict[str, str] | None = Field(default=None, description="the copies' labels; default: the same")
    processes: bool = Field(default=False, description="copy process state too (needs checkpoint/restore)")
    timeout: float = Field(default=120, gt=0, le=3600)


class ShellRequest(_Model):
    command: str = Field(max_length=1 << 20)
    session: str = "default"
    timeout: float | None = Field(default=None, gt=0, le=86400)
    max_output_bytes: int | None = Field(default=None, ge=0, le=MAX_OUTPUT_BYTES)
    idempotency_key: str | None = Field(
        default=None, min_length=1, max_length=256, description="run at most once; a repeat gets the record"
    )

    @field_validator("session")
    @classmethod
    def _session(cls, v: str) -> str:
        if not _SESSION_RE.match(v):
            raise ValueError("session names are 1-64 of A-Za-z0-9_.-")
        return v


class CommandResult(_Model):
    """The outcome of one command; output beyond the cap is dropped and ``truncated`` is set."""

    exit_code: int | None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    oom_killed: bool = False
    truncated: bool = False
    duration_s: float = 0.0


class ExecRequest(_Model):
    argv: list[OsStr] = Field(min_length=1, max_length=4096)
    stdin_b64: str | None = None
    env: Annotated[dict[str, str], AfterValidator(no_nul_env)] = Field(default_factory=dict)
    cwd: OsPath | None = None
    timeout: float | None = Field(default=None, gt=0, le=86400)
    max_output_bytes: int | None = Field(default=None, ge=0, le=MAX_OUTPUT_BYTES)
    idempotency_key: str | None = Field(
        default=None, min_length=1, max_length=256, description="run at most once; a repeat gets the record"
    )

    def stdin_bytes(self) -> bytes | None:
        try:
            return None if self.stdin_b64 is None else base64.b64decode(self.stdin_b64, validate=True)
        except ValueError as exc:
            raise InvalidRequest("stdin_b64 is not valid base64") from exc


class ExecEvent(_Model):
    """One line of an exec stream: ``out``/``err`` carry base64 data, ``exit`` ends the stream."""

    t: Literal["out", "err", "exit"]
    d: str | None = None
    result: CommandResult | None = None


class RetagRequest(_Model):
    """Point ``ref`` at other content: a layer digest or reference, or an ordered list (an image)."""

    ref: Ref
    target: Ref | list[Ref] = Field(union_mode="left_to_right")


class GcRequest(_Model):
    grace_s: float | None = Field(
        default=None, ge=0, le=MAX_TIMER_S, description="spare blobs younger than this"
    )


class CommitRequest(_Model):
    """Pack what a sandbox changed into a new layer ``ref``: ``name:version``, or a bare
    ``name`` for the next free integer version (what ``pack_diff`` does)."""

    ref: Ref
    scrub_defaults: bool = Field(default=True, description="remove caches, histories, temp files")
    exclude: list[OsPath] = Field(default_factory=list, max_length=256, description="more paths to scrub")


def validate_name_ref(ref: str) -> str:
    if not _NAME_RE.match(ref.split(":", 1)[0]):
        raise ValueError(f"invalid layer reference {ref!r}")
    return ref


def invalid_request(exc: ValidationError) -> InvalidRequest:
    """A pydantic validation failure as the caller's error, one clause per bad field."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return InvalidRequest("; ".join(parts))
