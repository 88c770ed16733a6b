"""Issue 30's eleven wrong answers, each as the official SDKs see it, sync and async.

Each test drives one point through both clients of each SDK version (``e2b`` is parametrized
over the versions); the behaviour asserted is envd's or E2B API's, read from their source
(e2b-dev/infra: packages/envd, packages/api, packages/shared/pkg/proxy).
"""

from __future__ import annotations

import pytest

from dsec.node.embedded import EmbeddedNode
from dsec.protocol.models import ShellRequest
from tests.e2b.conftest import E2B

# Snippets run both clients: the sync one in `sync()`, the async one in `main()`.
_BOTH = """
        import asyncio
        from e2b import AsyncSandbox
"""  # indented as the snippets are: run() dedents the whole


async def test_an_unknown_or_malformed_sandbox_id_is_not_found(e2b: E2B) -> None:
    out = await e2b.run(
        _BOTH
        + """
        IDS = ("nonexistingsandbox", "sb-nosuchnode-1-aaaaaaaaaaaaaaaaaaaa", "x" * 300)
        def outcome(call):
            try:
                return repr(call())
            except Exception as e:
                return type(e).__name__
        def sync():
            return [[outcome(lambda: Sandbox.kill(i)), outcome(lambda: Sandbox.get_info(i)),
                     outcome(lambda: Sandbox.connect(i)), outcome(lambda: Sandbox.pause(i))]
                    for i in IDS]
        async def aoutcome(call):
            try:
                return repr(await call())
            except Exception as e:
                return type(e).__name__
        async def main():
            return [[await aoutcome(lambda: AsyncSandbox.kill(i)),
                     await aoutcome(lambda: AsyncSandbox.get_info(i)),
                     await aoutcome(lambda: AsyncSandbox.connect(i)),
                     await aoutcome(lambda: AsyncSandbox.pause(i))] for i in IDS]
        print(json.dumps({"sync": sync(), "async": asyncio.run(main())}))
        """
    )
    wanted = ["False", "SandboxNotFoundException", "SandboxNotFoundException", "SandboxNotFoundException"]
    assert out == {"sync": [wanted] * 3, "async": [wanted] * 3}


async def test_an_ended_sandbox_is_not_running_and_a_command_cut_by_kill_is_a_timeout(
    e2b: E2B,
) -> None:
    out = await e2b.run(
        _BOTH
        + """
        import threading
        from e2b import TimeoutException
        def sleeping(processes):
            return any("sleep 600" in " ".join([p.cmd, *p.args]) for p in processes)
        def started(list_processes):
            for _ in range(600):
                if sleeping(list_processes()):
                    return True
                time.sleep(0.05)
            return False
        def sync():
            sbx = Sandbox.create(timeout=120)
            caught = {}
            def run():
                try:
                    sbx.commands.run("sleep 600")
                    caught["error"] = None
                except Exception as e:
                    caught["error"] = e
            runner = threading.Thread(target=run)
            runner.start()
            assert started(sbx.commands.list)
            alive = sbx.is_running()
            killed = Sandbox.kill(sbx.sandbox_id)
            runner.join(60)
            e = caught["error"]
            return [alive, killed, sbx.is_running(), isinstance(e, TimeoutException),
                    type(e).__name__, "killed" in str(e)]
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            task = asyncio.create_task(sbx.commands.run("sleep 600"))
            for _ in range(600):
                if sleeping(await sbx.commands.list()):
                    break
                await asyncio.sleep(0.05)
            alive = await sbx.is_running()
            killed = await AsyncSandbox.kill(sbx.sandbox_id)
            try:
                await asyncio.wait_for(task, 60)
                e = None
            except Exception as exc:
                e = exc
            return [alive, killed, await sbx.is_running(), isinstance(e, TimeoutException),
                    type(e).__name__, "killed" in str(e)]
        print(json.dumps({"sync": sync(), "async": asyncio.run(main())}))
        """,
        timeout=180,
    )
    for client in ("sync", "async"):
        alive, killed, running_after, is_timeout, name, says_killed = out[client]
        assert (alive, killed, running_after) == (True, True, False), (client, out)
        assert is_timeout and says_killed, (client, name, out)


