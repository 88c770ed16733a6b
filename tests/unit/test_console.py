"""The web console's routes: its pages need no key, its assets come from a fixed list (and say
how to install them when they are missing), and its terminal WebSocket checks the key, the
sandbox and its bounds before the upgrade. The terminal itself needs a real PTY, which the fake
backend does not hold: tests/e2e/test_console.py drives it."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from dsec import DSecClient, DSecContainerRunArgs
from dsec.apiserver.console.pages import ENV_MODULES
from dsec.apiserver.console.terminal import SUBPROTOCOL
from dsec.node.embedded import EmbeddedNode

from .conftest import TINY

ARGS = DSecContainerRunArgs(container_image=TINY, cpu_cores_limit=0.5, memory_limit_mb=64)
VENDOR = {
    "xterm.js": "@xterm/xterm/lib/xterm.js",
    "xterm.css": "@xterm/xterm/css/xterm.css",
    "addon-fit.js": "@xterm/addon-fit/lib/addon-fit.js",
}


async def get(node: EmbeddedNode, path: str) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as http, http.get(node.url + path) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.text()


def ws_url(node: EmbeddedNode, sid: str, query: str = "") -> str:
    return node.url.replace("http", "ws", 1) + f"/console/ws/sandboxes/{sid}/terminal{query}"


async def test_the_pages_need_no_key_and_serve_a_fixed_list(node: EmbeddedNode) -> None:
    status, ctype, html = await get(node, "/console")
    assert status == 200 and ctype.startswith("text/html")
    assert "/console/static/console.js" in html and "/console/vendor/xterm.js" in html
    async with aiohttp.ClientSession() as http, http.get(node.url + "/console") as resp:
        csp = resp.headers["Content-Security-Policy"]  # the key is in sessionStorage: no foreign script
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    status, ctype, js = await get(node, "/console/static/console.js")
    assert status == 200 and ctype.startswith("text/javascript") and "sessionStorage" in js
    for path in (
        "/console/static/index.html.bak",
        "/console/static/..%2F__init__.py",
        "/console/vendor/x.js",
    ):
        status, _, _ = await get(node, path)
        assert status == 404, path
    status, _, _ = await get(node, "/v1/sandboxes")  # the API itself still needs one
    assert status == 401


async def test_missing_assets_are_explained_not_a_500(
    node: EmbeddedNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_MODULES, str(tmp_path / "empty"))
    status, _, html = await get(node, "/console")
    assert status == 200
    assert 'id="assets-missing"' in html and "setup.sh" in html and "@xterm/xterm/lib/xterm.js" in html
    status, _, text = await get(node, "/console/vendor/xterm.js")
    assert status == 404 and "npm ci --prefix .node-console" in text
    # Installed: served as they are, and the notice is gone.
    for name, rel in VENDOR.items():
        (tmp_path / "mods" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "mods" / rel).write_text(f"/* {name} */")
    monkeypatch.setenv(ENV_MODULES, str(tmp_path / "mods"))
    for name in VENDOR:
        status, _, text = await get(node, f"/console/vendor/{name}")
        assert status == 200 and text == f"/* {name} */"
    status, _, html = await get(node, "/console")
    assert "assets-missing" not in html


async def test_the_terminal_checks_the_key_and_the_sandbox_before_the_upgrade(
    client: DSecClient, node: EmbeddedNode
) -> None:
    mine = await client.run_container(ARGS)  # root's
    await client.create_project("root", "console", sandboxes=1)
    team_key = await client.issue_key("root/console")
    try:
        cases = [
            ([SUBPROTOCOL], 401),  # no key
            ([SUBPROTOCOL, "key.dsec_" + "0" * 48], 401),  # an unknown one
            ([SUBPROTOCOL, "key." + team_key], 404),  # a key that cannot see it
            ([SUBPROTOCOL, "key." + "x" * 600], 400),  # bounded
        ]
        async with aiohttp.ClientSession() as http:
            for protocols, status in cases:
                with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                    await http.ws_connect(ws_url(node, mine.id), protocols=protocols)
                assert err.value.status == status, protocols
            for query in ("?rows=0", "?cols=4097", "?rows=abc"):
                with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                    await http.ws_connect(
                        ws_url(node, mine.id, query), protocols=[SUBPROTOCOL, "key." + node.api_key]
                    )
                assert err.value.status == 400, query
        assert await client._t.request("GET", f"/v1/sandboxes/{mine.id}/processes") == []  # none started
    finally:
        await mine.stop()


async def test_a_sandbox_without_terminals_answers_with_a_status(
    client: DSecClient, node: EmbeddedNode
) -> None:
    sb = await client.run_container(ARGS)  # the fake backend holds no pseudo-terminals
    try:
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                await http.ws_connect(ws_url(node, sb.id), protocols=[SUBPROTOCOL, "key." + node.api_key])
        assert err.value.status == 400  # the edge's refusal, before the upgrade: not a dead socket
    finally:
        await sb.stop()
