"""The SDK sends a sandbox call as its op (protocol/ops.py) to ``POST /v1/sandboxes/{id}/ops/{kind}``
and answers with the type the op names: bytes as bytes, no body as None, and an answer of the
wrong shape as the platform's failure, not the caller's."""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from dsec.protocol.errors import InfraFailure, InfraReason
from dsec.protocol.models import SandboxInfo
from dsec.sdk._transport import Transport
from dsec.sdk.client import Sandbox

PNG = b"\x89PNG\r\n\x1a\n\x00\xff"
SID = "sb-n-1-abc"
SEEN = web.AppKey("seen", list[Any])


def _info() -> dict[str, Any]:
    return {
        "id": SID, "state": "running", "backend": "fake", "node": "n", "layers": [], "labels": {},
        "init_user": "root", "memory_limit_mb": 64, "cpu_cores_limit": 0.5, "created_at": 0.0,
        "last_active_at": 0.0,
    }  # fmt: skip


async def _op(request: web.Request) -> web.Response:
    kind = request.match_info["kind"]
    request.app[SEEN].append((request.match_info["id"], kind, json.loads(await request.read())))
    answers: dict[str, Any] = {
        "screenshot": {"png": base64.b64encode(PNG).decode()},
        "remove": None,
        "send_input": 3,
        "list_dir": [
            {
                "path": "/w/x",
                "name": "x",
                "type": "file",
                "size": 1,
                "mode": 420,
                "mtime": 0,
                "uid": 0,
                "gid": 0,
            }
        ],
        "stat": {"path": 7},  # not a FileStat
    }
    return web.json_response(answers[kind])


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[Any]]]:
    app = web.Application()
    app[SEEN] = []
    app.router.add_post("/v1/sandboxes/{id}/ops/{kind}", _op)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}", app[SEEN]
    finally:
        await runner.cleanup()


async def test_calls_go_as_ops_and_come_back_typed(server: tuple[str, list[Any]]) -> None:
    url, seen = server
    transport = Transport(url, "key", timeout=30)
    try:
        sb = Sandbox(transport, SandboxInfo.model_validate(_info()))
        assert await sb.screenshot() == PNG  # base64 on the wire, bytes to the caller
        await sb.remove("/w/x", recursive=True)  # answered with no body
        assert await sb.type_text("hi") == 3
        [entry] = await sb.list_dir("/w")
        assert (entry.path, entry.size) == ("/w/x", 1)
        with pytest.raises(InfraFailure) as exc:
            await sb.stat("/w/x")
        assert exc.value.reason == InfraReason.protocol
        assert [(sid, kind) for sid, kind, _ in seen] == [
            (SID, "screenshot"),
            (SID, "remove"),
            (SID, "send_input"),
            (SID, "list_dir"),
            (SID, "stat"),
        ]
        assert seen[1][2] == {"kind": "remove", "path": "/w/x", "recursive": True}
    finally:
        await transport.close()
