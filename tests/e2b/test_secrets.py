"""E2B's secrets (``/secrets``) through the official SDK (2.63: ``Secret`` and ``AsyncSecret``;
2.34 has none) and raw HTTP: E2B's answers and fixed messages, the project wall, pagination,
metadata's keep-or-replace, every bound a 400, values sealed at rest and never answered, and
records another apiserver on the same layer store (a restart) reads.
"""

from __future__ import annotations

import datetime
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dsec.apiserver.app import ApiServer
from dsec.apiserver.e2b import E2BOptions
from dsec.apiserver.e2b.secret_store import (
    MAX_SECRETS_PER_PROJECT,
    MAX_VALUE_BYTES,
    SecretStore,
    parse_selector,
)
from dsec.apiserver.e2b.tokens import secret_from_file
from dsec.iam.base import Quota
from dsec.node.embedded import EmbeddedNode
from dsec.placement.placement import Placement, Watcher
from dsec.protocol.errors import Conflict, InvalidRequest
from dsec.protocol.http import listen
from tests.e2b.conftest import E2B, PROJECT

# A project of its own below PROJECT: its key lists only what a test made there.
CHILD = f"{PROJECT}/secrets"
PREFIX = "st-"  # every secret a test here makes is named so; stale ones are swept
STALE_S = 7200.0
RUN = uuid.uuid4().hex[:8]

SYNC = """
from e2b import Secret
from e2b.exceptions import SecretNotFoundException
name = "{name}"
made = Secret.create(name.upper(), "{value}", metadata={{"env": "test"}})
by_id, by_name = Secret.get_info(made.secret_id), Secret.get_info(name)
kept = Secret.update(made.secret_id, "{value}-2")
emptied = Secret.update(name, "{value}-3", metadata={{}})
replaced = Secret.update(name, "{value}-4", metadata={{"a": "b"}})
try:
    Secret.create(name, "again")
    twice = None
except Exception as e:
    twice = str(e)
try:
    Secret.get_info("{name}-missing")
    missing = None
except SecretNotFoundException as e:
    missing = type(e).__name__
try:
    Secret.update("{name}-missing", "v")
    missing_update = None
except SecretNotFoundException as e:
    missing_update = type(e).__name__
listed = []
paginator = Secret.list(limit=1)
while paginator.has_next:
    listed.append([s.name for s in paginator.next_items()])
exists = [Secret.exists(name), Secret.exists("{name}-missing")]
destroyed, again = Secret.destroy(made.secret_id), Secret.destroy(name)
print(json.dumps({{
    "made": [made.secret_id, made.name, made.version, made.metadata, made.created_at.isoformat(),
             made.updated_at.isoformat(), hasattr(made, "value")],
    "by_id": [by_id.secret_id, by_id.name], "by_name": by_name.secret_id,
    "versions": [kept.version, emptied.version, replaced.version],
    "metadata": [kept.metadata, emptied.metadata, replaced.metadata],
    "twice": twice, "missing": missing, "missing_update": missing_update, "listed": listed,
    "exists": exists, "destroyed": destroyed, "again": again, "after": Secret.exists(name),
}}))
"""

ASYNC = """
import asyncio
from e2b import AsyncSecret

async def main():
    made = await AsyncSecret.create("{name}", "{value}")
    got = await AsyncSecret.get_info("{name}")
    updated = await AsyncSecret.update(made.secret_id, "{value}-2", metadata={{"k": "v"}})
    paginator = AsyncSecret.list()
    names = [s.name for s in await paginator.next_items()]
    gone = await AsyncSecret.destroy("{name}")
    return {{"made": [made.secret_id, made.version], "got": got.secret_id,
             "updated": [updated.version, updated.metadata], "names": names, "more": paginator.has_next,
             "gone": gone, "exists": await AsyncSecret.exists("{name}")}}

print(json.dumps(asyncio.run(main())))
"""


def _name(tag: str) -> str:
    return f"{PREFIX}{RUN}-{tag}-{uuid.uuid4().hex[:6]}"


