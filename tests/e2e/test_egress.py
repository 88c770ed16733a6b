"""Egress allowlists on the real kernel: a sandbox reaches exactly what its named permissions
open (a real HTTP mirror in a network namespace of its own), resolves only allowed names,
finds nothing else by scanning, and its rules change live and survive an edge restart. The
container tests run on both runtimes: crun, and gVisor's netstack over the same veth."""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, DSecMicroVMRunArgs, InvalidRequest
from dsec.netpolicy import links, sniproxy
from dsec.node.embedded import EmbeddedNode
from dsec.sdk.client import Sandbox
from tests.conftest import BASE, Sandboxes, node_config
from tests.netpolicy import mirror
from tests.support import RestartedNode
from tests.unit.test_metrics_prometheus import parse, value

GATEWAY = str(ipaddress.ip_network(mirror.POOL).network_address + 1)  # the session node's

# Run inside a sandbox: try each (host, port) and each name; print what was reachable.
PROBE = r"""
import json, socket, sys, urllib.request
todo = json.loads(sys.argv[1])
out = {"open": [], "names": {}, "fetched": None}
for host, port in todo.get("connect", []):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
        out["open"].append([host, port])
    except OSError:
        pass
    finally:
        s.close()
for name in todo.get("resolve", []):
    try:
        out["names"][name] = sorted({a[4][0] for a in socket.getaddrinfo(name, 80, socket.AF_INET)})
    except OSError:
        out["names"][name] = None
if todo.get("fetch"):
    try:
        out["fetched"] = urllib.request.urlopen(todo["fetch"], timeout=5).read().decode()
    except OSError as e:
        out["fetched"] = "error: " + str(e)
print(json.dumps(out))
"""


@pytest.fixture(params=["crun", "gvisor"])
def runtime(request: pytest.FixtureRequest) -> str:
    if request.param == "gvisor" and shutil.which("runsc") is None:
        pytest.skip("runtime='gvisor' needs runsc (Debian package runsc): not installed")
    return str(request.param)


def ungranted(runtime: str) -> dict[str, bool]:
    """Rules granting nothing yet: none for crun (a link comes with the first grant); for
    gVisor, whose netstack takes its links at start, named at create (all False)."""
    return {"mirror": False} if runtime == "gvisor" else {}


@pytest.fixture(scope="module")
def the_mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with mirror.mirror(tmp_path_factory.mktemp("mirror")):
        yield


async def probe(sb: Sandbox, **todo: object) -> dict[str, object]:
    await sb.write_file("/tmp/probe.py", PROBE.encode())
    res = await sb.run_shell(f"python3 /tmp/probe.py '{json.dumps(todo)}'", timeout=120)
    assert res.exit_code == 0, res.stderr
    out: dict[str, object] = json.loads(res.stdout)
    return out


def nft_list(*what: str) -> str:
    return subprocess.run(["nft", "list", *what], capture_output=True, text=True, check=True).stdout


MIRROR_URL = f"http://{mirror.NAME}:{mirror.PORT}/hello.txt"
BOTH_PORTS = [[mirror.ADDRESS, mirror.PORT], [mirror.ADDRESS, mirror.OTHER_PORT]]
PUBLIC_A, PUBLIC_B = [mirror.PUBLIC_A, mirror.PORT], [mirror.PUBLIC_B, mirror.PORT]


async def test_nothing_is_reachable_without_permissions(
    the_mirror: None, make_sandbox: Sandboxes, runtime: str
) -> None:
    sb = await make_sandbox(runtime=runtime)
    out = await probe(sb, connect=BOTH_PORTS, resolve=[mirror.NAME], fetch=MIRROR_URL)
    assert out["open"] == []
    assert out["names"] == {mirror.NAME: None}
    assert str(out["fetched"]).startswith("error")
    # No link at all: only loopback in its namespace.
    devices = (await sb.run_shell("tail -n +3 /proc/net/dev | cut -d: -f1")).stdout.split()
    assert devices == ["lo"]
    assert not links.exists(links.link_name(sb.id))


