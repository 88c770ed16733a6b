"""E2B's in-sandbox API (envd) through the official SDKs, served by DSec's executor.

Each test runs once per SDK version (2.63.0: connectrpc; 2.34.0: its bundled Connect client).
What a command did is checked inside the sandbox through DSec where it matters, so a test
sees the sandbox's real state, not only what the SDK reports.
"""

from __future__ import annotations

from dsec.node.embedded import EmbeddedNode
from dsec.protocol.models import ShellRequest
from tests.e2b.conftest import E2B


async def test_foreground_command_streams_output_and_a_failure_raises(e2b: E2B) -> None:
    out = await e2b.run(
        """
        from e2b import CommandExitException
        sbx = Sandbox.create(timeout=120)
        seen = {"out": [], "err": []}
        r = sbx.commands.run("echo one; echo two >&2; echo three", envs={"GREETING": "hi"},
                             on_stdout=seen["out"].append, on_stderr=seen["err"].append)
        env = sbx.commands.run("echo $GREETING-$PWD", envs={"GREETING": "hi"}, cwd="/tmp").stdout
        try:
            sbx.commands.run("echo failing >&2; exit 3")
            failed = None
        except CommandExitException as e:
            failed = {"code": e.exit_code, "stderr": e.stderr}
        print(json.dumps({"stdout": r.stdout, "stderr": r.stderr, "code": r.exit_code,
                          "seen": seen, "env": env, "failed": failed}))
        """
    )
    assert (out["stdout"], out["stderr"], out["code"]) == ("one\nthree\n", "two\n", 0)
    assert "".join(out["seen"]["out"]) == "one\nthree\n" and "".join(out["seen"]["err"]) == "two\n"
    assert out["env"] == "hi-/tmp\n"
    assert out["failed"] == {"code": 3, "stderr": "failing\n"}


async def test_background_command_survives_its_client_and_is_reconnected_and_killed(
    e2b: E2B, node: EmbeddedNode
) -> None:
    started = await e2b.run(
        """
        sbx = Sandbox.create(timeout=120)
        sbx.commands.run("mkfifo /tmp/go")
        h = sbx.commands.run("echo ready; read line < /tmp/go; echo got-$line; sleep 600",
                             background=True)
        print(json.dumps({"id": sbx.sandbox_id, "pid": h.pid}))
        """
    )
    sid, pid = started["id"], started["pid"]
    # The first client is gone; the process runs on (its PID is the sandbox's own).
    ps = await node.link.run_shell(sid, ShellRequest(command=f"cat /proc/{pid}/cmdline"))
    assert "sleep 600" in ps.stdout.replace("\0", " ")
    out = await e2b.run(
        f"""
        sbx = Sandbox.connect({sid!r})
        listed = [p.pid for p in sbx.commands.list()]
        h = sbx.commands.connect({pid})
        sbx.commands.run("echo now > /tmp/go")
        lines = []
        for stdout, _, _ in h:
            if stdout:
                lines.append(stdout)
            if "got-now" in "".join(lines):
                break
        killed = sbx.commands.kill({pid})
        after = [p.pid for p in sbx.commands.list()]
        print(json.dumps({{"listed": listed, "lines": "".join(lines), "killed": killed, "after": after}}))
        """
    )
    assert pid in out["listed"]
    assert out["lines"] == "got-now\n"  # attaching does not replay "ready"
    assert out["killed"] is True and pid not in out["after"]
    gone = await node.link.run_shell(
        sid, ShellRequest(command=f"test -e /proc/{pid} && echo alive || echo gone")
    )
    assert gone.stdout == "gone\n"


async def test_stdin_reaches_the_command_and_closing_it_ends_cat(e2b: E2B) -> None:
    out = await e2b.run(
        """
        sbx = Sandbox.create(timeout=120)
        h = sbx.commands.run("cat; echo done", background=True, stdin=True)
        sbx.commands.send_stdin(h.pid, "hello ")
        sbx.commands.send_stdin(h.pid, "world\\n")
        sbx.commands.close_stdin(h.pid)
        r = h.wait()
        print(json.dumps({"stdout": r.stdout, "code": r.exit_code}))
        """
    )
    assert out == {"stdout": "hello world\ndone\n", "code": 0}