class Api:
    """Raw HTTP to the E2B front with one key; every answer's text is kept (see ``seen``)."""

    def __init__(self, http: aiohttp.ClientSession, url: str, key: str) -> None:
        self.http, self.url, self.key = http, url, key
        self.seen: list[str] = []

    async def call(
        self, method: str, path: str, body: Any = None, *, raw: bytes | None = None, **params: Any
    ) -> tuple[int, Any, Mapping[str, str]]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"X-API-Key": self.key, "Content-Type": "application/json"}
        async with self.http.request(
            method, self.url + path, data=data, headers=headers, params=params or None
        ) as resp:
            text = await resp.text()
            self.seen.append(text + json.dumps(dict(resp.headers)))
            assert resp.headers.get("Cache-Control") == "no-store", (method, path, resp.status)
            return resp.status, (json.loads(text) if text else None), resp.headers

    async def create(self, name: str, value: str, metadata: dict[str, str] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"name": name, "value": value}
        if metadata is not None:
            body["metadata"] = metadata
        status, out, _ = await self.call("POST", "/secrets", body)
        assert status == 201, out
        return dict(out)

    async def listed(self, **params: Any) -> list[dict[str, Any]]:
        status, out, _ = await self.call("GET", "/secrets", **params)
        assert status == 200, out
        return list(out)

    async def every(self) -> list[dict[str, Any]]:
        """Every secret the key sees, page after page."""
        out: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            status, page, headers = await self.call(
                "GET", "/secrets", **({"nextToken": token} if token else {})
            )
            assert status == 200, page
            out += page
            token = headers.get("X-Next-Token")
            if not token:
                return out

    async def sweep(self, everything: bool = False) -> None:
        """Delete this run's secrets the key sees, and any older than a run (``everything``: all)."""
        for s in await self.every():
            made = datetime.datetime.fromisoformat(s["createdAt"]).timestamp()
            mine = s["name"].startswith(f"{PREFIX}{RUN}-")
            if everything or mine or (s["name"].startswith(PREFIX) and made < time.time() - STALE_S):
                await self.call("DELETE", f"/secrets/{s['secretID']}")


@pytest.fixture(scope="module")
async def child_key(node: EmbeddedNode) -> str:
    try:
        await node.iam.create_project(PROJECT, "secrets", Quota(sandboxes=1))
    except Conflict:
        pass  # the data directory outlives sessions
    return await node.iam.issue_key(CHILD, format="e2b", name="tests/e2b/secrets")


@pytest.fixture
async def apis(e2b_latest: E2B, node: EmbeddedNode, child_key: str) -> AsyncIterator[dict[str, Api]]:
    """``own`` (PROJECT), ``other`` (a sibling project), ``root`` (the admin's, above both) and
    ``child`` (CHILD, below PROJECT, emptied first); this run's secrets are swept afterwards."""
    async with aiohttp.ClientSession() as http:
        apis = {
            "own": Api(http, node.url, e2b_latest.key),
            "other": Api(http, node.url, e2b_latest.other_key),
            "root": Api(http, node.url, node.api_key),
            "child": Api(http, node.url, child_key),
        }
        await apis["child"].sweep(everything=True)
        for who in ("own", "other"):
            await apis[who].sweep()
        try:
            yield apis
        finally:
            for who in ("own", "other"):
                await apis[who].sweep()


def _files(node: EmbeddedNode) -> list[Path]:
    return [p for p in (Path(node.store.root) / "e2b-secrets").rglob("*") if p.is_file()]


# -- the SDK ------------------------------------------------------------------------------------


async def test_the_sync_sdk_creates_reads_updates_lists_and_destroys(
    e2b_latest: E2B, apis: dict[str, Api], node: EmbeddedNode
) -> None:
    name, value = _name("sync"), f"v-{uuid.uuid4().hex}"
    out = await e2b_latest.run(SYNC.format(name=name, value=value))
    sid, got_name, version, metadata, created, updated, has_value = out["made"]
    assert sid.startswith("sec_") and len(sid) == 30 and parse_selector(sid) == ("id", sid)
    assert got_name == name, "names are lower-cased"
    assert (version, metadata, has_value) == (1, {"env": "test"}, False)
    assert created == updated and created.endswith("+00:00")
    assert out["by_id"] == [sid, name] and out["by_name"] == sid
    assert out["versions"] == [2, 3, 4]
    assert out["metadata"] == [{"env": "test"}, {}, {"a": "b"}], "omitted keeps, {} and {..} replace"
    assert out["twice"] is not None and "409" in out["twice"]
    assert out["missing"] == out["missing_update"] == "SecretNotFoundException"
    pages = out["listed"]
    assert all(len(p) <= 1 for p in pages) and [name] in pages, "one page a secret, through X-Next-Token"
    assert out["exists"] == [True, False]
    assert (out["destroyed"], out["again"], out["after"]) == (True, False, False)
    assert not any(value.encode() in p.read_bytes() for p in _files(node))


