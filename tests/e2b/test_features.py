"""DSec's own features behind E2B's names, as the official SDKs see them, sync and async:
``autoResume`` and ``is_running()`` of a paused sandbox, the ``startedAfter`` list filter,
network allow/deny on DSec's permissions (issue 30). The behaviour asserted is E2B's API and
proxy's (e2b-dev/infra: packages/api handlers, packages/client-proxy)."""

from __future__ import annotations

import aiohttp
import pytest

from dsec.apiserver.e2b.network import ALL_TRAFFIC
from dsec.node.embedded import EmbeddedNode
from tests.e2b.conftest import E2B, PROJECT
from tests.netpolicy import mirror

_BOTH = """
        import asyncio
        from e2b import AsyncSandbox
"""


async def test_a_paused_sandbox_is_running_only_when_it_auto_resumes(e2b: E2B, node: EmbeddedNode) -> None:
    out = await e2b.run(
        _BOTH
        + """
        PLAIN = {"on_timeout": "pause"}
        RESUMING = {"on_timeout": "pause", "auto_resume": True}
        def sync():
            plain = Sandbox.create(timeout=120, lifecycle=PLAIN, metadata={"k": "v"})
            plain.pause()
            asleep = [plain.is_running(), plain.get_info().state.value]
            plain.connect()
            woken = plain.is_running()
            auto = Sandbox.create(timeout=120, lifecycle=RESUMING, metadata={"k": "v"})
            info = auto.get_info()
            auto.pause()
            return {"plain": asleep + [woken], "auto": [auto.is_running(), auto.get_info().state.value],
                    "lifecycle": info.lifecycle, "metadata": info.metadata,
                    "ids": [plain.sandbox_id, auto.sandbox_id]}
        async def main():
            plain = await AsyncSandbox.create(timeout=120, lifecycle=PLAIN, metadata={"k": "v"})
            await plain.pause()
            asleep = [await plain.is_running(), (await plain.get_info()).state.value]
            await plain.connect()
            woken = await plain.is_running()
            auto = await AsyncSandbox.create(timeout=120, lifecycle=RESUMING, metadata={"k": "v"})
            info = await auto.get_info()
            await auto.pause()
            return {"plain": asleep + [woken],
                    "auto": [await auto.is_running(), (await auto.get_info()).state.value],
                    "lifecycle": info.lifecycle, "metadata": info.metadata,
                    "ids": [plain.sandbox_id, auto.sandbox_id]}
        print(json.dumps({"sync": sync(), "async": asyncio.run(main())}))
        """,
        timeout=180,
    )
    for client in ("sync", "async"):
        got = out[client]
        # Not running while paused (health: the proxy's 502), and the probe does not wake it.
        assert got["plain"] == [False, "paused", True], (client, got)
        assert got["auto"] == [True, "running"], (client, got)  # the probe resumed it
        assert got["lifecycle"] == {"on_timeout": "pause", "auto_resume": True}, (client, got)
        assert got["metadata"] == {"k": "v"}, (client, got)  # the kept setting is not metadata
        for sid in got["ids"]:
            assert (await node.link.get(sid)).state.value == "running"


async def test_the_started_after_filter(e2b: E2B) -> None:
    out = await e2b.run(
        _BOTH
        + """
        from e2b import SandboxQuery
        if "started_after" not in getattr(SandboxQuery, "__dataclass_fields__", {}):
            print(json.dumps(None))  # this SDK has no startedAfter
            sys.stdout.flush(); os._exit(0)
        def ids(paginator):
            return sorted(s.sandbox_id for s in paginator.next_items())
        def sync():
            first, second = Sandbox.create(timeout=120), Sandbox.create(timeout=120)
            since = second.get_info().started_at
            return [ids(Sandbox.list(query=SandboxQuery(started_after=since))),
                    ids(Sandbox.list(query=SandboxQuery(started_after=first.get_info().started_at))),
                    sorted([first.sandbox_id, second.sandbox_id]), second.sandbox_id]
        async def aids(paginator):
            return sorted(s.sandbox_id for s in await paginator.next_items())
        async def main():
            first = await AsyncSandbox.create(timeout=120)
            second = await AsyncSandbox.create(timeout=120)
            since = (await second.get_info()).started_at
            started = (await first.get_info()).started_at
            return [await aids(AsyncSandbox.list(query=SandboxQuery(started_after=since))),
                    await aids(AsyncSandbox.list(query=SandboxQuery(started_after=started))),
                    sorted([first.sandbox_id, second.sandbox_id]), second.sandbox_id]
        print(json.dumps({"sync": sync(), "async": asyncio.run(main())}))
        """,
        timeout=180,
    )
    if out is None:
        pytest.skip(f"e2b {e2b.version} has no started_after")
    for client in ("sync", "async"):
        newest, both, made, second = out[client]
        assert newest == [second] and both == made, (client, out)


