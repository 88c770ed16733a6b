"""Sandbox ports through ``sandbox.get_host(port)``, and signed file URLs that name no sandbox
(issue 30). The answers asserted are E2B's proxy's (e2b-dev/infra: packages/shared/pkg/proxy,
packages/orchestrator/pkg/proxy): 502 for a sandbox not found or a closed port, 403 for a
missing or wrong ``e2b-traffic-access-token``, 400 for a Host or port that names nothing.

The test process plays the user's browser: it connects to the apiserver with the Host
``get_host`` returned (a wildcard DNS record would send it there), or with E2B's routing
headers (``E2b-Sandbox-Id``/``E2b-Sandbox-Port``), which need no DNS at all.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit

import aiohttp
import pytest

from dsec.apiserver.remote_edge import RemoteEdgeLink
from dsec.edge.server import EdgeServer
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import Conflict, SandboxNotFound
from tests.e2b.conftest import E2B

DOMAIN = "sandboxes.dsec.test"
# A web server bound to the sandbox's loopback only (E2B's envd forwards such ports too), and
# a wait, inside the sandbox, until it listens.
_SERVE = """
sbx = Sandbox.create(timeout=120, network=NETWORK)
sbx.files.write("/tmp/www/hello.txt", "hello from the sandbox")
sbx.commands.run("cd /tmp/www && exec python3 -m http.server 8000 --bind 127.0.0.1", background=True)
sbx.commands.run("for i in $(seq 400); do (exec 3<>/dev/tcp/127.0.0.1/8000) 2>/dev/null && exit 0;"
                 " sleep 0.05; done; exit 1")
print(json.dumps({"id": sbx.sandbox_id, "host": sbx.get_host(8000), "closed": sbx.get_host(8001),
                  "traffic": sbx.traffic_access_token, "envd": sbx._envd_access_token}))
"""
# A WebSocket echo server in plain python3 (no package in the sandbox): the handshake, then
# each frame sent back unmasked.
_ECHO = r"""
import base64, hashlib, socket, struct, threading
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def serve(c):
    f = c.makefile("rb")
    headers = {}
    method = f.readline().split(b" ")[0]
    while line := f.readline().strip():
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    key = headers.get("sec-websocket-key")
    if key is None:  # plain HTTP: the body (by length or chunked) echoed back, chunked
        if "content-length" in headers:
            body = f.read(int(headers["content-length"]))
        else:
            body = b""
            while size := int(f.readline().split(b";")[0], 16):
                body += f.read(size)
                f.readline()
            f.readline()
        half = len(body) // 2
        c.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Method: " + method + b"\r\n\r\n")
        for piece in (body[:half], body[half:]):
            if piece:
                c.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        c.sendall(b"0\r\n\r\n")
        c.close()
        return
    accept = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
    c.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Accept: {accept}\r\n\r\n").encode())
    while len(head := f.read(2)) == 2:
        op, n = head[0] & 15, head[1] & 127
        if n == 126:
            n = struct.unpack(">H", f.read(2))[0]
        elif n == 127:
            n = struct.unpack(">Q", f.read(8))[0]
        mask = f.read(4)
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(f.read(n)))
        if op == 8:
            c.sendall(b"\x88" + bytes([len(data)]) + data)  # the close frame's code, echoed
            break
        size = bytes([n]) if n < 126 else b"\x7e" + struct.pack(">H", n) if n < 65536 else (
            b"\x7f" + struct.pack(">Q", n))
        c.sendall(bytes([0x80 | op]) + size + data)
    c.close()
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 8765))
srv.listen()
while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


@pytest.fixture
def domain(node: EmbeddedNode) -> Iterator[str]:
    """The node run as with ``--e2b-domain sandboxes.dsec.test``."""
    options = node.api.e2b.options
    before, options.domain = options.domain, DOMAIN
    yield DOMAIN
    options.domain = before


async def _serve(
    e2b: E2B, network: dict[str, object] | None = None, key: str | None = None
) -> dict[str, str]:
    return dict(await e2b.run(f"NETWORK = {network!r}\n" + _SERVE, key=key, timeout=120))