async def test_the_async_sdk(e2b_latest: E2B, apis: dict[str, Api]) -> None:
    name, value = _name("async"), uuid.uuid4().hex
    out = await e2b_latest.run(ASYNC.format(name=name, value=value))
    assert out["made"][1] == 1 and out["got"] == out["made"][0]
    assert out["updated"] == [2, {"k": "v"}]
    assert name in out["names"] and out["more"] is False
    assert (out["gone"], out["exists"]) == (True, False)


# -- raw HTTP -----------------------------------------------------------------------------------


async def test_a_secret_is_its_projects_and_its_parents_alone(apis: dict[str, Api]) -> None:
    own, other, root, child = apis["own"], apis["other"], apis["root"], apis["child"]
    name = _name("wall")
    made = await own.create(name, "wall-value")
    sid = made["secretID"]
    for selector in (sid, name, sid.upper()):
        for method, body in (("GET", None), ("POST", {"value": "stolen"}), ("DELETE", None)):
            status, out, _ = await other.call(method, f"/secrets/{selector}", body)
            assert (status, out) == (404, {"code": 404, "message": "Secret not found"}), (method, selector)
    assert sid not in {s["secretID"] for s in await other.every()}
    # The key of a project below sees none of its parent's either.
    assert (await child.call("GET", f"/secrets/{sid}"))[0] == 404
    assert sid not in {s["secretID"] for s in await child.every()}
    # Another project may hold the same name: names are unique within a project.
    twin = await other.create(name, "twin-value")
    assert twin["secretID"] != sid
    # A key of a project above sees it, by ID and by name, and may update it.
    assert sid in {s["secretID"] for s in await root.every()}
    status, out, _ = await root.call("GET", f"/secrets/{sid}")
    assert status == 200 and out == made
    status, out, _ = await root.call("POST", f"/secrets/{sid}", {"value": "rotated"})
    assert status == 200 and out["currentVersion"] == 2
    # By name from above, two projects below holding it: ambiguous, the ID settles it.
    status, out, _ = await root.call("GET", f"/secrets/{name}")
    assert status == 400 and out["message"].startswith("Invalid secrets request")
    # A key of the secret's own project reaches its own by name, never the sibling's.
    status, out, _ = await own.call("GET", f"/secrets/{name}")
    assert status == 200 and out["secretID"] == sid and out["currentVersion"] == 2
    assert (await own.call("DELETE", f"/secrets/{twin['secretID']}"))[0] == 404
    assert (await other.call("DELETE", f"/secrets/{name}"))[0] == 204
    assert (await own.call("DELETE", f"/secrets/{name}"))[0] == 204
    assert (await own.call("DELETE", f"/secrets/{sid}"))[0] == 404


async def test_pagination_follows_x_next_token(apis: dict[str, Api]) -> None:
    child = apis["child"]
    made = [(await child.create(_name(f"p{i}"), f"page-{i}"))["secretID"] for i in range(5)]
    seen: list[str] = []
    token: str | None = None
    sizes = []
    while True:
        status, page, headers = await child.call(
            "GET", "/secrets", limit=2, **({"nextToken": token} if token else {})
        )
        assert status == 200
        sizes.append(len(page))
        seen += [s["secretID"] for s in page]
        token = headers.get("X-Next-Token")
        if token is None:
            break
    assert sizes == [2, 2, 1] and seen == made, "oldest first, each once"
    status, page, headers = await child.call("GET", "/secrets", limit=5)
    assert [s["secretID"] for s in page] == made and "X-Next-Token" not in headers
    assert [s["secretID"] for s in await child.listed()] == made, "no limit: 100"
    for limit in ("0", "-1", "101", "abc", "1.5", "99999999999999999999", " 2", "+2"):
        status, out, _ = await child.call("GET", "/secrets", limit=limit)
        assert status == 400 and out["code"] == 400, limit
    for token in ("x", "sec_" + "!" * 26, "a" * 5000):
        assert (await child.call("GET", "/secrets", nextToken=token))[0] == 400


async def test_update_keeps_or_replaces_metadata(apis: dict[str, Api]) -> None:
    own = apis["own"]
    made = await own.create(_name("meta"), "m1", {"a": "1", "b": "2"})
    assert made["metadata"] == {"a": "1", "b": "2"} and made["currentVersion"] == 1
    path = f"/secrets/{made['secretID']}"
    answers = []
    for body in (
        {"value": "m2"},
        {"value": "m3", "metadata": {"c": "3"}},
        {"value": "m4"},
        {"value": "m5", "metadata": {}},
    ):
        status, out, _ = await own.call("POST", path, body)
        assert status == 200, out
        answers.append((out["currentVersion"], out["metadata"]))
        assert out["createdAt"] == made["createdAt"] and out["updatedAt"] >= made["updatedAt"]
        assert set(out) == {"secretID", "name", "currentVersion", "metadata", "createdAt", "updatedAt"}
    assert answers == [(2, {"a": "1", "b": "2"}), (3, {"c": "3"}), (4, {"c": "3"}), (5, {})]
    created = (await own.create(_name("nometa"), "x"))["metadata"]
    assert created == {}, "metadata is always present, empty when unset"


