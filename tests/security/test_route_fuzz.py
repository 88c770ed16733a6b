"""Property-based fuzzing of every route's input against the real node (issue 25).

Each case starts from a valid request body of a route's pydantic model and puts an edge value
(huge or negative numbers, 1e400 and NaN as raw JSON, NUL, lone surrogates, long or odd unicode
strings, wrong types) into one of the model's fields, or into a query parameter. Whatever the
input, the server must answer: no 5xx, within a timeout (a hang is a failure), in the error
shape of the front it reached, and the node must still create and drive a sandbox afterwards.

Hypothesis draws the cases (derandomized: CI sees the same ones every run); they are sent one
by one from the async test, since a pytest-asyncio loop cannot run inside ``@given``.
Destructive routes are aimed where validation happens and nothing is made: creates name a
template no store has, IAM writes name a project that does not exist.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from dsec import Sandbox
from dsec.apiserver.e2b.models import (
    ConnectSandbox,
    NewSandbox,
    RefreshRequest,
    ResumeSandbox,
    TimeoutRequest,
)
from dsec.apiserver.e2b.volumes import UpdateBody
from dsec.apiserver.fncall import FnCallRequest
from dsec.apiserver.sandboxfusion import RunCodeRequest
from dsec.edge.server import EdgeServer
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.fncall import FnTask
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import (
    BatchCreateRequest,
    ContainerSpec,
    CreateRequest,
    ExecRequest,
    InputRequest,
    KeyCreate,
    LeaseRequest,
    NetworkRulesRequest,
    ProjectCreate,
    QuotaModel,
    QuotaUpdate,
    RetagRequest,
    ShellRequest,
)
from dsec.protocol.ops import (
    Changes,
    Exec,
    ForkLocal,
    Mkdir,
    Remove,
    ResizeProcess,
    RunShell,
    SendInput,
    SetDeadline,
    SignalProcess,
    StartProcess,
    Stat,
    Trajectory,
    WatchDir,
)
from dsec.protocol.volumes import ListDir, MakeDir, UpdatePath
from tests.conftest import Sandboxes

EXAMPLES = 800  # seconds of requests; every route gets a dozen or more
REQUEST_TIMEOUT_S = 60.0  # far above any answer here: past it the server hangs
NOWHERE = "fuzz-no-such-template:1"
HOLE = "\x00__fuzz__\x00"
GHOST_VOLUME = "vol-fuzz-0000000000000000"  # well-formed, of no volume
_WRITE = {
    "path": "/f",
    "uid": "1",
    "gid": "1",
    "mode": "420",
    "force": "true",
}  # stands for the raw JSON value put into a body

# Raw JSON values: what json.dumps cannot write (1e400, NaN) is exactly what a client may send.
RAW_VALUES = [
    "1e400", "-1e400", "NaN", "Infinity", "-Infinity", "1e300", "-1e300", "1e-400", "-1", "0",
    "-0", "0.5", str(1 << 31), str((1 << 32) - 1), str(1 << 63), str(1 << 64), "1" + "0" * 30,
    "9" * 5000, "null", "true", "[]", "{}", "[1e400]", '{"a": NaN}', '""', '"\\u0000"',
    '"/tmp\\u0000x"', '"\\ud800"', '"../../etc/passwd"', '"-1"', '"1e400"', '"nan"',
    json.dumps("x" * 70_000), json.dumps("\u202e\u0301" * 1000), json.dumps("💥" * 300),
]  # fmt: skip
# Query parameter values.
RAW_PARAMS = [
    "", "-1", "1e400", "nan", "inf", "99999999999999999999", str(1 << 63), "+1", "1_0", "٣",
    "0x10", "\x00", "/tmp\x00x", "a=b", "=", "==", " k=v", "k=" + "v" * 300, "x" * 5000,
    "17777", "100644", "7777", "../..", "\u202e", "💥", "²",
]  # fmt: skip


@dataclass
class Route:
    method: str
    path: str  # {id}: the fuzz sandbox, {ghost}: a well-formed ID of none, {key}: the API key
    model: type[BaseModel] | None = None
    body: dict[str, Any] = field(default_factory=dict)  # a valid base body of ``model``
    params: dict[str, str] = field(default_factory=dict)  # valid base query parameters
    nested: dict[str, type[BaseModel]] = field(default_factory=dict)  # field -> its own model
    e2b: bool = False  # answers E2B's error shape ({"code", "message"})


def _routes(project: str) -> list[Route]:
    spec = {"type": "container", "image": NOWHERE}
    quick = {"timeout": 5}
    return [
        Route("POST", "/v1/sandboxes", CreateRequest, {"spec": spec, "timeout": 30},
              nested={"spec": ContainerSpec}),
        Route("POST", "/v1/sandboxes/batch", BatchCreateRequest, {"spec": spec, "count": 2, "timeout": 30},
              nested={"spec": ContainerSpec}),
        Route("GET", "/v1/sandboxes", params={"label": "fuzz=none"}),
        Route("POST", "/v1/sandboxes/pause", params={"label": "fuzz=none"}),
        Route("GET", "/v1/sandboxes/{id}"),
        Route("PUT", "/v1/sandboxes/{id}/network", NetworkRulesRequest, {"network_rules": {}}),
        Route("POST", "/v1/sandboxes/{id}/shell", ShellRequest, {"command": "true", **quick}),
        Route("POST", "/v1/sandboxes/{id}/exec", ExecRequest, {"argv": ["true"], **quick}),
        Route("POST", "/v1/sandboxes/{id}/input", InputRequest, {"events": [{"type": "text", "text": "x"}]}),
        Route("GET", "/v1/sandboxes/{id}/files/content", params={"path": "/etc/hostname"}),
        Route("PUT", "/v1/sandboxes/{id}/files/content", params={"path": "/tmp/fuzz", "mode": "644"}),
        Route("GET", "/v1/sandboxes/{id}/files/stat", params={"path": "/tmp"}),
        Route("GET", "/v1/sandboxes/{id}/files/list", params={"path": "/tmp"}),
        Route("POST", "/v1/sandboxes/{id}/files/mkdir", params={"path": "/tmp/fuzz-d", "parents": "true"}),
        Route("DELETE", "/v1/sandboxes/{id}/files", params={"path": "/tmp/fuzz-none", "recursive": "false"}),
        Route("POST", "/v1/sandboxes/{id}/files/move", params={"source": "/tmp/a", "destination": "/tmp/b"}),
        Route("GET", "/v1/sandboxes/{id}/trajectory", params={"after": "0", "limit": "10"}),
        Route("GET", "/v1/sandboxes/{id}/changes", params={"under": "/tmp"}),
        # The console's terminal WebSocket, sent as plain GETs: a bad size or a missing upgrade
        # is a 400 before a shell starts (its frames: tests/e2e/test_console.py).
        Route("GET", "/console/ws/sandboxes/{id}/terminal", params={"rows": "24", "cols": "80"}),
        Route("POST", "/v1/jobs/{job}/lease", LeaseRequest, {"lease_s": 60}),
        Route("POST", "/v1/projects", ProjectCreate, {"parent": project, "name": "x", "quota": {}},
              nested={"quota": QuotaModel}),
        Route("POST", "/v1/projects/quota", QuotaUpdate, {"project": project, "quota": {"sandboxes": 1}},
              nested={"quota": QuotaModel}),
        Route("GET", "/v1/projects", params={"under": project}),
        Route("GET", "/v1/projects/usage", params={"project": project}),
        Route("POST", "/v1/keys", KeyCreate, {"project": project}),
        Route("GET", "/v1/keys", params={"project": project}),
        Route("POST", "/v1/layers/retag", RetagRequest, {"ref": "fuzz-tag:1", "target": NOWHERE}),
        Route("POST", "/v1/layers/verify", params={"ref": NOWHERE}),
        Route("POST", "/v1/fncall", FnCallRequest,
              {"task": {"language": "python", "code": "print(1)", "run_timeout_s": 1}, "timeout": 5}),
        Route("POST", "/sandboxfusion/{key}/run_code", RunCodeRequest,
              {"code": "print(1)", "language": "nosuch"}),
        Route("POST", "/sandboxes", NewSandbox, {"templateID": NOWHERE}, e2b=True),
        Route("GET", "/v2/sandboxes", params={"limit": "10", "state": "running"}, e2b=True),
        # E2B's routes read the body first: a sandbox that is not there keeps valid ones harmless.
        Route("POST", "/sandboxes/{ghost}/connect", ConnectSandbox, {"timeout": 300}, e2b=True),
        Route("POST", "/sandboxes/{ghost}/timeout", TimeoutRequest, {"timeout": 300}, e2b=True),
        Route("POST", "/sandboxes/{ghost}/refreshes", RefreshRequest, {"duration": 60}, e2b=True),
        Route("POST", "/sandboxes/{ghost}/resume", ResumeSandbox, {"timeout": 300}, e2b=True),
        # Volumes: aimed at one that is not there (a made one would outlive the test).
        Route("GET", "/volumes/{vol}", e2b=True),
        Route("GET", "/volumecontent/{vol}/dir", params={"path": "/", "depth": "1"}, e2b=True),
        Route("PUT", "/volumecontent/{vol}/file", params=_WRITE, e2b=True),
        Route("PATCH", "/volumecontent/{vol}/path", UpdateBody, {"mode": 420}, params={"path": "/f"},
              e2b=True),
        # Secrets: listed, and one that is not there deleted (a created one would outlive the test).
        Route("GET", "/secrets", params={"limit": "10", "nextToken": "sec_" + "0" * 26}, e2b=True),
        Route("DELETE", "/secrets/{ghost}", e2b=True),
    ]  # fmt: skip


def _edge_routes(project: str) -> list[Route]:
    """The edge server's routes (what apiservers of a cluster call), served over the same node."""
    e = "/edge/v1"
    o, st_ = e + "/sandboxes/{id}/ops", e + "/sandboxes/{id}/streams"
    quick = {"timeout": 5}
    vol = {"volume_id": GHOST_VOLUME, "within": project}
    return [
        Route("POST", f"{e}/sandboxes", ContainerSpec, {"type": "container", "image": NOWHERE}),
        Route("GET", f"{e}/sandboxes", params={"label": "fuzz=none"}),
        Route("POST", f"{e}/bulk/pause", params={"label": "fuzz=none", "within": project}),
        Route("POST", e + "/leases/{job}", LeaseRequest, {"lease_s": 60}, params={"within": project}),
        Route("POST", o + "/run_shell", RunShell, {"command": "true", **quick}),
        Route("POST", st_ + "/exec", Exec, {"argv": ["true"], **quick}),
        Route("POST", e + "/sandboxes/{ghost}/ops/set_deadline", SetDeadline, {"timeout_s": 60}),
        Route("POST", e + "/sandboxes/{ghost}/ops/fork_local", ForkLocal, {"ids": ["x"]}),
        Route("POST", o + "/send_input", SendInput, {"events": [{"type": "text", "text": "x"}]}),
        Route("POST", o + "/trajectory", Trajectory, {"after": 0, "limit": 10}),
        Route("POST", o + "/changes", Changes, {"under": "/tmp"}),
        Route("POST", o + "/stat", Stat, {"path": "/tmp"}),
        Route("PUT", e + "/sandboxes/{id}/files/content", params={"path": "/tmp/fuzz-e", "mode": "644"}),
        Route("POST", o + "/mkdir", Mkdir, {"path": "/tmp/fuzz-ed", "parents": True}),
        Route("POST", o + "/remove", Remove, {"path": "/tmp/fuzz-none", "recursive": False}),
        Route("POST", st_ + "/start_process", StartProcess, {"argv": ["true"], "stdin": False}),
        Route("POST", o + "/signal_process", SignalProcess, {"pid": 999999, "signal": 15}),
        Route("POST", o + "/resize_process", ResizeProcess, {"pid": 999999, "rows": 24, "cols": 80}),
        # A valid watch runs until closed: aimed at no sandbox, every case still meets validation.
        Route("POST", e + "/sandboxes/{ghost}/streams/watch_dir", WatchDir, {"path": "/tmp"}),
        Route("POST", f"{e}/volumes/list_dir", ListDir, {**vol, "path": "/", "depth": 2}),
        Route("POST", f"{e}/volumes/make_dir", MakeDir, {**vol, "path": "/d", "mode": 493, "force": True}),
        Route("POST", f"{e}/volumes/update", UpdatePath, {**vol, "path": "/d", "uid": 1}),
        Route("PUT", e + "/volumes/{vol}/content", params={**_WRITE, "within": project}),
        Route("POST", f"{e}/fncall", FnTask, {"language": "python", "code": "print(1)", "run_timeout_s": 1}),
    ]  # fmt: skip