@pytest.mark.parametrize("value", ["yesterday", "2026-01-01T00:00:00", "x" * 5000])
async def test_a_bad_started_after_is_a_400(e2b: E2B, value: str) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"{e2b.url}/v2/sandboxes", params={"startedAfter": value}, headers={"X-API-Key": e2b.key}
        ) as r,
    ):
        body = await r.json()
    assert r.status == 400 and "startedAfter" in body["message"], body


async def test_network_updates_map_onto_permissions(e2b: E2B, node: EmbeddedNode) -> None:
    # The test node offers mirror, other, pypi, npm, mirror-dns and public-web (every public
    # address), and no `internet`.
    out = await e2b.run(
        _BOTH
        + f"""
        ALL = {ALL_TRAFFIC!r}
        def refused(call):
            try:
                call()
                return None
            except Exception as e:
                return str(e)
        def sync():
            sbx = Sandbox.create(timeout=120)
            plain = sbx.sandbox_id
            sbx.update_network({{"allow_out": ["mirror", {mirror.PUBLIC_A!r}], "deny_out": [ALL]}})
            closed = Sandbox.create(timeout=120, allow_internet_access=False,
                                    network={{"allow_out": ["other"]}})
            return {{"ids": [plain, closed.sandbox_id],
                    "address": refused(lambda: sbx.update_network({{"allow_out": ["10.0.0.5"]}})),
                    "deny_one": refused(lambda: sbx.update_network({{"deny_out": ["example.com"]}})),
                    "unknown": refused(lambda: sbx.update_network({{"allow_out": ["nosuch"]}})),
                    "no_internet": refused(
                        lambda: Sandbox.create(timeout=120, network={{"allow_out": [ALL]}}))}}
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            await sbx.update_network({{"allow_out": ["pypi", "npm"], "deny_out": [ALL]}})
            try:
                # No internet here: nothing public is reachable, so any range is denied already.
                await sbx.update_network(
                    {{"allow_out": ["pypi", "npm"], "deny_out": ["10.0.0.0/8", "8.8.8.8"]}}
                )
                deny = None
            except Exception as e:
                deny = str(e)
            return {{"ids": [sbx.sandbox_id], "deny_one": deny}}
        print(json.dumps({{"sync": sync(), "async": asyncio.run(main())}}))
        """,
        timeout=180,
    )
    plain, closed = out["sync"]["ids"]
    # A public address is opened for the sandbox; a private one is the operator's to open.
    assert (await node.link.get(plain)).network_rules == {"mirror": True, mirror.PUBLIC_A: True}
    assert (await node.link.get(closed)).network_rules == {"other": True}
    assert "public IPv4 addresses only" in out["sync"]["address"]
    assert out["sync"]["deny_one"] and "invalid denied CIDR example.com" in out["sync"]["deny_one"]
    assert out["async"]["deny_one"] is None
    assert "unknown network permission" in out["sync"]["unknown"] and "nosuch" in out["sync"]["unknown"]
    assert "'internet'" in out["sync"]["no_internet"]  # not offered here: refused, not ignored
    [sid] = out["async"]["ids"]
    assert (await node.link.get(sid)).network_rules == {"pypi": True, "npm": True}
    made = [
        i for i in await node.link.list_sandboxes() if i.project == PROJECT and i.state.value == "running"
    ]
    assert len(made) == 3  # the refused create left no sandbox behind
