"""The registry proxy in-process, against the fake registry on loopback: what a cutoff hides
(PEP 691 pages, PEP 503 pages, PyPI's JSON API, npm packuments), file links that lead back
through the proxy, one upstream fetch for many concurrent askers, and nothing for an address
holding no grant."""

from __future__ import annotations

import asyncio
import datetime
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from pydantic import ValidationError

from dsec.netpolicy.config import EgressConfig, Rule
from dsec.netpolicy.upstream import Upstream
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import GrantOptions, NetworkRules, NetworkRulesRequest
from dsec.registry import cutoff
from dsec.registry.config import CacheConfig, Registry
from dsec.registry.proxy import PEP691, RegistryProxy
from tests.registry.fake_registry import PROJECT, FakeRegistry, wheel_name

JUNE = datetime.date(2025, 6, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class World:
    def __init__(self, up: FakeRegistry, proxy: RegistryProxy, rules: dict[str, NetworkRules]) -> None:
        self.up, self.proxy, self.rules = up, proxy, rules
        self.pypi = f"http://127.0.0.1:{proxy.registries['pypi'].port}"
        self.npm = f"http://127.0.0.1:{proxy.registries['npm'].port}"
        self.apt = f"http://127.0.0.1:{proxy.registries['debian'].port}"

    def grant(self, rules: NetworkRules | None) -> None:
        if rules is None:
            self.rules.pop("127.0.0.1", None)
        else:
            self.rules["127.0.0.1"] = rules


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with FakeRegistry() as up:
        registries = {
            "pypi": Registry(kind="pypi", index=f"{up.url}/simple/", port=_free_port()),
            "npm": Registry(kind="npm", index=f"{up.url}/npm/", port=_free_port()),
            "debian": Registry(kind="debian", index=f"{up.url}/", port=_free_port()),
        }
        rules: dict[str, NetworkRules] = {}
        proxy = RegistryProxy(
            registries, CacheConfig(), tmp_path / "cache", "127.0.0.1", Upstream([]), rules.get
        )
        await proxy.start()
        try:
            yield World(up, proxy, rules)
        finally:
            await proxy.close()


async def _get(url: str, accept: str = "") -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.get(url, headers={"Accept": accept} if accept else {}) as r:
        return r.status, await r.read()


def test_the_cutoff_rules_on_documents() -> None:
    at = cutoff.instant(JUNE)
    page = {"files": [
        {"filename": "p-1.0.tar.gz", "upload-time": "2025-05-31T23:59:59Z"},
        {"filename": "p-2.0-py3-none-any.whl", "upload-time": "2025-06-01T00:00:00Z"},
        {"filename": "p-0.9.tar.gz"},  # no upload time: hidden under a cutoff
    ], "versions": ["0.9", "1.0", "2.0"]}  # fmt: skip
    kept = cutoff.pypi_simple(page, at)
    assert [f["filename"] for f in kept["files"]] == ["p-1.0.tar.gz"] and kept["versions"] == ["1.0"]
    assert len(cutoff.pypi_simple(page, None)["files"]) == 3
    packument = {
        "dist-tags": {"latest": "2.0.0", "beta": "2.1.0-beta.1", "old": "1.0.0"},
        "versions": {v: {} for v in ("1.0.0", "1.2.0", "1.10.0", "1.11.0-rc.1", "2.0.0", "2.1.0-beta.1")},
        "time": {
            "created": "2020-01-01T00:00:00Z",
            "modified": "2025-09-01T00:00:00Z",
            "1.0.0": "2021-01-01T00:00:00Z",
            "1.2.0": "2022-01-01T00:00:00Z",
            "1.10.0": "2023-01-01T00:00:00Z",
            "1.11.0-rc.1": "2024-01-01T00:00:00Z",
            "2.0.0": "2025-07-01T00:00:00Z",
            "2.1.0-beta.1": "2025-08-01T00:00:00Z",
        },
    }
    out = cutoff.npm_packument(packument, at)
    assert sorted(out["versions"]) == ["1.0.0", "1.10.0", "1.11.0-rc.1", "1.2.0"]
    # latest moves to the newest stable version left (1.10 > 1.2: numeric, not text order).
    assert out["dist-tags"] == {"old": "1.0.0", "latest": "1.10.0"}
    assert "2.0.0" not in out["time"] and "modified" not in out["time"]
    api = {"info": {"version": "2.0"}, "releases": {"1.0": [{"upload_time_iso_8601": "2025-01-01T00:00:00Z"}],
           "2.0": [{"upload_time_iso_8601": "2025-07-01T00:00:00Z"}]}, "urls": []}  # fmt: skip
    filtered = cutoff.pypi_json(api, at)
    assert list(filtered["releases"]) == ["1.0"] and filtered["info"]["version"] == "1.0"


async def test_a_cutoff_hides_newer_releases_and_their_files(world: World) -> None:
    world.grant({"pypi": True})
    status, body = await _get(f"{world.pypi}/simple/{PROJECT}/", PEP691)
    assert status == 200
    links = {f["filename"]: f["url"] for f in json.loads(body)["files"]}
    assert set(links) == {wheel_name("1.0"), wheel_name("2.0"), "dsec_demo-0.9-py3-none-any.whl"}
    assert all(u.startswith(f"{world.pypi}/-/dsec-files/") for u in links.values())
    newer = links[wheel_name("2.0")]
    status, data = await _get(newer)
    assert status == 200 and data == world.up.wheels[wheel_name("2.0")]

    world.grant({"pypi": GrantOptions(before=JUNE)})
    status, body = await _get(f"{world.pypi}/simple/{PROJECT}/", PEP691)
    assert [f["filename"] for f in json.loads(body)["files"]] == [wheel_name("1.0")]
    status, page = await _get(f"{world.pypi}/simple/{PROJECT}/", "text/html")  # PEP 503, as old pips ask
    assert status == 200 and wheel_name("1.0").encode() in page and wheel_name("2.0").encode() not in page
    assert b"#sha256=" in page
    # The newer file's link, known from before, leads nowhere now.
    assert (await _get(newer))[0] == 404
    status, body = await _get(f"{world.pypi}/pypi/{PROJECT}/json")
    assert status == 200 and list(json.loads(body)["releases"]) == ["1.0"]


async def test_npm_packuments_are_filtered_and_tarballs_come_through_the_proxy(world: World) -> None:
    world.grant({"npm": GrantOptions(before=JUNE)})
    status, body = await _get(f"{world.npm}/{PROJECT}")
    doc = json.loads(body)
    assert status == 200 and list(doc["versions"]) == ["1.0.0"]
    assert doc["dist-tags"] == {"latest": "1.0.0"}
    tarball = doc["versions"]["1.0.0"]["dist"]["tarball"]
    assert tarball.startswith(f"{world.npm}/-/dsec-files/")
    status, data = await _get(tarball)
    assert status == 200 and data == world.up.tarballs[f"{PROJECT}-1.0.0.tgz"]
    # The registry-path form of a newer tarball is refused under a cutoff.
    assert (await _get(f"{world.npm}/{PROJECT}/-/{PROJECT}-2.0.0.tgz"))[0] == 404


async def test_many_concurrent_askers_fetch_a_file_upstream_once(world: World) -> None:
    world.grant({"pypi": True})
    _, body = await _get(f"{world.pypi}/simple/{PROJECT}/", PEP691)
    link = next(f["url"] for f in json.loads(body)["files"] if f["filename"] == wheel_name("1.0"))
    results = await asyncio.gather(*(_get(link) for _ in range(64)))
    assert {status for status, _ in results} == {200}
    assert all(data == world.up.wheels[wheel_name("1.0")] for _, data in results)
    assert world.up.hits[f"/files/{world.up.salt}/{wheel_name('1.0')}"] == 1
    assert world.proxy.stats()["file_fetches"] == 1


async def test_an_address_without_the_grant_gets_nothing(world: World) -> None:
    world.grant(None)
    assert (await _get(f"{world.pypi}/simple/{PROJECT}/", PEP691))[0] == 403
    world.grant({"npm": True, "pypi": False})
    assert (await _get(f"{world.pypi}/simple/{PROJECT}/", PEP691))[0] == 403
    assert (await _get(f"{world.npm}/{PROJECT}"))[0] == 200
    # A file link naming another host is not fetched (the proxy opens only its registry).
    world.grant({"pypi": True})
    evil = f"{world.pypi}/-/dsec-files/aHR0cDovLzEyNy4wLjAuMTo5L3g/x"  # http://127.0.0.1:9/x
    assert (await _get(evil))[0] == 403
    assert set(world.up.hits) == {f"/npm/{PROJECT}"}


def test_bad_cutoffs_are_refused_with_a_clear_error() -> None:
    with pytest.raises(ValidationError, match="date"):
        NetworkRulesRequest.model_validate({"network_rules": {"pypi": {"before": "2025-13-01"}}})
    with pytest.raises(ValidationError, match="between 1990"):
        NetworkRulesRequest.model_validate({"network_rules": {"pypi": {"before": "1000-01-01"}}})
    with pytest.raises(ValidationError):
        NetworkRulesRequest.model_validate({"network_rules": {"pypi": {"after": "2025-01-01"}}})
    cfg = EgressConfig(catalogue=True, permissions={"corp": [Rule(domains=["corp.example"])]})
    cfg.check({"pypi": GrantOptions(before=JUNE), "npm": GrantOptions(before=JUNE)})
    for name in ("debian", "corp"):
        with pytest.raises(InvalidRequest, match=f"{name!r} takes no 'before' cutoff"):
            cfg.check({name: GrantOptions(before=JUNE)})


async def test_apt_s_proxy_serves_the_archive_hosts_only_and_caches(world: World) -> None:
    """apt asks with absolute URLs (``Acquire::http::Proxy``), as aiohttp's ``proxy=`` does."""
    world.grant({"debian": True})
    url = f"{world.up.url}/files/{world.up.salt}/{wheel_name('1.0')}"
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.get(url, proxy=world.apt) as r:
                assert r.status == 200 and await r.read() == world.up.wheels[wheel_name("1.0")]
        async with s.get("http://127.0.0.2:9/pool/x.deb", proxy=world.apt) as r:
            assert r.status == 403
    assert world.up.hits[f"/files/{world.up.salt}/{wheel_name('1.0')}"] == 1
