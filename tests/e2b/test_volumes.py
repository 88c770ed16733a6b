"""E2B's volumes (and its list of default templates) through the official SDKs (sync and
async, each SDK version): the REST API, the content API with the volume's token, mounts that
outlive sandboxes, and the walls around them.

What the SDK is told is checked against the node too: the volume's files are in a subvolume
of the node's quota file system, and a symlink a sandbox plants there leads nowhere outside.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import aiohttp

from dsec.node.embedded import EmbeddedNode
from dsec.protocol.volumes import DEFAULT_OWNER
from tests.e2b.conftest import E2B

SYNC = """
from e2b import Volume
name = "{name}"
vol = Volume.create(name)
info = Volume.get_info(vol.volume_id)
listed = [v.name for v in Volume.list()]
written = vol.write_file("/dir/a.txt", "hello", force=True)
try:
    vol.write_file("/dir/a.txt", "again")
    exclusive = None
except Exception as e:
    exclusive = type(e).__name__
stat = vol.get_info("/dir/a.txt")
tree = [(x.path, x.type.value) for x in vol.list("/", depth=2)]
made = vol.make_dir("/d2", mode=0o750)
updated = vol.update_metadata("/dir/a.txt", mode=0o640, uid=1000, gid=1000)
text = vol.read_file("/dir/a.txt")
exists = [vol.exists("/dir/a.txt"), vol.exists("/nope")]
try:
    vol.read_file("/nope")
    missing = None
except Exception as e:
    missing = type(e).__name__
sbx = Sandbox.create("e2b:base", volume_mounts={{"/mnt/data": vol}}, timeout=120)
seen = sbx.commands.run("cat /mnt/data/dir/a.txt").stdout
sbx.commands.run("echo from-sandbox > /mnt/data/b.txt && ln -s /etc /mnt/data/link", user="root")
flags = sbx.commands.run("grep ' /mnt/data ' /proc/mounts").stdout
try:
    Volume.destroy(vol.volume_id)
    busy = None
except Exception as e:
    busy = str(e)
sbx.kill()
back = vol.read_file("/b.txt")
try:
    vol.read_file("/link/passwd")
    escaped = True
except Exception as e:
    escaped = type(e).__name__
reader = Sandbox.create("e2b:base", volume_mounts={{"/work": name}}, timeout=120)
seen_again = reader.commands.run("cat /work/b.txt").stdout
reader.kill()
vol.remove("/dir")
after = [x.path for x in vol.list("/")]
destroyed, again = Volume.destroy(vol.volume_id), Volume.destroy(vol.volume_id)
print(json.dumps({{
    "id": vol.volume_id, "info": [info.volume_id, info.name, bool(info.token)], "listed": listed,
    "written": [written.path, written.size, written.mode, written.uid, written.type.value],
    "exclusive": exclusive, "stat": [stat.name, stat.size, stat.mtime.isoformat()], "tree": tree,
    "made": [made.path, made.mode, made.uid], "updated": [updated.mode, updated.uid, updated.gid],
    "text": text, "exists": exists, "missing": missing, "seen": seen, "flags": flags,
    "busy": busy, "back": back, "escaped": escaped, "seen_again": seen_again, "after": after,
    "destroyed": destroyed, "again": again,
}}))
"""

ASYNC = """
import asyncio
from e2b import AsyncSandbox, AsyncVolume

async def main():
    vol = await AsyncVolume.create("{name}")
    await vol.write_file("/x/y.bin", bytes(range(256)) * 4096, force=True)
    sbx = await AsyncSandbox.create("e2b:base", volume_mounts={{"/mnt/v": vol}}, timeout=120)
    size = (await sbx.commands.run("stat -c %s /mnt/v/x/y.bin")).stdout
    await sbx.commands.run("mkdir -p /mnt/v/out && echo done > /mnt/v/out/r.txt", user="root")
    await sbx.kill()
    back = await vol.read_file("/out/r.txt")
    raw = await vol.read_file("/x/y.bin", format="bytes")
    tree = [x.path for x in await vol.list("/", depth=3)]
    await vol.remove("/out")
    gone = await vol.exists("/out")
    ok = await AsyncVolume.destroy(vol.volume_id)
    return {{"size": size, "back": back, "raw": raw == bytes(range(256)) * 4096, "tree": tree,
             "gone": gone, "ok": ok}}