async def test_set_timeout_zero_ends_the_sandbox_now(e2b: E2B, node: EmbeddedNode) -> None:
    out = await e2b.run(
        _BOTH
        + """
        from e2b import SandboxNotFoundException
        def gone(sid):
            try:
                Sandbox.get_info(sid)
                return False
            except SandboxNotFoundException:
                return True
        def sync():
            sbx = Sandbox.create(timeout=120)
            sbx.set_timeout(0)
            return [sbx.is_running(), gone(sbx.sandbox_id), sbx.sandbox_id]
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            await sbx.set_timeout(0)
            return [await sbx.is_running(), gone(sbx.sandbox_id), sbx.sandbox_id]
        print(json.dumps({"sync": sync(), "async": asyncio.run(main())}))
        """
    )
    for client in ("sync", "async"):
        running, gone, sid = out[client]
        assert (running, gone) == (False, True), (client, out)
        assert (await node.link.get(sid)).state.value in ("stopped", "stopping")


async def test_a_command_past_its_timeout_raises_timeout_exception(e2b: E2B) -> None:
    out = await e2b.run(
        _BOTH
        + """
        from e2b import TimeoutException
        def sync():
            sbx = Sandbox.create(timeout=120)
            try:
                sbx.commands.run("sleep 60", timeout=1)
                return None
            except Exception as e:
                return [type(e).__name__, isinstance(e, TimeoutException), "exceeding 'timeout'" in str(e)]
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            try:
                await sbx.commands.run("sleep 60", timeout=1)
                return None
            except Exception as e:
                return [type(e).__name__, isinstance(e, TimeoutException), "exceeding 'timeout'" in str(e)]
        print(json.dumps({"sync": sync(), "async": asyncio.run(main())}))
        """
    )
    assert out == {"sync": ["TimeoutException", True, True], "async": ["TimeoutException", True, True]}


async def test_gzip_uploads_are_decoded_once_and_a_bomb_is_refused(e2b: E2B, node: EmbeddedNode) -> None:
    out = await e2b.run(
        _BOTH
        + """
        import gzip, httpx
        def sync():
            sbx = Sandbox.create(timeout=120)
            sbx.files.write("/tmp/g.txt", "x" * 100000, gzip=True)
            sbx.files.write_files([{"path": "/tmp/g2.txt", "data": "two"}], gzip=True)
            return [sbx.files.read("/tmp/g.txt") == "x" * 100000, sbx.files.read("/tmp/g2.txt")]
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            await sbx.files.write("/tmp/g.txt", "y" * 100000, gzip=True)
            return [await sbx.files.read("/tmp/g.txt") == "y" * 100000]
        def bomb():
            sbx = Sandbox.create(timeout=120)
            body = gzip.compress(bytes(256 << 20))  # 256 MiB of zeros, 250 KiB on the wire
            r = httpx.post(os.environ["E2B_SANDBOX_URL"] + "/files",
                           params={"path": "/tmp/bomb", "username": "root"}, content=body,
                           headers={"Content-Encoding": "gzip",
                                    "Content-Type": "application/octet-stream",
                                    "X-Access-Token": sbx._envd_access_token,
                                    "E2b-Sandbox-Id": sbx.sandbox_id}, timeout=120)
            return [r.status_code, len(body), sbx.sandbox_id]
        print(json.dumps({"sync": sync(), "async": asyncio.run(main()), "bomb": bomb()}))
        """,
        timeout=180,
    )
    assert out["sync"] == [True, "two"] and out["async"] == [True]
    status, wire, sid = out["bomb"]
    assert status == 400 and wire < 1 << 20
    check = await node.link.run_shell(sid, ShellRequest(command="test -e /tmp/bomb; echo $?"))
    assert check.stdout.strip() == "1"  # nothing of the refused body was left


