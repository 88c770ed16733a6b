"""Bytes fetched upstream when many clients install the same package: through the node's
registry proxy (its file cache, one upstream fetch per file however many ask at once) vs
each client fetching from upstream itself.

    .venv/bin/python bench/egress_registry.py [--clients 64] [--rounds 5]

In-process, on loopback: the tests' fake registry (tests/registry/fake_registry.py: a PEP 691
page and ~256 KiB wheels) as upstream, and :class:`dsec.registry.proxy.RegistryProxy` serving
it with every client granted ``pypi`` (the proxy's source-address check answered from a table,
as the edge's links table would). Each client does what pip does for one install: the project
page, then the wheel it picks. Per round a fresh cache (a cold burst, the worst case for the
cache), all clients at once; p50/p99 of one client's install time over all rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import aiohttp

from _stats import pct
from dsec.netpolicy.upstream import Upstream
from dsec.registry.config import CacheConfig, Registry
from dsec.registry.proxy import PEP691, RegistryProxy


def fake_registry() -> ModuleType:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    return importlib.import_module("tests.registry.fake_registry")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def install(session: aiohttp.ClientSession, index: str, project: str) -> float:
    """pip's requests for one install: the page, then the newest wheel; seconds taken."""
    t = time.perf_counter()
    async with session.get(f"{index}/simple/{project}/", headers={"Accept": PEP691}) as r:
        page = json.loads(await r.read())
    wheel = next(f for f in page["files"] if f["filename"].endswith("-2.0-py3-none-any.whl"))
    url = wheel["url"] if "://" in wheel["url"] else f"{index}/simple/{project}/{wheel['url']}"
    async with session.get(url) as r:
        assert r.status == 200, r.status
        await r.read()
    return time.perf_counter() - t


async def burst(index: str, project: str, clients: int) -> list[float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return list(await asyncio.gather(*(install(session, index, project) for _ in range(clients))))


async def main(clients: int, rounds: int) -> None:
    fr = fake_registry()
    direct_s, proxied_s = [], []
    direct_bytes, proxied_bytes, file_fetches = [], [], []
    for _ in range(rounds):
        async with fr.FakeRegistry() as up:
            sent = up.bytes_sent
            direct_s += await burst(up.url, fr.PROJECT, clients)
            direct_bytes.append(up.bytes_sent - sent)
            registry = Registry(kind="pypi", index=f"{up.url}/simple/", port=free_port())
            with tempfile.TemporaryDirectory() as cache:
                proxy = RegistryProxy(
                    {"pypi": registry},
                    CacheConfig(),
                    Path(cache),
                    "127.0.0.1",
                    Upstream([]),
                    lambda _address: {"pypi": True},
                )
                await proxy.start()
                try:
                    sent = up.bytes_sent
                    proxied_s += await burst(f"http://127.0.0.1:{registry.port}", fr.PROJECT, clients)
                    proxied_bytes.append(up.bytes_sent - sent)
                    file_fetches.append(proxy.stats()["file_fetches"])
                finally:
                    await proxy.close()
    wheel = len(fr.wheel("2.0"))
    print(f"cores: {os.cpu_count()}  clients: {clients}  rounds: {rounds}  wheel: {wheel} bytes")
    print(
        f"upstream bytes per burst: direct {sum(direct_bytes) / rounds:,.0f}"
        f" ({sum(direct_bytes) / rounds / wheel:.1f} wheel copies, pages included);"
        f" through the proxy {sum(proxied_bytes) / rounds:,.0f}"
        f" ({sum(proxied_bytes) / rounds / wheel:.2f} copies;"
        f" wheel fetches per burst: {sorted(set(file_fetches))})"
    )
    for name, xs in (("direct", direct_s), ("through the proxy (cold cache)", proxied_s)):
        print(f"one install, {name}: p50 {pct(xs, 50) * 1e3:.1f} ms  p99 {pct(xs, 99) * 1e3:.1f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64, choices=range(1, 1025), metavar="1-1024")
    ap.add_argument("--rounds", type=int, default=5, choices=range(1, 101), metavar="1-100")
    args = ap.parse_args()
    asyncio.run(main(args.clients, args.rounds))
