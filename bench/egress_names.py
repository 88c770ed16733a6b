"""What permissions that name domains cost: answers, the name check, and a full learned set.

    .venv/bin/python bench/egress_names.py [--n 200] [--links 1000] [--pool 10.234.0.0/16]

An embedded node on a scratch data directory (sharing `dsec up`'s layer store) and the tests'
mirror: a network namespace with an upstream name server and an HTTPS server on one address.
One sandbox holds two permissions on that server: ``fixed`` (its address, no upstream, no name
check: the baseline) and ``named`` (``*.dns.test``, resolved upstream, connections through the
edge's HAProxy). Measured inside the sandbox in the same run, each p50/p99 over --n:
  - a name answered: the fixed name (answered from configuration) vs the domain name (from the
    edge's cache after the first upstream question);
  - a TLS connect and handshake: directly (fixed) vs through the name check (named);
  - admitting one more address (one nftables update) and the named connect again, with the
    learned set holding the elements of 10 links vs --links links (4 addresses each).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from _node import scratch_node
from _stats import pct
from dsec import DSecClient, DSecContainerRunArgs
from dsec.density.swap import SwapConfig
from dsec.netpolicy import nft
from dsec.netpolicy.config import EgressConfig


def the_tests_mirror() -> ModuleType:
    """The tests' mirror (a namespace with an upstream name server and an HTTPS server): the
    bench needs the same world, and runs from the checkout that has it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    return importlib.import_module("tests.netpolicy.mirror")


INSIDE = r"""
import json, socket, ssl, sys, time
n, fixed, named = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
def resolve(name):
    t = time.perf_counter(); socket.getaddrinfo(name, 443, socket.AF_INET); return time.perf_counter() - t
def handshake(name):
    t = time.perf_counter()
    s = ctx.wrap_socket(socket.create_connection((name, 443), timeout=10), server_hostname=name)
    d = time.perf_counter() - t
    s.close()
    return d
out = {}
for what, f in (("resolve", resolve), ("tls", handshake)):
    f(fixed); f(named)  # warm: the first upstream question, the first connection
    out[what] = {"fixed": [f(fixed) for _ in range(n)], "named": [f(named) for _ in range(n)]}
print(json.dumps(out))
"""


def row(name: str, xs: list[float], base: list[float] | None = None) -> str:
    p50, p99 = pct(xs, 50) * 1e3, pct(xs, 99) * 1e3
    extra = ""
    if base is not None:
        b50 = pct(base, 50) * 1e3
        extra = f"  {p50 / b50:.2f}x the baseline, {p50 - b50:+.2f} ms at p50"
    return f"  {name:<52} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms{extra}"


async def inside(sb: Any, n: int, name: str) -> dict[str, dict[str, list[float]]]:
    await sb.write_file("/tmp/bench.py", INSIDE.encode())
    r = await sb.run_shell(f"python3 /tmp/bench.py {n} fixed.test {name}", timeout=600)
    assert r.exit_code == 0, r.stderr
    out: dict[str, dict[str, list[float]]] = json.loads(r.stdout)
    return out


async def admit_once(table: str, tag: str) -> float:
    t = time.perf_counter()
    await nft.apply(nft.learn(table, [((f"dsvq{tag}", "198.51.100.200", "tcp", 443), 600)]))
    return time.perf_counter() - t


async def fill(table: str, links: range) -> None:
    for start in range(links.start, links.stop, 250):  # one transaction per 1,000 elements
        batch = [
            ((f"dsvf{i:06d}", f"198.18.{i % 250}.{k}", "tcp", 443), 900)
            for i in range(start, min(start + 250, links.stop))
            for k in range(4)
        ]
        await nft.apply(nft.learn(table, batch))


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--links", type=int, default=1000)
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    ap.add_argument("--pool", default="10.234.0.0/16", help="sandbox link addresses (one per bench run)")
    a = ap.parse_args()
    mirror = the_tests_mirror()
    egress = EgressConfig.model_validate(
        {
            "pool": a.pool,
            "upstream": [mirror.ADDRESS],
            "permissions": {
                "fixed": [{"address": mirror.ADDRESS, "ports": [443], "names": ["fixed.test"]}],
                "named": [
                    {"domains": ["*.dns.test"], "resolves_to": [f"{mirror.ADDRESS}/32"], "ports": [443]}
                ],
            },
        }
    )
    print(f"cores {os.cpu_count()}  n {a.n}  links {a.links}")
    with tempfile.TemporaryDirectory() as tmp, mirror.mirror(Path(tmp)):
        async with scratch_node(
            "egress-names", a.layers, lambda scratch: {"swap": SwapConfig("none"), "egress": egress}
        ) as node:
            table = node.edge.egress.table
            async with DSecClient(node.url, node.api_key) as client:
                sb = await client.run_container(
                    DSecContainerRunArgs(
                        container_image="debian:bookworm", network_rules={"fixed": True, "named": True}
                    )
                )
                first = await inside(sb, a.n, mirror.DNS_NAME)
                await fill(table, range(10))
                small = [await admit_once(table, f"s{i}") for i in range(a.n // 4)]
                await fill(table, range(10, a.links))
                large = [await admit_once(table, f"l{i}") for i in range(a.n // 4)]
                full = await inside(sb, a.n, mirror.DNS_NAME)
                await sb.stop()
    print(row("name answered: fixed, from configuration (baseline)", first["resolve"]["fixed"]))
    print(
        row(
            "name answered: domain, from the edge's cache",
            first["resolve"]["named"],
            first["resolve"]["fixed"],
        )
    )
    print(row("TLS connect + handshake: direct (baseline)", first["tls"]["fixed"]))
    print(
        row("TLS connect + handshake: through the name check", first["tls"]["named"], first["tls"]["fixed"])
    )
    print(row("admit one address, learned set of 10 links (baseline)", small))
    print(row(f"admit one address, learned set of {a.links} links", large, small))
    print(
        row(
            f"TLS through the name check, {a.links} links learned",
            full["tls"]["named"],
            first["tls"]["named"],
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
