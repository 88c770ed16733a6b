"""Answers E2B's own Python SDK suite (packages/python-sdk/tests) found DSec giving wrongly,
each checked here through the official SDK."""

from __future__ import annotations

from tests.e2b.conftest import E2B


async def test_an_expired_signed_url_is_envds_401(e2b: E2B) -> None:
    """E2B's test_download_url_with_expired_signing: 401 {"code", "message"} in envd's words,
    whether the URL names no sandbox (made with E2B_SANDBOX_URL) or the client names it."""
    out = await e2b.run(
        """
        import httpx
        sbx = Sandbox.create(timeout=120)
        sbx.files.write("/tmp/e.txt", "x")
        url = sbx.download_url("/tmp/e.txt", user="root", use_signature_expiration=-120)
        bare = httpx.get(url)
        named = httpx.get(url, headers={"E2b-Sandbox-Id": sbx.sandbox_id})
        print(json.dumps([[r.status_code, r.json()] for r in (bare, named)]))
        """
    )
    expired = [401, {"code": 401, "message": "signature is already expired"}]
    assert out == [expired, expired]


async def test_a_renamed_file_keeps_its_metadata(e2b: E2B) -> None:
    """E2B's test_metadata_surfaced_after_rename: Move's answer carries the file's metadata."""
    out = await e2b.run(
        """
        sbx = Sandbox.create(timeout=120)
        sbx.files.write("/tmp/old.txt", "x", metadata={"stage": "renamed"})
        moved = sbx.files.rename("/tmp/old.txt", "/tmp/new.txt")
        print(json.dumps([moved.metadata, sbx.files.get_info("/tmp/new.txt").metadata]))
        """
    )
    assert out == [{"stage": "renamed"}, {"stage": "renamed"}]


async def test_base_is_a_public_template_and_answers_to_python(e2b: E2B) -> None:
    """E2B's template tests ask `Template.exists("base")` and build `from_template("base")`;
    its sandbox tests run `python` (E2B's base has it beside python3)."""
    out = await e2b.run(
        """
        from e2b import Template
        exists = Template.exists("base")
        sbx = Sandbox.create("e2b:base", timeout=120)
        py = sbx.commands.run("python -c 'print(6 * 7)'").stdout
        sbx.kill()
        print(json.dumps({"exists": exists, "py": py}))
        """,
        timeout=240,
    )
    assert out == {"exists": True, "py": "42\n"}


async def test_listings_and_watch_entries_carry_metadata_and_directories_a_size(
    e2b_latest: E2B,
) -> None:
    """E2B's test_metadata_surfaced_when_listing, test_get_info_of_directory and
    test_watch_directory_changes_with_entry_info: ListDir's entries carry each file's metadata;
    a directory's size is ext4's (whole 4 KiB blocks, at least one), not btrfs's 0; a sync
    watcher polled right after a write already holds the write, with its entry."""
    out = await e2b_latest.run(
        """
        from e2b import FilesystemEventType
        sbx = Sandbox.create(timeout=120)
        sbx.files.make_dir("/srv/d/empty")
        sbx.files.write("/srv/d/f.txt", "x", metadata={"tag": "listed"})
        sbx.files.write("/srv/d/g.txt", "y")
        listed = {e.name: [e.metadata, e.size] for e in sbx.files.list("/srv/d")}
        empty = sbx.files.get_info("/srv/d/empty").size
        writes = []
        for n in range(5):
            handle = sbx.files.watch_dir("/srv/d", include_entry=True)
            sbx.files.write("/srv/d/f.txt", "z" * (n + 1))
            events = handle.get_new_events()
            handle.stop()
            writes.append([[e.entry.name, e.entry.size] if e.entry else None
                           for e in events if e.type == FilesystemEventType.WRITE])
        print(json.dumps({"listed": listed, "empty": empty, "writes": writes}))
        """
    )
    assert out["listed"] == {"empty": [None, 4096], "f.txt": [{"tag": "listed"}, 1], "g.txt": [None, 1]}
    assert out["empty"] == 4096
    assert out["writes"] == [[["f.txt", n + 1]] for n in range(5)], out["writes"]


async def test_a_background_command_cut_by_kill_says_the_sandbox_was_killed(e2b: E2B) -> None:
    """E2B's test_kill_sandbox_while_command_is_running (sync and async): `wait()` on a
    background command whose sandbox is killed raises TimeoutException saying so. The cut is a
    reset for the SDKs whose HTTP stack takes only that for a transport failure (pyqwest, from
    2.35; 2.45 raised a generic timeout on a FIN), a FIN for the others."""
    out = await e2b.run(
        """
        import asyncio
        from e2b import AsyncSandbox, TimeoutException
        def sync():
            sbx = Sandbox.create(timeout=120)
            cmd = sbx.commands.run("sleep 60", background=True)
            sbx.kill()
            try:
                cmd.wait()
                return None
            except Exception as e:
                return [isinstance(e, TimeoutException), "sandbox was killed" in str(e)]
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            cmd = await sbx.commands.run("sleep 60", background=True)
            await sbx.kill()
            try:
                await cmd.wait()
                return None
            except Exception as e:
                return [isinstance(e, TimeoutException), "sandbox was killed" in str(e)]
        print(json.dumps([sync(), asyncio.run(main())]))
        """,
        timeout=180,
    )
    assert out == [[True, True], [True, True]]
