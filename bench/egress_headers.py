"""What egress headers cost: a request whose TLS the edge terminates to add headers, against the
same request spliced end to end through the name check.

    .venv/bin/python bench/egress_headers.py [--n 200] [--pool 10.235.0.0/16]

An embedded node on a scratch data directory (sharing `dsec up`'s layer store) and the tests'
mirror (an upstream name server and an HTTPS server that echoes headers, in a network namespace).
Two sandboxes hold the same permission naming the mirror's domain: one plain (the baseline: its
TLS spliced by HAProxy, verified against the mirror's own certificate), one with an egress header
filled from a secret (its TLS ended by HAProxy with a certificate of the node's CA, the header
set by Lua, TLS again to the mirror). Measured inside each in the same run, p50/p99 over --n:
  - an HTTPS GET on a new connection each time (connect, handshake, request, answer);
  - a plain HTTP GET on a new connection (the Lua action alone: no TLS to end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from _node import scratch_node
from dsec import DSecClient, DSecContainerRunArgs
from dsec.density.swap import SwapConfig
from dsec.netpolicy.config import EgressConfig
from egress_names import row, the_tests_mirror

INSIDE = r"""
import http.client, json, socket, ssl, sys, time
n, host, cafile = int(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None
ctx = ssl.create_default_context(cafile=cafile)
socket.getaddrinfo(host, 443, socket.AF_INET)  # the name's address learned for this sandbox
def get(conn):
    t = time.perf_counter()
    conn.request("GET", "/headers")
    r = conn.getresponse()
    body = r.read()
    conn.close()
    assert r.status == 200, r.status
    return time.perf_counter() - t, body
def https():
    return get(http.client.HTTPSConnection(host, 443, context=ctx, timeout=10))
def plain():
    return get(http.client.HTTPConnection(host, 80, timeout=10))
out = {"sent": json.loads(https()[1])}
plain()  # warm: the first connection of each kind
out["https"] = [https()[0] for _ in range(n)]
out["http"] = [plain()[0] for _ in range(n)]
print(json.dumps(out))
"""


async def inside(sb: Any, n: int, host: str, cafile: str | None) -> dict[str, Any]:
    await sb.write_file("/tmp/bench.py", INSIDE.encode())
    args = f"{n} {host}" + (f" {cafile}" if cafile else "")
    r = await sb.run_shell(f"python3 /tmp/bench.py {args}", timeout=600)
    assert r.exit_code == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    ap.add_argument("--pool", default="10.235.0.0/16", help="sandbox link addresses (one per bench run)")
    a = ap.parse_args()
    mirror = the_tests_mirror()
    cert, _ = mirror.tls_files()
    egress = EgressConfig.model_validate(
        {
            "pool": a.pool,
            "upstream": [mirror.ADDRESS],
            "upstream_ca": str(cert),
            "permissions": {
                "named": [
                    {"domains": ["*.dns.test"], "resolves_to": [f"{mirror.ADDRESS}/32"], "ports": [443, 80]}
                ],
            },
        }
    )
    print(f"cores {os.cpu_count()}  n {a.n}")
    # A secret (HTTPS only) and a plain header (plain HTTP gets it too: the Lua action's cost).
    headers = {mirror.DNS_NAME: {"Authorization": "Bearer ${secrets.key}", "X-Team": "rl"}}
    with tempfile.TemporaryDirectory() as tmp, mirror.mirror(Path(tmp)):
        async with scratch_node(
            "egress-headers", a.layers, lambda scratch: {"swap": SwapConfig("none"), "egress": egress}
        ) as node:
            async with DSecClient(node.url, node.api_key) as client:
                args = DSecContainerRunArgs(container_image="debian:bookworm", network_rules={"named": True})
                plain = await client.run_container(args)
                added = await client.run_container(
                    args.model_copy(update={"egress_headers": headers, "egress_secrets": {"key": "s3cret"}})
                )
                await plain.write_file("/tmp/mirror.pem", cert.read_bytes())
                base = await inside(plain, a.n, mirror.DNS_NAME, "/tmp/mirror.pem")
                with_headers = await inside(added, a.n, mirror.DNS_NAME, None)
                await plain.stop()
                await added.stop()
    sent = {k.lower(): v for k, v in with_headers["sent"]}
    assert sent.get("authorization") == "Bearer s3cret", sent  # what was measured added the headers
    print(row("HTTPS GET, spliced end to end (baseline)", base["https"]))
    print(row("HTTPS GET, TLS ended, header added, TLS again", with_headers["https"], base["https"]))
    print(row("HTTP GET through the name check (baseline)", base["http"]))
    print(row("HTTP GET through the name check, header added", with_headers["http"], base["http"]))


if __name__ == "__main__":
    asyncio.run(main())
