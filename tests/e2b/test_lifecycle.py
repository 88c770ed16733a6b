"""E2B's sandbox lifecycle through the official SDKs (each test runs once per SDK version).

States are read back through DSec (the node's edge link), so a test checks what really
happened to the sandbox, not only what the SDK was told.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from dsec.node.embedded import EmbeddedNode
from dsec.protocol.models import SandboxState, ShellRequest
from tests.e2b.conftest import E2B, PROJECT, SnippetFailed
from tests.support import eventually

EXTRA = "e2b-extra:1"  # a second layer, stacked on the base by a "+" template


async def state_of(node: EmbeddedNode, sandbox_id: str) -> SandboxState:
    return (await node.link.get(sandbox_id)).state


async def test_create_get_info_and_kill(e2b: E2B, node: EmbeddedNode) -> None:
    out = await e2b.run(
        """
        sbx = Sandbox.create(timeout=60)
        info = sbx.get_info()
        killed = sbx.kill()
        try:
            Sandbox.get_info(sbx.sandbox_id)
            gone = False
        except Exception as e:
            gone = type(e).__name__
        print(json.dumps({"id": sbx.sandbox_id, "template": info.template_id, "state": str(info.state.value),
                          "cpu": info.cpu_count, "mem": info.memory_mb, "envd": info.envd_version,
                          "end_minus_start": (info.end_at - info.started_at).total_seconds(),
                          "killed": killed, "again": Sandbox.kill(sbx.sandbox_id), "gone": gone}))
        """
    )
    assert out["id"].startswith("sb-test-") and out["template"] == "debian:bookworm"
    assert (out["state"], out["cpu"], out["mem"], out["envd"]) == ("running", 2, 1024, "0.6.4")
    assert 55 <= out["end_minus_start"] <= 65, "endAt is the deadline the timeout set"
    assert (out["killed"], out["again"], out["gone"]) == (True, False, "SandboxNotFoundException")
    info = await node.link.get(out["id"])
    assert info.state is SandboxState.stopped and info.project == PROJECT


async def test_template_names_layers_and_a_bad_one_is_not_found(
    e2b: E2B, node: EmbeddedNode, tmp_path: Path
) -> None:
    if not node.store.has_tag(EXTRA):
        (tmp_path / "extra").mkdir()
        (tmp_path / "extra" / "extra.txt").write_text("from the second layer\n")
        await asyncio.to_thread(node.store.import_path, tmp_path / "extra", EXTRA)
    await asyncio.to_thread(node.store.mark_public, EXTRA)  # a layer every project may use
    out = await e2b.run(
        f"""
        sbx = Sandbox.create(template="debian:bookworm+{EXTRA}", timeout=60)
        template = sbx.get_info().template_id
        try:
            Sandbox.create(template="no-such-template:1", timeout=60)
            err = None
        except Exception as e:
            err = [type(e).__name__, str(e)]
        print(json.dumps({{"id": sbx.sandbox_id, "template": template, "err": err}}))
        """
    )
    assert out["template"] == f"debian:bookworm+{EXTRA}"
    r = await node.link.run_shell(out["id"], ShellRequest(command="cat /extra.txt; test -x /bin/bash"))
    assert (r.exit_code, r.stdout) == (0, "from the second layer\n"), "both layers, in order"
    name, message = out["err"]
    assert name == "SandboxException" and message.startswith("404: ")
    assert "template 'no-such-template:1' not found" in message


async def test_metadata_and_env_vars(e2b: E2B, node: EmbeddedNode) -> None:
    out = await e2b.run(
        """
        sbx = Sandbox.create(timeout=60, metadata={"owner": "ci", "run": "7"}, envs={"GREETING": "hi there"})
        print(json.dumps({"id": sbx.sandbox_id, "metadata": sbx.get_info().metadata}))
        """
    )
    assert out["metadata"] == {"owner": "ci", "run": "7"}
    assert (await node.link.get(out["id"])).labels == {"owner": "ci", "run": "7"}
    r = await node.link.run_shell(out["id"], ShellRequest(command='echo "$GREETING"'))
    assert r.stdout == "hi there\n"
    with pytest.raises(SnippetFailed, match=r"dsec\.project"):
        await e2b.run('Sandbox.create(timeout=60, metadata={"dsec.project": "root"})')


async def test_list_filters_by_metadata_and_state_and_pages(e2b: E2B) -> None:
    batch = uuid.uuid4().hex[:8]
    out = await e2b.run(
        f"""
        from e2b import SandboxQuery, SandboxState
        made = [Sandbox.create(timeout=60, metadata={{"batch": "{batch}", "i": str(i)}}) for i in range(3)]
        Sandbox.create(timeout=60, metadata={{"batch": "other"}})
        pages = []
        paginator = Sandbox.list(query=SandboxQuery(metadata={{"batch": "{batch}"}}), limit=2)
        while paginator.has_next:
            pages.append(sorted(s.metadata["i"] for s in paginator.next_items()))
        made[1].pause()
        mine = {{"batch": "{batch}"}}
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED], metadata=mine))
        running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING], metadata=mine))
        print(json.dumps({{"pages": pages, "paused": [s.metadata["i"] for s in paused.next_items()],
                          "running": sorted(s.metadata["i"] for s in running.next_items())}}))
        """
    )
    assert [len(p) for p in out["pages"]] == [2, 1]
    assert sorted(i for p in out["pages"] for i in p) == ["0", "1", "2"]
    assert out["paused"] == ["1"] and out["running"] == ["0", "2"]


async def test_set_timeout_reclaims_the_sandbox(e2b: E2B, node: EmbeddedNode) -> None:
    sid = await e2b.run(
        """
        sbx = Sandbox.create(timeout=60)
        sbx.set_timeout(1)
        print(json.dumps(sbx.sandbox_id))
        """
    )

    async def stopped() -> bool:
        return await state_of(node, sid) is SandboxState.stopped

    await eventually(stopped, "the deadline set by set_timeout to stop the sandbox", timeout=15)
    assert (await node.link.get(sid)).stop_reason == "deadline"


async def test_auto_pause_at_the_timeout_then_connect_resumes(e2b: E2B, node: EmbeddedNode) -> None:
    sid = await e2b.run(
        """
        sbx = Sandbox.create(timeout=1, lifecycle={"on_timeout": "pause"})
        print(json.dumps(sbx.sandbox_id))
        """
    )

    async def paused() -> bool:
        return await state_of(node, sid) is SandboxState.paused

    await eventually(paused, "the timeout to pause the sandbox", timeout=15)
    out = await e2b.run(
        f"""
        sbx = Sandbox.connect("{sid}", timeout=60)
        print(json.dumps(str(sbx.get_info().state.value)))
        """
    )
    assert out == "running"
    info = await node.link.get(sid)
    assert info.state is SandboxState.running and info.on_deadline == "pause"


async def test_connect_from_a_second_process(e2b: E2B) -> None:
    sid = await e2b.run('print(json.dumps(Sandbox.create(timeout=60, metadata={"who": "first"}).sandbox_id))')
    out = await e2b.run(
        f"""
        sbx = Sandbox.connect("{sid}")
        info = sbx.get_info()
        print(json.dumps({{"id": sbx.sandbox_id, "metadata": info.metadata, "state": str(info.state.value)}}))
        """
    )
    assert out == {"id": sid, "metadata": {"who": "first"}, "state": "running"}


async def test_pause_and_resume_keep_the_files(e2b: E2B, node: EmbeddedNode) -> None:
    sid = await e2b.run("print(json.dumps(Sandbox.create(timeout=60).sandbox_id))")
    r = await node.link.run_shell(sid, ShellRequest(command="echo kept > /root/note.txt"))
    assert r.exit_code == 0
    out = await e2b.run(
        f"""
        sbx = Sandbox.connect("{sid}")
        sbx.pause()
        listed = Sandbox.list().next_items()
        print(json.dumps({{"state": [str(s.state.value) for s in listed if s.sandbox_id == "{sid}"]}}))
        """
    )
    assert out["state"] == ["paused"]
    assert await state_of(node, sid) is SandboxState.paused
    resumed = await e2b.run(f'print(json.dumps(str(Sandbox.connect("{sid}").get_info().state.value)))')
    assert resumed == "running" and await state_of(node, sid) is SandboxState.running
    r = await node.link.run_shell(sid, ShellRequest(command="cat /root/note.txt"))
    assert r.stdout == "kept\n"


async def test_a_key_of_another_project_sees_and_kills_nothing(e2b: E2B, node: EmbeddedNode) -> None:
    sid = await e2b.run("print(json.dumps(Sandbox.create(timeout=60).sandbox_id))")
    out = await e2b.run(
        f"""
        def outcome(call):
            try:
                return ["ok", call()]
            except Exception as e:
                return [type(e).__name__, None]
        print(json.dumps({{
            "list": [s.sandbox_id for s in Sandbox.list().next_items()],
            "info": outcome(lambda: Sandbox.get_info("{sid}").sandbox_id)[0],
            "connect": outcome(lambda: Sandbox.connect("{sid}").sandbox_id)[0],
            "kill": outcome(lambda: Sandbox.kill("{sid}")),
            "timeout": outcome(lambda: Sandbox.set_timeout("{sid}", 1))[0],
        }}))
        """,
        key=e2b.other_key,
    )
    assert sid not in out["list"]
    assert out["info"] == out["connect"] == out["timeout"] == "SandboxNotFoundException"
    assert out["kill"] == ["ok", False]
    assert await state_of(node, sid) is SandboxState.running


async def test_a_bad_key_is_an_authentication_error(e2b: E2B) -> None:
    out = await e2b.run(
        """
        try:
            Sandbox.create(timeout=60)
            print(json.dumps(None))
        except Exception as e:
            print(json.dumps([type(e).__name__, str(e)]))
        """,
        key="e2b_" + "0" * 48,
    )
    assert out[0] == "AuthenticationException" and "401" in out[1]