async def test_bad_input_is_a_400_that_quotes_nothing(apis: dict[str, Api], node: EmbeddedNode) -> None:
    own = apis["own"]
    secret_word = "quote-me-not-" + uuid.uuid4().hex
    name = _name("bad")
    ok = {"name": name, "value": secret_word}
    too_much_meta = {f"k{i}": "v" * 1000 for i in range(9)}
    bad_creates: list[Any] = [
        {"name": name},
        {"value": secret_word},
        {"name": name, "value": None},
        {"name": name, "value": 7},
        {"name": 7, "value": secret_word},
        {"name": "has space", "value": secret_word},
        {"name": " " + name, "value": secret_word},
        {"name": "", "value": secret_word},
        {"name": "sec_mine", "value": secret_word},
        {"name": "SEC_mine", "value": secret_word},
        {"name": "a" * 129, "value": secret_word},
        {"name": "ab\u0000c", "value": secret_word},
        {"name": "ключ", "value": secret_word},
        {**ok, "value": secret_word + "\u0000"},
        {**ok, "value": "x" * (MAX_VALUE_BYTES + 1)},
        {**ok, "value": "é" * (MAX_VALUE_BYTES // 2 + 1)},
        {**ok, "metadata": None},
        {**ok, "metadata": ["a"]},
        {**ok, "metadata": {"a": 1}},
        {**ok, "metadata": {"a": None}},
        {**ok, "metadata": {f"k{i}": "v" for i in range(33)}},
        {**ok, "metadata": {"k" * 129: "v"}},
        {**ok, "metadata": {"k": "v" * 1025}},
        {**ok, "metadata": {"k": "v\u0000"}},
        {**ok, "metadata": too_much_meta},
        [ok],
        "text",
        None,
    ]
    for body in bad_creates:
        status, out, _ = await own.call("POST", "/secrets", body)
        assert status == 400 and out["code"] == 400, (body if not isinstance(body, dict) else list(body), out)
        assert out["message"].startswith("Invalid secrets request"), out
    raw_bodies = [
        b"{",
        b"",
        b'{"name": "' + name.encode() + b'", "value": "\\ud800"}',
        b'{"name": "' + name.encode() + b'", "value": "\xff"}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"name": "x", "value": "' + b"y" * (1 << 20) + b'"}',
    ]
    for raw in raw_bodies:
        status, out, _ = await own.call("POST", "/secrets", raw=raw)
        assert status == 400 and out["message"].startswith("Invalid secrets request"), raw[:40]
    # At the bounds: accepted.
    edge = await own.create(
        name.upper()[:100], "v" * MAX_VALUE_BYTES, {f"k{i:02}": "w" * 250 for i in range(32)}
    )
    assert edge["name"] == name.lower()[:100]
    status, out, _ = await own.call("POST", "/secrets", {**ok, "name": name[:100]})
    assert status == 409 and out["message"].startswith("Secret cannot be modified"), "one name a project"
    path = f"/secrets/{edge['secretID']}"
    for body in ({}, {"value": None}, {"value": secret_word, "metadata": {"k": 1}}, {"value": "\u0000"}):
        status, out, _ = await own.call("POST", path, body)
        assert status == 400, body
    for selector in ("sec_nope", "SEC_" + "z" * 26, "sec_8" + "0" * 25, "bad%20name", "a" * 129, "%00"):
        for method in ("GET", "DELETE"):
            status, out, _ = await own.call(method, f"/secrets/{selector}")
            assert status == 400 and out["message"].startswith("Invalid secrets request"), (method, selector)
    status, out, _ = await own.call("GET", "/secrets/sec_" + "0" * 26)
    assert (status, out["message"]) == (404, "Secret not found"), "a well-formed ID nobody has"
    status, out, _ = await own.call("PUT", "/secrets")
    assert status == 405 and out["code"] == 405
    async with own.http.get(node.url + "/secrets") as resp:  # no key
        assert resp.status == 401 and resp.headers["Cache-Control"] == "no-store"
    assert not any(secret_word in text for text in own.seen), "no answer quotes a value"


async def test_a_project_holds_at_most_100_secrets(apis: dict[str, Api]) -> None:
    child = apis["child"]
    for i in range(MAX_SECRETS_PER_PROJECT):
        await child.create(_name(f"n{i}"), "x")
    status, out, _ = await child.call("POST", "/secrets", {"name": _name("one-more"), "value": "x"})
    assert status == 409 and out["message"].startswith("Secret cannot be modified"), out
    assert "100" in out["message"]
    assert len(await child.listed()) == 100
    assert (await apis["own"].create(_name("elsewhere"), "x"))["currentVersion"] == 1, "per project"
    await child.sweep(everything=True)


async def test_values_are_sealed_at_rest_and_outlive_the_apiserver(
    apis: dict[str, Api], node: EmbeddedNode
) -> None:
    own = apis["own"]
    value = "plain-" + uuid.uuid4().hex
    name = _name("rest")
    made = await own.create(name, value, {"note": "n"})
    updated = (await own.call("POST", f"/secrets/{name}", {"value": value + "-2"}))[1]
    files = _files(node)
    assert files and not any(value.encode() in p.read_bytes() for p in files)
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in files)
    folders = [p for p in (Path(node.store.root) / "e2b-secrets").rglob("*") if p.is_dir()]
    assert all(p.stat().st_mode & 0o777 == 0o700 for p in folders)
    assert not any(value in text for text in own.seen)
    # Another apiserver on the same layer store and token secret: a restart, or a cluster's peer.
    links = {node.config.node: node.link}
    options = E2BOptions(token_secret=secret_from_file(node.config.data_dir / "e2b-token-secret"))
    api = ApiServer(links, Placement(Watcher(links)), node.store, node.iam, e2b=options)
    runner, url = await listen(api.app(), "127.0.0.1", 0)
    try:
        again = Api(own.http, url, own.key)
        status, out, _ = await again.call("GET", f"/secrets/{made['secretID']}")
        assert status == 200 and out == updated
        assert await api.e2b.secrets.resolve(PROJECT, [name.upper()]) == {name.upper(): value + "-2"}
    finally:
        await runner.cleanup()
    # Under another token secret the record is there, its value does not open.
    stranger = SecretStore(Path(node.store.root) / "e2b-secrets", b"z" * 32)
    assert (await stranger.get(PROJECT, ("name", name))).version == 2
    with pytest.raises(InvalidRequest, match="cannot be opened"):
        await stranger.resolve(PROJECT, [name])


# -- the store --------------------------------------------------------------------------------


async def test_resolve_gives_one_projects_current_values(tmp_path: Path) -> None:
    store = SecretStore(tmp_path / "e2b-secrets", b"k" * 32)
    await store.create("root/a", "api-key", "one", {})
    await store.create("root/a/b", "below", "child's", {})
    await store.create("root", "above", "parent's", {})
    await store.update("root/a", ("name", "api-key"), "two", None)
    assert await store.resolve("root/a", ["api-key", " API-Key ", "api-key"]) == {
        "api-key": "two",
        " API-Key ": "two",
    }
    assert await store.resolve("root/a", []) == {}
    for missing in (["api-key", "below"], ["above"], ["nope", "below"], ["sec_x"], ["{bad}"]):
        with pytest.raises(InvalidRequest) as caught:
            await store.resolve("root/a", missing)
        first = next(n for n in missing if n != "api-key")
        assert caught.value.message == f"secret {first!r} does not exist in this project"
        assert caught.value.status == 400
    assert await store.resolve("root/a/b", ["below"]) == {"below": "child's"}
    with pytest.raises(InvalidRequest, match="'api-key' does not exist"):
        await store.resolve("root/other", ["api-key"])
    await store.delete("root/a", ("name", "api-key"))
    with pytest.raises(InvalidRequest, match="'api-key' does not exist"):
        await store.resolve("root/a", ["api-key"])
    on_disk = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert b"child's" not in on_disk and b"parent's" not in on_disk
    # A sealed value moved into another record does not open there.
    c = await store.create("root/a", "c", "secret-c", {})
    d = await store.create("root/a", "d", "secret-d", {})
    file = tmp_path / "e2b-secrets" / "root" / "a" / "_secrets.json"
    data = json.loads(file.read_text())
    data["secrets"][d.id]["sealed"] = data["secrets"][c.id]["sealed"]
    file.write_text(json.dumps(data))
    assert await store.resolve("root/a", ["c"]) == {"c": "secret-c"}
    with pytest.raises(InvalidRequest, match="cannot be opened"):
        await store.resolve("root/a", ["d"])
    # No token secret: a key of this process alone.
    with pytest.raises(InvalidRequest, match="cannot be opened"):
        await SecretStore(tmp_path / "e2b-secrets").resolve("root/a", ["c"])
