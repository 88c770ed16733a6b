"""The web console against a real node: its terminal WebSocket is a real PTY (typing, resize,
a full-screen program, ^C, exit codes, bounded frames), and a real headless Chromium (Debian's
``chromium`` and ``chromium-driver``, through Selenium) logs in, finds a sandbox, types into its
terminal, uploads a file, watches the creates chart and pauses a job. A screenshot of each page
goes to ``SHOTS``."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from dsec import DSecClient, DSecContainerRunArgs
from dsec.apiserver.console.pages import missing_assets
from dsec.apiserver.console.terminal import MAX_MESSAGE, SUBPROTOCOL
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import ProcessNotFound
from dsec.sdk.client import Sandbox
from tests.e2e.test_shell import CURSES_APP

SHOTS = Path("/tmp/console-shots")
WAIT_S = 60  # what one page change may take on a loaded CI machine; never reached when it works
JOB = "console-job"


def ws_url(node: EmbeddedNode, sid: str, query: str = "") -> str:
    return node.url.replace("http", "ws", 1) + f"/console/ws/sandboxes/{sid}/terminal{query}"


@pytest.fixture(scope="module")
async def job(client: DSecClient, base_layer: str) -> AsyncIterator[list[Sandbox]]:
    """Two sandboxes of one job: the module's only ones."""
    args = DSecContainerRunArgs(container_image=base_layer, memory_limit_mb=128, labels={"job": JOB})
    made = [await client.run_container(args) for _ in range(2)]
    try:
        yield made
    finally:
        for sb in made:
            await sb.stop()


async def read_until(ws: aiohttp.ClientWebSocketResponse, needle: bytes) -> bytes:
    """The terminal's output up to ``needle``. One that never comes fails the test naming what
    came instead, and the socket closes (hanging its shell up) rather than waiting for good."""
    seen = b""
    try:
        async with asyncio.timeout(WAIT_S):
            while needle not in seen:
                msg = await ws.receive()
                assert msg.type in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT), msg
                if msg.type == aiohttp.WSMsgType.BINARY:
                    seen += msg.data
    except TimeoutError:
        raise AssertionError(f"{needle!r} never came; the terminal's last output: {seen[-300:]!r}") from None
    return seen


async def ended(client: DSecClient, sid: str, pid: int) -> None:
    """Returns once process ``pid`` has ended (its events' last line), or is gone already."""
    try:
        async for line in client._t.lines("GET", f"/v1/sandboxes/{sid}/processes/{pid}/events"):
            if json.loads(line).get("t") == "end":
                return
    except ProcessNotFound:
        return


async def test_a_terminal_over_the_websocket(
    client: DSecClient, node: EmbeddedNode, job: list[Sandbox]
) -> None:
    sb = job[0]
    protocols = [SUBPROTOCOL, "key." + node.api_key]
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(ws_url(node, sb.id, "?rows=30&cols=90"), protocols=protocols) as ws,
    ):
        assert ws.protocol == SUBPROTOCOL  # the key is never echoed back
        start = json.loads(await ws.receive_str())
        assert start["t"] == "start" and start["pid"] > 0
        await ws.send_bytes(b"stty size\n")
        await read_until(ws, b"30 90")
        await ws.send_str(json.dumps({"t": "resize", "rows": 40, "cols": 100}))
        await ws.send_bytes(b"stty size\n")
        await read_until(ws, b"40 100")
        await ws.send_bytes(CURSES_APP.encode() + b"\n")  # a full-screen program, resized under it
        await read_until(ws, b"FULLSCREEN 40x100")
        await ws.send_str(json.dumps({"t": "resize", "rows": 20, "cols": 60}))
        await read_until(ws, b"RESIZED 20x60")
        await ws.send_bytes(b"q")
        await ws.send_bytes(b"stty size\n")
        await read_until(ws, b"20 60")
        # The marker comes from the child itself, which bash has made the terminal's foreground
        # process group before it runs: a ^C sent sooner could land in the moment between the
        # child's setpgid and tcsetpgrp, reach bash alone, and leave the sleep running.
        await ws.send_bytes(b"sh -c 'echo sleeping-$((2+3)); exec sleep 1000'\n")
        await read_until(ws, b"sleeping-5")
        await ws.send_bytes(b"\x03")  # ^C: a byte the PTY's line discipline makes SIGINT
        await ws.send_bytes(b"echo after-$((1+1))\n")
        await read_until(ws, b"after-2")
        await ws.send_bytes(b"exit 7\n")
        end = None
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                end = json.loads(msg.data)
    assert end == {"t": "end", "exit_code": 7, "error": None}
    await ended(client, sb.id, start["pid"])


