"""One request ID from the SDK through the apiserver to the edge, and the audit log, on the real
node: a stat of a missing file fails on the edge, and the error the SDK raises, the apiserver's
log line and the edge's log line all name the ID the caller chose; an admin action lands in the
audit log, and a project key's attempt at one is refused and written there as refused."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dsec.apiserver.app import ApiServer
from dsec.apiserver.remote_edge import RemoteEdgeLink
from dsec.edge.server import EdgeServer
from dsec.node.embedded import EmbeddedNode
from dsec.observe.audit import AuditLog
from dsec.observe.logs import RequestIdFilter
from dsec.observe.request_ids import request_id, valid
from dsec.placement.placement import Placement, Watcher
from dsec.protocol.errors import FileNotFound, Forbidden
from dsec.protocol.http import listen
from dsec.sdk.client import DSecClient, Sandbox


class Records(logging.Handler):
    """The records of the ``dsec`` loggers, with the request ID the real handler adds."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.addFilter(RequestIdFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def of(self, rid: str) -> dict[str, list[logging.LogRecord]]:
        out: dict[str, list[logging.LogRecord]] = {}
        for r in self.records:
            if getattr(r, "request_id", None) == rid:
                out.setdefault(r.name, []).append(r)
        return out


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    root = logging.getLogger("dsec")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)  # the access lines of successes are DEBUG
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.fixture(scope="module")
async def remote_url(node: EmbeddedNode, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """A second apiserver reaching the node's edge over HTTP, as a cluster's do: the hop where
    the ID must travel as a header."""
    secret = secrets.token_urlsafe(32)
    edge_server = EdgeServer(node.edge, secret)
    await edge_server.start("127.0.0.1", 0)
    link = RemoteEdgeLink(edge_server.url, secret, node.config.node)
    links = {node.config.node: link}
    audit = AuditLog(tmp_path_factory.mktemp("reqlog") / "audit.log")
    api = ApiServer(links, Placement(Watcher(links)), node.store, node.iam, audit=audit)
    runner, url = await listen(api.app(), "127.0.0.1", 0)
    try:
        yield url
    finally:
        await runner.cleanup()
        await link.close()
        await edge_server.close()
        audit.close()


async def _missing_stat(url: str, key: str, sandbox_id: str, rid: str) -> FileNotFound:
    async with DSecClient(url, key) as c:
        sb = await c.get(sandbox_id)
        with request_id(rid), pytest.raises(FileNotFound) as caught:
            await sb.stat("/no/such/file")
    return caught.value


async def test_one_id_follows_a_failed_request_to_the_edge_and_back(
    node: EmbeddedNode, remote_url: str, sandbox: Sandbox, records: Records
) -> None:
    # Through an apiserver that reaches the edge over HTTP: both servers log the caller's ID.
    err = await _missing_stat(remote_url, node.api_key, sandbox.id, "e2e-remote-missing-1")
    assert err.request_id == "e2e-remote-missing-1"
    seen = records.of("e2e-remote-missing-1")
    (api_line,) = seen["dsec.apiserver.access"]
    (edge_line,) = seen["dsec.edge.access"]
    assert api_line.status == 404 and edge_line.status == 404  # type: ignore[attr-defined]
    assert sandbox.id in edge_line.path and "stat" in edge_line.path  # type: ignore[attr-defined]

    # The embedded node (`dsec up`), whose apiserver calls its edge in-process: the same ID
    # comes back, and the apiserver's line names it.
    err = await _missing_stat(node.url, node.api_key, sandbox.id, "e2e-embedded-missing-1")
    assert err.request_id == "e2e-embedded-missing-1"
    assert records.of("e2e-embedded-missing-1")["dsec.apiserver.access"][0].status == 404  # type: ignore[attr-defined]


def _audit_lines(path: Path, rid: str) -> list[dict[str, object]]:
    return [x for x in map(json.loads, path.read_text().splitlines()) if x["request_id"] == rid]


async def test_admin_actions_land_in_the_audit_log_and_a_project_keys_attempt_is_refused(
    node: EmbeddedNode, client: DSecClient
) -> None:
    audit = node.config.data_dir / "audit.log"  # the embedded node's default
    name = f"reqlog-{secrets.token_hex(4)}"
    with request_id(f"{name}-create"):
        await client.create_project("root", name, sandboxes=1)
    try:
        with request_id(f"{name}-key"):
            key = await client.issue_key(f"root/{name}", name="reqlog")
        async with DSecClient(node.url, key) as project_client:
            with request_id(f"{name}-escalate"), pytest.raises(Forbidden) as refused:
                await project_client.issue_key(f"root/{name}", admin=True)
        assert refused.value.request_id == f"{name}-escalate"
    finally:
        with request_id(f"{name}-delete"):
            await client.delete_project(f"root/{name}")

    (created,) = _audit_lines(audit, f"{name}-create")
    assert created["action"] == "project.create" and created["outcome"] == "ok"
    target, who = created["target"], created["who"]
    assert isinstance(target, dict) and isinstance(who, dict)
    assert (target["parent"], target["name"], who["admin"]) == ("root", name, True)
    (issued,) = _audit_lines(audit, f"{name}-key")
    assert (issued["action"], issued["outcome"]) == ("key.issue", "ok")
    assert key not in json.dumps(issued)  # the secret is in the answer only
    (escalation,) = _audit_lines(audit, f"{name}-escalate")
    assert (escalation["action"], escalation["outcome"], escalation["error"]) == (
        "key.issue",
        "refused",
        "forbidden",
    )
    who = escalation["who"]
    assert isinstance(who, dict) and (who["project"], who["admin"]) == (f"root/{name}", False)
    assert who["key_id"] and who["key_id"] != created["who"]["key_id"]  # type: ignore[index]
    assert escalation["target"] == {"project": f"root/{name}", "admin": True, "name": ""}
    (deleted,) = _audit_lines(audit, f"{name}-delete")
    assert (deleted["action"], deleted["outcome"]) == ("project.delete", "ok")


CLOSED_PORT = 9  # discard: nothing listens on it in a sandbox


async def _tunnel_error(url: str, key: str, sandbox_id: str, rid: str) -> tuple[str | None, dict[str, Any]]:
    """Open the sandbox's port tunnel on a closed port: the handshake's ``X-Request-ID`` and
    the error body sent inside the socket."""
    ws_url = url.replace("http", "ws", 1) + f"/v1/sandboxes/{sandbox_id}/ports/{CLOSED_PORT}"
    headers = {"Authorization": f"Bearer {key}", "X-Request-ID": rid}
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url, headers=headers) as ws:
        echoed = ws._response.headers.get("X-Request-ID")
        first = await ws.receive()
    assert first.type is aiohttp.WSMsgType.TEXT, first
    body: dict[str, Any] = json.loads(first.data)
    return echoed, body