def _fields(route: Route) -> list[tuple[str, ...]]:
    """Every field of the route's model (and of its nested models) as a path into the body."""
    out: list[tuple[str, ...]] = []
    if route.model is not None:
        for name, info in route.model.model_fields.items():
            out.append((info.alias or name,))
            sub = route.nested.get(name)
            if sub is not None:
                out += [(name, inner.alias or n) for n, inner in sub.model_fields.items()]
    return out


@dataclass
class Case:
    route: Route
    where: tuple[str, ...] | None  # the body field replaced (None: a query parameter)
    param: str | None
    raw: str


def _cases(routes: list[Route]) -> list[Case]:
    out: list[Case] = []
    strings = st.text(max_size=300) | st.sampled_from(RAW_PARAMS)
    as_json = st.sampled_from(RAW_VALUES) | st.text(max_size=200).map(json.dumps) | st.integers().map(str)

    @st.composite
    def case(draw: st.DrawFn) -> Case:
        route = draw(st.sampled_from(routes))
        fields = _fields(route)
        if route.params and (not fields or draw(st.booleans())):
            name = draw(st.sampled_from(sorted(route.params)))
            return Case(route, None, name, draw(strings))
        if not fields:
            return Case(route, None, None, "")
        return Case(route, draw(st.sampled_from(fields)), None, draw(as_json))

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case())
    def collect(c: Case) -> None:
        out.append(c)

    collect()
    return out