async def test_bad_and_oversized_frames_close_the_terminal_and_hang_it_up(
    client: DSecClient, node: EmbeddedNode, job: list[Sandbox]
) -> None:
    sb = job[0]
    protocols = [SUBPROTOCOL, "key." + node.api_key]
    frames: list[tuple[str | bytes, int]] = [
        (json.dumps({"t": "resize", "rows": 0, "cols": 5}), aiohttp.WSCloseCode.POLICY_VIOLATION),
        (json.dumps({"t": "launch"}), aiohttp.WSCloseCode.POLICY_VIOLATION),
        (b"x" * (MAX_MESSAGE + 1), aiohttp.WSCloseCode.MESSAGE_TOO_BIG),
    ]
    async with aiohttp.ClientSession() as http:
        for frame, code in frames:
            async with http.ws_connect(ws_url(node, sb.id), protocols=protocols) as ws:
                start = json.loads(await ws.receive_str())
                await (ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_str(frame))
                async for _ in ws:
                    pass
                assert ws.close_code == code, frame[:40]
            await ended(client, sb.id, start["pid"])  # the closed socket hung its shell up
    assert await client._t.request("GET", f"/v1/sandboxes/{sb.id}/processes") == []


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, (
        "Debian's chromium and chromium-driver are missing: ./setup.sh test installs them"
    )
    assert not missing_assets(), "xterm.js is missing: ./setup.sh test installs .node-console"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(arg)  # --no-sandbox: Chromium's own sandbox refuses to run as root
    b = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield b
    finally:
        b.quit()


def drive(b: WebDriver, url: str, key: str, sid: str, upload: Path, create: Callable[[], object]) -> None:
    """A person's visit, step by step; each step waits for what the page shows. ``create``
    makes a sandbox while the nodes page is open, for its creates/s chart to see."""
    # The pages re-render as they poll: an element read as it is replaced is read again.
    wait = WebDriverWait(b, WAIT_S, ignored_exceptions=(StaleElementReferenceException,))

    def text_of(css: str) -> str:
        return str(b.find_element(By.CSS_SELECTOR, css).text)

    def shows(css: str, needle: str) -> None:
        wait.until(lambda _: any(needle in e.text for e in b.find_elements(By.CSS_SELECTOR, css)))

    SHOTS.mkdir(parents=True, exist_ok=True)
    b.get(url + "/console")
    b.find_element(By.ID, "login-key").send_keys(key)
    b.save_screenshot(str(SHOTS / "1-login.png"))
    b.find_element(By.ID, "login-button").click()
    shows("#sandboxes", sid)

    # Find the sandbox by its job, then open it.
    job_field = b.find_element(By.ID, "f-job")
    job_field.send_keys(JOB)
    b.find_element(By.ID, "apply").click()
    shows("#sandboxes-holder", "2 sandboxes")
    b.save_screenshot(str(SHOTS / "2-sandboxes.png"))
    b.find_element(By.CSS_SELECTOR, f'#sandboxes tr[data-id="{sid}"] a.sandbox-link').click()
    shows("#sb-info", sid)

    # Its terminal: typed into xterm.js, read back from the rendered rows.
    b.find_element(By.ID, "open-terminal").click()
    shows("#terminal-state", "connected")
    b.find_element(By.CSS_SELECTOR, "#terminal .xterm-helper-textarea").send_keys("echo hi-$((6*7))\n")
    shows("#terminal .xterm-rows", "hi-42")

    # Upload into /tmp, then see it in the listing.
    b.find_element(By.ID, "upload-input").send_keys(str(upload))
    b.find_element(By.ID, "upload-button").click()
    shows("#files-table", upload.name)
    b.save_screenshot(str(SHOTS / "3-sandbox.png"))

    b.get(url + "/console#/nodes")
    shows("#nodes", "true")
    shows("#creates-now", "creates/s")  # the chart: two scrapes of /metrics apart
    create()
    wait.until(lambda _: "(max 0)" not in text_of("#creates-now").split("\n")[0])  # a rate above 0
    b.save_screenshot(str(SHOTS / "4-nodes.png"))
    b.get(url + "/console#/projects")
    shows("#projects", "root")
    b.save_screenshot(str(SHOTS / "5-projects.png"))

    # Pause the job from the sandboxes page.
    b.get(url + f"/console#/sandboxes?job={JOB}")
    shows("#sandboxes-holder", "2 sandboxes")
    b.find_element(By.ID, "bulk-pause").click()
    shows("#bulk-result", "pause: 2 done")
    wait.until(lambda _: text_of("#sandboxes").count("paused") == 2)
    b.save_screenshot(str(SHOTS / "6-job-paused.png"))


async def test_the_console_in_a_real_browser(
    browser: WebDriver, client: DSecClient, node: EmbeddedNode, job: list[Sandbox], tmp_path: Path
) -> None:
    upload = tmp_path / "console-upload.txt"
    upload.write_text("uploaded from the browser\n")
    sid = job[0].id
    loop = asyncio.get_running_loop()
    made: list[Sandbox] = []

    def create() -> None:  # from the browser's thread, on this loop
        args = DSecContainerRunArgs(container_image=job[0].info.refs[0], memory_limit_mb=128)
        made.append(asyncio.run_coroutine_threadsafe(client.run_container(args), loop).result())

    # Selenium blocks; the node serves from this event loop, so the browser is driven off it.
    try:
        await asyncio.to_thread(drive, browser, node.url, node.api_key, sid, upload, create)
    finally:
        for sb in made:
            await sb.stop()
    states = {(await client.get(sb.id)).info.state for sb in job}
    assert states == {"paused"}
    assert await job[0].read_file(f"/tmp/{upload.name}") == b"uploaded from the browser\n"  # resumes it