async def test_a_permission_opens_exactly_its_endpoints_and_names(
    the_mirror: None, make_sandbox: Sandboxes, node: EmbeddedNode, runtime: str
) -> None:
    sb = await make_sandbox(runtime=runtime, network_rules={"mirror": True, "other": False})
    assert sb.info.network_rules == {"mirror": True, "other": False}
    out = await probe(
        sb, connect=BOTH_PORTS, resolve=[mirror.NAME, mirror.OTHER_NAME, "example.com"], fetch=MIRROR_URL
    )
    assert out["fetched"] == mirror.BODY
    assert out["open"] == [[mirror.ADDRESS, mirror.PORT]]
    assert out["names"] == {mirror.NAME: [mirror.ADDRESS], mirror.OTHER_NAME: None, "example.com": None}
    # The resolver configuration is the node's, read-only.
    res = await sb.run_shell("cat /etc/resolv.conf; echo x >> /etc/resolv.conf")
    assert f"nameserver {GATEWAY}" in res.stdout and res.exit_code != 0


async def test_the_edge_counts_what_its_firewall_granted_and_refused(
    the_mirror: None, make_sandbox: Sandboxes, node: EmbeddedNode
) -> None:
    sb = await make_sandbox(network_rules={"mirror": True, "other": False})
    before = parse((await node.edge.prom.scrape()).decode())
    out = await probe(sb, connect=BOTH_PORTS)
    assert out["open"] == [[mirror.ADDRESS, mirror.PORT]]
    after = parse((await node.edge.prom.scrape()).decode())

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # The refused connect is one reset SYN; the granted one one new connection (at least:
    # other sandboxes of the session may use the node at the same time).
    assert grew("dsec_egress_denied_packets_total", reason="not_granted") >= 1
    assert grew("dsec_egress_granted_connections_total") >= 1
    assert grew("dsec_egress_denied_packets_total", reason="spoofed") == 0


async def test_a_port_scan_from_inside_finds_only_what_was_allowed(
    the_mirror: None, make_sandbox: Sandboxes, node: EmbeddedNode, runtime: str
) -> None:
    sb = await make_sandbox(runtime=runtime, network_rules={"mirror": True})
    api_port = int(node.url.rsplit(":", 1)[1])
    proxy = [sniproxy.TLS_PORT, sniproxy.HTTP_PORT]  # reached only through the edge's redirect
    ports = sorted({*range(1, 1025), 3141, 5432, 8080, 8081, 8642, 8643, api_port, *proxy})
    hosts = [mirror.ADDRESS, mirror.HOST_SIDE, GATEWAY, "127.0.0.1", "192.0.2.10"]
    out = await probe(sb, connect=[[h, p] for h in hosts for p in ports])
    # The grant, and the node's name server (DNS over TCP), nothing else.
    assert out["open"] == [[mirror.ADDRESS, mirror.PORT], [GATEWAY, 53]]


async def test_rules_change_live(the_mirror: None, make_sandbox: Sandboxes, runtime: str) -> None:
    sb = await make_sandbox(runtime=runtime, network_rules=ungranted(runtime))
    assert (await probe(sb, connect=BOTH_PORTS))["open"] == []

    info = await sb.set_network_rules({"mirror": True})  # crun's link is made now
    assert info.network_rules == {"mirror": True}
    out = await probe(sb, connect=BOTH_PORTS, fetch=MIRROR_URL)
    assert out["open"] == [[mirror.ADDRESS, mirror.PORT]] and out["fetched"] == mirror.BODY

    await sb.set_network_rules({"mirror": False, "other": True})  # setup done, now solving
    out = await probe(sb, connect=BOTH_PORTS, resolve=[mirror.NAME, mirror.OTHER_NAME])
    assert out["open"] == [[mirror.ADDRESS, mirror.OTHER_PORT]]
    assert out["names"] == {mirror.NAME: None, mirror.OTHER_NAME: [mirror.ADDRESS]}

    await sb.set_network_rules({})  # grading: nothing
    assert (await probe(sb, connect=BOTH_PORTS))["open"] == []
    assert (await sb.refresh()).network_rules == {}
    kinds = [e.kind for e in await sb.trajectory()]
    assert kinds.count("network") == 3


