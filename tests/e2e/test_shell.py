"""`dsec sandbox shell`: a real terminal in a sandbox, driven the way a person does, through a
pseudo-terminal (pexpect): typing, resizing the window, ^C, a full-screen program, ^D and
`exit N`, against the node's apiserver and against one that reaches the edge over HTTP."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pexpect
import pytest

from dsec import DSec
from dsec.apiserver.app import ApiServer
from dsec.apiserver.remote_edge import RemoteEdgeLink
from dsec.edge.server import EdgeServer
from dsec.node.embedded import EmbeddedNode
from dsec.placement.placement import Placement, Watcher
from dsec.protocol.http import listen
from dsec.sdk.client import DSecClient, Sandbox
from dsec.sdk.config import write_client_config
from tests.conftest import Sandboxes
from tests.support import DSEC, dsec_env

PROMPT = r"[#$] $"  # bash's prompt, the last thing it printed
EXPECT_S = 60  # what one answer may take on a loaded CI machine; never reached when it works

# A full-screen program the minimal base surely runs: the alternate screen, the cursor put at
# the corners, keys read one by one without Enter, the screen given back on 'q'. Its reads
# time out every 100 ms: ncurses notices a SIGWINCH only as a read begins or is interrupted,
# so one landing between that check and a blocking read would wait for the next key (seen
# once in 40 resizes on a loaded machine; top, which redraws on a timer, never waits so).
CURSES_APP = """python3 -c '
import curses
def main(w):
    w.timeout(100)
    w.addstr(0, 0, "FULLSCREEN %dx%d" % w.getmaxyx()); w.refresh()
    while (key := w.getch()) != ord("q"):
        if key == curses.KEY_RESIZE:
            w.clear(); w.addstr(0, 0, "RESIZED %dx%d" % w.getmaxyx()); w.refresh()
curses.wrapper(main)'"""


def spawn(config: Path, *args: str, rows: int = 24, cols: int = 80) -> pexpect.spawn:
    child = pexpect.spawn(DSEC, list(args), env=dsec_env(config), dimensions=(rows, cols), timeout=EXPECT_S)
    return child


def finish(child: pexpect.spawn) -> int:
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus is not None, f"killed by signal {child.signalstatus}"
    return int(child.exitstatus)


def drive_a_session(child: pexpect.spawn) -> None:
    """Everything a person does at a shell, checked by what comes back."""
    child.expect(PROMPT)  # typed before the shell reads its terminal, a line may be lost
    child.sendline("echo typed-$((6*7))")
    child.expect("typed-42")
    child.setwinsize(37, 101)
    child.sendline("stty size")
    child.expect("37 101")
    # The marker comes from the child once bash has made it the terminal's foreground process
    # group: a ^C sent sooner can land between the child's setpgid and bash's tcsetpgrp, reach
    # bash alone, and leave the sleep running.
    child.sendline("sh -c 'echo sleeping-$((2+3)); exec sleep 100'")
    child.expect("sleeping-5")
    child.sendcontrol("c")  # to the terminal's line discipline there: SIGINT for sleep
    child.sendline("echo status=$?")
    child.expect("status=130")  # bash's word for "ended by SIGINT"
    child.sendline(CURSES_APP)
    child.expect("FULLSCREEN 37x101")
    child.setwinsize(30, 90)  # nothing typed after it: SIGWINCH alone must carry it there
    child.expect("RESIZED 30x90")
    child.send("x")  # a key read without Enter; not the one that quits
    child.send("q")
    child.expect(r"\x1b\[\?1049l")  # the screen given back
    child.sendline("command -v top >/dev/null && top -d 0.2 || echo top-$((400+4))")
    if child.expect(["top-404", "load average"]) == 1:  # procps' top, where the base has it
        child.expect("load average")  # its second screen: it reads keys now (before, it drops them)
        child.send("q")
    child.sendline("echo back-$((1+1))")
    child.expect("back-2")


@pytest.mark.slow
async def test_a_shell_is_a_real_terminal(node: EmbeddedNode, sandbox: Sandbox) -> None:
    def use() -> int:
        child = spawn(node.config.config_file, "sandbox", "shell", sandbox.id)
        drive_a_session(child)
        child.sendline("exit 7")
        return finish(child)

    assert await asyncio.to_thread(use) == 7
    # Nothing the shell started is left behind: it ended, and the edge forgot it.
    assert await node.link.list_processes(sandbox.id) == []


