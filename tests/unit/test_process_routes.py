"""The process routes on the public API (`/v1/sandboxes/{id}/processes...`, what `dsec sandbox
shell` drives) answer only for sandboxes the key may see, as every sandbox route does."""

from __future__ import annotations

import pytest

from dsec import DSecClient, DSecContainerRunArgs, SandboxNotFound
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import ProcessNotFound
from dsec.sdk.client import Sandbox

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
