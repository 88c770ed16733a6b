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
