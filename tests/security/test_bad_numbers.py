"""Bad numbers and strings are a 400 in DSec's error shape, never a 500 (issue 25), and the
node's defaults protect it (a default disk limit, a bound on memory limits).

Every request here goes to the real session node as raw HTTP, the way a client that is not the
SDK (or a hostile one) would send it: the SDK's own checks would hide what the server does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from dsec import Sandbox
from dsec.backends.container.backend import ContainerBackend
from dsec.node.embedded import EmbeddedNode
from tests.conftest import Sandboxes

MiB = 1 << 20


@pytest.fixture
async def http(node: EmbeddedNode) -> AsyncIterator[aiohttp.ClientSession]:
    headers = {"Authorization": f"Bearer {node.api_key}"}
    async with aiohttp.ClientSession(node.url, headers=headers) as s:
        yield s


async def _call(http: aiohttp.ClientSession, method: str, path: str, **kw: Any) -> tuple[int, Any]:
    async with http.request(method, path, **kw) as resp:
        raw = await resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw


def _refused(answer: tuple[int, Any], *words: str) -> None:
    """A 400 in DSec's wire form, naming what was wrong."""
    status, body = answer
    assert status == 400, answer
    assert isinstance(body, dict) and body["error"]["code"] == "invalid_request", answer
    for w in words:
        assert w in body["error"]["message"], answer


@pytest.fixture
async def project(http: aiohttp.ClientSession) -> AsyncIterator[str]:
    name = f"bad-numbers-{uuid.uuid4().hex[:8]}"
    status, body = await _call(http, "POST", "/v1/projects", json={"parent": "root", "name": name})
    assert status == 201, body
    try:
        yield f"root/{name}"
    finally:
        status, body = await _call(http, "DELETE", "/v1/projects", params={"project": f"root/{name}"})
        assert status == 200, body


# Raw JSON text: 1e400 cannot be written by json.dumps, and is what a client may send.
HUGE_QUOTAS = [
    ('{"cpu_cores": 1e400}', "cpu_cores"),
    ('{"cpu_cores": 1e300}', "cpu_cores"),
    ('{"memory_mib": 1000000000000000000000000000000}', "memory_mib"),
    ('{"sandboxes": 9223372036854775808}', "sandboxes"),
]


@pytest.mark.parametrize(("quota", "field"), HUGE_QUOTAS)
async def test_huge_quotas_are_refused_on_create_and_update(
    http: aiohttp.ClientSession, project: str, quota: str, field: str
) -> None:
    headers = {"Content-Type": "application/json"}
    body = f'{{"parent": "{project}", "name": "child", "quota": {quota}}}'
    _refused(await _call(http, "POST", "/v1/projects", data=body, headers=headers), field)
    body = f'{{"project": "{project}", "quota": {quota}}}'
    _refused(await _call(http, "POST", "/v1/projects/quota", data=body, headers=headers), field)
    # The project is untouched: no quota was half-written.
    status, infos = await _call(http, "GET", "/v1/projects", params={"under": project})
    assert status == 200, infos
    assert [i["quota"][field] for i in infos if i["id"] == project] == [None], infos


async def test_trajectory_cursor_past_64_bits_is_refused(
    http: aiohttp.ClientSession, sandbox: Sandbox
) -> None:
    path = f"/v1/sandboxes/{sandbox.id}/trajectory"
    _refused(await _call(http, "GET", path, params={"after": "99999999999999999999"}), "after")
    _refused(await _call(http, "GET", path, params={"limit": "100000000"}), "limit")
    _refused(await _call(http, "GET", path, params={"after": "+1"}), "after")
    status, entries = await _call(http, "GET", path, params={"after": str((1 << 63) - 1)})
    assert (status, entries) == (200, [])


async def test_nul_in_a_path_is_refused(http: aiohttp.ClientSession, sandbox: Sandbox) -> None:
    base = f"/v1/sandboxes/{sandbox.id}"
    _refused(await _call(http, "POST", f"{base}/exec", json={"argv": ["pwd"], "cwd": "/tmp\0x"}), "cwd")
    _refused(await _call(http, "POST", f"{base}/exec", json={"argv": ["ls", "/\0"]}), "argv")
    _refused(await _call(http, "GET", f"{base}/files/stat", params={"path": "/etc\0/passwd"}), "path")
    _refused(await _call(http, "GET", f"{base}/changes", params={"under": "/\0"}), "under")
    # The sandbox still answers, from the directory asked for.
    status, _ = await _call(http, "POST", f"{base}/exec", json={"argv": ["pwd"], "cwd": "/tmp"})
    assert status == 200


async def test_a_uid_the_kernel_cannot_take_is_refused_at_create(
    http: aiohttp.ClientSession, base_layer: str, make_sandbox: Sandboxes
) -> None:
    # (uid_t)-1 means "unchanged" to setuid and chown: such a sandbox ran nothing (exec failed
    # with 125) and its files were written as uid 0.
    for uid in (str((1 << 32) - 1), str(1 << 32), "9999999999"):
        spec = {"type": "container", "image": base_layer, "init_user": uid}
        status, body = await _call(http, "POST", "/v1/sandboxes", json={"spec": spec, "timeout": 60})
        if status == 201:  # the hole is open: do not leave the sandbox behind
            await _call(http, "DELETE", f"/v1/sandboxes/{body['id']}")
        _refused((status, body), "init_user", uid)
    # The largest valid uid still runs, as itself.
    sb = await make_sandbox(init_user=str((1 << 32) - 2))
    r = await sb.exec(["id", "-u"])
    assert (r.exit_code, r.stdout.strip()) == (0, str((1 << 32) - 2)), r