async def test_a_pty_session_sees_a_terminal_of_its_size_and_a_resize(e2b: E2B) -> None:
    out = await e2b.run(
        """
        import asyncio
        from e2b import AsyncSandbox, PtySize
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            data = bytearray()
            def seen(chunk):
                data.extend(chunk)
            h = await sbx.pty.create(size=PtySize(rows=30, cols=100), on_data=seen)
            while not data.rstrip().endswith((b"#", b"$")):  # the prompt: typeahead gets mangled
                await asyncio.sleep(0.05)
            # The terminal echoes input: the word looked for must not be in what was typed.
            await sbx.pty.send_stdin(h.pid, b"stty size; tty; test -t 0 && echo is-a-tt''y\\n")
            while b"is-a-tty" not in data:
                await asyncio.sleep(0.05)
            await sbx.pty.resize(h.pid, PtySize(rows=40, cols=120))
            await sbx.pty.send_stdin(h.pid, b"stty size; exit 0\\n")
            r = await h.wait()
            await sbx.kill()
            return {"text": data.decode(errors="replace"), "code": r.exit_code}
        print(json.dumps(asyncio.run(asyncio.wait_for(main(), 60))))
        """
    )
    text = out["text"].replace("\r", "")
    assert "30 100\n" in text and "is-a-tty\n" in text and "\n/dev/pts/" in text
    assert "40 120\n" in text
    assert out["code"] == 0


async def test_files_round_trip_list_stat_mkdir_rename_remove(e2b: E2B, node: EmbeddedNode) -> None:
    out = await e2b.run(
        """
        sbx = Sandbox.create(timeout=120)
        w = sbx.files.write("/work/notes/a.txt", "alpha")
        text = sbx.files.read("/work/notes/a.txt")
        raw = bytes(sbx.files.read("/work/notes/a.txt", format="bytes"))
        made = sbx.files.make_dir("/work/notes/sub")
        made_again = sbx.files.make_dir("/work/notes/sub")
        names = sorted(e.name for e in sbx.files.list("/work/notes"))
        info = sbx.files.get_info("/work/notes/a.txt")
        moved = sbx.files.rename("/work/notes/a.txt", "/work/notes/sub/b.txt")
        deep = sorted(e.path for e in sbx.files.list("/work", depth=3))
        exists_before = sbx.files.exists("/work/notes/sub/b.txt")
        sbx.files.remove("/work/notes")
        gone = sbx.files.exists("/work/notes/sub/b.txt")
        try:
            sbx.files.read("/no/such/file")
            missing = None
        except Exception as e:
            missing = type(e).__name__
        print(json.dumps({"id": sbx.sandbox_id, "w": [w.path, w.name], "text": text, "raw": raw.decode(),
                          "made": [made, made_again], "names": names,
                          "info": [info.name, info.type.value, info.size, info.owner, info.permissions],
                          "moved": moved.path, "deep": deep, "exists": [exists_before, gone],
                          "missing": missing}))
        """
    )
    assert out["w"] == ["/work/notes/a.txt", "a.txt"]
    assert out["text"] == out["raw"] == "alpha"
    assert out["made"] == [True, False]
    assert out["names"] == ["a.txt", "sub"]
    assert out["info"] == ["a.txt", "file", 5, "root", "-rw-r--r--"]
    assert out["moved"] == "/work/notes/sub/b.txt"
    assert out["deep"] == ["/work/notes", "/work/notes/sub", "/work/notes/sub/b.txt"]
    assert out["exists"] == [True, False]
    assert out["missing"] in ("FileNotFoundException", "NotFoundException")
    inside = await node.link.run_shell(out["id"], ShellRequest(command="ls -A /work"))
    assert inside.stdout == ""  # the remove really happened inside


async def test_a_100_mib_file_streams_both_ways(e2b: E2B, node: EmbeddedNode) -> None:
    out = await e2b.run(
        """
        import hashlib, io
        sbx = Sandbox.create(timeout=300)
        block = hashlib.sha256(b"seed").digest() * 32768  # 1 MiB, not all one byte
        data = b"".join(hashlib.sha256(bytes([i])).digest() + block[32:] for i in range(100))
        sent = hashlib.sha256(data).hexdigest()
        sbx.files.write("/work/big.bin", io.BytesIO(data))
        got = hashlib.sha256()
        size = 0
        for chunk in sbx.files.read("/work/big.bin", format="stream"):
            got.update(chunk)
            size += len(chunk)
        print(json.dumps({"id": sbx.sandbox_id, "sent": sent, "got": got.hexdigest(), "size": size}))
        """,
        timeout=240,
    )
    assert out["size"] == 100 << 20 and out["got"] == out["sent"]
    inside = await node.link.run_shell(out["id"], ShellRequest(command="sha256sum /work/big.bin"))
    assert inside.stdout.split()[0] == out["sent"]