async def test_a_port_tunnel_carries_the_request_id_to_the_edge_and_back(
    node: EmbeddedNode, remote_url: str, sandbox: Sandbox, records: Records
) -> None:
    # Through an apiserver that reaches the edge over HTTP: the edge refuses the closed port
    # with the caller's ID, and both hops log it before answering.
    echoed, body = await _tunnel_error(remote_url, node.api_key, sandbox.id, "e2e-port-remote-1")
    assert echoed == "e2e-port-remote-1"
    assert body["status"] == 409 and body["error"]["reason"] == "port_closed"
    assert body["error"]["request_id"] == "e2e-port-remote-1"
    assert len(records.of("e2e-port-remote-1")["dsec.edge.ports"]) == 2  # the edge's, the apiserver's

    # The embedded node, whose apiserver opens the port in-process: the same ID comes back.
    echoed, body = await _tunnel_error(node.url, node.api_key, sandbox.id, "e2e-port-embedded-1")
    assert echoed == "e2e-port-embedded-1" and body["error"]["request_id"] == "e2e-port-embedded-1"

    # E2B's traffic to a sandbox port (no API key, the sandbox and port in headers): its
    # answer names the ID, and the edge's refusal was logged under it.
    headers = {"E2b-Sandbox-Id": sandbox.id, "E2b-Sandbox-Port": str(CLOSED_PORT)}
    async with (
        aiohttp.ClientSession() as http,
        http.get(remote_url + "/", headers={**headers, "X-Request-ID": "e2e-port-e2b-1"}) as resp,
    ):
        assert resp.status == 502 and resp.headers.get("X-Request-ID") == "e2e-port-e2b-1"
    assert records.of("e2e-port-e2b-1")["dsec.edge.ports"]
    # A client that sends none gets one made for it, on the answer.
    async with aiohttp.ClientSession() as http, http.get(remote_url + "/", headers=headers) as resp:
        assert resp.status == 502 and valid(resp.headers.get("X-Request-ID"))
