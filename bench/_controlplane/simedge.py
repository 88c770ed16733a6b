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
from typing import Any

from pydantic import TypeAdapter

from dsec.edge.link import check_routed
from dsec.executor.file_ops import DEFAULT_FILE_MODE
from dsec.iam.base import in_subtree
from dsec.protocol.errors import CapacityExhausted, SandboxNotFound
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import (
    DEFAULT_PROJECT,
    PROJECT_LABEL,
    RESERVED_LABEL_PREFIX,
    BulkAction,
    BulkResult,
    CommandResult,
    CommitRequest,
    ContainerSpec,
    ExecEvent,
    FileStat,
    LayerInfo,
    SandboxInfo,
    SandboxState,
    ShellRequest,
)

_UNUSED = "the control-plane bench simulates creates only"
_INFOS = TypeAdapter(list[SandboxInfo])


def fast_sandbox_id(node: str, epoch: int) -> str:
    """A valid ID like ``SandboxId.new`` makes, at a tenth of its cost (that costs ~30 us in
    ``secrets.choice``, which a real edge pays on its own machine, not the apiserver's)."""
    tag = base64.b32encode(os.urandom(15)).decode("ascii")[:20].lower()
    return str(SandboxId(node, epoch, tag))


class SimulatedEdgeLink:
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
            raise NotImplementedError(_UNUSED)
        result = BulkResult(action=action)
        for info in await self.list_sandboxes(labels):
            if in_subtree(info.project, within):
                result.done.append(await self.stop(info.id))
        return result

    async def run_shell(self, sandbox_id: str, req: ShellRequest) -> CommandResult:
        raise NotImplementedError(_UNUSED)

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        raise NotImplementedError(_UNUSED)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        raise NotImplementedError(_UNUSED)

    async def renew_lease(self, job: str, lease_s: float, within: str) -> tuple[int, float]:
        raise NotImplementedError(_UNUSED)

    async def trajectory(self, sandbox_id: str, after: int = 0, limit: int = 1000) -> list[Any]:
        raise NotImplementedError(_UNUSED)

    async def changes(self, sandbox_id: str, under: str = "/") -> list[Any]:
        raise NotImplementedError(_UNUSED)

    async def fork_spec(self, sandbox_id: str, ref: str) -> tuple[ContainerSpec, LayerInfo]:
        raise NotImplementedError(_UNUSED)

    async def fork_local(
        self, sandbox_id: str, new_ids: list[str], labels: dict[str, str] | None = None
    ) -> list[SandboxInfo]:
        raise NotImplementedError(_UNUSED)

    async def screenshot(self, sandbox_id: str) -> bytes:
        raise NotImplementedError(_UNUSED)

    async def send_input(self, sandbox_id: str, events: list[Any]) -> int:
        raise NotImplementedError(_UNUSED)

    def exec_stream(
        self,
        sandbox_id: str,
        argv: list[str],
        *,
        stdin: bytes | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        idempotency_key: str | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        raise NotImplementedError(_UNUSED)

    async def commit(self, sandbox_id: str, req: CommitRequest) -> LayerInfo:
        raise NotImplementedError(_UNUSED)

    def read_stream(self, sandbox_id: str, path: str) -> AsyncGenerator[bytes, None]:
        raise NotImplementedError(_UNUSED)

    async def write_stream(
        self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes], *, mode: int = DEFAULT_FILE_MODE
    ) -> FileStat:
        raise NotImplementedError(_UNUSED)

    async def stat(self, sandbox_id: str, path: str) -> FileStat:
        raise NotImplementedError(_UNUSED)

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileStat]:
        raise NotImplementedError(_UNUSED)

    async def mkdir(self, sandbox_id: str, path: str, *, parents: bool = True) -> FileStat:
        raise NotImplementedError(_UNUSED)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        raise NotImplementedError(_UNUSED)

    async def fncall(self, task: Any, pool: str | None = None) -> Any:
        # Typed loosely: the function-call types are not what this bench is about.
        raise NotImplementedError(_UNUSED)

    async def layers_in_use(self, *, unmount_idle: bool = False) -> set[str]:
        return set()

    async def close(self) -> None:
        """Nothing to release."""


def simulated_edges(
    prefix: str, count: int, capacity: int, *, latency_s: float = 0.0, wire: bool = True
) -> dict[str, SimulatedEdgeLink]:
    nodes = [f"{prefix}{i:03d}" for i in range(count)]
    return {n: SimulatedEdgeLink(n, 1, capacity, latency_s=latency_s, wire=wire) for n in nodes}