def _body(route: Route, where: tuple[str, ...] | None, raw: str) -> str | None:
    if route.model is None:
        return None
    body = json.loads(json.dumps(route.body))
    if where is not None:
        target = body
        for key in where[:-1]:
            target = target.setdefault(key, {})
            if not isinstance(target, dict):
                return None
        target[where[-1]] = HOLE
    return json.dumps(body).replace(json.dumps(HOLE), raw)


def _session(url: str, bearer: str) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    return aiohttp.ClientSession(url, headers={"Authorization": f"Bearer {bearer}"}, timeout=timeout)


@pytest.fixture
async def http(node: EmbeddedNode) -> AsyncIterator[aiohttp.ClientSession]:
    async with _session(node.url, node.api_key) as s:
        yield s


@pytest.fixture
async def edge_http(node: EmbeddedNode) -> AsyncIterator[aiohttp.ClientSession]:
    """The session node's edge, served over HTTP as `dsec edge` serves it."""
    secret = uuid.uuid4().hex
    server = EdgeServer(node.edge, secret)
    try:
        async with _session(await server.start(), secret) as s:
            yield s
    finally:
        await server.close()


async def _send(http: aiohttp.ClientSession, case: Case, subs: dict[str, str]) -> tuple[int, bytes, str]:
    route = case.route
    path = route.path.format(**subs)
    params = dict(route.params)
    if case.param is not None:
        params[case.param] = case.raw
    body = _body(route, case.where, case.raw)
    data: str | bytes | None = body
    if route.model is None and route.method in ("PUT", "POST"):
        data = b"fuzz"
    headers = {"Content-Type": "application/json"} if body is not None else {}
    async with http.request(route.method, path, params=params, data=data, headers=headers) as resp:
        return resp.status, await resp.read(), resp.content_type


