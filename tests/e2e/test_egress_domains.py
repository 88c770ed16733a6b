"""Permissions that name domains, on the real kernel: the edge's name server resolves an
allowed name through the upstream resolver (the mirror's, in its own network namespace), and
only what the answer said opens, for that sandbox only, for the answer's TTL; other names do
not exist, answers pointing inside are dropped, nothing but addresses comes back."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest

from dsec import BuildFailed, DSecClient
from dsec.node.embedded import EmbeddedNode
from dsec.sdk.client import Sandbox
from tests.conftest import BASE, Sandboxes
from tests.e2e.test_egress import probe, the_mirror  # noqa: F401 (a fixture)
from tests.netpolicy import mirror
from tests.unit.test_metrics_prometheus import parse, scrape, value

WEB = [mirror.ADDRESS, mirror.PORT]
URL = f"http://{mirror.DNS_NAME}:{mirror.PORT}/hello.txt"

# Raw DNS inside the sandbox: (qname, qtype, "udp"|"tcp") -> [rcode, answer count].
RAW = r"""
import json, socket, struct, sys
out = []
for name, qtype, proto in json.loads(sys.argv[1]):
    q = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    q += struct.pack("!HH", qtype, 1)
    ns = open("/etc/resolv.conf").read().split("nameserver")[1].split()[0]
    if proto == "udp":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5)
        s.sendto(q, (ns, 53)); r = s.recv(4096)
    else:
        s = socket.create_connection((ns, 53), timeout=5); s.sendall(struct.pack("!H", len(q)) + q)
        n = struct.unpack("!H", s.recv(2))[0]; r = b""
        while len(r) < n: r += s.recv(n - len(r))
    out.append([r[3] & 0xF, struct.unpack_from("!H", r, 6)[0]])