async def test_unknown_permissions_are_refused_and_leave_nothing(
    make_sandbox: Sandboxes, client: DSecClient
) -> None:
    before = len(await client.list())
    with pytest.raises(InvalidRequest, match=r"unknown network permission.*'nope'.*mirror"):
        await make_sandbox(network_rules={"nope": True})
    assert len(await client.list()) == before
    sb = await make_sandbox()
    with pytest.raises(InvalidRequest, match="unknown network permission"):
        await sb.set_network_rules({"mirror": True, "nope": False})
    assert not links.exists(links.link_name(sb.id))
    assert (await sb.refresh()).network_rules == {}


async def test_a_sandbox_s_own_rules_open_and_deny_public_addresses(
    the_mirror: None, make_sandbox: Sandboxes, runtime: str
) -> None:
    everything = [PUBLIC_A, PUBLIC_B, [mirror.ADDRESS, mirror.PORT]]
    # One public address of its own, without any permission: that address alone.
    sb = await make_sandbox(runtime=runtime, network_rules={mirror.PUBLIC_A: True})
    out = await probe(sb, connect=everything, fetch=f"http://{mirror.PUBLIC_A}:{mirror.PORT}/hello.txt")
    assert out["open"] == [PUBLIC_A] and out["fetched"] == mirror.BODY
    # Every public address less one (never the private mirror: `public` opens public ones only).
    await sb.set_network_rules({"public-web": True, mirror.PUBLIC_A: False})
    assert (await probe(sb, connect=everything))["open"] == [PUBLIC_B]
    # Ranges denied, one address inside them allowed: the allow wins, as in E2B.
    rules = {"public-web": True, "203.0.113.0/24": False, "198.51.100.0/24": False, mirror.PUBLIC_A: True}
    await sb.set_network_rules(rules)
    assert (await probe(sb, connect=everything))["open"] == [PUBLIC_A]
    assert (await sb.refresh()).network_rules == rules
    # A private address is the operator's to open, never a sandbox's: refused, nothing changed.
    with pytest.raises(InvalidRequest, match="not public"):
        await sb.set_network_rules({mirror.ADDRESS: True})
    assert (await sb.refresh()).network_rules == rules
    assert (await probe(sb, connect=everything))["open"] == [PUBLIC_A]


# Listens on 0.0.0.0:8080 before the command returns (the parent exits once the socket listens).
LISTENER = (
    'python3 -c \'import os, socket; s = socket.socket(); s.bind(("0.0.0.0", 8080)); s.listen();'
    " os.fork() and os._exit(0); [s.accept()[1] for _ in iter(int, 1)]' > /dev/null 2>&1"
)


async def test_sandboxes_cannot_reach_each_other(
    the_mirror: None, make_sandbox: Sandboxes, runtime: str
) -> None:
    a = await make_sandbox(runtime=runtime, network_rules={"mirror": True})
    b = await make_sandbox(runtime=runtime, network_rules={"mirror": True})
    assert (await a.run_shell(LISTENER, timeout=30)).exit_code == 0
    # A's own address, as its routing picks it towards the mirror.
    mine = await a.run_shell(
        'python3 -c "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM);'
        f" s.connect(('{mirror.ADDRESS}', 9)); print(s.getsockname()[0])\""
    )
    address = mine.stdout.strip()
    assert ipaddress.ip_address(address) in ipaddress.ip_network(mirror.POOL)
    assert (await probe(a, connect=[["127.0.0.1", 8080], [address, 8080]]))["open"] == [
        ["127.0.0.1", 8080],
        [address, 8080],
    ]
    assert (await probe(b, connect=[[address, 8080], [address, 22]]))["open"] == []