def _check(case: Case, status: int, raw: bytes, ctype: str) -> None:
    what = f"{case.route.method} {case.route.path} {case.where or case.param}={case.raw[:120]!r}"
    assert status < 500 or _honest_capacity(raw), f"{what}: {status} {raw[:300]!r}"
    if status < 400:
        return
    assert ctype == "application/json", f"{what}: {status} {ctype} {raw[:300]!r}"
    body = json.loads(raw)
    if case.route.e2b:
        assert isinstance(body.get("code"), int) and isinstance(body.get("message"), str), f"{what}: {body}"
    else:
        err = body.get("error")
        assert isinstance(err, dict) and isinstance(err.get("code"), str), f"{what}: {body}"
        assert isinstance(err.get("message"), str), f"{what}: {body}"


def _honest_capacity(raw: bytes) -> bool:
    """A valid FnCall on a node without a pool for it: 503 capacity_exhausted is the truth."""
    try:
        return bool(json.loads(raw)["error"]["code"] == "capacity_exhausted")
    except (ValueError, KeyError, TypeError):
        return False


async def _fuzz(
    http: aiohttp.ClientSession, node: EmbeddedNode, make_sandbox: Sandboxes, routes: list[Route]
) -> None:
    target = await make_sandbox()
    before = {info.id for info in await node.link.list_sandboxes({})}
    sid = SandboxId.parse(target.id)
    ghost = str(SandboxId(sid.node, sid.epoch, SandboxId.new_tag()))
    subs = {"id": target.id, "ghost": ghost, "key": node.api_key, "job": "fuzz-job", "vol": GHOST_VOLUME}
    cases = _cases(routes)
    assert {c.route.path for c in cases} == {r.path for r in routes}  # every route drawn
    try:
        for case in cases:
            try:
                status, raw, ctype = await _send(http, case, subs)
            except TimeoutError:
                pytest.fail(f"{case.route.method} {case.route.path} hung on {case.where or case.param}")
            _check(case, status, raw, ctype)
    finally:
        # Nothing should have been made; if something was, it goes.
        for info in await node.link.list_sandboxes({}):
            if info.id not in before:
                await node.link.stop(info.id)
    await _still_serving(make_sandbox, target)


MISSING = f"root/fuzz-missing-{uuid.uuid4().hex[:8]}"  # IAM writes validate, then answer 404


async def test_no_input_makes_an_api_route_fail_hang_or_answer_out_of_shape(
    http: aiohttp.ClientSession, node: EmbeddedNode, make_sandbox: Sandboxes
) -> None:
    await _fuzz(http, node, make_sandbox, _routes(MISSING))


async def test_no_input_makes_an_edge_route_fail_hang_or_answer_out_of_shape(
    edge_http: aiohttp.ClientSession, node: EmbeddedNode, make_sandbox: Sandboxes
) -> None:
    await _fuzz(edge_http, node, make_sandbox, _edge_routes(MISSING))


async def _still_serving(make_sandbox: Sandboxes, target: Sandbox) -> None:
    fresh = await make_sandbox()
    for sb in (fresh, target):
        r = await asyncio.wait_for(sb.run_shell("echo ok"), REQUEST_TIMEOUT_S)
        assert r.stdout == "ok\n", r
