"""Egress headers on the real kernel: a sandbox's HTTPS requests to a host it reaches by name
get the headers its spec names (secrets filled at the edge; plain HTTP only those without a
secret), through a TLS connection
the edge terminates with its node's CA (which the sandbox trusts) and re-encrypts to the host,
whose own certificate it checks. Other hosts stay end to end; no read shows a secret; an edge
restart keeps the headers."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, InvalidRequest
from dsec.protocol.egress_headers import CA_BUNDLE
from dsec.sdk.client import Sandbox
from tests.conftest import BASE, Sandboxes, node_config
from tests.e2e.test_egress import probe, runtime, the_mirror  # noqa: F401 (fixtures)
from tests.netpolicy import mirror
from tests.support import RestartedNode

SECRET = "sk-live-0123456789abcdef"
HEADERS = {mirror.DNS_NAME: {"Authorization": "Bearer ${secrets.api-key}", "X-Team": "rl"}}

# Inside: GET /headers from each URL with the system's trust (Python's default context, which
# reads /etc/ssl/certs), sending X-Team itself; print [status or error, the server's headers].
FETCH = r"""
import json, ssl, sys, urllib.request
out = []
for url in json.loads(sys.argv[1]):
    req = urllib.request.Request(url, headers={"X-Team": "sandbox", "Authorization": "mine"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            out.append([r.status, dict((k.lower(), v) for k, v in json.loads(r.read()))])
    except Exception as e:
        out.append([type(e).__name__ + ": " + str(e)[:200], None])
print(json.dumps(out))
"""

# The issuer of the certificate the sandbox is shown for the host, checked against the
# system's trust, plus the PEM file argv[2] if given.
ISSUER = r"""
import socket, ssl, sys
name = sys.argv[1]
ctx = ssl.create_default_context(cafile=sys.argv[2] if len(sys.argv) > 2 else None)
with ctx.wrap_socket(socket.create_connection((name, 443), timeout=10), server_hostname=name) as s:
    print(dict(x[0] for x in s.getpeercert()["issuer"])["commonName"])
"""


async def issuer(sb: Sandbox, cafile: bytes | None = None) -> str:
    await sb.write_file("/tmp/issuer.py", ISSUER.encode())
    args = f" {mirror.DNS_NAME}"
    if cafile is not None:
        await sb.write_file("/tmp/host-ca.pem", cafile)
        args += " /tmp/host-ca.pem"
    res = await sb.run_shell(f"python3 /tmp/issuer.py{args}", timeout=60)
    assert res.exit_code == 0, res.stderr
    return res.stdout.strip()


HTTPS_URL = f"https://{mirror.DNS_NAME}/headers"
HTTP_URL = f"http://{mirror.DNS_NAME}/headers"


async def fetch(sb: Sandbox, *urls: str) -> list[list[object]]:
    await sb.write_file("/tmp/fetch.py", FETCH.encode())
    res = await sb.run_shell(f"python3 /tmp/fetch.py '{json.dumps(list(urls))}'", timeout=120)
    assert res.exit_code == 0, res.stderr
    out: list[list[object]] = json.loads(res.stdout)
    return out


def sent(result: list[object]) -> dict[str, str]:
    assert result[0] == 200, result
    headers = result[1]
    assert isinstance(headers, dict)
    return headers


async def test_requests_to_the_host_get_its_headers_with_the_secret_filled(
    the_mirror: None,  # noqa: F811
    make_sandbox: Sandboxes,
    runtime: str,  # noqa: F811
) -> None:
    sb = await make_sandbox(
        runtime=runtime,
        network_rules={"mirror-dns": True},
        egress_headers=HEADERS,
        egress_secrets={"api-key": SECRET},
    )
    https, http = await fetch(sb, HTTPS_URL, HTTP_URL)
    # Set, not added: the sandbox's own Authorization and X-Team are replaced.
    assert (sent(https)["authorization"], sent(https)["x-team"]) == (f"Bearer {SECRET}", "rl")
    # Plain HTTP proves nothing about where it goes and carries it in clear: no secret there,
    # the headers without one all the same.
    assert (sent(http)["authorization"], sent(http)["x-team"]) == ("mine", "rl")
    # The sandbox trusted the edge's certificate for the host: the node's CA, given to it.
    assert (await issuer(sb)).startswith("DSec egress CA")
    res = await sb.run_shell("grep -c 'BEGIN CERT' /etc/ssl/certs/dsec-egress.pem; echo $NODE_EXTRA_CA_CERTS")
    assert res.stdout.split() == ["1", "/etc/ssl/certs/dsec-egress.pem"], res.stdout
    # No read of the sandbox shows the secret; its headers read back as given.
    assert sb.info.egress_headers == HEADERS
    assert SECRET not in (await sb.refresh()).model_dump_json()


async def test_a_sandbox_without_headers_is_spliced_end_to_end(
    the_mirror: None,  # noqa: F811
    make_sandbox: Sandboxes,
) -> None:
    """The same host, from a sandbox with no headers (and one with headers for another host):
    nothing added, and the certificate it sees is the host's own (no CA of the node's)."""
    plain = await make_sandbox(network_rules={"mirror-dns": True})
    elsewhere = await make_sandbox(
        network_rules={"mirror-dns": True}, egress_headers={"alias.dns.test": {"X-Team": "rl"}}
    )
    for sb in (plain, elsewhere):
        await probe(sb, resolve=[mirror.DNS_NAME])
        # Verified against the host's own certificate: the one the host sent, untouched.
        assert await issuer(sb, mirror.tls_files()[0].read_bytes()) == mirror.DNS_NAME
    (http,) = await fetch(plain, HTTP_URL)
    assert (sent(http)["x-team"], sent(http)["authorization"]) == ("sandbox", "mine")  # its own, as sent


async def test_a_host_that_does_not_prove_its_name_gets_no_secret(
    the_mirror: None,  # noqa: F811
    make_sandbox: Sandboxes,
) -> None:
    """Headers for the alias (its CNAME leads to the mirror, whose certificate names
    web.dns.test only): the edge's check of the host's certificate fails, so the request
    never leaves with the secret; the sandbox sees an error, not a 200."""
    sb = await make_sandbox(
        network_rules={"mirror-dns": True},
        egress_headers={mirror.DNS_ALIAS: {"Authorization": "${secrets.k}"}},
        egress_secrets={"k": SECRET},
    )
    await probe(sb, resolve=[mirror.DNS_ALIAS])
    (result,) = await fetch(sb, f"https://{mirror.DNS_ALIAS}/headers")
    assert result[0] != 200 and result[1] is None, result


@pytest.mark.parametrize(
    ("rules", "headers", "secrets", "why"),
    [
        ({"mirror": True}, HEADERS, {"api-key": "x"}, "naming its domain"),  # reached by address only
        ({"mirror-dns": True}, {"pypi.test": {"A": "b"}}, {}, "naming its domain"),  # not granted
        ({"mirror-dns": True}, HEADERS, {}, "not in egress_secrets"),
        ({"mirror-dns": True}, {mirror.DNS_NAME: {"Host": "evil"}}, {}, "frames the request"),
        ({"mirror-dns": True}, {mirror.DNS_NAME: {"A": "x\r\nB: y"}}, {}, "control characters"),
        ({"mirror-dns": True}, HEADERS, {"api-key": "line\nbreak"}, "control characters"),
        ({"mirror-dns": True}, {mirror.DNS_NAME: {"A": "${secrets.}"}}, {}, "malformed"),
        ({"mirror-dns": True}, {f"h{i}.dns.test": {} for i in range(11)}, {}, "at most 10 hosts"),
    ],
)
async def test_bad_headers_are_refused_before_anything_is_made(
    make_sandbox: Sandboxes,
    rules: dict[str, bool],
    headers: dict[str, dict[str, str]],
    secrets: dict[str, str],
    why: str,
) -> None:
    with pytest.raises(InvalidRequest, match=why):
        await make_sandbox(network_rules=rules, egress_headers=headers, egress_secrets=secrets)


async def test_headers_survive_an_edge_restart(the_mirror: None, tmp_path: Path) -> None:  # noqa: F811
    cfg = node_config(tmp_path, data_dir=tmp_path / "node")
    cfg.node, cfg.microvm, cfg.vm = "hdr", False, False
    cfg.edge["egress"] = mirror.egress_config(pool=f"{mirror.net(2)}.0/24")
    args = DSecContainerRunArgs(
        container_image=BASE,
        network_rules={"mirror-dns": True},
        egress_headers=HEADERS,
        egress_secrets={"api-key": SECRET},
    )
    async with RestartedNode(cfg) as n:
        async with DSecClient(n.node.url, n.node.api_key) as c:
            sb = await c.run_container(args)
            assert sent((await fetch(sb, HTTPS_URL))[0])["authorization"] == f"Bearer {SECRET}"
        sniproxy = n.node.edge.egress.proxy
        assert sniproxy is not None
        assert (sniproxy.headers_map.stat().st_mode & 0o777) == 0o600  # it holds the secret
        await n.restart()
        async with DSecClient(n.node.url, n.node.api_key) as c:
            sb = await c.get(sb.id)
            assert sent((await fetch(sb, HTTPS_URL))[0])["authorization"] == f"Bearer {SECRET}"
            await sb.stop()
        # Gone with its sandbox: the map holds nothing of it, nor does its journal record.
        assert SECRET.encode().hex() not in sniproxy.headers_map.read_text()
        rec = n.node.edge.journal.get(sb.id)
        assert rec is not None and rec.spec.egress_secrets == {} and rec.spec.egress_headers == {}


async def test_headers_change_live_and_the_ca_stays_out_of_packed_layers(
    the_mirror: None,  # noqa: F811
    make_sandbox: Sandboxes,
) -> None:
    sb = await make_sandbox(network_rules={"mirror-dns": True})
    bundle = (await sb.run_shell(f"cat {CA_BUNDLE}")).stdout
    # Given later: the CA arrives with them, and commands started after see its environment.
    await sb.set_network_rules(
        {"mirror-dns": True}, egress_headers=HEADERS, egress_secrets={"api-key": SECRET, "unused": "x"}
    )
    assert sent((await fetch(sb, HTTPS_URL))[0])["authorization"] == f"Bearer {SECRET}"
    # A process started now has the environment (a session's shell keeps the one it began with).
    node_ca = (await sb.exec(["printenv", "NODE_EXTRA_CA_CERTS"])).stdout.strip()
    assert node_ca == "/etc/ssl/certs/dsec-egress.pem"
    # The trajectory keeps the headers as given, never a secret's value.
    log = await sb.trajectory()
    # (The fetch's own output holds it: the mirror echoes what it received, as httpbin does.)
    network = [e.model_dump() for e in log if e.kind == "network"]
    assert network[-1]["request"]["egress_headers"] == HEADERS and SECRET not in json.dumps(network)
    # A layer packed now has neither the CA's file nor the bundle holding it.
    ref = f"test/egress-ca:{uuid.uuid4().hex[:12]}"
    await sb.run_shell("echo made > /made")
    await sb.commit(ref)
    child = await make_sandbox(container_image=None, layers=[BASE, ref])
    res = await child.run_shell(f"cat /made; test ! -e /etc/ssl/certs/dsec-egress.pem && cat {CA_BUNDLE}")
    assert res.exit_code == 0 and res.stdout == "made\n" + bundle, res.stderr
    # Cleared: the CA goes, and the host's own certificate is what the sandbox sees again.
    await sb.set_network_rules({"mirror-dns": True}, egress_headers={})
    assert (await sb.run_shell(f"cat {CA_BUNDLE}")).stdout == bundle
    assert await issuer(sb, mirror.tls_files()[0].read_bytes()) == mirror.DNS_NAME
    assert sb.info.egress_headers == {}


async def test_a_sandbox_s_own_domain_is_opened_by_name_and_takes_headers(
    the_mirror: None,  # noqa: F811
    make_sandbox: Sandboxes,
) -> None:
    """A name no permission names (E2B's ``allow_out`` of a domain), on a node that opens public
    addresses: resolved, reached on 443 and 80 by that name only, and headers for it work."""
    sb = await make_sandbox(
        network_rules={mirror.PUBLIC_NAME: True},
        egress_headers={mirror.PUBLIC_NAME: {"Authorization": "${secrets.k}"}},
        egress_secrets={"k": SECRET},
    )
    out = await probe(sb, resolve=[mirror.PUBLIC_NAME, mirror.DNS_NAME])
    assert out["names"] == {mirror.PUBLIC_NAME: [mirror.PUBLIC_A], mirror.DNS_NAME: None}
    # Its 443 and 80, by name; not the address's other ports, not by address alone.
    assert (await probe(sb, connect=[[mirror.PUBLIC_A, mirror.PORT]]))["open"] == []
    https, http = await fetch(
        sb, f"https://{mirror.PUBLIC_NAME}/headers", f"http://{mirror.PUBLIC_NAME}/headers"
    )
    assert sent(https)["authorization"] == SECRET and sent(http)["authorization"] == "mine"
    (literal,) = await fetch(sb, f"http://{mirror.PUBLIC_A}/headers")  # no name: refused
    assert literal[0] != 200, literal


@pytest.mark.parametrize(
    ("rules", "why"),
    [
        ({mirror.PUBLIC_NAME: False}, "opened \\(true\\), never taken out"),
        ({mirror.PUBLIC_NAME: {"before": "2025-01-01"}}, "options apply to package registries"),
        ({"no-dot": True}, "unknown network permission"),
    ],
)
async def test_own_domains_are_opened_only(
    make_sandbox: Sandboxes, rules: dict[str, object], why: str
) -> None:
    with pytest.raises(InvalidRequest, match=why):
        await make_sandbox(network_rules=rules)
