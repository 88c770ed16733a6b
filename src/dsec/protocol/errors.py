"""The DSec error tree.

Every failure a caller can see is one of these classes, rooted at :class:`DSecError`. Each class
has a stable wire ``code`` and an HTTP status; the apiserver serialises an error as
``{"error": {"code": ..., "message": ..., "reason": ..., "request_id": ...}}`` and the SDK
raises the same class again on the client side, so ``except SandboxNotFound`` works across the
wire; ``err.request_id`` is the ID of the failed request (:mod:`dsec.observe.request_ids`).

    DSecError
    +-- InvalidRequest          400  bad input: malformed ID, limit out of range, path escape
    |   +-- LayerNotFound       404  an image/layer reference that names nothing
    |   +-- BuildFailed         400  a layer build's own step failed (its output is in the message)
    +-- Unauthorized            401  missing or unknown API key
    +-- Forbidden               403  the key may not touch this resource
    +-- SandboxNotFound         404  unknown or already reclaimed sandbox
    +-- FileNotFound            404  a path inside the sandbox that does not exist
    +-- ProcessNotFound         404  no such running process (ended, or not the API's)
    +-- VolumeNotFound          404  unknown or deleted shared volume, or another project's
    +-- SecretNotFound          404  unknown or deleted E2B secret, or another project's
    +-- Conflict                409  the sandbox is not in a state that allows the request
    +-- QuotaExceeded           429  a project quota would be exceeded
    +-- CapacityExhausted       503  no node can admit the sandbox right now
    +-- CommandTimeout          504  a command ran past its timeout (its process tree was killed)
    +-- InfraFailure            500  the platform failed, not the agent: mask it out of rewards
    |                           503  ... a part out of reach for now: edge starting, shutting
    |                                down or unreachable, node lost, overflow cluster unreachable
    |                           502  ... a server inside the sandbox broke HTTP (``upstream``)
        +-- SessionLost         500  a shell session died under the command (e.g. edge restart)
        +-- SandboxStopped      410  the sandbox was stopped or reclaimed under the command

``reason`` refines the class: ``InfraFailure.reason`` classifies the failure (``runtime``,
``storage``, ``edge_unreachable``...) so a trainer can tell infrastructure noise from the agent's
own doing. Every reason is a member of the enum its class names in ``reasons`` (:class:`InfraReason`,
:class:`NotFoundReason`, :class:`ConflictReason`, :class:`CapacityReason`,
:class:`InvalidReason`, :class:`QuotaReason`), one set for the server, the edge and the SDK.
They are ``StrEnum``: the wire carries the same strings as before, and ``err.reason == "runtime"``
still holds. A reason the enum does not know (a newer server's) is kept as its plain string,
so an older client still parses the error (forward compatibility); a known one comes back as
the member, whichever side built it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar


class InfraReason(StrEnum):
    """``InfraFailure.reason`` (and its subclasses'): what of the platform failed. The first four
    are work the platform cut short: the agent did not cause it, so a trainer masks the episode
    (``dsec.rl.fault_of`` says ``infra``) instead of learning from it.

    ``stopped``: another request stopped the sandbox while the command ran. ``reclaimed``: the
    platform reclaimed it (idle TTL, lease expiry, ``max_lifetime_s``). ``node_lost``: its node
    went away: the cluster's registry has not heard from it for ``dsec apiserver
    --node-lost-after`` seconds (30 by default), or it came back under a new epoch while the
    command ran. A command in flight then, and every later request on that node's sandboxes
    that cannot reach it, answers ``InfraFailure(reason="node_lost")``; the sandboxes may come
    back if the node returns with its state. A node that merely cannot be reached while it still
    heartbeats is ``InfraFailure(reason="edge_unreachable")``, and a request naming a sandbox of
    an earlier epoch answers ``SandboxNotFound(reason="stale_epoch")``: all ``infra`` to
    ``fault_of``. ``grading_sandbox_lost``: a clean-room grading sandbox (``dsec.rl.grade``)
    ended or vanished under the grader.
    """

    stopped = "stopped"
    reclaimed = "reclaimed"
    node_lost = "node_lost"
    grading_sandbox_lost = "grading_sandbox_lost"
    # What the platform failed at (not cut short): the part of it that broke.
    runtime = "runtime"  # the backend (OCI runtime, VMM, helper) failed to do its part
    storage = "storage"  # layer store, blobs, disk volumes, copies
    corrupt = "corrupt"  # stored bytes no longer match their digest
    network = "network"  # network namespaces, nftables, port forwarding
    protocol = "protocol"  # a peer sent something that is not the protocol
    http = "http"  # an HTTP-level failure of the server's own framework
    edge = "edge"  # the edge's own code failed
    edge_starting = "edge_starting"  # the edge is up but not serving yet (retried by the apiserver)
    edge_shutdown = "edge_shutdown"  # the edge is shutting down
    # The server a client talks to (the apiserver for the SDK, an edge for the apiserver) could
    # not be reached or went away mid-answer; both wire clients raise this one reason.
    edge_unreachable = "edge_unreachable"
    edge_misconfigured = "edge_misconfigured"
    registration = "registration"  # an edge could not register with the apiserver
    apiserver = "apiserver"  # the apiserver's own code failed
    interrupted = "interrupted"  # a recorded call has an unknown outcome (the edge restarted)
    upstream = "upstream"  # a server inside the sandbox broke the HTTP protocol
    image_build = "image_build"
    swap = "swap"
    pty = "pty"
    iam_store = "iam_store"
    workspace = "workspace"  # a prepared RL workspace failed verification
    guest_kit = "guest_kit"  # building the microVM guest kernel/kit
    vhost_vsock_missing = "vhost_vsock_missing"
    fncall_worker_lost = "fncall_worker_lost"
    client = "client"  # the SDK's own side failed (fncall decoding)
    # Another DSec cluster the apiserver sends creates to when its own is full
    # (apiserver/overflow.py) could not be reached, or went away mid-answer.
    overflow_unreachable = "overflow_unreachable"


class NotFoundReason(StrEnum):
    """``SandboxNotFound.reason``. ``stale_epoch``: the ID names a sandbox of an earlier epoch of
    its node (it restarted): it can no longer exist."""

    stale_epoch = "stale_epoch"


class ConflictReason(StrEnum):
    """``Conflict.reason``. ``port_closed``: the sandbox runs but nothing listens on the port.
    ``no_space``: the sandbox's disk is full."""

    port_closed = "port_closed"
    no_space = "no_space"


class CapacityReason(StrEnum):
    """``CapacityExhausted.reason``. ``never_fits``: no amount of waiting or pausing makes room
    on that node (the apiserver tries other nodes, then answers 400)."""

    never_fits = "never_fits"


class InvalidReason(StrEnum):
    """``InvalidRequest.reason`` (and its subclasses'). ``kernel_fs``: a path under a kernel file
    system (``/proc``, ``/sys``) the call does not serve."""

    too_large = "too_large"
    path_escape = "path_escape"
    kernel_fs = "kernel_fs"


class QuotaReason(StrEnum):
    """``QuotaExceeded.reason``: the quota dimension that would be exceeded."""

    sandboxes = "sandboxes"
    cpu_cores = "cpu_cores"
    memory_mib = "memory_mib"
    storage_mib = "storage_mib"


def _as_member(enum: type[StrEnum] | None, reason: str | None) -> str | None:
    if enum is None or reason is None or isinstance(reason, enum):
        return reason
    try:
        return enum(reason)
    except ValueError:
        return str(reason)  # unknown: a newer peer's reason, kept so the error still parses


class DSecError(Exception):
    """Root of every error DSec raises, on the server and in the SDK."""

    code: ClassVar[str] = "error"
    status: int = 500  # the class's; an InfraFailure's follows its reason (_UNAVAILABLE)
    # The enum this class's reasons come from (None: the class carries no reason of its own).
    reasons: ClassVar[type[StrEnum] | None] = None

    def __init__(self, message: str, *, reason: str | None = None, request_id: str | None = None) -> None:
        """``reason``: a member of ``type(self).reasons``; a string naming one becomes that
        member, any other string (a newer peer's reason) is kept as it is. ``request_id``: the
        ID of the request that failed (``X-Request-ID``, :mod:`dsec.observe.request_ids`), set
        on the errors a client raises from a server's answer: what to quote to an operator."""
        super().__init__(message)
        self.message = message
        self.reason: str | None = _as_member(type(self).reasons, reason)
        self.request_id = request_id

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.reason is not None:
            body["reason"] = str(self.reason)  # the member's value: a plain string on the wire
        if self.request_id is not None:
            body["request_id"] = self.request_id  # an older client ignores it
        return {"error": body}

    def __str__(self) -> str:
        return self.message if self.reason is None else f"{self.message} [{self.reason}]"


class InvalidRequest(DSecError):
    code = "invalid_request"
    status = 400
    reasons = InvalidReason


class LayerNotFound(InvalidRequest):
    code = "layer_not_found"
    status = 404


class TooLarge(InvalidRequest):
    """An upload, or what it expands to, exceeds a configured cap."""

    code = "too_large"
    status = 413


class BuildFailed(InvalidRequest):
    code = "build_failed"
    status = 400


class Unauthorized(DSecError):
    code = "unauthorized"
    status = 401


class Forbidden(DSecError):
    code = "forbidden"
    status = 403


class SandboxNotFound(DSecError):
    code = "sandbox_not_found"
    status = 404
    reasons = NotFoundReason


class FileNotFound(DSecError):
    code = "file_not_found"
    status = 404


class ProcessNotFound(DSecError):
    """Not a :class:`SandboxNotFound`: a process ending is the agent's doing, and code that
    takes a lost sandbox for the platform's failure (``rl.failures``) must not see one."""

    code = "process_not_found"
    status = 404


class VolumeNotFound(DSecError):
    code = "volume_not_found"
    status = 404


class SecretNotFound(DSecError):
    code = "secret_not_found"
    status = 404


class Conflict(DSecError):
    code = "conflict"
    status = 409
    reasons = ConflictReason


class QuotaExceeded(DSecError):
    code = "quota_exceeded"
    status = 429
    reasons = QuotaReason


class CapacityExhausted(DSecError):
    code = "capacity_exhausted"
    status = 503
    reasons = CapacityReason


class CommandTimeout(DSecError):
    code = "command_timeout"
    status = 504


class InfraFailure(DSecError):
    code = "infra_failure"
    status = 500
    reasons = InfraReason

    def __init__(self, message: str, *, reason: str | None = None, request_id: str | None = None) -> None:
        super().__init__(message, reason=reason, request_id=request_id)
        # Not the server's bug but a part out of reach for now: what a client, a proxy or a
        # load balancer should treat as "try again" (the wire code and reason are the same).
        if type(self).status != 500:
            pass  # a subclass's own status (SandboxStopped's 410) stays
        elif self.reason in _UNAVAILABLE:
            self.status = 503
        elif self.reason == InfraReason.upstream:
            self.status = 502  # a server inside the sandbox broke HTTP: a bad gateway's answer


_UNAVAILABLE = frozenset(
    {
        InfraReason.edge_starting,
        InfraReason.edge_shutdown,
        InfraReason.edge_unreachable,
        InfraReason.node_lost,
        InfraReason.overflow_unreachable,
    }
)


class SessionLost(InfraFailure):
    code = "session_lost"


class SandboxStopped(InfraFailure):
    """The sandbox was stopped (another request) or reclaimed (TTL, lease, lifetime) while the
    command ran: its end is not the command's outcome (``reason``: ``stopped``/``reclaimed``).
    Deliberate, not a fault of the platform's code: 410, the sandbox is gone."""

    code = "sandbox_stopped"
    status = 410


def _all_subclasses(cls: type[DSecError]) -> list[type[DSecError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


_BY_CODE: dict[str, type[DSecError]] = {c.code: c for c in _all_subclasses(DSecError)}
_MAX_REQUEST_ID = 128  # dsec.observe.request_ids.MAX_LEN: that module imports this one


def error_from_wire(status: int, body: Any) -> DSecError:
    """Rebuild the typed error from a response body; unknown shapes become ``InfraFailure``."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        cls = _BY_CODE.get(str(err.get("code")), DSecError)
        rid = err.get("request_id")
        # Only a string of a request ID's size: the body is another server's say.
        rid = rid if isinstance(rid, str) and 0 < len(rid) <= _MAX_REQUEST_ID else None
        return cls(str(err.get("message", "")), reason=err.get("reason"), request_id=rid)
    return InfraFailure(
        f"unexpected HTTP {status} from server: {str(body)[:200]}", reason=InfraReason.protocol
    )
