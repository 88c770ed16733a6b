"""E2B's sandbox lifecycle through the official SDKs (each test runs once per SDK version)."""

from __future__ import annotations

from tests.e2b.conftest import E2B


async def test_create_and_kill(e2b: E2B) -> None:
    out = await e2b.run(
        """
        sbx = Sandbox.create(timeout=60)
        info = sbx.get_info()
        killed = sbx.kill()
        print(json.dumps({"id": sbx.sandbox_id, "template": info.template_id, "state": str(info.state),
                          "killed": killed}))
        """
    )
    assert out["id"].startswith("sb-") and out["killed"] is True
