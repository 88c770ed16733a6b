"""Structured logs and request IDs without a node: the JSON and text formatters, which IDs a
server accepts, and the middleware over a loopback aiohttp app that fails as the edge does,
read back through the wire client (the SDK's and the apiserver's)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from dsec.apiserver._http import PRINCIPAL
from dsec.iam import Principal
from dsec.observe import request_ids
from dsec.observe.audit import AUDIT_KEY, AuditLog, audited, outcome_of
from dsec.observe.logs import (
    JsonFormatter,
    RequestIdFilter,
    TextFormatter,
    configure,
    echo_request_id,
    request_middleware,
)
from dsec.observe.metrics import ProcessMetrics
from dsec.protocol.errors import (
    DSecError,
    FileNotFound,
    Forbidden,
    InfraFailure,
    InvalidRequest,
    error_from_wire,
)
from dsec.protocol.http import CLIENT_CLOSED_REQUEST, listen
from dsec.protocol.wire_client import WireClient, ndjson
from tests.support import eventually


class Records(logging.Handler):
    """Keeps the records of the ``dsec`` loggers, with the request ID as the real handler adds it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.addFilter(RequestIdFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def named(self, name: str) -> list[logging.LogRecord]:
        return [r for r in self.records if r.name == name]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    root = logging.getLogger("dsec")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _record(msg: str, **extra: object) -> logging.LogRecord:
    record = logging.getLogger("dsec.test").makeRecord(
        "dsec.test", logging.WARNING, __file__, 1, msg, (), None, extra=extra
    )
    RequestIdFilter().filter(record)
    return record


# ---------------------------------------------------------------- formatters


def test_a_json_line_carries_the_request_id_and_the_extra_fields() -> None:
    with request_ids.request_id("req-1"):
        line = JsonFormatter().format(_record("two\nlines", sandbox="local-1", n=3))
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["msg"] == "two\nlines" and obj["level"] == "warning" and obj["logger"] == "dsec.test"
    assert obj["request_id"] == "req-1"
    assert obj["sandbox"] == "local-1" and obj["n"] == 3
    assert obj["ts"].endswith("+00:00")


def test_a_json_line_outside_a_request_has_no_id_and_keeps_a_traceback() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.getLogger("dsec.test").makeRecord(
            "dsec.test", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    RequestIdFilter().filter(record)
    obj = json.loads(JsonFormatter().format(record))
    assert "request_id" not in obj
    assert "RuntimeError: boom" in obj["exc"]


def test_a_text_line_names_the_request() -> None:
    with request_ids.request_id("req-2"):
        line = TextFormatter().format(_record("hello", sandbox="s1"))
    assert "dsec.test WARNING hello [req-2] sandbox=s1" in line


def test_configure_replaces_its_own_handler_and_filters_by_level() -> None:
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    out = io.StringIO()
    try:
        configure("info", "text", io.StringIO())
        configure("warning", "json", out)  # the first one is replaced, not doubled
        assert len(root.handlers) == len(before) + 1
        with request_ids.request_id("req-3"):
            logging.getLogger("dsec.test").info("dropped")
            logging.getLogger("dsec.test").warning("kept")
        lines = [json.loads(x) for x in out.getvalue().splitlines()]
        assert [(x["msg"], x["request_id"]) for x in lines] == [("kept", "req-3")]
        with pytest.raises(InvalidRequest):
            configure("loud", "json")
    finally:
        for h in [h for h in root.handlers if h not in before]:
            root.removeHandler(h)
        root.setLevel(level)


# ---------------------------------------------------------------- request IDs


@pytest.mark.parametrize("value", ["a", "0" * 128, "job-17:step.3_x", "550e8400-e29b-41d4-a716-446655440000"])
def test_well_formed_ids_are_accepted(value: str) -> None:
    assert request_ids.valid(value)
    assert request_ids.accept(value) == value


@pytest.mark.parametrize(
    "value", ["", "0" * 129, "a b", "a\nb", "a\r\nX-Evil: 1", "-lead", "é", 'a"b', "a/b", "a\0b"]
)
def test_malformed_ids_are_replaced_by_a_fresh_one(value: str) -> None:
    assert not request_ids.valid(value)
    fresh = request_ids.accept(value)
    assert fresh != value and request_ids.valid(fresh)
    with pytest.raises(InvalidRequest):
        with request_ids.request_id(value):
            pass


def test_each_request_outside_a_scope_gets_its_own_id() -> None:
    assert request_ids.current() is None
    assert request_ids.outgoing() != request_ids.outgoing()
    with request_ids.request_id("chosen"):
        assert request_ids.outgoing() == "chosen"
    assert request_ids.current() is None


def test_the_wire_keeps_the_id_and_an_old_body_still_parses() -> None:
    err = FileNotFound("no /x", request_id="rid-9")
    assert err.to_wire() == {"error": {"code": "file_not_found", "message": "no /x", "request_id": "rid-9"}}
    back = error_from_wire(404, err.to_wire())
    assert isinstance(back, FileNotFound) and back.request_id == "rid-9"
    old = error_from_wire(404, {"error": {"code": "file_not_found", "message": "no /x"}})
    assert isinstance(old, FileNotFound) and old.request_id is None
    junk = error_from_wire(404, {"error": {"code": "file_not_found", "message": "m", "request_id": ["x"]}})
    assert junk.request_id is None


# ---------------------------------------------------------------- the middleware


async def _missing(request: web.Request) -> web.Response:
    logging.getLogger("dsec.edge.test").info("looking for %s", request.query.get("path"))
    raise FileNotFound(f"no such file: {request.query.get('path')}")


async def _stream_then_fail(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    await resp.write(b'{"n": 1}\n')
    await resp.write(json.dumps(InfraFailure("mid-stream").to_wire()).encode() + b"\n")
    return resp


@web.middleware
async def _errors(request: web.Request, handler: object) -> web.StreamResponse:
    try:
        return await handler(request)  # type: ignore[operator]
    except DSecError as exc:
        return web.json_response(exc.to_wire(), status=exc.status)


class AdminRoutes:
    @audited("project.create", body=("parent", "name"))
    async def create(self, request: web.Request) -> web.Response:
        await request.read()
        if not request[PRINCIPAL].admin:
            raise Forbidden("this needs an admin API key")
        return web.json_response({"ok": True}, status=201)


@web.middleware
async def _principal(request: web.Request, handler: object) -> web.StreamResponse:
    admin = request.headers.get("Authorization") == "Bearer admin"
    request[PRINCIPAL] = Principal("root" if admin else "root/team", admin, "k-admin" if admin else "k-team")
    return await handler(request)  # type: ignore[operator]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[str, AuditLog]]:
    app = web.Application(middlewares=[request_middleware("edge"), _errors, _principal])
    app.on_response_prepare.append(echo_request_id)
    audit = AuditLog(tmp_path / "audit" / "audit.log")
    app[AUDIT_KEY] = audit
    app.router.add_get("/missing", _missing)
    app.router.add_get("/stream", _stream_then_fail)
    app.router.add_post("/projects", AdminRoutes().create)
    runner, url = await listen(app, "127.0.0.1", 0)
    try:
        yield url, audit
    finally:
        await runner.cleanup()
        audit.close()


async def test_an_error_carries_the_id_the_client_chose(
    server: tuple[str, AuditLog], records: Records
) -> None:
    client = WireClient(server[0], {})
    try:
        with request_ids.request_id("chosen-by-caller"), pytest.raises(FileNotFound) as caught:
            async with client.send("GET", "/missing", params={"path": "/nope"}):
                pass
        assert caught.value.request_id == "chosen-by-caller"
        (access,) = records.named("dsec.edge.access")
        assert access.request_id == "chosen-by-caller"  # type: ignore[attr-defined]
        assert (access.status, access.path) == (404, "/missing")  # type: ignore[attr-defined]
        (line,) = records.named("dsec.edge.test")
        assert line.request_id == "chosen-by-caller"  # type: ignore[attr-defined]
        # Without a scope, every request has an ID of its own.
        ids = []
        for _ in range(2):
            with pytest.raises(FileNotFound) as again:
                async with client.send("GET", "/missing"):
                    pass
            ids.append(again.value.request_id)
        assert ids[0] != ids[1] and all(request_ids.valid(i) for i in ids)
    finally:
        await client.close()


async def test_a_malformed_id_is_replaced_and_the_answer_says_which(server: tuple[str, AuditLog]) -> None:
    client = WireClient(server[0], {})
    try:
        bad = "x" * 200
        with pytest.raises(FileNotFound) as caught:
            async with client.send("GET", "/missing", headers={request_ids.HEADER: bad}):
                pass
        rid = caught.value.request_id
        assert rid is not None and rid != bad and request_ids.valid(rid)
        session = client.session()
        async with session.get(server[0] + "/missing", headers={request_ids.HEADER: "a b"}) as resp:
            body = await resp.json()
            assert resp.headers[request_ids.HEADER] == body["error"]["request_id"] != "a b"
    finally:
        await client.close()


async def test_a_stream_carries_the_id_in_its_header_and_its_error(server: tuple[str, AuditLog]) -> None:
    from pydantic import BaseModel

    class Event(BaseModel):
        n: int

    client = WireClient(server[0], {})
    try:
        with request_ids.request_id("streamed"), pytest.raises(InfraFailure) as caught:
            async with client.send("GET", "/stream") as resp:
                assert resp.headers[request_ids.HEADER] == "streamed"
                async for _ in ndjson(resp, Event, peer="test"):
                    pass
        assert caught.value.request_id == "streamed"
    finally:
        await client.close()


async def test_admin_actions_are_audited_refusals_too(server: tuple[str, AuditLog], records: Records) -> None:
    url, audit = server
    for key, rid in (("admin", "by-admin"), ("team", "by-team")):
        client = WireClient(url, {"Authorization": f"Bearer {key}"})
        try:
            with request_ids.request_id(rid):
                if key == "admin":
                    async with client.send("POST", "/projects", json_body={"parent": "root", "name": "p"}):
                        pass
                else:
                    with pytest.raises(Forbidden):
                        async with client.send(
                            "POST", "/projects", json_body={"parent": "root", "name": "q"}
                        ):
                            pass
        finally:
            await client.close()
    assert audit.path is not None
    lines = [json.loads(x) for x in audit.path.read_text().splitlines()]
    assert [(x["action"], x["outcome"], x["request_id"], x["who"]["key_id"]) for x in lines] == [
        ("project.create", "ok", "by-admin", "k-admin"),
        ("project.create", "refused", "by-team", "k-team"),
    ]
    assert lines[0]["target"] == {"parent": "root", "name": "p"}
    assert lines[1]["error"] == "forbidden"
    assert [r.audit["outcome"] for r in records.named("dsec.audit")] == ["ok", "refused"]  # type: ignore[attr-defined]
    assert audit.path.stat().st_mode & 0o777 == 0o600


def test_outcomes() -> None:
    assert outcome_of(None) == {"outcome": "ok"}
    assert outcome_of(Forbidden("no")) == {"outcome": "refused", "error": "forbidden"}
    assert outcome_of(InvalidRequest("bad")) == {"outcome": "failed", "error": "invalid_request"}
    assert outcome_of(RuntimeError("x")) == {"outcome": "failed", "error": "RuntimeError"}


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["up", "--log-format", "xml"], "json or text"),
        (["edge", "--node", "n", "--apiserver", "http://x", "--log-level", "loud"], "log level"),
        (["apiserver", "--iam", "postgresql://x", "--shared-layers", "/x", "--log-format", "yaml"], "json"),
    ],
)
def test_the_node_commands_refuse_a_bad_log_option_before_starting(args: list[str], why: str) -> None:
    from typer.testing import CliRunner

    from dsec.cli.main import app

    root = logging.getLogger()
    before = list(root.handlers)
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and why in result.output, result.output
    assert root.handlers == before  # nothing was configured


