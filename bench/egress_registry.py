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

    .venv/bin/python bench/egress_registry.py --sandboxes 64 [--layers /var/lib/dsec-test/layers]

With real sandboxes instead of loopback clients: a scratch node (bench/_node.py) whose egress
names the fake registry (in this process, on loopback) as the ``pypi`` registry's upstream;
N sandboxes granted ``pypi`` (so the edge writes /etc/pip.conf pointing at its proxy) run real
`pip install` of the same wheel at the same moment, into an empty target, cold cache. Prints
the bytes the upstream sent (target: one wheel copy) and the install time inside the sandbox
(pip's whole run, its start-up included) p50/p99.
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

from _node import scratch_node
from _stats import pct
from dsec import DSecClient, DSecContainerRunArgs
from dsec.density.swap import SwapConfig
from dsec.netpolicy.config import EgressConfig
from dsec.netpolicy.upstream import Upstream
from dsec.registry.config import CacheConfig, Registry
from dsec.registry.proxy import PEP691, RegistryProxy
from dsec.sdk.client import Sandbox


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


PIP_WHEELS = sorted(Path("/usr/share/python-wheels").glob("pip-*.whl"))  # Debian's python3-pip-whl
# pip as /etc/pip.conf says (the node's proxy); prints its exit code and its run's milliseconds.
INSTALL = (
    "s=$(date +%s%N); $PIP install -q --no-cache-dir --disable-pip-version-check"
    " --break-system-packages --target /tmp/site {project} >/tmp/pip.log 2>&1; rc=$?;"
    " e=$(date +%s%N); echo $rc $(((e - s) / 1000000))"
)


async def with_sandboxes(n: int, layers: Path, pool: str) -> None:
    fr = fake_registry()
    wheel_size = len(fr.wheel("2.0"))
    async with fr.FakeRegistry() as up:
        egress = EgressConfig.model_validate(
            {
                "pool": pool,
                # The permission itself names a documentation address: only the proxy serves.
                "permissions": {"pypi": [{"address": "192.0.2.10", "ports": [3141], "names": ["pypi.test"]}]},
                "registries": {"pypi": {"kind": "pypi", "index": f"{up.url}/simple/", "port": 13141}},
            }
        )
        print(f"cores: {os.cpu_count()}  sandboxes: {n}  wheel: {wheel_size} bytes")
        async with scratch_node(
            "egress-registry", layers, lambda scratch: {"swap": SwapConfig("none"), "egress": egress}
        ) as node:
            async with DSecClient(node.url, node.api_key) as client:
                gate = asyncio.Semaphore(8)  # creates in flight (the node's own pace, not the bench's)

                async def make() -> Sandbox:
                    args = DSecContainerRunArgs(
                        container_image="debian:bookworm", memory_limit_mb=512, network_rules={"pypi": True}
                    )
                    async with gate:
                        return await client.run_container(args)

                t = time.perf_counter()
                sbs = list(await asyncio.gather(*(make() for _ in range(n))))
                print(f"{n} sandboxes created in {time.perf_counter() - t:.1f} s")
                has_pip = (await sbs[0].run_shell("python3 -m pip --version")).exit_code == 0
                pip = "python3 -m pip"
                if not has_pip:  # an older base: Debian's pip wheel, run from the wheel
                    wheel = PIP_WHEELS[-1].read_bytes()
                    await asyncio.gather(*(sb.write_file("/tmp/pip.whl", wheel) for sb in sbs))
                    pip = "python3 /tmp/pip.whl/pip"
                print(f"pip: {'the base' if has_pip else PIP_WHEELS[-1].name}")
                sent, hits = up.bytes_sent, dict(up.hits)
                command = f"PIP='{pip}'; " + INSTALL.format(project=fr.PROJECT)
                t = time.perf_counter()
                results = await asyncio.gather(*(sb.run_shell(command, timeout=1800) for sb in sbs))
                wall = time.perf_counter() - t
                runs = [tuple(int(x) for x in r.stdout.split()) for r in results]
                failed = [i for i, (code, _) in enumerate(runs) if code != 0]
                if failed:
                    log = await sbs[failed[0]].run_shell("tail -5 /tmp/pip.log")
                    print(f"FAILED installs: {len(failed)}; the first: {log.stdout}")
                got = await sbs[-1].run_shell(
                    "PYTHONPATH=/tmp/site python3 -c 'import dsec_demo as d; print(d.VERSION)'"
                )
                fetched = up.bytes_sent - sent

                def fetches(path: str) -> int:
                    return up.hits[path] - hits.get(path, 0)

                copies = fetches(f"/files/{up.salt}/{fr.wheel_name('2.0')}")
                pages = fetches(f"/simple/{fr.PROJECT}/")
                print(
                    f"installed: {n - len(failed)}/{n} (version {got.stdout.strip()}),"
                    f" burst wall {wall:.1f} s"
                )
                print(
                    f"upstream bytes for the burst: {fetched:,} ({fetched / wheel_size:.2f} wheel sizes,"
                    f" pages included); the wheel fetched upstream {copies} time(s), the page {pages} time(s)"
                )
                secs = [ms / 1e3 for _, ms in runs]
                print(
                    f"one pip install inside a sandbox: p50 {pct(secs, 50):.2f} s  p99 {pct(secs, 99):.2f} s"
                )
                await asyncio.gather(*(sb.stop() for sb in sbs))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64, choices=range(1, 1025), metavar="1-1024")
    ap.add_argument("--rounds", type=int, default=5, choices=range(1, 101), metavar="1-100")
    ap.add_argument("--sandboxes", type=int, choices=range(1, 1025), metavar="1-1024", help="real sandboxes")
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"), help="with --sandboxes")
    ap.add_argument("--pool", default="10.235.0.0/16", help="with --sandboxes: link addresses (one per run)")
    args = ap.parse_args()
    if args.sandboxes:
        asyncio.run(with_sandboxes(args.sandboxes, args.layers, args.pool))
    else:
        asyncio.run(main(args.clients, args.rounds))
