"""The process table and directory watches of a remote edge (routes of :mod:`dsec.edge.server_processes`).

Mixed into :class:`~dsec.apiserver.remote_edge.RemoteEdgeLink`. Closing a process stream
closes its HTTP response: the edge sees the hang-up and detaches (the process runs on);
closing a watch stream removes the watch the same way.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
from pydantic import BaseModel, TypeAdapter, ValidationError

from dsec.protocol.models import invalid_request
from dsec.protocol.processes import (
    ProcessEvent,
    ProcessInfo,
    ProcessInput,
    ProcessSignal,
    ProcessStart,
    PtySize,
    WatchEvent,
)
from dsec.protocol.wire_client import ndjson

if TYPE_CHECKING:
    from dsec.apiserver.node_verdict import NodeView

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
_INFOS = TypeAdapter(list[ProcessInfo])
_JSON = {"Content-Type": "application/json"}


class RemoteProcesses:
    if TYPE_CHECKING:
        node: str
        url: str
        view: NodeView

        def _call(
            self,
            method: str,
            path: str,
            *,
            params: Mapping[str, str] | list[tuple[str, str]] | None = None,
            data: Any = None,
            headers: Mapping[str, str] | None = None,
            quick: bool = False,
        ) -> AbstractAsyncContextManager[aiohttp.ClientResponse]: ...
        def _parse(self, model: type[M], data: bytes) -> M: ...
        def _parse_list(self, adapter: TypeAdapter[list[T]], data: bytes) -> list[T]: ...
        async def _json(
            self, method: str, path: str, *, body: BaseModel | None = None, quick: bool = False, **kw: Any
        ) -> bytes: ...
        @staticmethod
        def _sandbox(sandbox_id: str, tail: str = "") -> str: ...

    def _lines(self, resp: aiohttp.ClientResponse, model: type[M]) -> AsyncIterator[M]:
        return ndjson(resp, model, peer=f"edge {self.node!r}")

    async def _process_events(
        self, method: str, path: str, data: str | None
    ) -> AsyncGenerator[ProcessEvent, None]:
        started_epoch = self.view.epoch
        async with self._call(method, path, data=data, headers=_JSON) as resp:
            async for event in self._lines(resp, ProcessEvent):
                yield event
                if event.t == "end":
                    return
        raise await self.view.ended_early("a process stream", self.url, started_epoch)

    def start_process(self, sandbox_id: str, req: ProcessStart) -> AsyncGenerator[ProcessEvent, None]:
        return self._process_events("POST", self._sandbox(sandbox_id, "/processes"), req.model_dump_json())

    def connect_process(self, sandbox_id: str, pid: int) -> AsyncGenerator[ProcessEvent, None]:
        return self._process_events("GET", self._sandbox(sandbox_id, f"/processes/{int(pid)}/events"), None)

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        raw = await self._json("GET", self._sandbox(sandbox_id, "/processes"), quick=True)
        return self._parse_list(_INFOS, raw)

    async def _control(self, sandbox_id: str, pid: int, what: str, body: BaseModel | None = None) -> None:
        await self._json("POST", self._sandbox(sandbox_id, f"/processes/{int(pid)}/{what}"), body=body)

    async def send_process_input(self, sandbox_id: str, pid: int, data: bytes) -> None:
        try:
            body = ProcessInput(data=data)
        except ValidationError as exc:
            raise invalid_request(exc) from exc
        await self._control(sandbox_id, pid, "input", body)

    async def close_process_stdin(self, sandbox_id: str, pid: int) -> None:
        await self._control(sandbox_id, pid, "close-stdin")

    async def signal_process(self, sandbox_id: str, pid: int, signal: int) -> None:
        try:
            body = ProcessSignal(signal=signal)
        except ValidationError as exc:
            raise invalid_request(exc) from exc
        await self._control(sandbox_id, pid, "signal", body)

    async def resize_process(self, sandbox_id: str, pid: int, size: PtySize) -> None:
        await self._control(sandbox_id, pid, "resize", size)

    async def watch_dir(
        self, sandbox_id: str, path: str, recursive: bool
    ) -> AsyncGenerator[WatchEvent, None]:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        async with self._call("GET", self._sandbox(sandbox_id, "/watch"), params=params) as resp:
            async for event in self._lines(resp, WatchEvent):
                yield event