print(json.dumps(out))
"""


async def raw_dns(sb: Sandbox, *queries: tuple[str, int, str]) -> list[list[int]]:
    await sb.write_file("/tmp/raw_dns.py", RAW.encode())
    res = await sb.run_shell(f"python3 /tmp/raw_dns.py '{json.dumps(queries)}'", timeout=60)
    assert res.exit_code == 0, res.stderr
    out: list[list[int]] = json.loads(res.stdout)
    return out


async def test_an_allowed_name_opens_what_upstream_answered_and_nothing_else(
    the_mirror: None,  # noqa: F811
    make_sandbox: Sandboxes,
) -> None:
    sb = await make_sandbox(network_rules={"mirror-dns": True})
    neighbour = await make_sandbox(network_rules={"mirror-dns": False, "other": True})
    # Before any answer the address is closed: a literal connect gets nothing.
    assert (await probe(sb, connect=[WEB]))["open"] == []
    out = await probe(
        sb,
        resolve=[mirror.DNS_NAME, mirror.DNS_ALIAS, mirror.DNS_REBIND, mirror.DNS_OUTSIDE, "pypi.org"],
        fetch=URL,
    )
    assert out["fetched"] == mirror.BODY
    assert out["names"] == {
        mirror.DNS_NAME: [mirror.ADDRESS],
        mirror.DNS_ALIAS: [mirror.ADDRESS],  # through its CNAME
        mirror.DNS_REBIND: None,  # 127.0.0.1: dropped
        mirror.DNS_OUTSIDE: None,  # upstream knows it, the permission does not
        "pypi.org": None,
    }
    # The answer opened the rule's port on that address, for this sandbox only.
    after = await probe(sb, connect=[WEB, [mirror.ADDRESS, mirror.OTHER_PORT]])
    assert after["open"] == [WEB]
    assert (await probe(neighbour, connect=[WEB]))["open"] == []


async def test_only_addresses_come_back_over_udp_and_tcp(
    the_mirror: None,  # noqa: F811
    make_sandbox: Sandboxes,
) -> None:
    sb = await make_sandbox(network_rules={"mirror-dns": True})
    a, txt, aaaa = 1, 16, 28
    got = await raw_dns(
        sb,
        (mirror.DNS_NAME, a, "udp"),
        (mirror.DNS_NAME, a, "tcp"),
        ("tunnel.dns.test", txt, "udp"),
        ("tunnel.dns.test", txt, "tcp"),
        (mirror.DNS_NAME, aaaa, "udp"),
        ("x.other-zone.test", a, "tcp"),
    )
    assert got == [[0, 1], [0, 1], [0, 0], [0, 0], [0, 0], [3, 0]]  # 3: NXDOMAIN


async def test_an_answer_s_addresses_close_with_its_ttl_and_with_a_revoke(
    the_mirror: None,  # noqa: F811
    make_sandbox: Sandboxes,
) -> None:
    sb = await make_sandbox(network_rules={"mirror-dns": True})
    await probe(sb, resolve=[mirror.DNS_NAME])  # (a probe connects first, then resolves)
    assert (await probe(sb, connect=[WEB]))["open"] == [WEB]
    # The kernel drops the address when the answer's TTL ends (the test node adds no grace).
    deadline = time.monotonic() + 60
    while (await probe(sb, connect=[WEB]))["open"]:
        assert time.monotonic() < deadline, "the address stayed open past its TTL"
        await asyncio.sleep(0.5)  # polling the kernel's expiry: nothing to wait on instead
    # Asking again opens it again; a revoke closes it at once.
    await probe(sb, resolve=[mirror.DNS_NAME])
    assert (await probe(sb, connect=[WEB]))["open"] == [WEB]
    await sb.set_network_rules({"mirror-dns": False})
    assert (await probe(sb, connect=[WEB]))["open"] == []
    assert (await probe(sb, resolve=[mirror.DNS_NAME]))["names"] == {mirror.DNS_NAME: None}


# TLS and HTTP from inside: each case (host to connect to, server name or Host to send,
# "tls"|"http") -> what came back: the body, or "refused: ..." when the edge cut it.
NAMED = r"""
import json, socket, ssl, sys
out = []
for host, name, kind, port in json.loads(sys.argv[1]):
    try:
        s = socket.create_connection((host, port), timeout=5)
        if kind == "tls":
            ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
            s = ctx.wrap_socket(s, server_hostname=name)  # None: no server name (an IP literal)
        s.sendall(f"GET /hello.txt HTTP/1.0\r\nHost: {name or host}\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        out.append(body.decode() if b" 200 " in head.split(b"\r\n")[0] else "refused: " + head[:40].decode())
    except (OSError, ssl.SSLError) as e:
        out.append("refused: " + type(e).__name__)
print(json.dumps(out))
"""


async def test_shared_addresses_open_only_the_allowed_names_by_sni_and_host(
    the_mirror: None,  # noqa: F811
    make_sandbox: Sandboxes,
) -> None:
    """The mirror's address serves web.dns.test (allowed) and web.other-zone.test (not):
    having learned the address from the allowed name opens the allowed site only."""
    sb = await make_sandbox(network_rules={"mirror-dns": True})
    await probe(sb, resolve=[mirror.DNS_NAME])
    https, http = mirror.HTTPS_PORT, mirror.HTTP_PORT
    cases = [
        [mirror.DNS_NAME, mirror.DNS_NAME, "tls", https],
        [mirror.ADDRESS, mirror.DNS_OUTSIDE, "tls", https],  # another site on the same address
        [mirror.ADDRESS, None, "tls", https],  # an IP literal: no server name at all
        [mirror.DNS_NAME, mirror.DNS_NAME, "http", http],
        [mirror.ADDRESS, mirror.DNS_OUTSIDE, "http", http],
    ]
    got = await named(sb, cases)
    assert got[0] == mirror.BODY and got[3] == mirror.BODY, got
    assert all(r.startswith("refused") for r in (got[1], got[2], got[4])), got


async def test_the_edge_counts_what_its_name_check_let_through_and_refused(
    the_mirror: None,  # noqa: F811
    make_sandbox: Sandboxes,
    node: EmbeddedNode,
) -> None:
    """dsec_egress_name_checks_total on the edge's /metrics follows what the sandbox tried:
    a refused TLS connect each (another site's name, no name), a refused HTTP request each
    (another Host), and what was let through."""
    sb = await make_sandbox(network_rules={"mirror-dns": True})
    await probe(sb, resolve=[mirror.DNS_NAME])
    path = f"/metrics/edges/{node.config.node}"
    status, _, text = await scrape(node, path, node.api_key)
    assert status == 200
    before = parse(text)
    https, http = mirror.HTTPS_PORT, mirror.HTTP_PORT
    got = await named(
        sb,
        [
            [mirror.ADDRESS, mirror.DNS_OUTSIDE, "tls", https],
            [mirror.ADDRESS, None, "tls", https],
            [mirror.ADDRESS, mirror.DNS_OUTSIDE, "http", http],
            [mirror.ADDRESS, "pypi.org", "http", http],
            [mirror.DNS_NAME, mirror.DNS_NAME, "tls", https],
            [mirror.DNS_NAME, mirror.DNS_NAME, "http", http],
        ],
    )
    assert [r.startswith("refused") for r in got] == [True] * 4 + [False] * 2, got
    after = parse((await scrape(node, path, node.api_key))[2])

    def grew(kind: str, verdict: str) -> float:
        name, labels = "dsec_egress_name_checks_total", {"kind": kind, "verdict": verdict}
        return value(after, name, **labels) - value(before, name, **labels)

    # Exactly these: no other test's sandbox runs meanwhile, and nothing of the edge's own
    # goes through the name check.
    assert (grew("tls", "refused"), grew("http", "refused")) == (2, 2)
    assert (grew("tls", "granted"), grew("http", "granted")) == (1, 1)


async def named(sb: Sandbox, cases: list[list[object]]) -> list[str]:
    """Run :data:`NAMED`'s cases in ``sb``: what each got."""
    await sb.write_file("/tmp/named.py", NAMED.encode())
    res = await sb.run_shell(f"python3 /tmp/named.py '{json.dumps(cases)}'", timeout=120)
    assert res.exit_code == 0, res.stderr
    out: list[str] = json.loads(res.stdout)
    return out


FETCH = f"import urllib.request as u; print(u.urlopen('{URL}', timeout=10).read().decode(), end='')"


async def test_a_build_reaches_what_it_was_granted_and_a_network_none_step_does_not(
    the_mirror: None,  # noqa: F811
    client: DSecClient,
    make_sandbox: Sandboxes,
    tmp_path: Path,
) -> None:
    offline = "\n".join(
        [
            "import urllib.request as u",
            "try:",
            f" u.urlopen('{URL}', timeout=5)",
            "except OSError:",
            " print('offline')",
        ]
    )
    (tmp_path / "offline.py").write_text(offline)
    dockerfile = (
        f"FROM {BASE}\n"
        f'RUN python3 -c "{FETCH}" > /fetched\n'
        "COPY offline.py /offline.py\n"
        "RUN --network=none python3 /offline.py > /offline\n"
    )
    ref = f"test/net-build:{uuid.uuid4().hex[:12]}"
    await client.build_layer(dockerfile, tmp_path, ref, network_rules={"mirror-dns": True})
    sb = await make_sandbox(container_image=None, layers=[BASE, ref])
    assert await sb.read_file("/fetched") == mirror.BODY.encode()
    assert await sb.read_file("/offline") == b"offline\n"
    # Without the grant the same build cannot fetch: its first RUN fails.
    with pytest.raises(BuildFailed, match="line 2"):
        await client.build_layer(dockerfile, tmp_path, f"{ref}-no-net")
