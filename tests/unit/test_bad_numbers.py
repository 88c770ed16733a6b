"""Bounds that need no node (issue 25): admission's memory ceiling and default disk limit, the
shared query-parameter parsers, and the JSON answer to what aiohttp refuses by itself.
The same holes are closed end to end in tests/security/test_bad_numbers.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from dsec.edge.admission import NEVER_FITS, Admission
from dsec.edge.config import EdgeConfig
from dsec.edge.tally import LiveSandboxes
from dsec.protocol.errors import CapacityExhausted, DSecError
from dsec.protocol.http import count_param, file_mode_param, label_filter, listen, text_param
from dsec.protocol.models import ContainerSpec, MicroVMSpec

GiB = 1 << 30


class _Node(Admission):
    """Admission over a node of 24 GiB with no sandbox."""

    total_memory = staticmethod(lambda: 24 * GiB)
    available_memory = staticmethod(lambda: 20 * GiB)

    def __init__(self, config: EdgeConfig) -> None:
        super().__init__(config, LiveSandboxes(), creating=lambda: 0, pause=None)  # type: ignore[arg-type]


class _Backend:
    def __init__(self, name: str, quota: bool) -> None:
        self.name = name
        self.quota = quota
        self.asked = 0
        self.size_mb = 0

    def capabilities(self) -> dict[str, Any]:
        self.asked += 1
        return {"disk_quota": self.quota, **({"disk_quota_mb": self.size_mb} if self.size_mb else {})}


async def test_a_memory_limit_above_the_nodes_ram_never_fits(tmp_path: Path) -> None:
    node = _Node(EdgeConfig(data_dir=tmp_path))
    with pytest.raises(CapacityExhausted, match="memory_limit_mb=25600") as exc:
        async with node.reserve(ContainerSpec(image="x", memory_limit_mb=25 * 1024)):
            pass
    assert exc.value.reason == NEVER_FITS  # the apiserver tries other nodes, then answers 400
    async with node.reserve(ContainerSpec(image="x", memory_limit_mb=24 * 1024)):
        pass  # the whole RAM is a limit one sandbox may have


async def test_an_overcommit_cap_below_one_lowers_the_ceiling(tmp_path: Path) -> None:
    node = _Node(EdgeConfig(data_dir=tmp_path, memory_overcommit=0.5))
    assert node.memory_limit_ceiling() == 12 * GiB
    assert _Node(EdgeConfig(data_dir=tmp_path, memory_overcommit=8)).memory_limit_ceiling() == 24 * GiB


def test_the_default_disk_limit_goes_to_containers_without_one(tmp_path: Path) -> None:
    node = _Node(EdgeConfig(data_dir=tmp_path, default_disk_limit_mb=10240))
    container = _Backend("container", quota=True)
    assert node.with_default_disk(ContainerSpec(image="x"), container).disk_limit_mb == 10240  # type: ignore[arg-type]
    own = ContainerSpec(image="x", disk_limit_mb=64)
    assert node.with_default_disk(own, container).disk_limit_mb == 64  # type: ignore[arg-type]
    vm = MicroVMSpec(image="x")  # a VM's disk is sized by disk_mb
    assert node.with_default_disk(vm, _Backend("microvm", quota=True)).disk_limit_mb is None  # type: ignore[arg-type]
    assert container.asked == 1  # asked once, not per create


def test_no_default_disk_limit_where_the_node_cannot_enforce_one(tmp_path: Path) -> None:
    node = _Node(EdgeConfig(data_dir=tmp_path, default_disk_limit_mb=10240))
    spec = ContainerSpec(image="x")
    # Sandboxes still run (unbounded, as before) rather than every create failing.
    assert node.with_default_disk(spec, _Backend("container", quota=False)) is spec  # type: ignore[arg-type]
    off = _Node(EdgeConfig(data_dir=tmp_path))
    assert off.with_default_disk(spec, _Backend("container", quota=True)) is spec  # type: ignore[arg-type]


async def _echo(request: web.Request) -> web.Response:
    try:
        out = {
            "labels": label_filter(request),
            "after": count_param(request, "after", 0),
            "mode": file_mode_param(request),
            "path": text_param(request, "path", "/"),
        }
    except DSecError as exc:
        return web.json_response(exc.to_wire(), status=exc.status)
    return web.json_response(out)


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/", _echo)
    runner, url = await listen(app, "127.0.0.1", 0)
    try:
        yield url
    finally:
        await runner.cleanup()


async def _get(url: str, **kw: Any) -> tuple[int, str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/", **kw) as resp:
        ctype = resp.content_type
        return resp.status, ctype, await resp.json() if ctype == "application/json" else await resp.text()


@pytest.mark.parametrize(
    "query",
    [
        {"after": "99999999999999999999"},
        {"after": "-1"},
        {"after": "+1"},
        {"after": "1_0"},
        {"after": "٣"},
        {"mode": "17777"},
        {"mode": "0o644"},
        {"mode": "-1"},
        {"mode": "8"},
        {"path": "/tmp\0x"},
        {"path": "x" * 5000},
        {"label": "k"},
        {"label": " k=v"},
        {"label": "k=" + "v" * 257},
    ],
)
async def test_bad_query_parameters_are_invalid_requests(server: str, query: dict[str, str]) -> None:
    status, _, body = await _get(server, params=query)
    assert status == 400 and body["error"]["code"] == "invalid_request", body


async def test_good_query_parameters_parse(server: str) -> None:
    query = {"after": str((1 << 63) - 1), "mode": "4755", "path": "/tmp/x", "label": "job=a/b.c"}
    status, _, body = await _get(server, params=query)
    assert (status, body) == (
        200,
        {"labels": {"job": "a/b.c"}, "after": (1 << 63) - 1, "mode": 0o4755, "path": "/tmp/x"},
    )


async def test_what_aiohttp_refuses_itself_answers_in_the_json_shape(server: str) -> None:
    status, ctype, body = await _get(server, headers={"X-Pad": "p" * 10_000})
    assert (status, ctype) == (400, "application/json"), body
    assert body["error"]["code"] == "invalid_request"
    assert (await _get(server))[0] == 200


def test_a_default_beyond_the_quota_file_system_is_cut_to_its_size(tmp_path: Path) -> None:
    """On a small disk the default must not refuse every create that asked for no limit."""
    node = _Node(EdgeConfig(data_dir=tmp_path, default_disk_limit_mb=10240))
    small = _Backend("container", quota=True)
    small.size_mb = 3000
    assert node.with_default_disk(ContainerSpec(image="x"), small).disk_limit_mb == 3000  # type: ignore[arg-type]
