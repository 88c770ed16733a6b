"""envd's ``process.Process`` service over the edge's process table.

A command's pipes (or its terminal) stay with the edge, not with this request: a Start stream
that the client drops leaves the process running (E2B's background commands), and Connect
attaches to it again by pid or tag. ``Connect-Timeout-Ms`` on Start bounds the *process*, as
envd does: it is killed when the deadline passes, whether or not anyone is still attached.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import signal as signals
import socket
import struct
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from aiohttp import web

from dsec.apiserver.e2b.connect import ConnectError, ServerStream, field, from_dsec, pump, timeout_s
from dsec.edge.link import EdgeLink
from dsec.protocol.errors import DSecError, SandboxNotFound
from dsec.protocol.models import SandboxState
from dsec.protocol.processes import ProcessEvent, ProcessInfo, ProcessStart, PtySize

_KILL_WAIT_S = 5.0
_DEADLINE_ERROR = "timeout"  # a ProcessEvent end's error for a process killed at its timeout
_ALIVE = (SandboxState.creating, SandboxState.running, SandboxState.paused)


class SandboxCut(Exception):
    """The sandbox went while a stream was open. E2B's proxy loses envd with the sandbox's VM
    and drops the connection mid-stream; the SDKs then probe ``/health`` (a 502) and raise
    their "sandbox was killed" TimeoutException. The handler drops the connection the same way."""


async def _sandbox_gone(link: EdgeLink, sandbox_id: str) -> bool:
    try:
        return (await link.get(sandbox_id)).state not in _ALIVE
    except SandboxNotFound:
        return True


async def envd_ends(
    events: AsyncGenerator[ProcessEvent, None], link: EdgeLink, sandbox_id: str, deadline: bool
) -> AsyncGenerator[ProcessEvent, None]:
    """``events`` with their ends as envd's: a process killed at its Start's
    ``Connect-Timeout-Ms`` ends the call with ``deadline_exceeded`` and no end event (envd's
    request context expires with the process's), and one killed by its sandbox's stop cuts
    the connection (:class:`SandboxCut`)."""
    started = False
    try:
        async for event in events:
            if event.t == "end" and event.error:
                if deadline and event.error == _DEADLINE_ERROR:
                    raise ConnectError("deadline_exceeded", "context deadline exceeded")
                if await _sandbox_gone(link, sandbox_id):
                    raise SandboxCut(event.error)
            started = True
            yield event
    except SandboxNotFound as exc:
        if started:
            raise SandboxCut(str(exc)) from exc
        raise
    finally:
        await events.aclose()


_SIGNALS = {"SIGNAL_SIGTERM": signals.SIGTERM, "SIGNAL_SIGKILL": signals.SIGKILL, 15: 15, 9: 9}


def _b64(data: bytes | None) -> str:
    return base64.b64encode(data or b"").decode()


def _unb64(text: Any, what: str) -> bytes:
    try:
        return base64.b64decode(text or "", validate=True)
    except (ValueError, TypeError) as exc:
        raise ConnectError("invalid_argument", f"{what} must be base64") from exc


def event_wire(event: ProcessEvent) -> dict[str, Any]:
    """One ProcessEvent as envd's ``ProcessEvent`` message."""
    if event.t == "start":
        return {"start": {"pid": event.pid}}
    if event.t in ("out", "err", "pty"):
        name = {"out": "stdout", "err": "stderr", "pty": "pty"}[event.t]
        return {"data": {name: _b64(event.data)}}
    end: dict[str, Any] = {"exited": event.signal is None}
    if event.signal is None:
        end["status"] = f"exit status {event.exit_code}"
        if event.exit_code:
            end["exitCode"] = event.exit_code
    else:
        # Go's ProcessState: -1 and "signal: killed" for a death by signal, what envd sends.
        end["exitCode"] = -1
        end["status"] = f"signal: {_signal_name(event.signal)}"
    if event.error:
        end["error"] = event.error
    return {"end": end}


def _signal_name(number: int) -> str:
    names = {signals.SIGKILL: "killed", signals.SIGTERM: "terminated", signals.SIGINT: "interrupt"}
    with contextlib.suppress(ValueError):
        return names.get(signals.Signals(number), signals.Signals(number).name.lower().removeprefix("sig"))
    return str(number)


def _wrap(event: ProcessEvent) -> dict[str, Any]:
    return {"event": event_wire(event)}


_KEEPALIVE: dict[str, Any] = {"event": {"keepalive": {}}}


def info_wire(info: ProcessInfo) -> dict[str, Any]:
    config: dict[str, Any] = {"cmd": info.argv[0], "args": info.argv[1:], "envs": info.env, "cwd": info.cwd}
    out: dict[str, Any] = {"config": config, "pid": info.pid}
    if info.tag is not None:
        out["tag"] = info.tag
    return out


def _pty_size(msg: dict[str, Any] | None) -> PtySize | None:
    if not msg:
        return None
    size = msg.get("size") or {}
    try:
        return PtySize(rows=int(size.get("rows", 24)), cols=int(size.get("cols", 80)))
    except (ValueError, TypeError, OverflowError, AttributeError) as exc:  # int(1e400): overflow
        raise ConnectError("invalid_argument", f"bad pty size: {size}") from exc


def start_request(msg: dict[str, Any], user: str | None, deadline: float | None) -> ProcessStart:
    process = msg.get("process") or {}
    cmd = process.get("cmd")
    if not isinstance(cmd, str) or not cmd:
        raise ConnectError("invalid_argument", "process.cmd is required")
    args = process.get("args") or []
    envs = process.get("envs") or {}
    if not isinstance(args, list) or not isinstance(envs, dict):
        raise ConnectError("invalid_argument", "process.args must be a list and process.envs an object")
    try:
        return ProcessStart(
            argv=[cmd, *map(str, args)],
            env={str(k): str(v) for k, v in envs.items()},
            cwd=process.get("cwd") or None,
            user=user,
            tag=msg.get("tag"),
            pty=_pty_size(msg.get("pty")),
            stdin=bool(msg.get("stdin", False)),
            timeout=deadline,
        )
    except ValueError as exc:
        raise ConnectError("invalid_argument", str(exc)) from exc


async def select(link: EdgeLink, sandbox_id: str, msg: dict[str, Any] | None) -> int:
    """The pid a ``ProcessSelector`` names (a tag is looked up among running processes)."""
    selector = msg or {}
    if "pid" in selector:
        pid = selector["pid"]
        if not isinstance(pid, int) or not 0 < pid < 1 << 31:  # pid_t; 1e400 or "x" are no pid
            raise ConnectError("invalid_argument", "process.pid must be a process ID")
        return pid
    tag = selector.get("tag")
    if not isinstance(tag, str):
        raise ConnectError("invalid_argument", "give process.pid or process.tag")
    for info in await link.list_processes(sandbox_id):
        if info.tag == tag:
            return info.pid
    raise ConnectError("not_found", f"no running process tagged {tag!r}")


async def _pump_or_cut(
    stream: ServerStream, events: AsyncGenerator[ProcessEvent, None]
) -> web.StreamResponse:
    try:
        return await pump(stream, events, _wrap, _KEEPALIVE)
    except SandboxCut:
        # The stream's end never comes, as when E2B's proxy resets the HTTP/2 stream of a VM
        # that went; the SDK then probes /health and raises its "sandbox was killed" error.
        # HTTP/1.1 has no stream reset: each client stack is cut the way it reads as a
        # transport failure (_resets).
        transport = stream.request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None and _resets(stream.request):
            with contextlib.suppress(OSError):  # closed with a RST
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if stream.request.protocol is not None:
            stream.request.protocol.force_close()
        return stream.response


def _resets(request: web.Request) -> bool:
    """Whether a cut stream is closed with a TCP reset rather than a FIN: for the Python SDK
    from 2.35, whose envd calls go through connect-python over pyqwest (``User-Agent:
    connectrpc/...``; 2.45 and 2.63 measured). pyqwest takes a body cut at a FIN for an HTTP
    protocol error (2.45 then raises a generic timeout, no health probe) and a reset for a
    transport failure. 2.34 and earlier (httpx, ``e2b-python-sdk/...``) and the JS SDK read a
    FIN as the transport failure, and a reset as an error of their own (2.34: httpx's
    ReadError)."""
    return request.headers.get("User-Agent", "").startswith("connectrpc/")


class ProcessService:
    """The unary and streaming handlers, each given the request's sandbox, link and user."""

    async def start(
        self, request: web.Request, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str | None
    ) -> web.StreamResponse:
        stream = ServerStream(request)
        try:
            req = start_request(msg, user, timeout_s(request))
        except ConnectError as exc:
            return await stream.end(exc)
        events = envd_ends(link.start_process(sandbox_id, req), link, sandbox_id, req.timeout is not None)
        return await _pump_or_cut(stream, events)

    async def connect(
        self, request: web.Request, msg: dict[str, Any], link: EdgeLink, sandbox_id: str, user: str | None
    ) -> web.StreamResponse:
        stream = ServerStream(request)
        try:
            pid = await select(link, sandbox_id, msg.get("process"))
        except ConnectError as exc:
            return await stream.end(exc)
        except DSecError as exc:
            return await stream.end(from_dsec(exc))
        events = envd_ends(link.connect_process(sandbox_id, pid), link, sandbox_id, False)
        return await _pump_or_cut(stream, events)

    async def list(self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str) -> dict[str, Any]:
        return {"processes": [info_wire(i) for i in await link.list_processes(sandbox_id)]}

    async def send_input(self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str) -> dict[str, Any]:
        pid = await select(link, sandbox_id, msg.get("process"))
        await self._input(link, sandbox_id, pid, msg.get("input") or {})
        return {}

    @staticmethod
    async def _input(link: EdgeLink, sandbox_id: str, pid: int, given: dict[str, Any]) -> None:
        raw = given.get("stdin", given.get("pty"))
        if raw is None:
            raise ConnectError("invalid_argument", "input.stdin or input.pty is required")
        await link.send_process_input(sandbox_id, pid, _unb64(raw, "input"))

    async def stream_input(
        self, messages: AsyncIterator[dict[str, Any]], link: EdgeLink, sandbox_id: str
    ) -> dict[str, Any]:
        """Client stream: a ``start`` naming the process, then ``data`` in order."""
        pid: int | None = None
        async for msg in messages:
            if "start" in msg:
                pid = await select(link, sandbox_id, (msg["start"] or {}).get("process"))
            elif "data" in msg:
                if pid is None:
                    raise ConnectError("failed_precondition", "send a start message before data")
                await self._input(link, sandbox_id, pid, (msg["data"] or {}).get("input") or {})
        return {}

    async def close_stdin(self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str) -> dict[str, Any]:
        await link.close_process_stdin(sandbox_id, await select(link, sandbox_id, msg.get("process")))
        return {}

    async def send_signal(self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str) -> dict[str, Any]:
        pid = await select(link, sandbox_id, msg.get("process"))
        name = msg.get("signal", "SIGNAL_UNSPECIFIED")
        number = _SIGNALS.get(name) if isinstance(name, str) else None  # a list is unhashable
        if number is None:
            raise ConnectError(
                "invalid_argument",
                f"signal must be SIGNAL_SIGTERM or SIGNAL_SIGKILL, not {msg.get('signal')!r}",
            )
        # Attach first: after a kill, the caller's next List must not show the process, so the
        # answer waits (briefly) for its end; attaching after the signal could miss it.
        events = link.connect_process(sandbox_id, pid) if number == signals.SIGKILL else None
        try:
            if events is not None:
                await anext(events)  # start: attached
            await link.signal_process(sandbox_id, pid, int(number))
            if events is not None:
                with contextlib.suppress(TimeoutError, StopAsyncIteration):
                    async with asyncio.timeout(_KILL_WAIT_S):
                        async for event in events:
                            if event.t == "end":
                                break
        finally:
            if events is not None:
                await events.aclose()
        return {}

    async def update(self, msg: dict[str, Any], link: EdgeLink, sandbox_id: str) -> dict[str, Any]:
        pid = await select(link, sandbox_id, msg.get("process"))
        size = _pty_size(field(msg, "pty"))
        if size is not None:
            await link.resize_process(sandbox_id, pid, size)
        return {}
