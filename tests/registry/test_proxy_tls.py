"""The registry proxy against an upstream served over HTTPS (a certificate authority of the
test's own, which the proxy is told to trust through ``registry_cache.ca_file``): it serves
pages and files fetched over TLS, and refuses an upstream whose certificate it does not trust
or that names another host, with a 502 that says so (never a 500, never the data)."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from pydantic import ValidationError

from dsec.netpolicy.upstream import Upstream
from dsec.protocol.models import NetworkRules
from dsec.registry.config import CacheConfig, Registry
from dsec.registry.proxy import PEP691, RegistryProxy
from tests.registry.fake_registry import PROJECT, FakeRegistry, wheel_name
from tests.registry.tls import Authority, server_context

Proxied = Callable[[list[str], CacheConfig], AbstractAsyncContextManager[tuple[FakeRegistry, str]]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def authority(tmp_path: Path) -> Authority:
    return Authority.make(tmp_path / "ca")


@pytest.fixture
def proxied(tmp_path: Path, authority: Authority) -> Proxied:
    """An HTTPS fake registry on loopback whose certificate names ``names``, and the proxy's
    PyPI port in front of it (granted to loopback): yields (upstream, proxy URL)."""

    @asynccontextmanager
    async def make(names: list[str], cache: CacheConfig) -> AsyncIterator[tuple[FakeRegistry, str]]:
        cert, key = authority.issue(tmp_path / "server", *names)
        async with FakeRegistry(tls=server_context(cert, key)) as up:
            pypi = Registry(kind="pypi", index=f"{up.url}/simple/", port=_free_port())
            rules: dict[str, NetworkRules] = {"127.0.0.1": {"pypi": True}}
            proxy = RegistryProxy(
                {"pypi": pypi}, cache, tmp_path / "cache", "127.0.0.1", Upstream([]), rules.get
            )
            await proxy.start()
            try:
                yield up, f"http://127.0.0.1:{pypi.port}"
            finally:
                await proxy.close()

    return make


async def _get(url: str, accept: str = "") -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.get(url, headers={"Accept": accept} if accept else {}) as r:
        return r.status, await r.read()


async def test_pages_and_files_come_over_verified_tls(proxied: Proxied, authority: Authority) -> None:
    async with proxied(["127.0.0.1"], CacheConfig(ca_file=authority.cert)) as (up, pypi):
        assert up.url.startswith("https://")
        status, body = await _get(f"{pypi}/simple/{PROJECT}/", PEP691)
        assert status == 200, body
        link = next(f["url"] for f in json.loads(body)["files"] if f["filename"] == wheel_name("1.0"))
        status, data = await _get(link)
        assert status == 200 and data == up.wheels[wheel_name("1.0")]
        assert up.hits[f"/files/{up.salt}/{wheel_name('1.0')}"] == 1


async def test_an_upstream_certificate_from_an_authority_not_trusted_is_refused(proxied: Proxied) -> None:
    async with proxied(["127.0.0.1"], CacheConfig()) as (up, pypi):  # the system's authorities only
        status, body = await _get(f"{pypi}/simple/{PROJECT}/", PEP691)
        assert status == 502
        assert b"TLS certificate the proxy does not trust" in body, body
        assert up.hits[f"/simple/{PROJECT}/"] == 0  # no request went over that connection


async def test_an_upstream_certificate_for_another_host_is_refused(
    proxied: Proxied, authority: Authority
) -> None:
    async with proxied(["other.test"], CacheConfig(ca_file=authority.cert)) as (up, pypi):
        status, body = await _get(f"{pypi}/simple/{PROJECT}/", PEP691)
        assert status == 502
        assert b"TLS certificate the proxy does not trust" in body and b"mismatch" in body, body
        assert up.hits[f"/simple/{PROJECT}/"] == 0


def test_a_ca_file_that_holds_no_certificates_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(ValidationError, match="no PEM certificates"):
        CacheConfig(ca_file=bad)
    with pytest.raises(ValidationError, match="no PEM certificates"):
        CacheConfig(ca_file=tmp_path / "missing.pem")
