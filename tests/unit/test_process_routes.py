"""The process routes on the public API (`/v1/sandboxes/{id}/processes...`, what `dsec sandbox
shell` drives) answer only for sandboxes the key may see, as every sandbox route does."""

from __future__ import annotations

import json
import logging

import aiohttp
import pytest

from dsec import DSecClient, DSecContainerRunArgs, SandboxNotFound
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import ProcessNotFound
from dsec.sdk.client import Sandbox
from tests.support import eventually

from .conftest import TINY
from .test_tenancy import team_client

ARGS = DSecContainerRunArgs(container_image=TINY, cpu_cores_limit=0.5, memory_limit_mb=64)
CONTROLS = [("input", {"data": "aGk="}), ("resize", {"rows": 10, "cols": 20}), ("signal", {"signal": 15})]


async def test_a_key_reaches_the_processes_of_its_own_sandboxes_only(
    client: DSecClient, node: EmbeddedNode
) -> None:
    mine = await client.run_container(ARGS)  # the admin's, in root
    team = await team_client(client, node, "terminals", sandboxes=1)
    try:
        with pytest.raises(SandboxNotFound):
            await Sandbox(team._t, mine.info).open_pty(["/bin/sh"])
        for what, body in CONTROLS:
            with pytest.raises(SandboxNotFound):  # nor type into, resize or signal one there
                await team._t.request("POST", f"/v1/sandboxes/{mine.id}/processes/1/{what}", json_body=body)
            with pytest.raises(ProcessNotFound):  # its owner gets past the check, to the edge's answer
                await client._t.request("POST", f"/v1/sandboxes/{mine.id}/processes/1/{what}", json_body=body)
        assert await client._t.request("GET", f"/v1/sandboxes/{mine.id}/processes") == []
    finally:
        await team.close()
        await mine.stop()


async def test_a_client_that_leaves_a_stream_mid_way_is_no_server_error(
    client: DSecClient, node: EmbeddedNode, caplog: pytest.LogCaptureFixture
) -> None:
    sb = await client.run_container(ARGS)
    try:
        path = f"/v1/sandboxes/{sb.id}/processes"
        caplog.set_level(logging.INFO, logger="dsec.apiserver")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {node.api_key}"}) as http:
            argv = ["sh", "-c", "while :; do echo output-that-never-ends; done"]
            resp = await http.post(node.url + path, json={"argv": argv})
            assert resp.status == 200
            pid = json.loads(await resp.content.readline())["pid"]
            await resp.content.readline()
            resp.close()  # mid-stream, the edge still writing

        def answered() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.name == "dsec.apiserver.access" and path in r.getMessage()]

        line = (await eventually(answered, "the access log's line for the stream"))[0].getMessage()
        assert line == f"POST {path} 499", "nginx's word: the client closed the request"
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        await client._t.request("POST", f"{path}/{pid}/signal", json_body={"signal": 9})
    finally:
        await sb.stop()
