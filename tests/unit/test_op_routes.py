"""``POST /v1/sandboxes/{id}/ops/{kind}`` (apiserver/op_routes.py): any public sandbox operation
as data, checked against the key's projects once and forwarded unchanged to the node."""

from __future__ import annotations

import pytest

from dsec import DSecClient, DSecContainerRunArgs, SandboxNotFound
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import FileNotFound, InvalidRequest
from dsec.protocol.ops import OPS, PUBLIC, Call

from .conftest import TINY
from .test_tenancy import team_client

ARGS = DSecContainerRunArgs(container_image=TINY, cpu_cores_limit=0.5, memory_limit_mb=64)


def test_the_public_kinds_are_calls() -> None:
    assert PUBLIC <= set(OPS) and all(issubclass(OPS[k], Call) for k in PUBLIC)
    assert "fork_local" not in PUBLIC and "fork_spec" not in PUBLIC  # IDs and layers the apiserver picks


async def test_an_op_reaches_the_sandbox_of_its_key_only(client: DSecClient, node: EmbeddedNode) -> None:
    mine = await client.run_container(ARGS)
    team = await team_client(client, node, "ops-route", sandboxes=1)
    ops = f"/v1/sandboxes/{mine.id}/ops"
    try:
        ran = await client._t.request("POST", f"{ops}/run_shell", json_body={"command": "echo hi"})
        assert (ran["exit_code"], ran["stdout"]) == (0, "hi\n")
        made = await client._t.request("POST", f"{ops}/mkdir", json_body={"path": "/work/d"})
        assert (made["path"], made["type"]) == ("/work/d", "dir")
        assert await client._t.request("POST", f"{ops}/remove", json_body={"path": "/work/d"}) is None
        with pytest.raises(FileNotFound):
            await client._t.request("POST", f"{ops}/stat", json_body={"path": "/work/d"})
        kinds = [e["kind"] for e in await client._t.request("POST", f"{ops}/trajectory", json_body={})]
        assert kinds == ["shell", "mkdir", "remove"]  # the same records the REST routes leave
        with pytest.raises(SandboxNotFound):  # another project's key: as if it did not exist
            await team._t.request("POST", f"{ops}/stat", json_body={"path": "/"})
        for kind in ("fork_local", "exec", "no_such_op"):
            with pytest.raises(InvalidRequest, match="not offered"):
                await client._t.request("POST", f"{ops}/{kind}", json_body={})
        with pytest.raises(InvalidRequest, match="path"):
            await client._t.request("POST", f"{ops}/stat", json_body={"path": "/a\0b"})
        with pytest.raises(InvalidRequest, match="kind"):
            await client._t.request("POST", f"{ops}/stat", json_body={"kind": "remove", "path": "/"})
    finally:
        await team.close()
        await mine.stop()
