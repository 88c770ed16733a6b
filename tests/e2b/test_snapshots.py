"""E2B's snapshots and fork through the official SDKs (each test runs once per SDK version).

What the SDK is told is checked against DSec: the snapshot's image in the layer store (its
owner, its packed layer), the forks' project and state on the node.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import aiohttp
import pytest

from dsec import DSecClient, DSecMicroVMRunArgs
from dsec.apiserver.e2b.snapshots import PACK_PREFIX, SNAPSHOT_PREFIX
from dsec.images.refs import parse_tag
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.models import SandboxState, ShellRequest
from dsec.sdk.client import Sandbox
from tests.conftest import BASE
from tests.e2b.conftest import E2B, PROJECT
from tests.support import eventually


async def _status(e2b: E2B, method: str, path: str, body: object = None, key: str | None = None) -> int:
    """The status E2B's API answers on ``path``, read without an SDK (which hides it)."""
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, e2b.url + path, json=body, headers={"X-API-Key": key or e2b.key}) as resp,
    ):
        if resp.status >= 400:
            error = await resp.json()
            assert set(error) == {"code", "message"} and error["code"] == resp.status, error
        return resp.status


async def test_snapshot_create_list_create_from_and_delete(e2b: E2B, node: EmbeddedNode) -> None:
    out = await e2b.run(
        """
        sbx = Sandbox.create("e2b:base", timeout=120, envs={"SNAP_ENV": "kept"})
        sbx.commands.run("mkdir -p /data && echo from-snapshot > /data/snap.txt", user="root")
        snap = sbx.create_snapshot()
        sbx.commands.run("echo after > /data/snap.txt", user="root")  # not in the snapshot
        mine = [s.snapshot_id for s in sbx.list_snapshots().next_items()]
        every = [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        child = Sandbox.create(snap.snapshot_id, timeout=120)
        seen = child.commands.run("cat /data/snap.txt", user="root").stdout
        who = [sbx.commands.run("whoami").stdout, child.commands.run("whoami").stdout]
        env = child.commands.run("echo $SNAP_ENV").stdout
        deleted = Sandbox.delete_snapshot(snap.snapshot_id)
        again = Sandbox.delete_snapshot(snap.snapshot_id)
        left = [s.snapshot_id for s in sbx.list_snapshots().next_items()]
        try:
            Sandbox.create(snap.snapshot_id, timeout=60)
            err = None
        except Exception as e:
            err = str(e)
        print(json.dumps({"id": sbx.sandbox_id, "snap": snap.snapshot_id, "names": snap.names,
                          "mine": mine, "every": every, "seen": seen, "deleted": deleted,
                          "again": again, "left": left, "err": err, "child": child.sandbox_id,
                          "who": who, "env": env}))
        """,
        timeout=240,
    )
    snap = out["snap"]
    assert snap.startswith(f"{SNAPSHOT_PREFIX}{out['id']}:") and out["names"] == []
    assert out["mine"] == [snap] and snap in out["every"]
    assert out["seen"] == "from-snapshot\n", "the snapshot's files, as they were when it was taken"
    assert out["who"] == ["user\n", "user\n"], "a snapshot of E2B's base runs commands as its user"
    assert out["env"] == "kept\n", "a snapshot starts with its source's environment, as envd's memory does"
    kept = Path(node.store.root) / "e2b-snapshots"
    assert kept.stat().st_mode & 0o777 == 0o700, "tenants' env is kept for root's eyes only"
    assert (out["deleted"], out["again"], out["left"]) == (True, False, [])
    assert out["err"] is not None and out["err"].startswith("404: ")
    assert not node.store.has_image(snap), "deleted from DSec's store"
    pack = f"{PACK_PREFIX}{out['id']}:{parse_tag(snap)[1]}"
    assert not node.store.has_tag(pack), "the packed layer's tag goes with the last snapshot naming it"
    child = await node.link.get(out["child"])
    assert child.project == PROJECT and child.refs == [snap]


async def test_named_snapshot_replaces_and_filters(e2b: E2B, node: EmbeddedNode) -> None:
    name = f"snap-{uuid.uuid4().hex[:8]}"
    out = await e2b.run(
        f"""
        sbx = Sandbox.create(timeout=120)
        sbx.commands.run("echo one > /root/n.txt", user="root")
        first = sbx.create_snapshot(name="{name}")
        sbx.commands.run("echo two > /root/n.txt", user="root")
        second = sbx.create_snapshot(name="{name}")
        tagged = sbx.create_snapshot(name="{name}:v2")
        by_name = sorted(s.snapshot_id for s in Sandbox.list_snapshots(name="{name}").next_items())
        by_tag = [s.snapshot_id for s in Sandbox.list_snapshots(name="{name}:v2").next_items()]
        pages, paginator = [], sbx.list_snapshots(limit=1)
        while paginator.has_next:
            pages.append([s.snapshot_id for s in paginator.next_items()])
        child = Sandbox.create(first.snapshot_id, timeout=60)
        seen = child.commands.run("cat /root/n.txt", user="root").stdout
        try:
            sbx.create_snapshot(name="root/someone-else/{name}")
            foreign = None
        except Exception as e:
            foreign = str(e)
        print(json.dumps({{"first": [first.snapshot_id, first.names], "second": second.snapshot_id,
                          "tagged": tagged.snapshot_id, "by_name": by_name, "by_tag": by_tag, "pages": pages,
                          "seen": seen, "foreign": foreign}}))
        """,
        timeout=240,
    )
    ref = f"{PROJECT}/{name}"
    assert out["first"] == [f"{ref}:default", [ref]] and out["second"] == f"{ref}:default"
    assert out["by_name"] == [f"{ref}:default", f"{ref}:v2"] and out["by_tag"] == [f"{ref}:v2"]
    assert out["pages"] == [[f"{ref}:v2"], [f"{ref}:default"]], "one a page, newest first"
    assert out["seen"] == "two\n", "a name taken again holds the newest snapshot, as in E2B"
    assert out["foreign"].startswith("400: ") and "must be the project" in out["foreign"]
    assert node.store.catalogue.get(ref, "default").owner == PROJECT  # type: ignore[union-attr]