@pytest.mark.slow
async def test_ctrl_d_ends_the_shell_and_the_terminal_is_restored(
    node: EmbeddedNode, sandbox: Sandbox
) -> None:
    def use() -> tuple[int, str]:
        # A local shell whose terminal runs `dsec sandbox shell`: after it, `stty -a` shows
        # whether the local modes came back (raw mode would show -icanon -echo).
        child = pexpect.spawn(
            "/bin/sh", env=dsec_env(node.config.config_file), dimensions=(24, 80), timeout=EXPECT_S
        )
        child.sendline(f"{DSEC} sandbox shell {sandbox.id}; echo local-exit=$?")
        child.expect("root@")
        child.expect(PROMPT)
        child.sendline("echo inside-$((2*3))")
        child.expect("inside-6")
        child.sendcontrol("d")
        child.expect(r"local-exit=(\d+)")
        code = child.match.group(1).decode()
        child.sendline("stty -a")
        child.expect("isig")
        child.sendline("exit")
        child.expect(pexpect.EOF)
        modes = (child.before or b"").decode(errors="replace")
        return int(code), modes

    code, modes = await asyncio.to_thread(use)
    assert code == 0
    assert " icanon" in modes and " echo " in modes, modes


@pytest.mark.slow
async def test_create_shell_stops_its_sandbox(
    node: EmbeddedNode, client: DSecClient, base_layer: str
) -> None:
    before = {sb.id for sb in await client.list()}

    def use() -> tuple[int, str]:
        child = spawn(node.config.config_file, "sandbox", "create", "--shell", base_layer)
        try:
            child.expect(r"sandbox (\S+)")
            made = child.match.group(1).decode()
            child.expect(PROMPT)
            child.sendline("echo created-$((3*3))")
            child.expect("created-9")
            child.sendline("exit 3")
            return finish(child), made
        finally:
            child.close(force=True)

    code, made = await asyncio.to_thread(use)
    after = {sb.id for sb in await client.list()}
    try:
        assert code == 3
        assert made not in after and made not in before
    finally:
        for sid in after - before:
            await (await client.get(sid)).stop()


@pytest.fixture
async def remote_apiserver(node: EmbeddedNode, tmp_path: Path) -> AsyncIterator[Path]:
    """A second apiserver that reaches the node's edge over HTTP (as a cluster's do); the path
    of a client config naming it."""
    secret = secrets.token_urlsafe(32)
    edge_server = EdgeServer(node.edge, secret)
    await edge_server.start("127.0.0.1", 0)
    link = RemoteEdgeLink(edge_server.url, secret, node.config.node)
    links = {node.config.node: link}
    api = ApiServer(links, Placement(Watcher(links)), node.store, node.iam)
    runner, url = await listen(api.app(), "127.0.0.1", 0)
    config = tmp_path / "remote.json"
    write_client_config(url, node.api_key, config)
    try:
        yield config
    finally:
        await runner.cleanup()
        await link.close()
        await edge_server.close()


@pytest.mark.slow
async def test_a_shell_through_an_apiserver_that_reaches_the_edge_over_http(
    remote_apiserver: Path, make_sandbox: Sandboxes
) -> None:
    sandbox = await make_sandbox()

    def use() -> int:
        child = spawn(remote_apiserver, "sandbox", "shell", sandbox.id)
        drive_a_session(child)
        child.sendline("exit 5")
        return finish(child)

    assert await asyncio.to_thread(use) == 5


async def test_the_sync_sdk_drives_a_terminal(node: EmbeddedNode, sandbox: Sandbox) -> None:
    script = "stty size; read line; echo got-$line; exit 4"

    def use() -> tuple[bytes, int | None]:
        with DSec(node.url, node.api_key) as dsec:
            sb = dsec.get(sandbox.id)
            with sb.open_pty(["/bin/sh", "-c", script], rows=11, cols=33) as pty:
                seen, typed = b"", False
                for data in pty.output():
                    seen += data
                    if b"11 33" in seen and not typed:
                        pty.write(b"typed\r")
                        typed = True
                return seen, pty.exit_code

    seen, code = await asyncio.to_thread(use)
    assert b"11 33" in seen and b"got-typed" in seen
    assert code == 4