async def test_removing_a_missing_path_succeeds(e2b: E2B) -> None:
    out = await e2b.run(
        _BOTH
        + """
        def sync():
            sbx = Sandbox.create(timeout=120)
            sbx.files.write("/tmp/r/x.txt", "x")
            sbx.files.remove("/tmp/r")
            sbx.files.remove("/tmp/r")
            sbx.files.remove("/tmp/never/was/here")
            return sbx.files.exists("/tmp/r")
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            await sbx.files.remove("/tmp/never/was/here")
            return await sbx.files.exists("/tmp/never")
        print(json.dumps({"sync": sync(), "async": asyncio.run(main())}))
        """
    )
    assert out == {"sync": False, "async": False}


async def test_a_watcher_sees_an_upload_as_envd_writes_it(e2b: E2B) -> None:
    out = await e2b.run(
        _BOTH
        + """
        def sync():
            sbx = Sandbox.create(timeout=120)
            sbx.files.make_dir("/tmp/w")
            handle = sbx.files.watch_dir("/tmp/w")
            sbx.files.write("/tmp/w/f.txt", "data")
            seen = []
            for _ in range(600):
                seen.extend((e.name, e.type.value) for e in handle.get_new_events())
                if ("f.txt", "write") in seen:
                    break
                time.sleep(0.05)
            handle.stop()
            return seen
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            await sbx.files.make_dir("/tmp/aw")
            seen, wrote = [], asyncio.Event()
            def on_event(e):
                seen.append((e.name, e.type.value))
                if (e.name, e.type.value) == ("b.txt", "write"):
                    wrote.set()
            handle = await sbx.files.watch_dir("/tmp/aw", on_event)
            await sbx.files.write("/tmp/aw/b.txt", "b")
            await asyncio.wait_for(wrote.wait(), 30)
            await handle.stop()
            return seen
        print(json.dumps({"sync": sync(), "async": asyncio.run(main())}))
        """
    )
    assert [tuple(e) for e in out["sync"]] == [("f.txt", "create"), ("f.txt", "chmod"), ("f.txt", "write")]
    assert [tuple(e) for e in out["async"]] == [("b.txt", "create"), ("b.txt", "chmod"), ("b.txt", "write")]


async def test_include_entry_fills_the_event_entry(e2b: E2B) -> None:
    if e2b.version.startswith("2.34"):
        pytest.skip("e2b 2.34 has no include_entry (envd 0.6.3's event entry)")
    out = await e2b.run(
        _BOTH
        + """
        def entry(e):
            return None if e.entry is None else [e.entry.name, e.entry.type.value, e.entry.size]
        def sync():
            sbx = Sandbox.create(timeout=120)
            sbx.files.make_dir("/tmp/w")
            handle = sbx.files.watch_dir("/tmp/w", include_entry=True)
            seen = []
            def until(kind):
                for _ in range(600):
                    seen.extend((e.name, e.type.value, entry(e)) for e in handle.get_new_events())
                    if any(s[1] == kind for s in seen):
                        return
                    time.sleep(0.05)
            sbx.commands.run("printf abc > /tmp/w/e.txt")
            until("write")
            sbx.commands.run("rm /tmp/w/e.txt")
            until("remove")
            handle.stop()
            return seen
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            await sbx.files.make_dir("/tmp/aw")
            seen, done = [], asyncio.Event()
            def on_event(e):
                seen.append((e.name, e.type.value, entry(e)))
                if e.type.value == "write":
                    done.set()
            handle = await sbx.files.watch_dir("/tmp/aw", on_event, include_entry=True)
            await sbx.files.write("/tmp/aw/e.txt", "abc")
            await asyncio.wait_for(done.wait(), 30)
            await handle.stop()
            return seen
        print(json.dumps({"sync": sync(), "async": asyncio.run(main())}))
        """
    )
    for client in ("sync", "async"):
        events = out[client]
        creates = [e for e in events if e[1] == "create"]
        assert creates and creates[0][2] is not None and creates[0][2][:2] == ["e.txt", "file"], out
        writes = [e for e in events if e[1] == "write"]
        assert writes and writes[-1][2] in (["e.txt", "file", 3], None), out
        assert all(e[2] is None for e in events if e[1] in ("remove", "rename")), out
    assert ["e.txt", "file", 3] in [e[2] for e in out["async"]]