async def test_other_project_cannot_see_delete_or_use_a_snapshot(e2b: E2B, node: EmbeddedNode) -> None:
    made = await e2b.run(
        """
        sbx = Sandbox.create(timeout=120)
        print(json.dumps({"id": sbx.sandbox_id, "snap": sbx.create_snapshot().snapshot_id}))
        """
    )
    out = await e2b.run(
        f"""
        listed = [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        by_sandbox = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id="{made["id"]}").next_items()]
        deleted = Sandbox.delete_snapshot("{made["snap"]}")
        errors = {{}}
        for what, call in [("create", lambda: Sandbox.create("{made["snap"]}", timeout=60)),
                           ("snapshot", lambda: Sandbox.create_snapshot("{made["id"]}")),
                           ("fork", lambda: Sandbox.fork("{made["id"]}"))]:
            try:
                call()
                errors[what] = None
            except Exception as e:
                errors[what] = [type(e).__name__, str(e)[:5]]
        print(json.dumps({{"listed": listed, "by_sandbox": by_sandbox, "deleted": deleted,
                          "errors": errors}}))
        """,
        key=e2b.other_key,
    )
    assert made["snap"] not in out["listed"] and out["by_sandbox"] == []
    assert out["deleted"] is False, "another project's snapshot is not found, so not deleted"
    assert out["errors"]["create"] == ["SandboxException", "404: "]
    assert out["errors"]["snapshot"][0] == "SandboxNotFoundException"
    assert out["errors"]["fork"][0] == "SandboxNotFoundException"
    assert node.store.has_image(made["snap"]), "still there for its own project"
    status = await _status(e2b, "DELETE", f"/templates/{made['snap']}", key=e2b.other_key)
    assert status == 404
    assert await _status(e2b, "DELETE", f"/templates/{made['snap']}") == 204


async def test_bad_ids_and_bounds_are_404_or_400(e2b: E2B) -> None:
    cases = [
        ("POST", "/sandboxes/not-a-sandbox/snapshots", {}, 404),
        ("POST", "/sandboxes/sb-nosuch-1-aaaaaaaaaaaaaaaaaaaa/snapshots", {}, 404),
        ("POST", "/sandboxes/not-a-sandbox/fork", {}, 404),
        ("POST", "/sandboxes/sb-nosuch-1-aaaaaaaaaaaaaaaaaaaa/fork", {"count": 1}, 404),
        ("DELETE", "/templates/e2b-snapshot%2Fno-such:1", None, 404),
        ("DELETE", "/templates/bad%20id!", None, 400),
        ("DELETE", "/templates/" + "a" * 300, None, 400),
        ("GET", "/snapshots?sandboxID=garbage", None, 400),
        ("GET", "/snapshots?limit=0", None, 400),
        ("GET", "/snapshots?limit=x", None, 400),
        ("GET", "/snapshots?nextToken=%21%21%21", None, 400),
    ]
    got = [(m, p, await _status(e2b, m, p, b)) for m, p, b, _ in cases]
    assert got == [(m, p, s) for m, p, _, s in cases]


async def test_paused_sandbox_snapshot_stays_paused(e2b: E2B, node: EmbeddedNode) -> None:
    out = await e2b.run(
        """
        sbx = Sandbox.create(timeout=120)
        sbx.commands.run("echo paused-state > /root/p.txt", user="root")
        sbx.pause()
        snap = sbx.create_snapshot()
        child = Sandbox.create(snap.snapshot_id, timeout=60)
        seen = child.commands.run("cat /root/p.txt", user="root").stdout
        print(json.dumps({"id": sbx.sandbox_id, "seen": seen}))
        """,
        timeout=180,
    )
    assert out["seen"] == "paused-state\n"
    assert (await node.link.get(out["id"])).state is SandboxState.paused, "paused again after the pack"