async def test_watch_dir_reports_changes_made_inside(e2b: E2B) -> None:
    out = await e2b.run(
        """
        sbx = Sandbox.create(timeout=120)
        sbx.files.make_dir("/work/w")
        handle = sbx.files.watch_dir("/work/w", recursive=True)
        seen = []
        def until(event):
            # Each step waits for the watch to report the last: a subdirectory is watched once
            # its creation is seen (what inotify allows); nothing here races the watcher.
            deadline = time.time() + 30
            while event not in seen and time.time() < deadline:
                seen.extend((e.name, e.type.value) for e in handle.get_new_events())
                time.sleep(0.05)
        sbx.commands.run("echo y > /work/w/top.txt && mkdir /work/w/sub")
        until(("sub", "create"))
        sbx.commands.run("echo x > /work/w/sub/new.txt")
        until(("sub/new.txt", "write"))
        sbx.commands.run("mv /work/w/sub/new.txt /work/w/moved.txt && rm /work/w/moved.txt")
        until(("moved.txt", "remove"))
        handle.stop()
        print(json.dumps(seen))
        """
    )
    events = [tuple(e) for e in out]
    wanted = [
        ("top.txt", "create"),
        ("top.txt", "write"),
        ("sub", "create"),
        ("sub/new.txt", "create"),
        ("sub/new.txt", "write"),
        ("sub/new.txt", "rename"),
        ("moved.txt", "create"),
        ("moved.txt", "remove"),
    ]
    for event in wanted:
        assert event in events, (event, events)
    assert [events.index(e) for e in wanted[2:]] == sorted(events.index(e) for e in wanted[2:]), events


async def test_async_sdk_watch_dir_streams_events(e2b: E2B) -> None:
    out = await e2b.run(
        """
        import asyncio
        from e2b import AsyncSandbox
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            seen = []
            got = asyncio.Event()
            def on_event(e):
                seen.append((e.name, e.type.value))
                if e.name == "b.txt":
                    got.set()
            await sbx.files.make_dir("/work/aw")
            handle = await sbx.files.watch_dir("/work/aw", on_event)
            await sbx.files.write("/work/aw/b.txt", "b")
            await asyncio.wait_for(got.wait(), 30)
            await handle.stop()
            await sbx.kill()
            return seen
        print(json.dumps(asyncio.run(main())))
        """
    )
    assert ["b.txt", "create"] in out or ["b.txt", "write"] in out


async def test_pause_and_resume_keep_files_and_a_running_process(e2b: E2B) -> None:
    out = await e2b.run(
        """
        sbx = Sandbox.create(timeout=120)
        sbx.files.write("/work/kept.txt", "kept")
        # Renamed into place: a process frozen between the truncation and the write of
        # `echo > file` (and paged out) leaves the file empty for a while after the resume.
        loop = "n=0; while true; do n=$((n+1)); echo $n >/work/c; mv /work/c /work/count; sleep 0.05; done"
        h = sbx.commands.run(loop, background=True)
        sbx.commands.run("sleep 0.3")
        sbx.pause()
        same = Sandbox.connect(sbx.sandbox_id)
        first = int(same.files.read("/work/count"))
        same.commands.run("sleep 0.5")
        second = int(same.files.read("/work/count"))
        running = h.pid in [p.pid for p in same.commands.list()]
        print(json.dumps({"kept": same.files.read("/work/kept.txt"), "counts": [first, second],
                          "running": running}))
        """,
        timeout=120,
    )
    assert out["kept"] == "kept"
    assert out["running"] is True
    assert out["counts"][1] > out["counts"][0]  # the same loop went on counting after the resume


async def test_signed_file_urls_open_their_file_and_nothing_else(e2b: E2B) -> None:
    # With E2B_SANDBOX_URL set a signed URL carries no sandbox: the client names it in the header.
    out = await e2b.run(
        """
        import httpx
        sbx = Sandbox.create(timeout=120)
        sbx.files.write("/work/s.txt", "signed")
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id}
        url = sbx.download_url("/work/s.txt", user="root", use_signature_expiration=60)
        ok = httpx.get(url, headers=headers)
        tampered = httpx.get(url.replace("s.txt", "t.txt"), headers=headers)
        print(json.dumps({"ok": [ok.status_code, ok.text], "tampered": tampered.status_code}))
        """
    )
    assert out == {"ok": [200, "signed"], "tampered": 401}


async def test_files_serve_no_kernel_views_and_a_deep_listing_skips_them(e2b: E2B) -> None:
    """/proc is the sandbox kernel's view, not its files: listing /proc/1/fd is refused, and a
    deep listing of / shows the /proc directory without walking into it."""
    out = await e2b.run(
        """
        sbx = Sandbox.create(timeout=120)
        try:
            sbx.files.list("/proc/1/fd")
            refused = None
        except Exception as e:
            refused = type(e).__name__
        deep = [e.path for e in sbx.files.list("/", depth=2)]
        print(json.dumps({"refused": refused, "deep": deep}))
        sbx.kill()
        """
    )
    assert out["refused"] == "InvalidArgumentException", out
    assert "/proc" in out["deep"] and "/etc/passwd" in out["deep"], out
    assert [p for p in out["deep"] if p.startswith(("/proc/", "/dev/pts/"))] == [], out
