"""E2B's base template for E2B clients (issue 30): ``base`` is ``e2b:base`` once ``dsec base``
built it, with E2B's ``user`` (uid 1000, home /home/user, passwordless sudo) whom commands run
as by default, as envd runs them as its template's default user; ``user="root"`` still works."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dsec.images.base import E2B_BASE_REF, E2B_PACKAGES, E2B_RECIPE, add_e2b_user, ensure_base_layer
from dsec.node.embedded import EmbeddedNode
from tests.e2b.conftest import E2B

_BOTH = """
        import asyncio
        from e2b import AsyncSandbox
"""
_PROBE = (
    "whoami; id -u; echo $HOME; pwd; curl --version >/dev/null && echo curl;"
    " git --version >/dev/null && echo git; python3 -c 'print(1)'; pip --version >/dev/null && echo pip"
)


@pytest.fixture
async def e2b_base(node: EmbeddedNode) -> AsyncIterator[None]:
    """E2B's base built in the test store (one debootstrap per store) and made what ``base``
    means, as ``dsec up`` makes it."""
    await asyncio.to_thread(
        ensure_base_layer,
        node.store,
        E2B_BASE_REF,
        packages=E2B_PACKAGES,
        customize=add_e2b_user,
        recipe=E2B_RECIPE,
    )
    lifecycle = node.api.e2b.lifecycle
    before, lifecycle.default_template = lifecycle.default_template, E2B_BASE_REF
    try:
        yield
    finally:
        lifecycle.default_template = before


async def test_base_runs_commands_as_user_with_sudo(e2b: E2B, e2b_base: None) -> None:
    out = await e2b.run(
        _BOTH
        + f"""
        PROBE = {_PROBE!r}
        def sync():
            sbx = Sandbox.create(timeout=120)
            sbx.files.write("rel.txt", "hi")
            return [sbx.get_info().template_id, sbx.commands.run(PROBE).stdout.split(),
                    sbx.commands.run("whoami", user="root").stdout.strip(),
                    sbx.commands.run("stat -c %U /home/user/rel.txt").stdout.strip()]
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            await sbx.files.write("rel.txt", "hi")
            return [(await sbx.get_info()).template_id, (await sbx.commands.run(PROBE)).stdout.split(),
                    (await sbx.commands.run("whoami", user="root")).stdout.strip(),
                    (await sbx.commands.run("stat -c %U /home/user/rel.txt")).stdout.strip()]
        print(json.dumps({{"sync": sync(), "async": asyncio.run(main())}}))
        """,
        timeout=180,
    )
    for client in ("sync", "async"):
        template, probe, as_root, owner = out[client]
        assert template == E2B_BASE_REF, (client, out)
        assert probe == ["user", "1000", "/home/user", "/home/user", "curl", "git", "1", "pip"], (
            client,
            out,
        )
        assert (as_root, owner) == ("root", "user"), (client, out)


async def test_base_has_passwordless_sudo(e2b: E2B, e2b_base: None) -> None:
    out = await e2b.run(
        """
        sbx = Sandbox.create(timeout=120)
        r = sbx.commands.run("sudo -n whoami 2>&1 || true")
        print(json.dumps(r.stdout.strip()))
        """
    )
    assert out == "root", out