print(json.dumps(asyncio.run(main())))
"""


async def test_volume_api_content_and_mounts_through_the_sync_sdk(e2b: E2B, node: EmbeddedNode) -> None:
    name = f"v-{uuid.uuid4().hex[:10]}"
    out = await e2b.run(SYNC.format(name=name), timeout=300)
    vid = out["id"]
    assert vid.startswith(f"vol-{node.config.node}-"), "the ID names the node that keeps it"
    assert out["info"] == [vid, name, True] and name in out["listed"]
    assert out["written"] == ["/dir/a.txt", 5, 0o666, DEFAULT_OWNER, "file"], "E2B's defaults"
    assert out["exclusive"] is not None, "without force an existing file is not replaced"
    assert out["stat"][:2] == ["a.txt", 5]
    assert out["tree"] == [["/dir", "directory"], ["/dir/a.txt", "file"]], "depth first, as E2B"
    assert out["made"] == ["/d2", 0o750, DEFAULT_OWNER]
    assert out["updated"] == [0o640, 1000, 1000]
    assert out["text"] == "hello" and out["exists"] == [True, False]
    assert out["missing"] == "VolumePathNotFoundException" or out["missing"] == "NotFoundException"
    assert out["seen"] == "hello", "the sandbox's user (uid 1000) reads what the volume API wrote"
    assert "nosuid" in out["flags"] and "nodev" in out["flags"]
    assert out["busy"] is not None and "mounted by 1 sandboxes" in out["busy"]
    assert out["back"] == "from-sandbox\n", "what a sandbox wrote outlives it"
    assert out["escaped"] in ("VolumePathNotFoundException", "NotFoundException"), (
        "a symlink a sandbox planted resolves inside the volume, never to the host's /etc"
    )
    assert out["seen_again"] == "from-sandbox\n", "a second sandbox mounts it by name"
    assert sorted(out["after"]) == ["/b.txt", "/d2", "/link"]
    assert (out["destroyed"], out["again"]) == (True, False)


async def test_volume_content_through_the_async_sdk(e2b: E2B) -> None:
    out = await e2b.run(ASYNC.format(name=f"a-{uuid.uuid4().hex[:10]}"), timeout=300)
    assert out["size"] == f"{256 * 4096}\n" and out["raw"] is True
    assert out["back"] == "done\n"
    assert out["tree"] == ["/out", "/out/r.txt", "/x", "/x/y.bin"]
    assert out["gone"] is False and out["ok"] is True


async def test_volumes_are_their_projects_and_their_tokens_only(e2b: E2B, node: EmbeddedNode) -> None:
    name = f"p-{uuid.uuid4().hex[:10]}"
    made = await e2b.run(
        f'from e2b import Volume\nv = Volume.create("{name}")\nprint(json.dumps([v.volume_id, v.token]))'
    )
    vid, token = made
    try:
        other = await e2b.run(
            f"""
            from e2b import Volume
            seen = [v.volume_id for v in Volume.list()]
            got = Volume.destroy("{vid}")
            try:
                Sandbox.create("e2b:base", volume_mounts={{"/m": "{name}"}}, timeout=60)
                mounted = True
            except Exception as e:
                mounted = str(e)
            print(json.dumps([seen, got, mounted]))
            """,
            key=e2b.other_key,
        )
        assert vid not in other[0] and other[1] is False, "another project's volume is not found"
        assert "not found" in other[2], other[2]
        async with aiohttp.ClientSession() as http:
            url = f"{e2b.url}/volumecontent/{vid}/path?path=/"
            async with http.get(url) as resp:
                assert resp.status == 401 and set(await resp.json()) == {"code", "message"}
            forged = token[:-4] + ("0000" if not token.endswith("0000") else "1111")
            async with http.get(url, headers={"Authorization": f"Bearer {forged}"}) as resp:
                assert resp.status == 401
            async with http.get(url, headers={"Authorization": f"Bearer {token}"}) as resp:
                assert resp.status == 200 and (await resp.json())["type"] == "directory"
            async with http.get(
                f"{e2b.url}/volumecontent/{vid}/dir?path=/&depth=11",
                headers={"Authorization": f"Bearer {token}"},
            ) as resp:
                assert resp.status == 400, "depth is bounded as E2B bounds it"
            async with http.get(
                f"{e2b.url}/volumecontent/{vid}/dir?path=/&depth=-3",
                headers={"Authorization": f"Bearer {token}"},
            ) as resp:
                assert resp.status == 200, "below 1 is 1, as E2B's max(depth, minDepth)"
            async with http.post(
                f"{e2b.url}/volumes", json={"name": "no spaces"}, headers={"X-API-Key": e2b.key}
            ) as resp:
                assert resp.status == 400
            async with http.post(
                f"{e2b.url}/volumes", json={"name": name}, headers={"X-API-Key": e2b.key}
            ) as resp:
                assert resp.status == 400 and "already exists" in (await resp.json())["message"]
        root = node.edge.volumes.shared
        assert root is not None
        rec = await root.get(vid, "root")
        assert Path(root.root(rec)).stat().st_uid == DEFAULT_OWNER
    finally:
        await e2b.run(f'from e2b import Volume\nprint(json.dumps(Volume.destroy("{vid}")))')


async def test_default_templates_name_the_base_this_apiserver_starts(
    e2b_latest: E2B, node: EmbeddedNode
) -> None:
    out = await e2b_latest.run(
        """
        from e2b.api.client.api.templates import get_default_templates
        from e2b.api.client_sync import get_api_client
        from e2b.connection_config import ConnectionConfig
        res = get_default_templates.sync_detailed(client=get_api_client(ConnectionConfig()))
        print(json.dumps([res.status_code, [[t.template_id, t.public, t.aliases] for t in res.parsed]]))
        """
    )
    assert out == [200, [["base", True, ["base"]]]]
