"""The process table and directory watches through a link: part of :class:`LinkConformance`.

These run in real container sandboxes (the ``ct_link`` fixture: the link under test over the
session's ``ct_edge``, tests/edge/conftest.py), so PIDs, terminals, signals and inotify are
the kernel's. Nothing waits by sleeping: each step waits for the event that proves it.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import secrets
import shutil
import signal
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from dsec.edge.link import EdgeLink
from dsec.protocol.errors import FileNotFound, InvalidRequest, ProcessNotFound, SandboxNotFound
from dsec.protocol.models import ContainerSpec
from dsec.protocol.processes import ProcessEvent, ProcessStart, PtySize, WatchEvent
from tests.backends.conformance import host_pids_running
from tests.support import eventually
from tests.unit.conftest import TINY

from .conftest import BUSYBOX

EVENT_TIMEOUT_S = 20.0


async def next_event(events: AsyncGenerator[Any, None]) -> Any:
    return await asyncio.wait_for(anext(events), EVENT_TIMEOUT_S)


async def to_end(events: AsyncGenerator[ProcessEvent, None]) -> tuple[bytes, bytes, ProcessEvent]:
    """Everything up to ``end`` (the stream's last event): stdout (or the terminal), stderr.
    A ``start`` not read yet must come first."""
    out, err = bytearray(), bytearray()
    first = True
    while True:
        event = await next_event(events)
        if first and event.t == "start":
            first = False
            continue
        first = False
        if event.t == "end":
            with pytest.raises(StopAsyncIteration):
                await anext(events)  # nothing after the end
            return bytes(out), bytes(err), event
        assert event.t in ("out", "err", "pty") and event.data is not None
        (err if event.t == "err" else out).extend(event.data)


async def until(
    events: AsyncGenerator[ProcessEvent, None], needle: bytes, seen: bytearray, after: int = 0
) -> None:
    """Read output into ``seen`` until it holds ``needle`` (past offset ``after``)."""
    while needle not in seen[after:]:
        event = await next_event(events)
        assert event.t != "end", f"ended before {needle!r}: {bytes(seen)!r}"
        seen.extend(event.data or b"")


async def exec_ok(link: EdgeLink, sid: str, script: str) -> None:
    async for event in link.exec_stream(sid, ["sh", "-c", script]):
        if event.t == "exit":
            assert event.result is not None and event.result.exit_code == 0, base64.b64decode(event.d or "")


def collapse(events: list[WatchEvent]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for e in events:
        if not out or out[-1] != (e.t, e.name):
            out.append((e.t, e.name))
    return out


async def watch_until(
    watch: AsyncGenerator[WatchEvent, None], last: tuple[str, str]
) -> list[tuple[str, str]]:
    seen: list[WatchEvent] = []
    while not seen or (seen[-1].t, seen[-1].name) != last:
        seen.append(await next_event(watch))
    return collapse(seen)


def start(argv: list[str], **kw: Any) -> ProcessStart:
    return ProcessStart(argv=argv, **kw)


class ProcessConformance:
    @pytest.fixture
    async def ct_sandbox(self, ct_link: EdgeLink) -> AsyncIterator[str]:
        info = await ct_link.create(ContainerSpec(image=BUSYBOX))
        try:
            yield info.id
        finally:
            await ct_link.stop(info.id)

    @pytest.fixture(params=["crun", "gvisor"])
    def runtime(self, request: pytest.FixtureRequest) -> str:
        if request.param == "gvisor" and shutil.which("runsc") is None:
            pytest.skip("runtime='gvisor' needs runsc (Debian package runsc): not installed")
        return str(request.param)

    @pytest.fixture
    async def pty_sandbox(self, runtime: str, ct_link: EdgeLink) -> AsyncIterator[str]:
        """A sandbox on either runtime: gVisor's terminals are host ones runsc hands inside."""
        info = await ct_link.create(ContainerSpec(image=BUSYBOX, runtime=runtime))  # type: ignore[arg-type]
        try:
            yield info.id
        finally:
            await ct_link.stop(info.id)

    # -- processes ----------------------------------------------------------------------------

    async def test_a_process_reports_its_sandbox_pid_separate_streams_and_exit_code(
        self, ct_link: EdgeLink, ct_sandbox: str
    ) -> None:
        events = ct_link.start_process(ct_sandbox, start(["sh", "-c", "echo $$; echo oops >&2; exit 3"]))
        first = await next_event(events)
        assert first.t == "start" and first.pid > 1
        out, err, end = await to_end(events)
        assert out == f"{first.pid}\n".encode()  # the PID the sandbox itself sees
        assert err == b"oops\n"
        assert (end.exit_code, end.signal, end.error) == (3, None, None)

    async def test_a_death_by_signal_is_told_from_an_exit_code(
        self, ct_link: EdgeLink, ct_sandbox: str
    ) -> None:
        _, _, killed = await to_end(ct_link.start_process(ct_sandbox, start(["sh", "-c", "kill -TERM $$"])))
        assert (killed.exit_code, killed.signal) == (-15, 15)
        _, _, exited = await to_end(ct_link.start_process(ct_sandbox, start(["sh", "-c", "exit 143"])))
        assert (exited.exit_code, exited.signal) == (143, None)

    async def test_errors_before_the_start_come_from_the_first_event(
        self, ct_link: EdgeLink, ct_sandbox: str
    ) -> None:
        with pytest.raises(InvalidRequest, match="working directory"):
            await anext(ct_link.start_process(ct_sandbox, start(["true"], cwd="/nowhere")))
        with pytest.raises(InvalidRequest, match="user"):
            await anext(ct_link.start_process(ct_sandbox, start(["true"], user="nobody")))
        gone = ct_sandbox[:-4] + ("aaaa" if not ct_sandbox.endswith("aaaa") else "bbbb")
        with pytest.raises(SandboxNotFound):
            await anext(ct_link.start_process(gone, start(["true"])))
        for missing in (ct_link.connect_process(ct_sandbox, 99999),):
            with pytest.raises(ProcessNotFound):
                await anext(missing)
        with pytest.raises(ProcessNotFound):
            await ct_link.signal_process(ct_sandbox, 99999, 9)
        # As a user of the image, in its home (a relative cwd is taken from there).
        out, _, end = await to_end(
            ct_link.start_process(ct_sandbox, start(["sh", "-c", "id -u; pwd"], user="agent"))
        )
        assert out == b"1000\n/home/agent\n" and end.exit_code == 0

    async def test_a_detached_process_runs_on_and_a_later_attach_sees_what_follows(
        self, ct_link: EdgeLink, ct_sandbox: str
    ) -> None:
        script = 'echo before; read line; echo "got $line"'
        events = ct_link.start_process(ct_sandbox, start(["sh", "-c", script], tag="bg"))
        pid = (await next_event(events)).pid
        assert (await next_event(events)).data == b"before\n"
        await events.aclose()  # detach, not kill
        listed = {p.pid: p for p in await ct_link.list_processes(ct_sandbox)}
        assert listed[pid].tag == "bg" and listed[pid].argv == ["sh", "-c", script] and not listed[pid].pty
        again = ct_link.connect_process(ct_sandbox, pid)
        assert (await next_event(again)) == ProcessEvent(t="start", pid=pid)
        await ct_link.send_process_input(ct_sandbox, pid, b"hello\n")
        out, _, end = await to_end(again)
        assert out == b"got hello\n" and end.exit_code == 0  # no replay of "before"
        assert pid not in {p.pid for p in await ct_link.list_processes(ct_sandbox)}
        with pytest.raises(ProcessNotFound):
            await anext(ct_link.connect_process(ct_sandbox, pid))

    async def test_input_reaches_cat_and_closing_stdin_ends_it(
        self, ct_link: EdgeLink, ct_sandbox: str
    ) -> None:
        events = ct_link.start_process(ct_sandbox, start(["cat"]))
        pid = (await next_event(events)).pid
        await ct_link.send_process_input(ct_sandbox, pid, b"abc\n")
        seen = bytearray()
        await until(events, b"abc\n", seen)
        await ct_link.close_process_stdin(ct_sandbox, pid)
        out, _, end = await to_end(events)
        assert bytes(seen) + out == b"abc\n" and end.exit_code == 0
        # Without stdin, cat reads /dev/null and input is refused.
        quiet = ct_link.start_process(ct_sandbox, start(["sh", "-c", "cat; read x || echo eof"], stdin=False))
        await next_event(quiet)
        out, _, end = await to_end(quiet)
        assert out == b"eof\n" and end.exit_code == 0

    async def test_input_to_a_process_without_stdin_is_refused(
        self, ct_link: EdgeLink, ct_sandbox: str
    ) -> None:
        events = ct_link.start_process(ct_sandbox, start(["sleep", "600"], stdin=False))
        pid = (await next_event(events)).pid
        try:
            with pytest.raises(InvalidRequest, match="without stdin"):
                await ct_link.send_process_input(ct_sandbox, pid, b"x")
        finally:
            await ct_link.signal_process(ct_sandbox, pid, 9)
            await to_end(events)

    async def test_a_pty_process_has_a_terminal_of_the_size_asked_and_resizes(
        self, ct_link: EdgeLink, pty_sandbox: str, runtime: str
    ) -> None:
        ct_sandbox = pty_sandbox
        script = "[ -t 0 ] && [ -t 1 ] && echo is-a-tty; tty; stty size; echo $TERM; read x; stty size"
        events = ct_link.start_process(ct_sandbox, start(["sh", "-c", script], pty=PtySize(rows=24, cols=80)))
        pid = (await next_event(events)).pid
        assert [p.pty for p in await ct_link.list_processes(ct_sandbox) if p.pid == pid] == [True]
        seen = bytearray()
        await until(events, b"xterm-256color", seen)
        # crun: a terminal of the sandbox's own devpts, named inside (ttyname works). gVisor: a
        # host terminal runsc hands in, which has no name there (and is no controlling terminal).
        name = rb"/dev/pts/\d+" if runtime == "crun" else rb"not a tty"
        assert re.search(rb"is-a-tty\r\n" + name + rb"\r\n24 80\r\n", seen), bytes(seen)
        await ct_link.resize_process(ct_sandbox, pid, PtySize(rows=50, cols=132))
        await ct_link.send_process_input(ct_sandbox, pid, b"go\r")
        out, _, end = await to_end(events)
        assert (bytes(seen) + out).endswith(b"50 132\r\n") and end.exit_code == 0

    async def test_a_pty_shell_is_its_sessions_leader_with_job_control(
        self, ct_link: EdgeLink, pty_sandbox: str
    ) -> None:
        ct_sandbox = pty_sandbox
        # The controlling terminal: ^C (typed, not signalled) interrupts the foreground job.
        events = ct_link.start_process(ct_sandbox, start(["sh", "-i"], pty=PtySize(rows=24, cols=80)))
        pid = (await next_event(events)).pid
        seen = bytearray()
        await until(events, b"# ", seen)  # the prompt: the shell reads its input now
        await ct_link.send_process_input(ct_sandbox, pid, b"sh -c 'echo started; exec sleep 600'\r")
        # Printed by the job itself (not the echo of the line): its signals are set up.
        await until(events, b"started\r\n", seen)
        await ct_link.send_process_input(ct_sandbox, pid, b"\x03")
        await until(events, b"^C", seen)
        await until(events, b"# ", seen, after=seen.index(b"^C"))  # a fresh prompt: input is read again
        # The interrupted job died of SIGINT; the shell, which ignores it, lives on.
        await ct_link.send_process_input(ct_sandbox, pid, b"echo rc-$?\r")
        await until(events, b"rc-130\r\n", seen)
        await ct_link.send_process_input(ct_sandbox, pid, b"exit\r")
        _, _, end = await to_end(events)
        assert end.exit_code == 0

    async def test_a_hangup_ends_a_terminal_program_even_one_that_ignores_sighup(
        self, ct_link: EdgeLink, pty_sandbox: str
    ) -> None:
        # What the console and the SDK send when their terminal closes. A SIGHUP alone can be
        # deferred or ignored and leave the program reading a terminal nobody holds any more:
        # the terminal itself is hung up, so its reads end.
        script = "trap '' HUP; echo reading; read x; echo read-$?"
        events = ct_link.start_process(
            pty_sandbox, start(["sh", "-c", script], pty=PtySize(rows=24, cols=80))
        )
        pid = (await next_event(events)).pid
        await until(events, b"reading", bytearray())
        await ct_link.signal_process(pty_sandbox, pid, signal.SIGHUP)
        _, _, end = await to_end(events)
        assert end.signal is None, "it ignores SIGHUP: it ended reading the end of its terminal"
        assert pid not in {p.pid for p in await ct_link.list_processes(pty_sandbox)}

    async def test_resize_needs_a_pty(self, ct_link: EdgeLink, ct_sandbox: str) -> None:
        events = ct_link.start_process(ct_sandbox, start(["sleep", "600"]))
        pid = (await next_event(events)).pid
        with pytest.raises(InvalidRequest, match="no terminal"):
            await ct_link.resize_process(ct_sandbox, pid, PtySize(rows=10, cols=10))
        await ct_link.signal_process(ct_sandbox, pid, 9)
        _, _, end = await to_end(events)
        assert (end.exit_code, end.signal) == (-9, 9)

    async def test_a_signal_reaches_the_whole_tree_and_list_forgets_the_ended(
        self, ct_link: EdgeLink, ct_sandbox: str
    ) -> None:
        argv = ["sh", "-c", "sleep 31001 & sleep 31002; wait"]
        events = ct_link.start_process(ct_sandbox, start(argv))
        pid = (await next_event(events)).pid
        assert pid in {p.pid for p in await ct_link.list_processes(ct_sandbox)}
        hosts = await _host_pids(["sleep", "31001"], ["sleep", "31002"])
        await ct_link.signal_process(ct_sandbox, pid, 15)
        _, _, end = await to_end(events)
        assert (end.exit_code, end.signal) == (-15, 15)
        # The background sleep too: the group's SIGTERM was sent with the shell's, but the
        # shell's end can be reported before the sleep has run to its death (seen once).
        await eventually(lambda: not any(_alive(h) for h in hosts), "the background sleep ended")
        assert pid not in {p.pid for p in await ct_link.list_processes(ct_sandbox)}

    async def test_a_timeout_kills_the_tree_and_says_so(self, ct_link: EdgeLink, ct_sandbox: str) -> None:
        events = ct_link.start_process(ct_sandbox, start(["sh", "-c", "echo up; sleep 600"], timeout=0.5))
        await next_event(events)
        out, _, end = await to_end(events)
        assert out == b"up\n" and (end.exit_code, end.signal, end.error) == (-9, 9, "timeout")
        entries = [e for e in await ct_link.trajectory(ct_sandbox) if e.kind == "process"]
        assert entries[-1].request["argv"] == ["sh", "-c", "echo up; sleep 600"]
        assert entries[-1].result is not None and entries[-1].result["error"] == "timeout"

    async def test_stopping_the_sandbox_kills_its_processes(self, ct_link: EdgeLink) -> None:
        info = await ct_link.create(ContainerSpec(image=BUSYBOX))
        try:
            detached = ct_link.start_process(info.id, start(["sleep", "31337"]))
            await next_event(detached)
            await detached.aclose()
            watched = ct_link.start_process(info.id, start(["sleep", "31338"]))
            await next_event(watched)
            hosts = await _host_pids(["sleep", "31337"], ["sleep", "31338"])
        finally:
            await ct_link.stop(info.id)
        assert not any(_alive(h) for h in hosts)
        _, _, end = await to_end(watched)
        assert end.error == "sandbox stopped" and end.signal == 9

    async def test_a_reader_that_does_not_read_holds_the_writer_back_and_loses_nothing(
        self, ct_link: EdgeLink, ct_sandbox: str
    ) -> None:
        total = 64_000_000 + secrets.randbelow(1_000_000)  # its argv names one host process
        argv = ["head", "-c", str(total), "/dev/zero"]
        events = ct_link.start_process(ct_sandbox, start(argv))
        await next_event(events)
        (host,) = await _host_pids(argv)
        # Nobody reads: the writer blocks on its pipe, the edge does not buffer 64 MB for it.
        await eventually(lambda: "pipe_write" in _wchan(host), "the writer to block on its pipe")
        out, _, end = await to_end(events)
        assert len(out) == total and end.exit_code == 0

    async def test_output_nobody_is_attached_to_is_dropped_not_waited_for(
        self, ct_link: EdgeLink, ct_sandbox: str
    ) -> None:
        script = "head -c 64000000 /dev/zero; touch /tmp/drained; cat"
        events = ct_link.start_process(ct_sandbox, start(["sh", "-c", script]))
        pid = (await next_event(events)).pid
        await events.aclose()
        await eventually(
            lambda: _exists(ct_link, ct_sandbox, "/tmp/drained"), "the detached writer to finish"
        )
        again = ct_link.connect_process(ct_sandbox, pid)
        await next_event(again)
        await ct_link.close_process_stdin(ct_sandbox, pid)
        out, _, end = await to_end(again)
        assert out == b"" and end.exit_code == 0

    async def test_a_fake_sandbox_runs_processes_on_pipes_but_has_no_pty(self, link: EdgeLink) -> None:
        info = await link.create(ContainerSpec(image=TINY))
        try:
            out, _, end = await to_end(link.start_process(info.id, start(["sh", "-c", "echo hi"])))
            assert out == b"hi\n" and end.exit_code == 0
            with pytest.raises(InvalidRequest, match="pseudo-terminals"):
                await anext(link.start_process(info.id, start(["sh"], pty=PtySize(rows=2, cols=2))))
        finally:
            await link.stop(info.id)

    # -- directory watches --------------------------------------------------------------------

    async def test_a_watch_sees_create_write_rename_chmod_remove_in_order(
        self, ct_link: EdgeLink, ct_sandbox: str
    ) -> None:
        await ct_link.mkdir(ct_sandbox, "/tmp/w")
        watch = ct_link.watch_dir(ct_sandbox, "/tmp/w", recursive=False)
        try:
            assert await next_event(watch) == WatchEvent(t="start")
            await exec_ok(ct_link, ct_sandbox, "cd /tmp/w; echo a > f; mv f g; chmod 600 g; rm g")
            assert await watch_until(watch, ("remove", "g")) == [
                ("create", "f"),
                ("write", "f"),
                ("rename", "f"),
                ("create", "g"),
                ("chmod", "g"),
                ("remove", "g"),
            ]
            # Not recursive: a change below a subdirectory is not reported, one beside it is.
            await exec_ok(
                ct_link, ct_sandbox, "mkdir /tmp/w/sub; echo x > /tmp/w/sub/deep; echo y > /tmp/w/top"
            )
            assert await watch_until(watch, ("create", "top")) == [("create", "sub"), ("create", "top")]
        finally:
            await watch.aclose()

    async def test_a_recursive_watch_follows_new_subdirectories(
        self, ct_link: EdgeLink, ct_sandbox: str
    ) -> None:
        await ct_link.mkdir(ct_sandbox, "/tmp/r/old")
        watch = ct_link.watch_dir(ct_sandbox, "/tmp/r", recursive=True)
        try:
            await next_event(watch)
            await exec_ok(
                ct_link, ct_sandbox, "echo 1 > /tmp/r/old/a; mkdir -p /tmp/r/d/e; echo 2 > /tmp/r/d/e/f"
            )
            seen = await watch_until(watch, ("create", "d/e/f"))
            assert ("create", "old/a") in seen and ("create", "d") in seen and ("create", "d/e") in seen
            await exec_ok(ct_link, ct_sandbox, "echo 3 > /tmp/r/d/e/g")  # the new directory is watched
            assert (await watch_until(watch, ("create", "d/e/g")))[-1] == ("create", "d/e/g")
        finally:
            await watch.aclose()

    async def test_a_watch_never_leaves_the_sandbox(self, ct_link: EdgeLink, ct_sandbox: str) -> None:
        host_dir = tempfile.mkdtemp(prefix="dsec-watch-host-")
        try:
            # A symlink to a host path names the sandbox's own path of that name.
            await exec_ok(ct_link, ct_sandbox, f"ln -s {host_dir} /tmp/link")
            with pytest.raises(FileNotFound):
                await anext(ct_link.watch_dir(ct_sandbox, "/tmp/link", recursive=False))
            await exec_ok(ct_link, ct_sandbox, f"mkdir -p {host_dir}")
            watch = ct_link.watch_dir(ct_sandbox, "/tmp/link", recursive=True)
            try:
                await next_event(watch)
                with open(os.path.join(host_dir, "on-the-host"), "w") as fh:
                    fh.write("x")
                await exec_ok(ct_link, ct_sandbox, f"echo y > {host_dir}/in-the-sandbox")
                assert await next_event(watch) == WatchEvent(t="create", name="in-the-sandbox")
            finally:
                await watch.aclose()
            for kernel_dir in ("/proc", "/proc/1"):
                with pytest.raises(InvalidRequest):
                    await anext(ct_link.watch_dir(ct_sandbox, kernel_dir, recursive=False))
        finally:
            shutil.rmtree(host_dir)

    async def test_stopping_the_sandbox_ends_its_watches(self, ct_link: EdgeLink) -> None:
        info = await ct_link.create(ContainerSpec(image=BUSYBOX))
        try:
            watch = ct_link.watch_dir(info.id, "/tmp", recursive=False)
            await next_event(watch)
        finally:
            await ct_link.stop(info.id)
        with pytest.raises(SandboxNotFound):
            while True:
                await next_event(watch)


async def _host_pids(*argvs: list[str]) -> list[int]:
    """The host PIDs of processes with these command lines (each must be running)."""
    found: list[int] = []
    for argv in argvs:  # a shell's child may not have exec'd yet: wait for it
        found += await eventually(lambda argv=argv: host_pids_running(argv), f"{argv} running")
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as fh:
            return fh.read()
    except OSError:
        return ""


async def _exists(link: EdgeLink, sid: str, path: str) -> bool:
    try:
        await link.stat(sid, path)
    except FileNotFound:
        return False
    return True
