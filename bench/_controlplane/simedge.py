"""An in-memory edge: what a node answers an apiserver, with no sandbox behind it.

It keeps an entry per live sandbox, as a real edge does, so memory that grows here is edge
state, not apiserver state; the memory phase uses it as its baseline. What the apiserver's
side of a remote link pays (serialising the spec, parsing answers) is paid here; ``wire`` off
skips it on the create path. The HTTP round trip to the edge is not simulated.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from collections.abc import AsyncGenerator, AsyncIterable
from typing import Any, TypeVar, cast

from pydantic import TypeAdapter

from dsec.edge.link import EdgeLink, check_routed
from dsec.executor.file_ops import DEFAULT_FILE_MODE
from dsec.iam.base import in_subtree
from dsec.protocol.errors import CapacityExhausted, InvalidRequest, SandboxNotFound
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import (
    DEFAULT_PROJECT,
    PROJECT_LABEL,
    RESERVED_LABEL_PREFIX,
    BulkAction,
    BulkResult,
    ContainerSpec,
    FileStat,
    SandboxInfo,
    SandboxState,
)
from dsec.protocol.ops import OPS, Call, Stream

_INFOS = TypeAdapter(list[SandboxInfo])
R = TypeVar("R")
E = TypeVar("E")

# Every sandbox operation by kind: what simulates it here, or None for "not simulated" (the
# bench is about creates). tests/edge/test_ops_registry.py checks this names every kind.
SIMULATED: dict[str, str | None] = {kind: None for kind in OPS} | {
    "pause": "the entry's state",
    "resume": "the entry's state",
}


def _unsimulated(what: str) -> InvalidRequest:
    return InvalidRequest(f"the control-plane bench's simulated edge does not simulate {what}")


def fast_sandbox_id(node: str, epoch: int) -> str:
    """A valid ID like ``SandboxId.new`` makes, at a tenth of its cost (that costs ~30 us in
    ``secrets.choice``, which a real edge pays on its own machine, not the apiserver's)."""
    tag = base64.b32encode(os.urandom(15)).decode("ascii")[:20].lower()
    return str(SandboxId(node, epoch, tag))


class SimulatedEdgeLink(EdgeLink):
    """An :class:`~dsec.edge.link.EdgeLink` to a node that admits up to ``capacity`` sandboxes.

    A sandbox's entry is its JSON, as the edge would send it: bytes, which the garbage
    collector never scans. Entries as objects would put hundreds of thousands of objects in
    the apiserver's process that in a cluster live in the edges' processes, and every full
    collection (a pause of 100 ms and more) would be charged to the apiserver.

    ``latency_s`` delays every create as a remote node's work would (an asyncio sleep: the
    apiserver's event loop stays free meanwhile, as it would while waiting on a socket).
    With ``keep`` off the node counts its sandboxes but keeps no entry for them (the memory
    probe's way to see the apiserver's share alone); ``get`` then answers for any ID of it.
    """

    def __init__(
        self, node: str, epoch: int, capacity: int, *, latency_s: float = 0.0, wire: bool = True
    ) -> None:
        self.node = node
        self._epoch = epoch
        self.capacity = capacity
        self.latency_s = latency_s
        self.wire = wire
        self.keep = True
        self.creating = 0
        self.created = 0
        self.live: dict[str, bytes] = {}  # sandbox ID -> its SandboxInfo as JSON
        self._last = b""

    @property
    def running(self) -> int:
        return len(self.live) if self.keep else self.created

    @property
    def epoch(self) -> int:
        return self._epoch

    async def stats(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "epoch": self._epoch,
            "backends": ["container"],
            "running": self.running,
            "creating": self.creating,
            "capacity": self.capacity,
        }

    async def create(self, spec: ContainerSpec, sandbox_id: str | None = None) -> SandboxInfo:
        if sandbox_id is not None:
            check_routed(self.node, self._epoch, sandbox_id)  # chosen by the apiserver
        if self.wire:
            spec.model_dump_json()  # the request body a remote link would send
        if self.running + self.creating >= self.capacity:
            raise CapacityExhausted(f"node {self.node} is full ({self.capacity} sandboxes)")
        self.creating += 1
        try:
            if self.latency_s > 0:
                await asyncio.sleep(self.latency_s)
            now = time.time()
            info = SandboxInfo.model_construct(
                id=sandbox_id or fast_sandbox_id(self.node, self._epoch),
                state=SandboxState.running,
                backend="container",
                node=self.node,
                layers=spec.layer_refs(),
                labels={k: v for k, v in spec.labels.items() if not k.startswith(RESERVED_LABEL_PREFIX)},
                project=spec.labels.get(PROJECT_LABEL, DEFAULT_PROJECT),
                init_user=spec.init_user,
                memory_limit_mb=spec.memory_limit_mb,
                cpu_cores_limit=spec.cpu_cores_limit,
                created_at=now,
                last_active_at=now,
                stop_reason=None,
                # Given, not defaulted: pydantic >= 2.10's model_construct inspects a default
                # factory's signature on every call (~450 us each for dict and list).
                network_rules={},
                refs=spec.layer_refs(),
            )
            sent = info.model_dump_json().encode()
            if self.keep:
                self.live[info.id] = sent
            self._last = sent
            self.created += 1
        finally:
            self.creating -= 1
        return SandboxInfo.model_validate_json(sent) if self.wire else info  # the answer, parsed

    async def get(self, sandbox_id: str) -> SandboxInfo:
        check_routed(self.node, self._epoch, sandbox_id)
        sent = self.live.get(sandbox_id)
        if sent is not None:
            return SandboxInfo.model_validate_json(sent)
        if not self.keep and self._last:
            return SandboxInfo.model_validate_json(self._last).model_copy(update={"id": sandbox_id})
        raise SandboxNotFound(f"sandbox {sandbox_id} does not exist")

    async def list_sandboxes(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        # One answer as a remote edge sends it, joined from the entries (costing this process
        # next to nothing, as writing it would on the edge's own machine), parsed as
        # RemoteEdgeLink does: the parsing is the apiserver's cost.
        infos = _INFOS.validate_json(b"[" + b",".join(self.live.values()) + b"]")
        want = (labels or {}).items()
        return [i for i in infos if want <= i.labels.items()] if want else infos

    async def sandbox_ids(self) -> list[str]:
        # As RemoteEdgeLink parses the edge's {"ids": [...]} answer.
        raw = json.dumps({"ids": list(self.live)}).encode()
        return [str(i) for i in json.loads(raw)["ids"]]

    async def stop(self, sandbox_id: str) -> SandboxInfo:
        check_routed(self.node, self._epoch, sandbox_id)
        sent = self.live.pop(sandbox_id, None)
        if sent is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} does not exist")
        info = SandboxInfo.model_validate_json(sent)
        return info.model_copy(update={"state": SandboxState.stopped, "stop_reason": "stopped"})

    async def bulk(self, action: BulkAction, labels: dict[str, str], within: str) -> BulkResult:
        if action != "stop":
            raise _unsimulated(f"bulk {action}")
        result = BulkResult(action=action)
        for info in await self.list_sandboxes(labels):
            if in_subtree(info.project, within):
                result.done.append(await self.stop(info.id))
        return result

    async def renew_lease(self, job: str, lease_s: float, within: str) -> tuple[int, float]:
        raise _unsimulated("renew_lease")

    # -- sandbox operations (dsec.protocol.ops): the lifecycle ones, the rest say so ------------

    async def call(self, sandbox_id: str, op: Call[R]) -> R:
        if SIMULATED[op.kind] is None:
            raise _unsimulated(op.kind)
        check_routed(self.node, self._epoch, sandbox_id)
        sent = self.live.get(sandbox_id)
        if sent is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} does not exist")
        info = SandboxInfo.model_validate_json(sent)
        paused = op.kind == "pause"
        info.state = SandboxState.paused if paused else SandboxState.running
        info.pause_reason, info.paused_at = ("requested", time.time()) if paused else (None, None)
        self.live[sandbox_id] = info.model_dump_json().encode()
        return cast(R, SandboxInfo.model_validate_json(self.live[sandbox_id]))  # as a remote link parses it

    def stream(self, sandbox_id: str, op: Stream[E]) -> AsyncGenerator[E, None]:
        raise _unsimulated(op.kind)

    def read_stream(self, sandbox_id: str, path: str) -> AsyncGenerator[bytes, None]:
        raise _unsimulated("read_stream")

    async def write_stream(
        self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes], *, mode: int = DEFAULT_FILE_MODE
    ) -> FileStat:
        raise _unsimulated("write_stream")

    async def open_port(self, sandbox_id: str, port: int) -> Any:
        raise _unsimulated("open_port")

    async def fncall(self, task: Any, pool: str | None = None) -> Any:
        # Typed loosely: the function-call types are not what this bench is about.
        raise _unsimulated("fncall")

    async def layers_in_use(self, *, unmount_idle: bool = False) -> set[str]:
        return set()

    async def close(self) -> None:
        """Nothing to release."""


def simulated_edges(
    prefix: str, count: int, capacity: int, *, latency_s: float = 0.0, wire: bool = True
) -> dict[str, SimulatedEdgeLink]:
    nodes = [f"{prefix}{i:03d}" for i in range(count)]
    return {n: SimulatedEdgeLink(n, 1, capacity, latency_s=latency_s, wire=wire) for n in nodes}