async def test_a_name_no_encoding_can_write_is_escaped_in_the_audit_and_the_log(
    server: tuple[str, AuditLog],
) -> None:
    url, audit = server
    client = WireClient(url, {"Authorization": "Bearer admin"})
    try:
        body = '{"parent": "root", "name": "\\ud800"}'  # a lone surrogate, as JSON allows
        async with client.send("POST", "/projects", data=body.encode()):
            pass
    finally:
        await client.close()
    assert audit.path is not None
    (line,) = audit.path.read_text().splitlines()
    assert json.loads(line)["target"]["name"] == "\ud800"
    assert "\ud800" in json.loads(JsonFormatter().format(_record("\ud800")))["msg"]


async def test_an_access_line_keeps_the_path_encoded_and_drops_the_query(
    server: tuple[str, AuditLog], records: Records
) -> None:
    client = WireClient(server[0], {})
    try:
        with pytest.raises(DSecError):
            async with client.send("GET", "/missing%0aforged?token=secret"):
                pass
    finally:
        await client.close()
    (access,) = records.named("dsec.edge.access")
    assert access.path.lower() == "/missing%0aforged"  # type: ignore[attr-defined]
    assert "\n" not in TextFormatter().format(access)


async def test_a_request_its_client_hangs_up_on_is_logged_and_counted_499_not_500(records: Records) -> None:
    # The edge cancels the work of an apiserver that hangs up (handler_cancellation): no one
    # got an answer, so neither the access log nor the metrics may say the server failed.
    metrics = ProcessMetrics("edge")
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        entered.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        raise AssertionError("never answered")

    app = web.Application(middlewares=[request_middleware("edge"), metrics.middleware])
    app.router.add_get("/slow", slow)
    runner, url = await listen(app, "127.0.0.1", 0, handler_cancellation=True)
    try:
        host, port = url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await entered.wait()
        writer.close()
        await cancelled.wait()
        lines = await eventually(lambda: records.named("dsec.edge.access"), "the access line", 30)
    finally:
        await runner.cleanup()
    assert [(r.levelno, r.status) for r in lines] == [(logging.INFO, CLIENT_CLOSED_REQUEST)]  # type: ignore[attr-defined]
    count = metrics.registry.get_sample_value
    labels = {"route": "/slow", "method": "GET"}
    assert count("dsec_edge_http_requests_total", {**labels, "status": "499"}) == 1
    assert count("dsec_edge_http_requests_total", {**labels, "status": "500"}) is None