async def test_stop_removes_the_link_and_its_grants(
    the_mirror: None, make_sandbox: Sandboxes, node: EmbeddedNode, runtime: str
) -> None:
    sb = await make_sandbox(runtime=runtime, network_rules={"mirror": True})
    ifname = links.link_name(sb.id)
    table = node.edge.egress.table
    assert links.exists(ifname) and ifname in nft_list("set", "inet", table, "allowed")
    await sb.stop()
    assert not links.exists(ifname)
    assert ifname not in nft_list("set", "inet", table, "allowed")


@pytest.mark.vm
@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 is not installed")
async def test_a_microvm_reaches_what_its_rules_grant_through_a_tap(
    the_mirror: None, client: DSecClient, node: EmbeddedNode
) -> None:
    args = DSecMicroVMRunArgs(container_image=BASE, memory_limit_mb=384, network_rules={"mirror": True})
    vm = await client.run_microvm(args)
    ifname, table = links.link_name(vm.id), node.edge.egress.table
    api_port = int(node.url.rsplit(":", 1)[1])
    elsewhere = [[mirror.ADDRESS, mirror.OTHER_PORT], [GATEWAY, api_port], ["192.0.2.10", 3141]]
    try:
        assert links.exists(ifname), "a tap made before QEMU started"
        assert (Path("/sys/class/net", ifname) / "tun_flags").exists()
        out = await probe(
            vm, connect=[[mirror.ADDRESS, mirror.PORT], *elsewhere], resolve=[mirror.NAME, mirror.OTHER_NAME]
        )
        assert out["open"] == [[mirror.ADDRESS, mirror.PORT]]
        assert out["names"] == {mirror.NAME: [mirror.ADDRESS], mirror.OTHER_NAME: None}
        assert (await probe(vm, fetch=MIRROR_URL))["fetched"] == mirror.BODY
        # Live: the same set update as a container's; a snapshot pause keeps the tap for the
        # QEMU that resumes it (the probe's first call wakes it).
        await vm.set_network_rules({"mirror": False, "other": True})
        await vm.pause()
        out = await probe(vm, connect=BOTH_PORTS)
        assert out["open"] == [[mirror.ADDRESS, mirror.OTHER_PORT]]
    finally:
        await vm.stop()
    assert not links.exists(ifname)
    assert ifname not in nft_list("set", "inet", table, "links")


async def test_links_and_rules_survive_an_edge_restart(
    the_mirror: None, tmp_path: Path, runtime: str
) -> None:
    cfg = node_config(tmp_path, data_dir=tmp_path / "node")
    cfg.node, cfg.microvm, cfg.vm = "egr", False, False
    cfg.edge["egress"] = mirror.egress_config(pool=f"{mirror.net(2)}.0/24")
    async with RestartedNode(cfg) as n:
        table = n.node.edge.egress.table
        async with DSecClient(n.node.url, n.node.api_key) as c:
            rules = {"mirror": True, "public-web": True, mirror.PUBLIC_A: False}
            sb = await c.run_container(
                DSecContainerRunArgs(container_image=BASE, runtime=runtime, network_rules=rules)
            )
            assert (await probe(sb, fetch=MIRROR_URL))["fetched"] == mirror.BODY
        await n.restart()
        async with DSecClient(n.node.url, n.node.api_key) as c:
            sb = await c.get(sb.id)
            out = await probe(sb, connect=[*BOTH_PORTS, PUBLIC_A, PUBLIC_B], resolve=[mirror.NAME])
            assert out["open"] == [[mirror.ADDRESS, mirror.PORT], PUBLIC_B]  # the deny kept too
            assert out["names"] == {mirror.NAME: [mirror.ADDRESS]}
            await sb.set_network_rules({"other": True})
            assert (await probe(sb, connect=BOTH_PORTS))["open"] == [[mirror.ADDRESS, mirror.OTHER_PORT]]
    # The last sandbox stopped with the node: its link went, and with no link the table too.
    assert not links.exists(links.link_name(sb.id))
    assert table not in nft_list("tables")