async def _get(node: EmbeddedNode, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http, http.get(node.url + path, headers=headers) as resp:
        return resp.status, await resp.read()


async def test_get_host_reaches_a_web_server_in_the_sandbox(
    e2b: E2B, node: EmbeddedNode, domain: str
) -> None:
    got = await _serve(e2b)
    sid = got["id"]
    assert got["host"] == f"8000-{sid}.{domain}"  # the SDK's get_host over the `domain` DSec answered
    assert got["traffic"] is None  # public traffic: E2B's default

    # By Host, as a wildcard DNS record would bring the request here.
    status, body = await _get(node, "/hello.txt", {"Host": got["host"]})
    assert (status, body) == (200, b"hello from the sandbox")
    # By E2B's routing headers: no DNS needed.
    status, body = await _get(node, "/hello.txt", {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"})
    assert (status, body) == (200, b"hello from the sandbox")
    status, body = await _get(node, "/missing", {"Host": got["host"]})
    assert status == 404  # the server inside's answer, passed through

    # A port nothing listens on: E2B's proxy's 502, never a 500.
    status, body = await _get(node, "/", {"Host": got["closed"]})
    assert status == 502
    assert json.loads(body) == {
        "sandboxId": sid,
        "message": "The sandbox is running but port is not open",
        "port": 8001,
        "code": 502,
    }
    # Hosts and ports that name nothing: 400.
    for host in (f"70000-{sid}.{domain}", f"x-{sid}.{domain}", f"{domain}-nodash.{domain}"):
        status, _ = await _get(node, "/", {"Host": host})
        assert status == 400, host
    status, _ = await _get(node, "/", {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "0"})
    assert status == 400
    status, _ = await _get(node, "/", {"Host": f"8000-nosuchsandbox.{domain}"})
    assert status == 400

    # envd's port by Host: envd's routes for that sandbox, with no E2b-Sandbox-Id header.
    envd = {"Host": f"49983-{sid}.{domain}", "X-Access-Token": got["envd"]}
    assert (await _get(node, "/health", envd))[0] == 204
    status, body = await _get(node, "/files?path=/tmp/www/hello.txt", envd)
    assert (status, body) == (200, b"hello from the sandbox")
    status, _ = await _get(node, "/v1/sandboxes", envd)
    assert status == 404  # envd's port serves envd alone, not DSec's API

    await node.link.pause(sid)  # paused, and not auto-resuming: E2B's proxy finds no sandbox
    status, body = await _get(node, "/hello.txt", {"Host": got["host"]})
    assert status == 502 and json.loads(body)["message"] == "The sandbox was not found"
    assert (await node.link.get(sid)).state.value == "paused"  # and traffic did not wake it
    await node.link.stop(sid)  # a sandbox that has ended: the proxy's "not found"
    status, body = await _get(node, "/hello.txt", {"Host": got["host"]})
    assert status == 502 and json.loads(body)["message"] == "The sandbox was not found"


async def test_the_traffic_token_is_required_when_asked(e2b: E2B, node: EmbeddedNode, domain: str) -> None:
    private = await _serve(e2b, {"allow_public_traffic": False})
    other = await _serve(e2b, {"allow_public_traffic": False}, key=e2b.other_key)  # another project's
    token = private["traffic"]
    assert token and token != private["envd"] and token != other["traffic"]
    host = private["host"]

    status, body = await _get(node, "/hello.txt", {"Host": host})
    assert status == 403 and "'e2b-traffic-access-token' is missing" in json.loads(body)["message"]
    for wrong in (private["envd"], other["traffic"], "x" * 64):
        status, body = await _get(node, "/hello.txt", {"Host": host, "e2b-traffic-access-token": wrong})
        assert status == 403 and "is invalid" in json.loads(body)["message"]
    status, body = await _get(node, "/hello.txt", {"Host": host, "e2b-traffic-access-token": token})
    assert (status, body) == (200, b"hello from the sandbox")
    headers = {"E2b-Sandbox-Id": private["id"], "E2b-Sandbox-Port": "8000", "e2b-traffic-access-token": token}
    assert (await _get(node, "/hello.txt", headers))[0] == 200


async def test_a_websocket_round_trip(e2b: E2B, node: EmbeddedNode, domain: str) -> None:
    got = await e2b.run(
        f"""
        sbx = Sandbox.create(timeout=120)
        sbx.files.write("/tmp/echo.py", {_ECHO!r})
        sbx.commands.run("exec python3 /tmp/echo.py", background=True)
        sbx.commands.run("for i in $(seq 400); do (exec 3<>/dev/tcp/127.0.0.1/8765) 2>/dev/null && exit 0;"
                         " sleep 0.05; done; exit 1")
        print(json.dumps(sbx.get_host(8765)))
        """,
        timeout=120,
    )
    big = bytes(range(256)) * 1024  # 256 KiB: several messages' worth of stream chunks
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(node.url + "/echo", headers={"Host": got}) as ws,
    ):
        await ws.send_str("hello")
        assert (await ws.receive()).data == "hello"
        await ws.send_bytes(big)
        assert (await ws.receive()).data == big
        await ws.close()
    assert ws.close_code == 1000

    # Plain HTTP to the same server: request bodies by length and chunked, a chunked answer.
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield big[:50_000]

    async with aiohttp.ClientSession() as http:
        async with http.post(node.url + "/p?q=1", data=big, headers={"Host": got}) as resp:
            assert resp.status == 200 and resp.headers["X-Method"] == "POST"
            assert await resp.read() == big
        async with http.put(node.url + "/p", data=chunks(), headers={"Host": got}) as resp:
            assert resp.headers["X-Method"] == "PUT" and await resp.read() == big[:50_000] * 4


async def test_signed_urls_made_with_e2b_sandbox_url_need_no_header(e2b: E2B, node: EmbeddedNode) -> None:
    got = await e2b.run("""
        sbx = Sandbox.create(timeout=120)
        sbx.files.write("/tmp/signed.txt", "signed content")
        print(json.dumps({"down": sbx.download_url("/tmp/signed.txt"), "up": sbx.upload_url("/tmp/up.txt"),
                          "expiring": sbx.download_url("/tmp/signed.txt", use_signature_expiration=120),
                          "id": sbx.sandbox_id}))
        """)
    assert urlsplit(got["down"]).netloc == urlsplit(node.url).netloc  # E2B_SANDBOX_URL: no ID in it
    async with aiohttp.ClientSession() as http:  # no E2b-Sandbox-Id, no access token: curl's request
        for url in (got["down"], got["expiring"]):
            async with http.get(url) as resp:
                assert (resp.status, await resp.read()) == (200, b"signed content")
        form = aiohttp.FormData()
        form.add_field("file", b"uploaded", filename="up.txt")
        async with http.post(got["up"], data=form) as resp:
            assert resp.status == 200, await resp.text()
        tampered = got["down"].replace("signed.txt", "other.txt")
        async with http.get(tampered) as resp:
            assert resp.status in (400, 401)  # no sandbox's token signs it
    chunks = [c async for c in node.link.read_stream(got["id"], "/tmp/up.txt")]
    assert b"".join(chunks) == b"uploaded"


async def test_a_remote_edge_opens_ports_too(e2b: E2B, node: EmbeddedNode, domain: str) -> None:
    """The cluster path: the same port through the edge server's WebSocket route."""
    got = await _serve(e2b)
    server = EdgeServer(node.link, "ports-test-secret-0123456789")
    url = await server.start()
    remote = RemoteEdgeLink(url, "ports-test-secret-0123456789", node.link.node)
    try:
        stream = await remote.open_port(got["id"], 8000)
        try:
            await stream.write(b"GET /hello.txt HTTP/1.0\r\nHost: x\r\n\r\n")
            await stream.write_eof()
            answer = b""
            while data := await stream.read():
                answer += data
        finally:
            await stream.close()
        assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(b"hello from the sandbox")
        with pytest.raises(Conflict) as closed:
            await remote.open_port(got["id"], 8001)
        assert closed.value.reason == "port_closed"
        await node.link.stop(got["id"])
        with pytest.raises(SandboxNotFound):
            await remote.open_port(got["id"], 8000)
    finally:
        with contextlib.suppress(Exception):
            await remote.close()
        await server.close()