@pytest.mark.parametrize("mode", ["17777", "100644", "-1", "0o644"])
async def test_an_upload_mode_outside_0_to_7777_is_refused_not_masked(
    http: aiohttp.ClientSession, sandbox: Sandbox, mode: str
) -> None:
    path = f"/v1/sandboxes/{sandbox.id}/files/content"
    _refused(await _call(http, "PUT", path, params={"path": "/tmp/m", "mode": mode}, data=b"x"), "mode")
    stat = f"/v1/sandboxes/{sandbox.id}/files/stat"
    assert (await _call(http, "GET", stat, params={"path": "/tmp/m"}))[0] == 404
    status, info = await _call(http, "PUT", path, params={"path": "/tmp/m", "mode": "4755"}, data=b"x")
    assert status == 201 and info["mode"] & 0o7777 == 0o4755, info


async def test_max_output_bytes_has_a_server_side_ceiling(
    http: aiohttp.ClientSession, sandbox: Sandbox
) -> None:
    base = f"/v1/sandboxes/{sandbox.id}"
    gib = {"command": "true", "max_output_bytes": 1 << 30}
    _refused(await _call(http, "POST", f"{base}/shell", json=gib), "max_output_bytes")
    _refused(await _call(http, "POST", f"{base}/exec", json={"argv": ["true"], **gib}), "max_output_bytes")
    ok = {"command": "echo hi", "max_output_bytes": 64 * MiB}
    status, body = await _call(http, "POST", f"{base}/shell", json=ok)
    assert status == 200 and body["stdout"] == "hi\n", body


@pytest.mark.parametrize("label", ["=v", " k=v", "k\0=v", "k=" + "v" * 257, "dsec..x/" * 10 + "=v"])
async def test_label_filters_are_validated(http: aiohttp.ClientSession, label: str) -> None:
    _refused(await _call(http, "GET", "/v1/sandboxes", params={"label": label}), "label")
    _refused(await _call(http, "POST", "/v1/sandboxes/pause", params={"label": label}), "label")


async def test_an_oversized_header_answers_the_json_error_shape(http: aiohttp.ClientSession) -> None:
    status, body = await _call(http, "GET", "/v1/health", headers={"X-Pad": "p" * 10_000})
    assert status == 400 and isinstance(body, dict) and body["error"]["code"] == "invalid_request", body
    assert (await _call(http, "GET", "/v1/health"))[0] == 200  # the server serves on


async def test_a_memory_limit_beyond_the_node_is_refused_not_admitted(
    http: aiohttp.ClientSession, node: EmbeddedNode, base_layer: str
) -> None:
    ram_mib = node.edge.admission.total_memory() >> 20
    too_big = ram_mib + 1024
    if too_big > 1024 * 1024:
        pytest.skip("this node has more RAM than a spec may ask for")
    spec = {"type": "container", "image": base_layer, "memory_limit_mb": too_big}
    status, body = await _call(http, "POST", "/v1/sandboxes", json={"spec": spec, "timeout": 60})
    if status == 201:
        await _call(http, "DELETE", f"/v1/sandboxes/{body['id']}")
    _refused((status, body), "memory_limit_mb", str(too_big))


async def test_sandboxes_without_a_disk_limit_get_the_nodes_default(
    node: EmbeddedNode, make_sandbox: Sandboxes
) -> None:
    backend = node.backend
    assert isinstance(backend, ContainerBackend)
    if not backend.capabilities()["disk_quota"]:
        pytest.skip("this node cannot enforce disk quotas (needs btrfs and loop devices)")
    config = node.edge.config
    before = config.default_disk_limit_mb
    config.default_disk_limit_mb = 64  # what an operator sets with --default-disk-limit-mb
    try:
        sb = await make_sandbox()
        own = await make_sandbox(disk_limit_mb=256)  # a sandbox's own limit wins
    finally:
        config.default_disk_limit_mb = before
    dd = "dd if=/dev/zero of=/root/big bs=1M count=128 conv=fsync status=none"
    r = await sb.run_shell(dd)
    assert r.exit_code != 0 and "Disk quota exceeded" in r.stderr, r
    assert (await own.run_shell(dd)).exit_code == 0
    assert sb.id in backend.disk_quota.volumes()


@pytest.mark.parametrize("mb", ["inf", "1e400", "-1", "nan"])
async def test_an_image_import_merge_size_must_be_a_finite_size(http: aiohttp.ClientSession, mb: str) -> None:
    params = {"ref": f"bad-numbers-{uuid.uuid4().hex[:8]}:1", "merge_below_mb": mb}
    _refused(await _call(http, "POST", "/v1/images", params=params, data=b""), "merge_below_mb")


async def test_a_flag_that_is_not_true_or_false_is_refused_not_taken_as_false(
    http: aiohttp.ClientSession, sandbox: Sandbox
) -> None:
    base = f"/v1/sandboxes/{sandbox.id}/files"
    assert (await _call(http, "POST", f"{base}/mkdir", params={"path": "/tmp/d/e"}))[0] == 201
    # "yes" used to mean false: a recursive remove the caller asked for was refused as not empty.
    _refused(await _call(http, "DELETE", base, params={"path": "/tmp/d", "recursive": "yes"}), "recursive")
    _refused(
        await _call(http, "POST", f"{base}/mkdir", params={"path": "/tmp/f/g", "parents": "1"}), "parents"
    )
    assert (await _call(http, "DELETE", base, params={"path": "/tmp/d", "recursive": "true"}))[0] == 200