async def test_get_info_of_a_symlink_names_its_target(e2b: E2B) -> None:
    out = await e2b.run(
        _BOTH
        + """
        def sync():
            sbx = Sandbox.create(timeout=120)
            sbx.commands.run("mkdir -p /tmp/s && echo hi > /tmp/s/real.txt && "
                             "ln -s real.txt /tmp/s/link && ln -s /tmp/s/link /tmp/s/chain && "
                             "ln -s /nowhere /tmp/s/dangling")
            infos = [sbx.files.get_info(p) for p in ("/tmp/s/link", "/tmp/s/chain", "/tmp/s/dangling")]
            plain = sbx.files.get_info("/tmp/s/real.txt")
            # A dangling link's type is envd's UNSPECIFIED: None in 2.34 (2.63 marks the link).
            return [[i.symlink_target, i.type and i.type.value] for i in infos] + [plain.symlink_target]
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            await sbx.commands.run("echo hi > /tmp/real.txt && ln -s /tmp/real.txt /tmp/link")
            info = await sbx.files.get_info("/tmp/link")
            return [info.symlink_target, info.type.value]
        print(json.dumps({"sync": sync(), "async": asyncio.run(main())}))
        """
    )
    # envd: the fully resolved path, the link's own when it leads nowhere; 2.63 marks the link
    # (is_symlink), 2.34 shows the type of what it points to.
    link_type = "symlink" if e2b.version.startswith("2.63") else "file"
    assert out["sync"][:2] == [["/tmp/s/real.txt", link_type], ["/tmp/s/real.txt", link_type]]
    assert out["sync"][2] == ["/tmp/s/dangling", "symlink" if link_type == "symlink" else None]
    assert out["sync"][3] is None
    assert out["async"] == ["/tmp/real.txt", link_type]


async def test_a_deep_listing_is_depth_first(e2b: E2B) -> None:
    out = await e2b.run(
        _BOTH
        + """
        def sync():
            sbx = Sandbox.create(timeout=120)
            sbx.commands.run("mkdir -p /tmp/d/a/a1/a2 /tmp/d/b/b1 && touch /tmp/d/a/f /tmp/d/c")
            return [e.path for e in sbx.files.list("/tmp/d", depth=3)]
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            await sbx.commands.run("mkdir -p /tmp/d/a/a1 /tmp/d/b/b1")
            return [e.path for e in await sbx.files.list("/tmp/d", depth=2)]
        print(json.dumps({"sync": sync(), "async": asyncio.run(main())}))
        """
    )
    assert out["sync"] == [
        "/tmp/d/a",
        "/tmp/d/a/a1",
        "/tmp/d/a/a1/a2",
        "/tmp/d/a/f",
        "/tmp/d/b",
        "/tmp/d/b/b1",
        "/tmp/d/c",
    ]
    assert out["async"] == ["/tmp/d/a", "/tmp/d/a/a1", "/tmp/d/b", "/tmp/d/b/b1"]


async def test_upload_metadata_is_kept_as_user_e2b_xattrs(e2b: E2B) -> None:
    out = await e2b.run(
        _BOTH
        + """
        def sync():
            sbx = Sandbox.create(timeout=120)
            w = sbx.files.write("/tmp/m.txt", "x", metadata={"owner": "me", "Kind": "a note"})
            first = sbx.files.get_info("/tmp/m.txt").metadata
            sbx.files.write("/tmp/m.txt", "y")  # an upload without metadata leaves none
            return [getattr(w, "metadata", "n/a"), first, sbx.files.get_info("/tmp/m.txt").metadata]
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            await sbx.files.write("/tmp/m.txt", "x", metadata={"k": "v"})
            return (await sbx.files.get_info("/tmp/m.txt")).metadata
        print(json.dumps({"sync": sync(), "async": asyncio.run(main())}))
        """
    )
    wanted = {"owner": "me", "kind": "a note"}  # envd lowercases keys
    assert out["sync"][0] in (wanted, "n/a") and out["sync"][1:] == [wanted, None], out
    assert out["async"] == {"k": "v"}