async def test_fork_yields_independent_copies(e2b: E2B, node: EmbeddedNode) -> None:
    out = await e2b.run(
        """
        sbx = Sandbox.create(timeout=120, metadata={"who": "source"})
        sbx.commands.run("echo source > /root/f.txt", user="root")
        forks = sbx.fork(timeout=90, count=2)
        assert all(isinstance(f, Sandbox) for f in forks), forks
        a, b = forks
        a.commands.run("echo changed-in-fork > /root/f.txt", user="root")
        sbx.commands.run("echo changed-in-source > /root/g.txt", user="root")
        read = lambda s, p: s.commands.run(f"cat {p} 2>/dev/null || echo none", user="root").stdout.strip()
        sbx.pause()
        try:
            Sandbox.fork(sbx.sandbox_id)
            paused = None
        except Exception as e:
            paused = str(e)[:5]
        sbx.connect()
        print(json.dumps({"id": sbx.sandbox_id, "forks": [f.sandbox_id for f in forks],
                          "source": [read(sbx, "/root/f.txt"), read(sbx, "/root/g.txt")],
                          "a": [read(a, "/root/f.txt"), read(a, "/root/g.txt")],
                          "b": [read(b, "/root/f.txt"), read(b, "/root/g.txt")],
                          "meta": a.get_info().metadata, "paused": paused}))
        """,
        timeout=240,
    )
    assert len(set(out["forks"])) == 2 and out["id"] not in out["forks"]
    assert out["source"] == ["source", "changed-in-source"]
    assert out["a"] == ["changed-in-fork", "none"] and out["b"] == ["source", "none"]
    assert out["meta"] == {"who": "source"} and out["paused"] == "409: "
    for fid in out["forks"]:
        info = await node.link.get(fid)
        assert info.project == PROJECT and info.state is SandboxState.running
        assert info.deadline_at is not None, "the fork's timeout is a DSec deadline"
    assert (await _status(e2b, "POST", f"/sandboxes/{out['id']}/fork", {"count": 0})) == 400
    assert (await _status(e2b, "POST", f"/sandboxes/{out['id']}/fork", {"count": 101})) == 400


async def test_async_snapshot_and_fork(e2b: E2B, node: EmbeddedNode) -> None:
    out = await e2b.run(
        """
        import asyncio
        from e2b import AsyncSandbox

        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            await sbx.commands.run("echo async > /root/a.txt", user="root")
            snap = await sbx.create_snapshot()
            listed = [s.snapshot_id for s in await sbx.list_snapshots().next_items()]
            child = await AsyncSandbox.create(snap.snapshot_id, timeout=60)
            seen = (await child.commands.run("cat /root/a.txt", user="root")).stdout
            [fork] = await sbx.fork(count=1)
            forked = (await fork.commands.run("cat /root/a.txt", user="root")).stdout
            deleted = await AsyncSandbox.delete_snapshot(snap.snapshot_id)
            return {"snap": snap.snapshot_id, "listed": listed, "seen": seen, "fork": fork.sandbox_id,
                    "forked": forked, "deleted": deleted}

        print(json.dumps(asyncio.run(main())))
        """,
        timeout=240,
    )
    assert out["listed"] == [out["snap"]] and out["seen"] == out["forked"] == "async\n"
    assert out["deleted"] is True and not node.store.has_image(out["snap"])
    r = await node.link.run_shell(out["fork"], ShellRequest(command="cat /root/a.txt"))
    assert r.stdout == "async\n"


@pytest.mark.vm
@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 is not installed")
async def test_fork_of_a_microvm_copies_its_memory_and_processes(e2b_latest: E2B, node: EmbeddedNode) -> None:
    # A microVM of the E2B project (made through DSec's API: E2B's create makes containers),
    # with a process whose secret lives only in its memory and is rewritten to a file.
    async with DSecClient(node.url, e2b_latest.key) as client:
        sb = await client.run_microvm(DSecMicroVMRunArgs(container_image=BASE, memory_limit_mb=256))
        await sb.run_shell(
            "sh -c 'v=secret-$$; while :; do echo $v > /tmp/v; sleep 0.2; done' >/dev/null 2>&1 &"
        )
        await sb.write_file("/root/disk.txt", "before the fork")
        secret = await eventually(lambda: _written(sb), "the process to write its secret")
    out = await e2b_latest.run(
        f"""
        src = Sandbox.connect("{sb.id}")
        [copy] = src.fork(timeout=90, count=1)
        copy.commands.run("rm -f /tmp/v", user="root")
        for _ in range(600):  # the copied process writes it again, if it runs
            if copy.commands.run("test -s /tmp/v && echo yes || echo no", user="root").stdout == "yes\\n":
                break
        print(json.dumps({{"id": copy.sandbox_id, "v": copy.files.read("/tmp/v", user="root"),
                          "disk": copy.files.read("/root/disk.txt", user="root")}}))
        """,
        timeout=240,
    )
    assert out["v"] == secret.decode() and out["disk"] == "before the fork"
    info = await node.link.get(out["id"])
    assert info.backend == "microvm" and info.project == PROJECT and info.state is SandboxState.running
    assert info.deadline_at is not None, "the fork's timeout is a DSec deadline"


async def _written(sb: Sandbox) -> bytes | None:
    if (await sb.run_shell("test -s /tmp/v")).exit_code != 0:
        return None
    return await sb.read_file("/tmp/v")
